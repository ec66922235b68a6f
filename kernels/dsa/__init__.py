"""DSA sparse attention ops: lightning indexer, top-k selection, sparse MLA attention (prefill and paged decode).

`dsa_decode_paged` picks the Triton kernels for CUDA tensors and the PyTorch path otherwise
(`expertmesh.kernels.backend.resolve`; `use_backend` forces one); on CPU its sparse attention runs the C++ kernel
(`cpu_kernel.py`) when it is built and the backend is not forced. `dsa_prefill` and `lightning_indexer` have
no Triton kernel yet: their blocked PyTorch paths run on either device. The Triton module is imported only
when first chosen, so the PyTorch paths need no triton and TRITON_INTERPRET can be set before the kernels
are decorated. The math, tie-breaking and index order are described in `naive.py`.
"""

from __future__ import annotations

import torch

from expertmesh.kernels.backend import resolve
from expertmesh.kernels.dsa.cpu_kernel import runs_for as cpu_kernel_runs_for
from expertmesh.kernels.dsa.naive import (
    check_decode_inputs,
    check_dsa_inputs,
    dsa_attention_reference,
    dsa_decode_paged_reference,
    indexer_scores,
    lightning_indexer_reference,
    topk_indices_reference,
)
from expertmesh.kernels.dsa.sparse import (
    dsa_decode_paged as dsa_decode_paged_torch,
)
from expertmesh.kernels.dsa.sparse import (
    dsa_prefill,
    lightning_indexer,
    mla_prefill,
    paged_indexer_scores,
    paged_sparse_attention,
    select_topk,
    visible_positions,
)
from expertmesh.kernels.dsa.sparse import (
    mla_decode_paged as mla_decode_paged_torch,
)

__all__ = [
    "dsa_prefill",
    "mla_prefill",
    "dsa_decode_paged",
    "mla_decode_paged",
    "lightning_indexer",
    "dsa_attention_reference",
    "dsa_decode_paged_reference",
    "lightning_indexer_reference",
    "topk_indices_reference",
    "dsa_decode_paged_torch",
    "select_topk",
    "indexer_scores",
    "paged_indexer_scores",
    "paged_sparse_attention",
    "check_dsa_inputs",
    "check_decode_inputs",
    "decode_rows_are_batch_invariant",
]


def decode_rows_are_batch_invariant(q: torch.Tensor) -> bool:
    """Whether a decode over several sequences at once gives each the bits it gets alone, when every sequence's
    top-k covers its whole context (no indexer pass): the CPU kernel's result depends only on its own row. (The
    PyTorch path's GEMMs and softmax run over the widest row; the Triton path decodes per sequence here.)"""
    return cpu_kernel_runs_for(q)


def dsa_decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    topk: int,
    scale: float | None = None,
    v_dim: int | None = None,
    return_indices: bool = False,
    out: torch.Tensor | None = None,
):
    """One DSA decode step over a paged cache. Contract: `expertmesh.kernels.dsa.sparse.dsa_decode_paged`.

    Triton branch (`triton_dsa.dsa_decode_paged_triton`): indexer and sparse attention are Triton kernels,
    top-k between them is torch.topk plus the tie rule; no host sync."""
    args = (
        q,
        kv_cache,
        index_k_cache,
        block_table,
        context_lens,
        index_q,
        index_weights,
        topk,
        scale,
        v_dim,
        return_indices,
        out,
    )
    if resolve(q) == "triton":
        from expertmesh.kernels.dsa.triton_dsa import dsa_decode_paged_triton

        return dsa_decode_paged_triton(*args)
    return dsa_decode_paged_torch(*args)


def mla_decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    v_dim: int | None = None,
) -> torch.Tensor:
    """Dense MLA decode over a paged cache. Contract: `expertmesh.kernels.dsa.sparse.mla_decode_paged`.

    Triton branch: the paged sparse-attention kernel over every visible position."""
    if resolve(q) == "triton":
        from expertmesh.kernels.dsa.triton_dsa import paged_sparse_attention_triton

        D = q.shape[-1]
        idx = visible_positions(context_lens, block_table.shape[1] * kv_cache.shape[1])  # no host sync
        return paged_sparse_attention_triton(
            q,
            kv_cache,
            block_table,
            context_lens,
            idx,
            D**-0.5 if scale is None else scale,
            D if v_dim is None else v_dim,
        )

    return mla_decode_paged_torch(q, kv_cache, block_table, context_lens, scale, v_dim)
