"""The files of a checkpoint directory, read without torch: their names, the safetensors headers (every tensor's
dtype, shape and file) and the error that names what is wrong with them."""

from __future__ import annotations

import json
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match what the config says it should hold: names the file, tensor or field."""


def read_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Parse a safetensors header and check the file is as long as its header says → {name: (dtype, shape)}."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated (no safetensors header)")
        n = int.from_bytes(raw, "little")
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated (header of {n} bytes, file has {size - 8} after the length)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    end = 0
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = (info["dtype"], info["shape"])
        end = max(end, info["data_offsets"][1])
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated: tensors need {8 + n + end} bytes, file has {size}")
    return out


def safetensors_headers(path: Path) -> tuple[list[Path], dict[str, Path], dict[str, tuple[str, list[int]]]]:
    """The shards of a directory (those its index names, else every `*.safetensors`) and every tensor in them →
    (files, tensor → file, tensor → (dtype, shape)), from the headers alone."""
    index = path / INDEX_FILE
    files = sorted(path.glob("*.safetensors"))
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid index ({e!r})") from None
        files = sorted({path / f for f in weight_map.values()})
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    file_of: dict[str, Path] = {}
    header: dict[str, tuple[str, list[int]]] = {}
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f}: missing (named by {INDEX_FILE})")
        for name, info in read_header(f).items():
            file_of[name] = f
            header[name] = info
    return files, file_of, header
