"""Row-batch-invariant building blocks (see docs/architecture.md, "Determinism").

CPU BLAS picks its kernel by the number of rows: one row goes through a matrix-vector path and a few rows
through differently blocked GEMMs, so row i of `x @ w.T` changes in the last bits with the batch it sits in.

bf16 projections on CPU (`linear` with a bf16 parameter, `bmm` with bf16 operands) run the row-invariant C++
kernel (`kernels/linear/cpu_kernel.py`) where it is available (built, enabled, a CPU with AVX2 + FMA or more): every
output element is reduced in one fixed order that depends only on K, so rows need no padding. `linear` runs it on
the kernel's packed copy of each weight (`kernel_weight`, the same size as the weight: an extra resident copy of
every bf16 projection weight, in place of oneDNN's copy below). Projections that share their input
(`linear_fused`: MLA's q_a | kv_a | indexer k | gate, q_b | indexer q, an MLP's gate | up, KDA's input projections)
run as one call on a packed copy of their concatenation, kept in place of their separate copies: the same bits, one
stream of weights. EXPERTMESH_CPU_LINEAR_KERNEL=0 turns it off.

fp32 projections (the routing and indexer-head weights under bf16 activations; every projection of an fp32
model) run the kernel's fp32 linear where its AVX-512 path runs (`fp32_available`): one fixed summation order per K (16 lanes, folded by
halves), no padding, one thread for a decode step's small calls (oneDNN's padded 16-row call cost ~0.15 ms each
inside a decode step, two per layer).

Everything else (plain-tensor weights in other dtypes, no kernel) pads the rows to a multiple of `ROW_TILE` (≥ 16), which
keeps every call on the same blocked kernel, whose per-row result does not depend on the other rows — measured
on torch 2.13 CPU and checked by tests/kernels/test_batch_invariance.py. There the projections run on a oneDNN
prepacked copy of each weight (`packed_weight`): ATen's F.linear reorders the weight into oneDNN's blocked layout
on every call, which cost half the time of a 16-row linear (bf16 and fp32 alike: 9 → 17 GB/s of weights). The
copy is an extra resident copy of every projection weight the kernel does not take on CPU (not of the MXFP4
experts); EXPERTMESH_CPU_PACKED_LINEAR=0 turns it off.

A dtype oneDNN refuses to prepack here (`kernels.cpu_features.onednn_prepacks`: bf16 on CPUs without
AVX512-BW/VL/DQ or AVX-NE-CONVERT, e.g. AVX2-only EPYCs, where the row-invariant kernel takes bf16 unless it is off
or unbuilt; every dtype under EXPERTMESH_CPU_ISA=portable) runs the portable path: F.linear on exactly ROW_TILE rows a call, as plain
tensor weights do. Batch-invariant as every one-shape call is, but not the prepacked path's bits (another fp32
summation order of the same exact bf16 products): within bf16 rounding of it, so greedy tokens match the fast
path's only where no logit is that close. `linear_path(dtype)` names the path a dtype takes (kernels/cpu_isa.py).

Which path a projection takes depends on the weight and dtypes, never on the number of rows, so a weight's rows
always come from one path within a process.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from expertmesh.kernels import cpu_features
from expertmesh.kernels.linear import cpu_kernel as linear_kernel

ROW_TILE = 16
_PACKED_DTYPES = (torch.float32, torch.bfloat16)
# (id(weight),) → (((data_ptr, version),), packed): oneDNN's copies, the linear kernel's, and the kernel's copies of
# concatenated weights (ids and keys of each weight, in order)
_packed: dict[tuple[int, ...], tuple[tuple, torch.Tensor]] = {}
_kernel_packed: dict[tuple[int, ...], tuple[tuple, torch.Tensor]] = {}
_fused_packed: dict[tuple[int, ...], tuple[tuple, torch.Tensor]] = {}
_packed_lock = threading.Lock()


def _packing_enabled() -> bool:
    return (
        os.environ.get("EXPERTMESH_CPU_PACKED_LINEAR", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


PACKING = _packing_enabled()


def _cacheable(weight: torch.Tensor, dtypes) -> bool:
    """A CPU parameter [N, K] of one of `dtypes` that does not need its gradient: worth a packed copy."""
    return (
        isinstance(weight, torch.nn.Parameter)
        and weight.device.type == "cpu"
        and weight.dtype in dtypes
        and weight.dim() == 2
        and not (weight.requires_grad and torch.is_grad_enabled())
    )


def _cached(cache: dict, weights: tuple[torch.Tensor, ...], make) -> torch.Tensor:
    """make(the weights), kept while they all live (keyed by their ids); made again when any is written in place
    or re-pointed (version / storage)."""
    ids = tuple(id(w) for w in weights)
    key = tuple((w.data_ptr(), w._version) for w in weights)
    entry = cache.get(ids)
    if entry is not None and entry[0] == key:
        return entry[1]
    packed = make(*(w.detach().contiguous() for w in weights))
    with _packed_lock:
        if ids not in cache:
            for w in weights:
                weakref.finalize(w, cache.pop, ids, None)
        cache[ids] = (key, packed)
    return packed


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a CPU parameter [N, K] (fp32 / bf16), made on first use and kept while the
    parameter lives; made again when it is written in place or re-pointed (version / storage). None where the
    plain path runs: a temporary tensor (packing per call gains nothing), other dtypes or devices, a weight that
    needs its gradient, packing off, a dtype oneDNN does not prepack on this CPU. (`linear` does not ask for it
    where the kernel takes the weight.)"""
    if not PACKING or not _cacheable(weight, _PACKED_DTYPES) or not cpu_features.onednn_prepacks(weight.dtype):
        return None
    return _cached(_packed, (weight,), lambda w: torch.ops.mkldnn._reorder_linear_weight(w, ROW_TILE))


def linear_path(dtype: torch.dtype) -> str:
    """The path `linear` takes for a CPU parameter of `dtype` (fp32 / bf16) and activations of the same dtype."""
    if linear_kernel.available() and dtype == torch.bfloat16:
        return f"row-invariant kernel {linear_kernel.default_isa()}"
    if linear_kernel.fp32_available() and dtype == torch.float32:
        return "row-invariant kernel fp32"
    if PACKING and cpu_features.onednn_prepacks(dtype):
        return "onednn-prepacked"
    return f"portable ({ROW_TILE}-row F.linear)"


def kernel_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The row-invariant kernel's packed copy (`kernels.linear.naive.pack_weight`) of a bf16 CPU parameter
    [N, K], cached as `packed_weight`'s is; None where the kernel does not take the weight (not a bf16 CPU
    parameter, needs its gradient, the kernel unavailable)."""
    if not _cacheable(weight, (torch.bfloat16,)) or not linear_kernel.available():
        return None
    return _cached(_kernel_packed, (weight,), linear_kernel.pack_weight)


def fused_kernel_weight(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The row-invariant kernel's packed copy of the concatenation [ΣN_i, K] of bf16 CPU parameters [N_i, K] that
    share K, kept while they all live and made again when any is written in place or re-pointed; None where the
    kernel does not take every one of them (see `kernel_weight`). It stands in for their separate copies."""
    if (
        len({w.shape[1] for w in weights}) != 1
        or not linear_kernel.available()
        or not all(_cacheable(w, (torch.bfloat16,)) for w in weights)
    ):
        return None
    return _cached(_fused_packed, tuple(weights), lambda *ws: linear_kernel.pack_weight(torch.cat(ws)))


def linear_fused(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """[`linear`(x, w) for w in weights] (x [..., K], each w [N_i, K], no bias). Where the row-invariant kernel
    takes them all, one call on `fused_kernel_weight`: the input is read once and the weights stream as one, and
    every output is bitwise the separate call's (each output column's order depends only on K, never on which
    other columns share the call). Otherwise one `linear` per weight."""
    if (
        len(weights) > 1
        and not x.is_cuda
        and all(w.dtype == x.dtype for w in weights)
        and not (x.requires_grad and torch.is_grad_enabled())
    ):
        kw = fused_kernel_weight(weights)
        if kw is not None:
            sizes = [w.shape[0] for w in weights]
            out = linear_kernel.linear(x, kw, sum(sizes), weights[0].shape[1])
            return list(out.split(sizes, dim=-1))
    return [linear(x, w) for w in weights]


def pad_rows(x: torch.Tensor, tile: int = ROW_TILE) -> tuple[torch.Tensor, int]:
    """x [M, K] → ([M', K] with M' the next multiple of `tile` ≥ tile, M)."""
    m = x.shape[0]
    padded = max(tile, -(-m // tile) * tile)
    if padded == m:
        return x, m
    return torch.cat([x, x.new_zeros(padded - m, *x.shape[1:])]), m


MAX_ROWS = 1024  # rows per GEMM call: keeps every call inside the checked set of shapes
POINTWISE_WIDTH = 64  # pad rows to whole SIMD vectors (AVX-512 fp32 = 16 lanes; 64 covers every ISA)
POINTWISE_GRAIN = 16384  # elements per call, below ATen's parallel grain (32768): one thread, no chunk tails


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose output rows do not depend on how many other rows are in `x` (x [..., K], weight [N, K])."""
    if x.is_cuda:  # GPU path: batch invariance there is the kernels' job, not padding's
        return F.linear(x, weight, bias)
    if x.dtype == weight.dtype and not (x.requires_grad and torch.is_grad_enabled()):
        kw = kernel_weight(weight)
        if kw is not None:
            out = linear_kernel.linear(x, kw, weight.shape[0], weight.shape[1])
            return out if bias is None else out + bias.to(out.dtype)  # elementwise: row-invariant
        if (
            x.dtype == torch.float32
            and linear_kernel.fp32_available()
            and not (weight.requires_grad and torch.is_grad_enabled())
        ):
            out = linear_kernel.linear_fp32(x, weight.detach())
            return out if bias is None else out + bias.to(out.dtype)
    return linear_padded(x, weight, bias, packed_weight(weight) if x.dtype == weight.dtype else None)


def linear_padded(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """The row-padded path of `linear` (CPU): 16-row tiles, at most MAX_ROWS rows a call, through oneDNN's
    `packed` copy of the weight when given, else F.linear on exactly ROW_TILE rows a call: ATen's fp32 GEMM picks
    its blocking from M, and on AMX-class CPUs (MKL) a row's bits change above ~64-128 rows for K ≥ 1024, so only
    one shape is safe there (as in `bmm_padded`)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    outs = []
    rows = MAX_ROWS if packed is not None else ROW_TILE
    for s in range(0, max(flat.shape[0], 1), rows):
        padded, m = pad_rows(flat[s : s + rows])
        if packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(padded.contiguous(), packed, bias, "none", [], "")
        else:
            out = F.linear(padded, weight, bias)
        outs.append(out[:m])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*lead, weight.shape[0])


def bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-batch-item matmul x [B, M, K] @ weight [B, K, N] → [B, M, N] whose rows do not depend on how many other
    rows are in `x` (e.g. MLA's per-head absorbed projections over every token of a step). `x` may be a strided
    view. bf16 on CPU runs the row-invariant kernel where it is available (no padding, the weight read where it
    is); otherwise `bmm_padded`. A weight that is a tensor of its own (not a view) runs on the kernel's packed copy
    of it (`pack_bmm_weight`, cached as `kernel_weight`'s: the same bits, the weight streamed from contiguous
    memory; in a decode step, one row per head on a 2 MB weight, 0.245 -> 0.204 ms a call in process)."""
    if x.is_cuda:
        return torch.bmm(x, weight)
    if (
        x.dtype == weight.dtype == torch.bfloat16
        and linear_kernel.available()
        and not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled())
    ):
        if weight._base is None and weight.is_contiguous():  # a tensor of its own (MLA's absorbed halves)
            packed = _cached(_kernel_packed, (weight,), linear_kernel.pack_bmm_weight)
            return linear_kernel.bmm_packed(x, packed, weight.shape[2], weight.shape[1])
        return linear_kernel.bmm(x, weight)
    return bmm_padded(x, weight)


def bmm_padded(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`bmm` through ATen (CPU): every call has exactly ROW_TILE rows (the last tile zero-padded): ATen picks
    bmm's kernel from the whole problem's size, and for small bf16 problems a 64-row call rounds differently from a
    16-row one, so only one shape is safe."""
    m = x.shape[1]
    out = x.new_empty(x.shape[0], m, weight.shape[2])
    for s in range(0, m, ROW_TILE):
        part = x[:, s : s + ROW_TILE]
        rows = part.shape[1]
        if rows != ROW_TILE:
            part = torch.cat([part, part.new_zeros(part.shape[0], ROW_TILE - rows, part.shape[2])], dim=1)
        out[:, s : s + rows] = torch.bmm(part, weight)[:, :rows]
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
    if flat.shape[0] <= rows:
        out = fn(flat)
    else:
        out = torch.cat([fn(flat[s : s + rows]) for s in range(0, flat.shape[0], rows)])
    return out[:, :d].reshape(*lead, d) if x.dim() else out[0, 0]
