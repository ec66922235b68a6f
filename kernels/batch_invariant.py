"""Row-batch-invariant building blocks (see DESIGN.md, "Determinism").

CPU BLAS picks its kernel by the number of rows: one row goes through a matrix-vector path and a few rows
through differently blocked GEMMs, so row i of `x @ w.T` changes in the last bits with the batch it sits in.
Padding the rows to a multiple of `ROW_TILE` (≥ 16) keeps every call on the same blocked kernel, whose per-row
result does not depend on the other rows — measured on torch 2.13 CPU and checked by tests/test_batch_invariance.py.

On CPU the projections run on a oneDNN prepacked copy of each weight (`packed_weight`): ATen's F.linear reorders
the weight into oneDNN's blocked layout on every call, which cost half the time of a 16-row linear (bf16 and fp32
alike: 9 → 17 GB/s of weights). The copy is an extra resident copy of every projection weight on CPU (not of the
MXFP4 experts); EXPERTMESH_CPU_PACKED_LINEAR=0 turns it off.
"""
from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.nn.functional as F

ROW_TILE = 16
_PACKED_DTYPES = (torch.float32, torch.bfloat16)
_packed: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}     # id(weight) → ((data_ptr, version), packed)
_packed_lock = threading.Lock()


def _packing_enabled() -> bool:
    return (os.environ.get("EXPERTMESH_CPU_PACKED_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


PACKING = _packing_enabled()


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a CPU parameter [N, K] (fp32 / bf16), made on first use and kept while the
    parameter lives; made again when it is written in place or re-pointed (version / storage). None where the
    plain path runs: a temporary tensor (packing per call gains nothing), other dtypes or devices, a weight that
    needs its gradient, packing off."""
    if not PACKING or not isinstance(weight, torch.nn.Parameter) or weight.device.type != "cpu" or \
            weight.dtype not in _PACKED_DTYPES or weight.dim() != 2 or (weight.requires_grad and torch.is_grad_enabled()):
        return None
    key = (weight.data_ptr(), weight._version)
    entry = _packed.get(id(weight))
    if entry is not None and entry[0] == key:
        return entry[1]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROW_TILE)
    with _packed_lock:
        if id(weight) not in _packed:
            weakref.finalize(weight, _packed.pop, id(weight), None)
        _packed[id(weight)] = (key, packed)
    return packed


def pad_rows(x: torch.Tensor, tile: int = ROW_TILE) -> tuple[torch.Tensor, int]:
    """x [M, K] → ([M', K] with M' the next multiple of `tile` ≥ tile, M)."""
    m = x.shape[0]
    padded = max(tile, -(-m // tile) * tile)
    if padded == m:
        return x, m
    return torch.cat([x, x.new_zeros(padded - m, *x.shape[1:])]), m


MAX_ROWS = 1024           # rows per GEMM call: keeps every call inside the checked set of shapes
POINTWISE_WIDTH = 64     # pad rows to whole SIMD vectors (AVX-512 fp32 = 16 lanes; 64 covers every ISA)
POINTWISE_GRAIN = 16384  # elements per call, below ATen's parallel grain (32768): one thread, no chunk tails


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose output rows do not depend on how many other rows are in `x` (x [..., K], weight [N, K])."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda:  # GPU path: batch invariance there is the kernels' job, not padding's
        return F.linear(x, weight, bias)
    packed = packed_weight(weight) if flat.dtype == weight.dtype else None
    outs = []
    for s in range(0, max(flat.shape[0], 1), MAX_ROWS):
        padded, m = pad_rows(flat[s:s + MAX_ROWS])
        if packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(padded.contiguous(), packed, bias, "none", [], "")
        else:
            out = F.linear(padded, weight, bias)
        outs.append(out[:m])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*lead, weight.shape[0])


def bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-batch-item matmul x [B, M, K] @ weight [B, K, N] → [B, M, N] whose rows do not depend on how many other
    rows are in `x` (e.g. MLA's per-head absorbed projections over every token of a step). Every call has exactly
    ROW_TILE rows (the last tile zero-padded): ATen picks bmm's kernel from the whole problem's size, and for small
    bf16 problems a 64-row call rounds differently from a 16-row one, so only one shape is safe. `x` may be a
    strided view."""
    if x.is_cuda:
        return torch.bmm(x, weight)
    m = x.shape[1]
    out = x.new_empty(x.shape[0], m, weight.shape[2])
    for s in range(0, m, ROW_TILE):
        part = x[:, s:s + ROW_TILE]
        rows = part.shape[1]
        if rows != ROW_TILE:
            part = torch.cat([part, part.new_zeros(part.shape[0], ROW_TILE - rows, part.shape[2])], dim=1)
        out[:, s:s + rows] = torch.bmm(part, weight)[:, :rows]
    return out


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise function (sigmoid, silu, softplus, rsqrt, exp, ...) so that each element goes
    through the same code path whatever the batch: ATen runs SIMD on whole vectors and a scalar loop — which
    rounds transcendental functions differently — on the tail of each thread's chunk. Rows are padded to whole
    vectors and processed in single-threaded chunks, so no element of a real row is ever in a tail."""
    if x.is_cuda or x.numel() == 0:
        return fn(x)
    lead, d = x.shape[:-1], x.shape[-1] if x.dim() else 1
    flat = x.reshape(-1, d)
    width = -(-d // POINTWISE_WIDTH) * POINTWISE_WIDTH
    if width != d:
        flat = torch.cat([flat, flat.new_zeros(flat.shape[0], width - d)], dim=1)
    rows = max(1, POINTWISE_GRAIN // width)
    out = torch.cat([fn(flat[s:s + rows]) for s in range(0, flat.shape[0], rows)])
    return out[:, :d].reshape(*lead, d) if x.dim() else out[0, 0]
