"""Grouped MoE expert GEMM over MXFP4 weights: the CPU fast path (same contract as `naive.moe_expert_outputs`).

The T·K (token, slot) pairs are sorted by expert once (a stable argsort of the flattened ids); each expert
with tokens gathers its rows, runs the batch-invariant MLP (`naive.expert_mlp`: padded row tiles, the chunked
activation — SwiGLU or SiTU, keyword `activation`) once on all of them, and scatters the results back; experts
without tokens are skipped and never dequantised. Per-row results are bitwise those of the reference (same
per-row arithmetic), so a token's output does not depend on the batch it arrives in.

Dequantised weights can be kept in a small LRU cache (`set_dequant_cache_bytes`, env
`EXPERTMESH_MOE_DEQUANT_CACHE_MB`, default 256 MiB; 0 turns it off). An entry is keyed by the identity of
the weight tensors and the expert, and is valid only while both tensors are alive and unmodified (their
in-place version counters unchanged), so swapped or reloaded weights are never served stale.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

from expertmesh.kernels.activation import SWIGLU, GatedActivation, check_activation
from expertmesh.kernels.moe.experts import MXFP4Experts
from expertmesh.kernels.moe.naive import check_moe_inputs, expert_mlp
from expertmesh.kernels.mxfp4.naive import dequantize_mxfp4


class DequantCache:
    """LRU of dequantised expert matrices, bounded in bytes, keyed by tensor identity + version + expert."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()  # re-entrant: a weakref callback may fire while it is held (GC)
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _drop(self, key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[3].numel() * entry[3].element_size()

    def get(self, blocks: torch.Tensor, scales: torch.Tensor, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """dequantize_mxfp4(blocks[expert], scales[expert], dtype), from the cache when still valid."""
        if self.max_bytes <= 0 or blocks.is_inference() or scales.is_inference():
            # inference-mode tensors keep no version counter: in-place changes could not be seen
            return dequantize_mxfp4(blocks[expert], scales[expert], dtype)
        key = (id(blocks), id(scales), expert, dtype)
        versions = (blocks._version, scales._version)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                ref_b, ref_s, ver, w = entry
                if ref_b() is blocks and ref_s() is scales and ver == versions:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return w
                self._drop(key)
        self.misses += 1
        w = dequantize_mxfp4(blocks[expert], scales[expert], dtype)
        size = w.numel() * w.element_size()
        if size > self.max_bytes:
            return w
        with self._lock:
            self._drop(key)
            while self._entries and self._bytes + size > self.max_bytes:
                self._drop(next(iter(self._entries)))
            # A dead weight tensor drops its entries (weakref callback), so memory follows the live weights.
            drop = _dropper(weakref.ref(self), key)
            self._entries[key] = (weakref.ref(blocks, drop), weakref.ref(scales, drop), versions, w)
            self._bytes += size
        return w


def _dropper(cache_ref: weakref.ref[DequantCache], key) -> Callable:
    def drop(_):
        cache = cache_ref()
        if cache is not None:
            with cache._lock:
                cache._drop(key)

    return drop


_CACHE = DequantCache(int(float(os.environ.get("EXPERTMESH_MOE_DEQUANT_CACHE_MB", "256")) * 2**20))


def dequant_cache() -> DequantCache:
    """The process-wide cache used by `moe_expert_outputs`."""
    return _CACHE


def set_dequant_cache_bytes(max_bytes: int) -> None:
    """Bound the dequantised-weight cache (0 disables it and frees it)."""
    _CACHE.max_bytes = int(max_bytes)
    _CACHE.clear()


def group_by_expert(topk_ids: torch.Tensor, E: int) -> tuple[torch.Tensor, list[int], int]:
    """topk_ids [T, K] → (order [T*K] flat slot indices sorted by expert (stable; the -1 slots first),
    counts per expert (host ints, length E), n_invalid = number of -1 slots)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    valid = flat[flat >= 0]
    counts = torch.bincount(valid, minlength=E).tolist() if valid.numel() else [0] * E
    return order, counts, flat.numel() - valid.numel()


def grouped_expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    E: int,
    weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    out: torch.Tensor | None = None,
    *,
    activation: GatedActivation = SWIGLU,
) -> torch.Tensor:
    """The grouped loop, given `weights(e) -> (w13 [2I, H], w2 [H, I])` as float tensors (fp32 or bf16).

    With bf16 weights the rows are cast to bf16 and the GEMMs run in bf16 (benchmark comparison only: not the
    fp32 contract; the activation still runs in fp32). x [T, H], topk_ids [T, K] (checked by the caller) → [T, K, H]
    in x.dtype."""
    check_activation(activation)
    T, K = topk_ids.shape
    H = x.shape[1]
    order, counts, start = group_by_expert(topk_ids, E)
    flat_out = torch.zeros(T * K, H, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        w13, w2 = weights(e)
        rows = xf.index_select(0, slots // K)  # [n, H]: token of each slot
        if w13.dtype != torch.float32:
            res = expert_mlp(rows.to(w13.dtype), w13, w2, activation=activation).float()
        else:
            res = expert_mlp(rows, w13, w2, activation=activation)
        flat_out.index_copy_(0, slots, res)
    result = flat_out.view(T, K, H)
    if out is None:
        return result.to(x.dtype)
    out.copy_(result)
    return out


def moe_expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: MXFP4Experts,
    *,
    out: torch.Tensor | None = None,
    activation: GatedActivation = SWIGLU,
) -> torch.Tensor:
    """Grouped fast path. Contract: `expertmesh.kernels.moe.naive.moe_expert_outputs`."""
    s = check_moe_inputs(x, topk_ids, experts, out)

    def weights(e: int):
        return (
            _CACHE.get(experts.gate_up_blocks, experts.gate_up_scales, e, torch.float32),
            _CACHE.get(experts.down_blocks, experts.down_scales, e, torch.float32),
        )

    return grouped_expert_outputs(x, topk_ids, s.E, weights, out, activation=activation)


def moe_expert_outputs_dense(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: GatedActivation = SWIGLU,
) -> torch.Tensor:
    """The same grouped GEMM on pre-dequantised weights w13 [E, 2I, H], w2 [E, H, I] (fp32, or bf16 GEMMs).

    For benchmarks and tests (no MXFP4 decode in the loop); x and topk_ids as in `moe_expert_outputs`."""
    return grouped_expert_outputs(x, topk_ids, w13.shape[0], lambda e: (w13[e], w2[e]), activation=activation)
