"""Tensor ⇄ `expertmesh.v1.Tensor` encoding: raw little-endian bytes with dtype and shape (DESIGN: "Tensors on
the wire"). Decoding is exact (bitwise), so a remote call returns the same numbers as a local one."""
from __future__ import annotations

import math
import sys

import torch

from expertmesh.protos import tensor_pb2

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
# same-width integer views for byte swapping on a big-endian host (numpy has no bfloat16)
_SWAP_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIG_ENDIAN = sys.byteorder != "little"


def _swap(t: torch.Tensor) -> torch.Tensor:
    """Reverse each element's bytes (a contiguous 1-D tensor)."""
    if t.element_size() == 1:
        return t
    return torch.from_numpy(t.view(_SWAP_VIEW[t.element_size()]).numpy().byteswap().copy()).view(t.dtype)


def to_proto(t: torch.Tensor, name: str = "tensor") -> tensor_pb2.Tensor:
    """Encode `t` (any device, any strides) as a Tensor message: C-order little-endian bytes."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    wire = NAMES.get(t.dtype)
    if wire is None:
        raise ValueError(f"{name}: dtype {t.dtype} cannot go on the wire; expected one of {sorted(DTYPES)}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if _BIG_ENDIAN:
        flat = _swap(flat)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return tensor_pb2.Tensor(dtype=wire, shape=list(t.shape), data=data)


def from_proto(msg: tensor_pb2.Tensor, name: str = "tensor") -> torch.Tensor:
    """Decode a Tensor message into a fresh, writable CPU tensor.

    Raises ValueError naming `name` when the dtype is unknown, a dimension is negative, or len(data) is not
    prod(shape) × itemsize."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"{name}.dtype: expected one of {sorted(DTYPES)}, found {msg.dtype!r}")
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{name}.shape: expected non-negative dimensions, found {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise ValueError(f"{name}.data: expected {expected} bytes for {msg.dtype} {shape}, found {len(msg.data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)   # bytearray: a writable copy
    if dtype == torch.bool:
        return (raw != 0).reshape(shape)   # any non-zero byte is True; never an invalid bool
    flat = raw.view(dtype)
    if _BIG_ENDIAN:
        flat = _swap(flat)
    return flat.reshape(shape)


# ---------------------------------------------------------------------------------------------- sampling
def sampling_to_proto(params):
    """model.SamplingParams → expertmesh.v1.SamplingParams (every field set)."""
    from expertmesh.protos import sampling_pb2
    msg = sampling_pb2.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                      top_p=params.top_p, top_k=params.top_k,
                                      stop_token_ids=list(params.stop_token_ids), min_p=params.min_p,
                                      presence_penalty=params.presence_penalty,
                                      frequency_penalty=params.frequency_penalty,
                                      logit_bias=dict(params.logit_bias))
    for f in ("seed", "logprobs", "prompt_logprobs", "grammar", "grammar_after_token"):
        if getattr(params, f, None) is not None:
            setattr(msg, f, getattr(params, f))
    return msg


def sampling_from_proto(msg):
    """expertmesh.v1.SamplingParams → model.SamplingParams; a field left unset takes the dataclass default.
    Values are not range-checked here (the sampler / engine do that, naming the field)."""
    from expertmesh.model import SamplingParams
    fields = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "prompt_logprobs", "min_p",
              "presence_penalty", "frequency_penalty", "grammar", "grammar_after_token")
    kw = {f: getattr(msg, f) for f in fields if msg.HasField(f)}
    return SamplingParams(**kw, stop_token_ids=tuple(msg.stop_token_ids),
                          logit_bias=tuple(sorted(msg.logit_bias.items())))
