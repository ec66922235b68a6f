"""A sequence's cache off the device, and its byte format: what the attention workers' lower KV tiers keep
(worker/kv_tiers.py: host memory, disk files) and what a prefill worker hands to a decode worker (ImportSequence,
streamed in pieces). Shared by the workers and their gRPC clients.

`PrefixSnapshot`: tokens [0, length) of every latent-KV layer (MLA/DSA latent entries, DSA indexer keys) and the
KDA recurrent + conv state at `length`, as tensors. `encode` / `decode`: its bytes,
    b"EMKVTIER" | u32 little-endian header length | header (JSON) | payload | tag (32 bytes)
the header holding the format version, the `identity` of the model and layout it belongs to (a file of another
model or layout is foreign), the key, the length, each tensor's name / dtype / shape / offset / bytes and the
payload size; the tag an HMAC-SHA256 of everything before it under `mac_key` — the disk tier's key (held by the
deployment, never stored beside the files: whoever can write the files cannot forge one), or none for a hand-off
(an integrity check: its channel is the deployment's gRPC, mutual TLS where configured).

Nothing in a file is trusted before it is checked: the header is bounded (MAX_HEADER_BYTES) and parsed into
`FileHeader` — every field typed, each tensor's bytes its shape × dtype, the tensors contiguous and adding up to
the payload, per-token tensors `length` rows — and with a `SnapshotLayout` (the reader's model) the tensors must be
exactly the layout's for that length. Every failure is CorruptFile, saying why; no tensor is allocated before the
header passed and the tag matched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from dataclasses import dataclass

import torch

MAGIC = b"EMKVTIER"
VERSION = 2  # 2: header and payload under one keyed tag (1: a sha256 of the payload alone, in the header)
PREAMBLE_BYTES = len(MAGIC) + 4
MAX_HEADER_BYTES = 1 << 20  # a full K3 prefix's header is ~15 kB
TAG_BYTES = 32
_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
}
_PER_TOKEN = ("latent", "index_k")  # [length, width]
_KINDS = (*_PER_TOKEN, "kda_state", "kda_conv")
_MAX_DIMS = 4


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


@dataclass(frozen=True)
class SnapshotLayout:
    """The tensors a snapshot of one worker's model holds: `rows` name → (dtype, width), [length, width] each
    (latent entries, indexer keys); `states` name → (dtype, shape), fixed (KDA recurrent and conv state);
    lengths 1..`max_length`. Dtypes by name (float32, bfloat16, ...)."""

    rows: dict[str, tuple[str, int]]
    states: dict[str, tuple[str, tuple[int, ...]]]
    max_length: int

    def expected(self, length: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (d, (length, w)) for n, (d, w) in self.rows.items()} | self.states


class CorruptFile(Exception):
    """A disk-tier file that must not be served (torn, corrupted, forged, foreign); the message says why."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # in the payload
    nbytes: int


@dataclass(frozen=True)
class FileHeader:
    """A file's header, checked for consistency (`read_header`); `start`: where the payload begins."""

    identity: str
    key: str
    length: int
    tensors: tuple[TensorEntry, ...]
    payload_bytes: int
    start: int

    @property
    def file_bytes(self) -> int:
        return self.start + self.payload_bytes + TAG_BYTES


def new_mac(mac_key: bytes):
    """The running HMAC-SHA256 of a file's bytes (everything before its tag)."""
    return hmac.new(mac_key, digestmod=hashlib.sha256)


def check_tag(mac, tag: bytes) -> None:
    if not hmac.compare_digest(mac.digest(), bytes(tag)):
        raise CorruptFile("checksum mismatch: its HMAC-SHA256 tag fails (tampered with, corrupted, or keyed otherwise)")


def encode(key: str, identity: str, snap: PrefixSnapshot, mac_key: bytes = b"") -> bytes:
    """The file bytes of one prefix (format in the module docstring)."""
    entries, chunks, offset = [], [], 0
    for name, t in snap.named_tensors():
        raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, len(raw)])
        chunks.append(raw)
        offset += len(raw)
    header = json.dumps(
        {
            "version": VERSION,
            "identity": identity,
            "key": key,
            "length": snap.length,
            "tensors": entries,
            "payload_bytes": offset,
        }
    ).encode()
    chunks.insert(0, MAGIC + struct.pack("<I", len(header)) + header)
    mac = new_mac(mac_key)
    for c in chunks:
        mac.update(c)
    chunks.append(mac.digest())
    return b"".join(chunks)


def header_length(preamble: bytes) -> int:
    """The header's size from a file's first PREAMBLE_BYTES; CorruptFile when it is not a tier file or the header
    is larger than MAX_HEADER_BYTES."""
    if len(preamble) < PREAMBLE_BYTES or preamble[: len(MAGIC)] != MAGIC:
        raise CorruptFile("not a KV tier file (bad magic)")
    (n,) = struct.unpack("<I", preamble[len(MAGIC) : PREAMBLE_BYTES])
    if not 0 < n <= MAX_HEADER_BYTES:
        raise CorruptFile(f"a header of {n} bytes: expected 1..{MAX_HEADER_BYTES}")
    return n


def read_header(data: bytes) -> FileHeader:
    """The header of file bytes `data` (its first PREAMBLE_BYTES + header length at least), checked for consistency;
    CorruptFile saying what is wrong."""
    n = header_length(data[:PREAMBLE_BYTES])
    raw = data[PREAMBLE_BYTES : PREAMBLE_BYTES + n]
    if len(raw) != n:
        raise CorruptFile(f"torn: {len(raw)} header bytes, expected {n}")
    try:
        h = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, too many digits, nesting
        raise CorruptFile(f"unreadable header ({type(e).__name__})") from None
    if not isinstance(h, dict):
        raise CorruptFile("header: expected a JSON object")
    if h.get("version") != VERSION:
        raise CorruptFile(f"header: format version {h.get('version')!r}, expected {VERSION}")
    length, payload_bytes = _count(h, "length"), _count(h, "payload_bytes")
    listed = _field(h, "tensors", list)
    tensors, offset = [], 0
    for i, t in enumerate(listed):
        entry = _tensor_entry(t, i, length)
        if entry.offset != offset:
            raise CorruptFile(f"header: tensors[{i}] ({entry.name}) at offset {entry.offset}, expected {offset}")
        offset += entry.nbytes
        tensors.append(entry)
    if offset != payload_bytes:
        raise CorruptFile(f"header: the tensors hold {offset} bytes, payload_bytes says {payload_bytes}")
    names = {e.name for e in tensors}
    if len(names) != len(tensors):
        raise CorruptFile("header: a tensor listed twice")
    for e in tensors:
        kind, layer = e.name.split(".")
        twin = {"kda_state": "kda_conv", "kda_conv": "kda_state"}.get(kind)
        if twin and f"{twin}.{layer}" not in names:
            raise CorruptFile(f"header: {e.name} without {twin}.{layer}")
    return FileHeader(
        _field(h, "identity", str), _field(h, "key", str), length, tuple(tensors), payload_bytes, PREAMBLE_BYTES + n
    )


def _field(h: dict, name: str, kind: type):
    v = h.get(name)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise CorruptFile(f"header: {name} {v!r:.60}, expected a {kind.__name__}")
    return v


def _count(h: dict, name: str) -> int:
    v = _field(h, name, int)
    if v < 0:
        raise CorruptFile(f"header: {name} {v}, expected ≥ 0")
    return v


def _tensor_entry(t, i: int, length: int) -> TensorEntry:
    """tensors[i] = [name, dtype, shape, offset, bytes], checked on its own and against the header's length."""
    if not isinstance(t, list) or len(t) != 5:
        raise CorruptFile(f"header: tensors[{i}] {t!r:.60}, expected [name, dtype, shape, offset, bytes]")
    name, dtype, shape, offset, nbytes = t
    kind, _, layer = name.partition(".") if isinstance(name, str) else ("", "", "")
    if kind not in _KINDS or not (layer.isascii() and layer.isdigit() and len(layer) <= 6 and str(int(layer)) == layer):
        raise CorruptFile(f"header: tensors[{i}] name {name!r:.60}, expected <{'|'.join(_KINDS)}>.<layer>")
    if dtype not in _DTYPES:
        raise CorruptFile(f"header: {name} dtype {dtype!r:.40}, expected one of {', '.join(_DTYPES)}")
    fields = {"offset": offset, "bytes": nbytes}
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise CorruptFile(f"header: {name} shape {shape!r:.60}, expected a list of at most {_MAX_DIMS} sizes")
    fields |= {f"shape[{d}]": s for d, s in enumerate(shape)}
    for what, v in fields.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise CorruptFile(f"header: {name} {what} {v!r:.40}, expected an integer ≥ 0")
    if kind in _PER_TOKEN and (len(shape) != 2 or shape[0] != length):
        raise CorruptFile(f"header: {name} shape {shape}, expected [{length}, width] (length {length})")
    need = math.prod(shape) * _DTYPES[dtype].itemsize
    if nbytes != need:
        raise CorruptFile(f"header: {name} holds {nbytes} bytes, its {dtype} {shape} needs {need}")
    return TensorEntry(name, dtype, tuple(shape), offset, nbytes)


def check_header(
    header: FileHeader, *, identity: str, key: str | None = None, layout: SnapshotLayout | None = None
) -> None:
    """CorruptFile unless the file is this model's and layout's (`identity`), holds `key` (when given) and, with
    `layout`, exactly the layout's tensors for its length."""
    if header.identity != identity:
        raise CorruptFile(f"foreign file (identity {header.identity!r:.80}, expected {identity!r})")
    if key is not None and header.key != key:
        raise CorruptFile(f"holds key {header.key!r:.80}, expected {key!r}")
    if layout is None:
        return
    if not 0 < header.length <= layout.max_length:
        raise CorruptFile(f"length {header.length}: expected 1..{layout.max_length}")
    want = layout.expected(header.length)
    got = {e.name: (e.dtype, e.shape) for e in header.tensors}
    for name in sorted(set(want) | set(got)):
        if name not in got:
            raise CorruptFile(f"{name} missing")
        if name not in want:
            raise CorruptFile(f"{name} is not a tensor of this model")
        if got[name] != want[name]:
            raise CorruptFile(
                f"{name}: expected {want[name][0]} {list(want[name][1])}, found {got[name][0]} {list(got[name][1])}"
            )


def decode(
    data: bytes, *, key: str, identity: str, mac_key: bytes = b"", layout: SnapshotLayout | None = None
) -> PrefixSnapshot:
    """The snapshot in file bytes `data`, checked: header, identity, key, layout (when given), size, tag
    (CorruptFile if not)."""
    header = read_header(data)
    check_header(header, identity=identity, key=key, layout=layout)
    if len(data) != header.file_bytes:
        raise CorruptFile(f"torn: {len(data)} bytes, the header says {header.file_bytes}")
    view = memoryview(data)
    mac = new_mac(mac_key)
    mac.update(view[:-TAG_BYTES])
    check_tag(mac, view[-TAG_BYTES:])
    payload = view[header.start : header.start + header.payload_bytes]
    tensors = {}
    for e in header.tensors:
        dtype = _DTYPES[e.dtype]
        tensors[e.name] = (
            torch.frombuffer(bytearray(payload[e.offset : e.offset + e.nbytes]), dtype=torch.uint8)
            .view(dtype)
            .reshape(e.shape)
            if e.nbytes
            else torch.empty(e.shape, dtype=dtype)
        )
    return PrefixSnapshot.from_named(header.length, tensors)
