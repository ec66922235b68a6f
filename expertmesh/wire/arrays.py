"""numpy arrays ⇄ `expertmesh.v1.Tensor`: raw little-endian bytes with dtype and shape (docs/architecture.md:
"Wire tensors"), for the processes that hold no tensor library — the router sends token ids, pixels and replica tables and
reads log-probabilities this way. `expertmesh/wire/tensors.py` is the torch side of the same encoding (bfloat16
included); both check a message the same way (`check_message`), and decoding is exact (bitwise)."""

from __future__ import annotations

import math

import numpy as np

from expertmesh.protos import tensor_pb2

# wire name → little-endian storage dtype. bfloat16 has no numpy dtype: it is stored (and decoded here) as its
# uint16 bit patterns. bool travels as one byte per element (0 / 1).
STORAGE: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "bfloat16": np.dtype("<u2"),
    "float16": np.dtype("<f2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("u1"),
}
_WIRE_OF: dict[str, str] = {
    "float32": "float32",
    "float16": "float16",
    "int64": "int64",
    "int32": "int32",
    "uint8": "uint8",
    "bool": "bool",
}


def check_message(msg: tensor_pb2.Tensor, name: str) -> tuple[np.dtype, list[int]]:
    """The storage dtype and shape of a Tensor message; ValueError naming `name` when the dtype is unknown, a
    dimension is negative, or len(data) is not prod(shape) × itemsize."""
    storage = STORAGE.get(msg.dtype)
    if storage is None:
        raise ValueError(f"{name}.dtype: expected one of {sorted(STORAGE)}, found {msg.dtype!r}")
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{name}.shape: expected non-negative dimensions, found {shape}")
    expected = math.prod(shape) * storage.itemsize
    if len(msg.data) != expected:
        raise ValueError(f"{name}.data: expected {expected} bytes for {msg.dtype} {shape}, found {len(msg.data)}")
    return storage, shape


def array_to_proto(a, name: str = "tensor", wire: str | None = None) -> tensor_pb2.Tensor:
    """Encode a numpy array (any strides) as a Tensor message: C-order little-endian bytes. `wire`: the dtype it
    travels as when not the array's own (bfloat16: `a` holds the uint16 bit patterns)."""
    a = np.asarray(a)
    wire = wire or _WIRE_OF.get(a.dtype.name)
    if wire not in STORAGE:
        raise ValueError(f"{name}: dtype {a.dtype} cannot go on the wire; expected one of {sorted(_WIRE_OF)}")
    data = np.ascontiguousarray(a, dtype=STORAGE[wire]).tobytes()
    return tensor_pb2.Tensor(dtype=wire, shape=list(a.shape), data=data)


def array_from_proto(msg: tensor_pb2.Tensor, name: str = "tensor") -> np.ndarray:
    """Decode a Tensor message into a fresh, writable array of the native byte order (bool for bool — any
    non-zero byte is True —, uint16 bit patterns for bfloat16)."""
    storage, shape = check_message(msg, name)
    flat = np.frombuffer(msg.data, dtype=storage)
    if msg.dtype == "bool":
        return (flat != 0).reshape(shape)
    return flat.astype(storage.newbyteorder("="), copy=True).reshape(shape)
