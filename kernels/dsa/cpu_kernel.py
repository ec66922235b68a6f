"""The CPU sparse-attention kernel over a paged latent cache (`kernels/dsa/cpu/paged_attention.cpp`): what
`sparse.paged_sparse_attention` computes — each sequence's query heads over its selected positions, read from the
pages where they are — as one C++ loop per (sequence, group of 4 heads), parallel over them, with no gather
copy: the heads share one latent row, so each row is read (and a bf16 row widened) once per group, not per head.

Numerics (see the C++ header comment): fp32, every reduction in one fixed order that depends only on the sequence's
own inputs, so a sequence's result does not depend on the batch, the index rows' width or the thread count
(batch-invariant by construction: the decode of several sequences can be one call). The order differs from the
PyTorch path's (a gather, two batched GEMMs and a softmax), so the two agree to fp32 rounding, not bitwise.
Built on first use (kernels/cpu_extension.py); without a compiler, or when the build fails, `available()` is False
after one warning and callers keep the PyTorch path. `EXPERTMESH_CPU_KERNEL=0` turns it off, as it does the MoE
kernel.
"""

from __future__ import annotations

from pathlib import Path

import torch

from expertmesh.kernels.backend import _configured
from expertmesh.kernels.cpu_extension import LazyExtension
from expertmesh.kernels.moe.cpu_kernel import enabled

EXTENSION = LazyExtension(
    "expertmesh_dsa_cpu",
    Path(__file__).parent / "cpu" / "paged_attention.cpp",
    "expertmesh_dsa_cpu",
    what="CPU paged-attention kernel",
    probe="paged_attention",
)
DENSE_EXTENSION = LazyExtension(
    "expertmesh_attention_amx",
    Path(__file__).parent / "cpu" / "dense_attention_amx.cpp",
    "expertmesh_attention_amx",
    what="AMX dense-attention kernel",
    probe="dense_attention",
)


def available() -> bool:
    """The kernel is enabled and built (building it now if it was not tried yet)."""
    return enabled() and EXTENSION.load() is not None


def runs_for(q: torch.Tensor) -> bool:
    """Whether `paged_sparse_attention` runs this kernel for `q`: a CPU tensor, the backend not forced, built."""
    return q.device.type == "cpu" and _configured() == "auto" and available()


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int
) -> torch.Tensor:
    """q [B,H,D] over the entries `indices` [B,k] (logical positions, −1 = unused; at least one used per row) of
    each sequence's pages (kv_cache [num_blocks, block_size, D] fp32 / bf16, block_table [B, max_blocks]) →
    [B,H,v_dim] fp32. Contract: `expertmesh.kernels.dsa.sparse.paged_sparse_attention`."""
    ops = EXTENSION.load()
    if ops is None:
        raise RuntimeError(f"the CPU paged-attention kernel is not available ({EXTENSION.build_error})")
    out = torch.empty(q.shape[0], q.shape[1], v_dim, dtype=torch.float32)
    ops.paged_attention(
        q.float().contiguous(),
        kv_cache.contiguous(),
        block_table.to(torch.int32).contiguous(),
        indices.to(torch.int64).contiguous(),
        float(scale),
        out,
    )
    return out


_dense_runs: bool | None = None


def dense_available() -> bool:
    """The AMX dense-attention kernel is enabled, built (building it now if it was not tried yet) and runs here:
    the CPU (and Linux) offer AMX-BF16."""
    global _dense_runs
    if not enabled():
        return False
    if _dense_runs is None:
        ops = DENSE_EXTENSION.load()
        _dense_runs = ops is not None and bool(ops.runs())
    return _dense_runs


def dense_runs_for(q: torch.Tensor) -> bool:
    """Whether `dense_attention` runs for `q`: bf16 on CPU, the backend not forced, `dense_available()`."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and _configured() == "auto" and dense_available()


def dense_attention(
    q: torch.Tensor, kv: torch.Tensor, q_pos: torch.Tensor | None, scale: float, v_dim: int
) -> torch.Tensor:
    """q [B,T,H,D] bf16 over kv [B,n,D] bf16, query t seeing positions 0 .. q_pos[t] (q_pos None: all n) →
    [B,T,H,v_dim] fp32, on AMX-BF16 (kernels/dsa/cpu/dense_attention_amx.cpp: the numerics, and why a query's
    bits do not depend on the call's other queries)."""
    ops = DENSE_EXTENSION.load()
    if ops is None:
        raise RuntimeError(f"the AMX dense-attention kernel is not available ({DENSE_EXTENSION.build_error})")
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], v_dim, dtype=torch.float32)
    pos = torch.empty(0, dtype=torch.int64) if q_pos is None else q_pos.to(torch.int64).contiguous()
    ops.dense_attention(q.contiguous(), kv.contiguous(), pos, float(scale), out)
    return out
