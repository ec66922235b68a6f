"""Row-batch-invariant building blocks (see DESIGN.md, "Determinism").

CPU BLAS picks its kernel by the number of rows: one row goes through a matrix-vector path and a few rows
through differently blocked GEMMs, so row i of `x @ w.T` changes in the last bits with the batch it sits in.
Padding the rows to a multiple of `ROW_TILE` (≥ 16) keeps every call on the same blocked kernel, whose per-row
result does not depend on the other rows — measured on torch 2.13 CPU and checked by tests/test_batch_invariance.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 16


def pad_rows(x: torch.Tensor, tile: int = ROW_TILE) -> tuple[torch.Tensor, int]:
    """x [M, K] → ([M', K] with M' the next multiple of `tile` ≥ tile, M)."""
    m = x.shape[0]
    padded = max(tile, -(-m // tile) * tile)
    if padded == m:
        return x, m
    return torch.cat([x, x.new_zeros(padded - m, *x.shape[1:])]), m


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose output rows do not depend on how many other rows are in `x` (x [..., K], weight [N, K])."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda:  # GPU path: batch invariance there is the kernels' job, not padding's
        return F.linear(x, weight, bias)
    padded, m = pad_rows(flat)
    out = F.linear(padded, weight, bias)[:m]
    return out.reshape(*lead, weight.shape[0])
