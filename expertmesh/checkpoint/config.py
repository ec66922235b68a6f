"""A checkpoint directory's model config, read without tensors or torch: native (`config.json` in this project's
format) or a Hugging Face directory of a published relative (its config.json mapped by checkpoint/hf_config.py, with the
safetensors headers for the optional tensors it implies). The router, which holds no weights, needs no more; the
weight loader (checkpoint/loader.py) reads its config the same way and then checks every tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from expertmesh.checkpoint.files import CONFIG_FILE, CheckpointError, safetensors_headers
from expertmesh.checkpoint.hf_config import config_from_hf
from expertmesh.model.config import ModelConfig, load_config


def read_raw_config(path: Path) -> dict:
    """config.json of a checkpoint directory, parsed (not yet interpreted)."""
    cfg_path = path / CONFIG_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not cfg_path.exists():
        raise CheckpointError(f"{cfg_path}: missing (a checkpoint needs its config.json)")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None


def is_hugging_face(raw) -> bool:
    """A published relative's config (its own model_type) rather than this project's format."""
    return isinstance(raw, dict) and "model_type" in raw and raw["model_type"] != "expertmesh"


def native_config(path: Path) -> ModelConfig:
    cfg_path = path / CONFIG_FILE
    try:
        return load_config(cfg_path)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: invalid model config: {e}") from None


def mapped_config_error(path: Path, e: ValidationError) -> CheckpointError:
    """A Hugging Face config that maps to values ModelConfig refuses: the first field and why."""
    first = e.errors()[0]
    return CheckpointError(
        f"{path / CONFIG_FILE}: maps to an invalid model config: {'.'.join(map(str, first['loc']))}: {first['msg']}"
    )


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The model config of a checkpoint directory, native or Hugging Face, without reading a tensor."""
    path = Path(path)
    raw = read_raw_config(path)
    if not is_hugging_face(raw):
        return native_config(path)
    _, _, header = safetensors_headers(path)
    try:
        return config_from_hf(raw, set(header), name=path.name)
    except ValidationError as e:
        raise mapped_config_error(path, e) from None
