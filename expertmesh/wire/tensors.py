"""torch tensors ⇄ `expertmesh.v1.Tensor`: raw little-endian bytes with dtype and shape (docs/architecture.md:
"Wire tensors"), the workers' side of `expertmesh/wire/arrays.py` (same bytes, same checks) with bfloat16 as a dtype of its
own. Decoding is exact (bitwise), so a remote call returns the same numbers as a local one."""

from __future__ import annotations

import numpy as np
import torch

from expertmesh.protos import tensor_pb2
from expertmesh.wire.arrays import array_from_proto, array_to_proto

# wire name → torch dtype; bool travels as one byte per element (0 / 1)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def to_proto(t: torch.Tensor, name: str = "tensor") -> tensor_pb2.Tensor:
    """Encode `t` (any device, any strides) as a Tensor message: C-order little-endian bytes."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if t.dtype not in NAMES:
        raise ValueError(f"{name}: dtype {t.dtype} cannot go on the wire; expected one of {sorted(DTYPES)}")
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bit patterns go as they are
        return array_to_proto(t.contiguous().view(torch.int16).numpy().view(np.uint16), name, wire="bfloat16")
    return array_to_proto(t.numpy(), name)


def from_proto(msg: tensor_pb2.Tensor, name: str = "tensor") -> torch.Tensor:
    """Decode a Tensor message into a fresh, writable CPU tensor.

    Raises ValueError naming `name` when the dtype is unknown, a dimension is negative, or len(data) is not
    prod(shape) × itemsize."""
    a = array_from_proto(msg, name)
    if msg.dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
