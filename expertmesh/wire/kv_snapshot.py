"""A sequence's cache off the device, and its byte format: what the attention workers' lower KV tiers keep
(worker/kv_tiers.py: host memory, disk files) and what a prefill worker hands to a decode worker (ImportSequence,
streamed in pieces). Shared by the workers and their gRPC clients.

`PrefixSnapshot`: tokens [0, length) of every latent-KV layer (MLA/DSA latent entries, DSA indexer keys) and the
KDA recurrent + conv state at `length`, as tensors. `encode` / `decode`: its bytes,
    b"EMKVTIER" | u32 little-endian header length | header (JSON) | payload
the header holding the format version, the `identity` of the model and layout it belongs to (a file of another
model or layout is foreign), the key, the length, each tensor's name / dtype / shape / offset, the payload size and
its sha256. `decode` refuses (CorruptFile, saying why) a header that does not parse, a foreign identity, another
key, a short payload or a checksum that fails.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

MAGIC = b"EMKVTIER"
VERSION = 1
_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
}


@dataclass
class PrefixSnapshot:
    """A cached prefix off the device: `length` tokens."""

    length: int
    latent: dict[int, torch.Tensor]  # latent-KV layer → [length, kv_lora_rank + rope_dim]
    index_k: dict[int, torch.Tensor]  # DSA layer → [length, indexer head_dim]
    kda: dict[int, tuple[torch.Tensor, torch.Tensor]]  # KDA layer → (recurrent state [H, K, V] fp32, conv tail)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor under a stable name (the disk file's order)."""
        out = [(f"latent.{i}", t) for i, t in sorted(self.latent.items())]
        out += [(f"index_k.{i}", t) for i, t in sorted(self.index_k.items())]
        for i, (state, conv) in sorted(self.kda.items()):
            out += [(f"kda_state.{i}", state), (f"kda_conv.{i}", conv)]
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())

    @staticmethod
    def from_named(length: int, tensors: dict[str, torch.Tensor]) -> PrefixSnapshot:
        snap = PrefixSnapshot(length, {}, {}, {})
        for name, t in tensors.items():
            kind, layer = name.rsplit(".", 1)
            if kind == "latent":
                snap.latent[int(layer)] = t
            elif kind == "index_k":
                snap.index_k[int(layer)] = t
        for name, t in tensors.items():
            kind, layer = name.rsplit(".", 1)
            if kind == "kda_state":
                snap.kda[int(layer)] = (t, tensors[f"kda_conv.{layer}"])
        return snap

    def map(self, fn) -> PrefixSnapshot:
        return PrefixSnapshot.from_named(self.length, {n: fn(t) for n, t in self.named_tensors()})


def layout_identity(cfg_json: str, dtype: torch.dtype, block_size: int) -> str:
    """What a disk file must match to be served here: the model config, the KV dtype, the block size."""
    h = hashlib.sha256(f"{cfg_json}|{dtype}|{block_size}".encode()).hexdigest()
    return f"kv-v{VERSION}-{h[:32]}"


class CorruptFile(Exception):
    """A disk-tier file that must not be served (torn, corrupted, foreign); the message says why."""


def encode(key: str, identity: str, snap: PrefixSnapshot) -> bytes:
    """The file bytes of one prefix (format in the module docstring)."""
    entries, chunks, offset = [], [], 0
    for name, t in snap.named_tensors():
        raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, len(raw)])
        chunks.append(raw)
        offset += len(raw)
    payload = b"".join(chunks)
    header = json.dumps(
        {
            "version": VERSION,
            "identity": identity,
            "key": key,
            "length": snap.length,
            "tensors": entries,
            "payload_bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def read_header(data: bytes) -> tuple[dict, int]:
    """(header, payload offset) of file bytes `data`; CorruptFile when it is not a tier file."""
    if data[: len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 4:
        raise CorruptFile("not a KV tier file (bad magic)")
    (n,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start : start + n])
        header["key"], header["length"], header["payload_bytes"], header["sha256"], header["tensors"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptFile(f"unreadable header ({type(e).__name__})") from None
    return header, start + n


def decode(data: bytes, *, key: str, identity: str) -> PrefixSnapshot:
    """The snapshot in file bytes `data`, checked: identity, key, payload size and sha256 (CorruptFile if not)."""
    header, start = read_header(data)
    if header.get("version") != VERSION or header.get("identity") != identity:
        raise CorruptFile(f"foreign file (identity {header.get('identity')!r}, expected {identity!r})")
    if header["key"] != key:
        raise CorruptFile(f"holds key {header['key']!r}, expected {key!r}")
    payload = data[start:]
    if len(payload) != header["payload_bytes"]:
        raise CorruptFile(f"torn: {len(payload)} payload bytes, header says {header['payload_bytes']}")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise CorruptFile("payload checksum mismatch")
    tensors = {}
    for name, dtype, shape, offset, nbytes in header["tensors"]:
        raw = bytearray(payload[offset : offset + nbytes])
        tensors[name] = (
            torch.frombuffer(raw, dtype=torch.uint8).view(_DTYPES[dtype]).reshape(shape)
            if nbytes
            else torch.empty(shape, dtype=_DTYPES[dtype])
        )
    return PrefixSnapshot.from_named(int(header["length"]), tensors)
