"""DSA decode in Triton: the paged lightning indexer and sparse MLA attention over the selected latent entries.

- `_paged_indexer_kernel`: one program per (BN context positions, sequence). It maps the positions through
  the block table, gathers their index keys [BN, Di], scores them against all Hi indexer heads at once
  (tl.dot [BH, Di] x [Di, BN]), ReLU, weighted head sum; positions >= context_len get -inf. Programs wholly
  past a sequence's context only write -inf.
- top-k between the two is `sparse.select_topk` (torch.topk plus the lower-position tie rule; no host sync).
- `_paged_sparse_mla_kernel`: one program per (v_dim tile, head tile, sequence). It walks the used slots of
  the selection in BN-entry chunks: gathers the entries by index through the block table, q.kv over D in
  BD-wide pieces, online softmax, acc += p @ kv[:, v tile]. Every head tile shares each gathered entry (MQA);
  the q.kv logits are recomputed per v tile (v_dim/BV times) to keep the [BH, BV] accumulator in registers.
  No split over the selection (flash-decoding style) yet: B * H/BH * v_dim/BV programs per step.

fp32 inputs use IEEE fp32 tl.dot (not TF32), so the scores are close enough to the reference's to select
the same top-k outside near ties; bf16/fp16 inputs run on tensor cores with fp32 accumulation (p is rounded
to the input dtype for p @ v, as flash attention does). Block sizes are untuned (no GPU in CI).
Importing this module decorates the kernels, so set TRITON_INTERPRET=1 first to run them on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertmesh.kernels.backend import triton_interpreted
from expertmesh.kernels.dsa.naive import check_decode_inputs
from expertmesh.kernels.dsa.sparse import decode_indices, pad_indices


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    # F32: IEEE fp32 products (fp32 inputs; and the interpreter, whose tl.dot misreads bf16 operands).
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _paged_indexer_kernel(
    iq,
    iw,
    ik,
    table,
    lens,
    scores,
    stride_table,
    W,
    Hi: tl.constexpr,
    Di: tl.constexpr,
    BS: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    F32: tl.constexpr,
):
    i_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ctx = tl.load(lens + b).to(tl.int32)
    pos = i_n * BN + tl.arange(0, BN)  # logical positions [BN]
    if i_n * BN < ctx:
        o_h = tl.arange(0, BH)
        o_d = tl.arange(0, BD)
        m_h = o_h < Hi
        m_d = o_d < Di
        valid = pos < ctx
        blk = tl.load(table + b * stride_table + pos // BS, mask=valid, other=0).to(tl.int64)
        row = blk * BS + pos % BS  # physical rows [BN]
        b_k = tl.load(ik + row[:, None] * Di + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.0)
        b_q = tl.load(iq + (b * Hi + o_h[:, None]) * Di + o_d[None, :], mask=m_h[:, None] & m_d[None, :], other=0.0)
        b_w = tl.load(iw + b * Hi + o_h, mask=m_h, other=0.0).to(tl.float32)
        logits = _dot(b_q, tl.trans(b_k), F32)  # [BH, BN]
        s = tl.sum(tl.maximum(logits, 0.0) * b_w[:, None], axis=0)  # padded heads have w = 0
        s = tl.where(valid, s, float("-inf"))
    else:
        s = tl.full([BN], float("-inf"), tl.float32)
    tl.store(scores + b * W + pos, s, mask=pos < W)


@triton.jit
def _paged_sparse_mla_kernel(
    q,
    kv,
    table,
    lens,
    idx,
    o,
    scale,
    stride_table,
    H: tl.constexpr,
    D: tl.constexpr,
    V: tl.constexpr,
    BS: tl.constexpr,
    K: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    BV: tl.constexpr,
    BN: tl.constexpr,
    F32: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    o_h = i_h * BH + tl.arange(0, BH)
    o_v = i_v * BV + tl.arange(0, BV)
    m_h = o_h < H
    m_v = o_v < V
    # Canonical order: the used slots come first, and there are min(context_len, topk) of them (>= 1).
    n_used = tl.minimum(tl.load(lens + b).to(tl.int32), K)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BV], dtype=tl.float32)
    for j0 in range(0, n_used, BN):
        o_n = j0 + tl.arange(0, BN)
        pos = tl.load(idx + b * K + o_n, mask=o_n < n_used, other=-1)
        used = pos >= 0
        safe = tl.where(used, pos, 0)
        blk = tl.load(table + b * stride_table + safe // BS, mask=used, other=0).to(tl.int64)
        row = blk * BS + safe % BS  # physical rows [BN]
        s = tl.zeros([BH, BN], dtype=tl.float32)
        for d0 in tl.static_range(0, D, BD):
            o_d = d0 + tl.arange(0, BD)
            m_d = o_d < D
            b_q = tl.load(q + (b * H + o_h[:, None]) * D + o_d[None, :], mask=m_h[:, None] & m_d[None, :], other=0.0)
            b_k = tl.load(kv + row[:, None] * D + o_d[None, :], mask=used[:, None] & m_d[None, :], other=0.0)
            s += _dot(b_q, tl.trans(b_k), F32)
        s = tl.where(used[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: slot 0 is always used
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        b_v = tl.load(kv + row[:, None] * D + o_v[None, :], mask=used[:, None] & m_v[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(b_v.dtype), b_v, F32)
        m_i = m_new
    b_o = acc / l_i[:, None]
    tl.store(
        o + (b * H + o_h[:, None]) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_h[:, None] & m_v[None, :]
    )


def _f32_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or triton_interpreted()


def _pow2(n: int, lo: int = 16, hi: int | None = None) -> int:
    p = max(lo, triton.next_power_of_2(n))
    return min(p, hi) if hi is not None else p


def paged_indexer_scores_triton(index_q, index_weights, index_k_cache, block_table, context_lens, out=None):
    """Indexer scores over a paged cache: index_q [B,Hi,Di], index_weights [B,Hi], index_k_cache
    [num_blocks, block_size, Di] (index_q's dtype), block_table [B, max_blocks], context_lens [B] → [B,
    max_blocks*block_size] fp32, -inf at positions >= context_lens[b] (into `out` if given, contiguous)."""
    B, Hi, Di = index_q.shape
    bs = index_k_cache.shape[1]
    W = block_table.shape[1] * bs
    out = torch.empty(B, W, device=index_q.device) if out is None else out
    BN = 64
    grid = (triton.cdiv(W, BN), B)
    if B and W:
        _paged_indexer_kernel[grid](
            index_q.contiguous(),
            index_weights.contiguous(),
            index_k_cache.contiguous(),
            block_table,
            context_lens,
            out,
            block_table.stride(0),
            W,
            Hi=Hi,
            Di=Di,
            BS=bs,
            BH=_pow2(Hi),
            BD=_pow2(Di),
            BN=BN,
            F32=_f32_dot(index_q.dtype),
        )
    return out


def paged_sparse_attention_triton(q, kv_cache, block_table, context_lens, indices, scale, v_dim, out=None):
    """q [B,H,D] over the selected entries `indices` [B,K] (logical positions in canonical order: the
    min(context_len, topk) used slots first, then -1) of each sequence's pages in kv_cache [num_blocks,
    block_size, D] → [B,H,v_dim] in q's dtype (into `out` if given, contiguous)."""
    B, H, D = q.shape
    bs = kv_cache.shape[1]
    K = indices.shape[1]
    out = torch.empty(B, H, v_dim, dtype=q.dtype, device=q.device) if out is None else out
    BH, BV = 16, _pow2(v_dim, hi=256)
    grid = (triton.cdiv(v_dim, BV), triton.cdiv(H, BH), B)
    if B and H:
        _paged_sparse_mla_kernel[grid](
            q.contiguous(),
            kv_cache.contiguous(),
            block_table,
            context_lens,
            indices.contiguous(),
            out,
            float(scale),
            block_table.stride(0),
            H=H,
            D=D,
            V=v_dim,
            BS=bs,
            K=K,
            BH=BH,
            BD=_pow2(D, hi=64),
            BV=BV,
            BN=32,
            F32=_f32_dot(q.dtype),
        )
    return out


def dsa_decode_paged_triton(
    q,
    kv_cache,
    index_k_cache,
    block_table,
    context_lens,
    index_q,
    index_weights,
    topk,
    scale=None,
    v_dim=None,
    return_indices=False,
    out=None,
):
    """One DSA decode step with the Triton kernels; contract: `expertmesh.kernels.dsa.sparse.dsa_decode_paged`.
    The indexer scores every slot of the block table (max_blocks*block_size, -inf past each context), so the
    step needs no host sync."""
    shp = check_decode_inputs(
        q, kv_cache, index_k_cache, block_table, context_lens, index_q, index_weights, topk, scale, v_dim, out
    )
    idx = decode_indices(
        shp,
        lambda: paged_indexer_scores_triton(index_q, index_weights, index_k_cache, block_table, context_lens),
        context_lens,
        shp.max_blocks * shp.block_size,
    )
    o = paged_sparse_attention_triton(q, kv_cache, block_table, context_lens, idx, shp.scale, shp.v_dim, out=out)
    return (o, pad_indices(idx, shp.width)) if return_indices else o
