"""KDA Triton kernels: the recurrent form (decode) and the chunked form (prefill, partly Triton).

- `fused_recurrent_kda_triton`: one program per (sequence, head, V-tile); the [K, BV] state tile lives in
  registers for the whole sequence, each step reads q/k/g/v/beta once and writes o once.
- `chunk_kda_triton`, three stages:
  1. the two decayed Gram matrices of every (chunk, head) — the per-channel-decay part, where the
     memory traffic is — in a Triton kernel (`_decayed_grams_kernel`, sub-chunk trick of chunk.py,
     one program per pair of 16-row sub-chunks, exact [16, 16, BK] decays on the diagonal, tl.dot off it);
  2. the unit-triangular solve and the U0/W/Qeff/Ointra products in PyTorch (chunk.prepare_chunks:
     batched over all chunks, i.e. a few large cuBLAS calls on a GPU);
  3. walking the chunks with the state in a Triton kernel (`_chunk_state_kernel`): one program per
     (sequence, head, V-tile), state tile in registers, three tl.dot per chunk.
  Stages 1-3 fused into one kernel, as flash-linear-attention does, is not written yet.

Both take the flattened [B*T, H, D] (contiguous) layout; sequence n covers rows cu[n] .. cu[n+1]-1.
Importing this module decorates the kernels, so set TRITON_INTERPRET=1 first to run them on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertmesh.kernels.kda.chunk import check_chunk_size, from_blocks, prepare_chunks
from expertmesh.kernels.kda.naive import KDAInputs, check_kda_inputs


@triton.jit
def _fused_recurrent_kda_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    h0,
    ht,
    cu,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_h = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)  # state tile S[:, v-tile]
    if HAS_H0:
        b_h += tl.load(h0 + p_h, mask=m_h, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        row = t * H + i_h
        # Padded K lanes load k = q = 0 and g = 0 (decay 1): they never touch the real lanes.
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + row).to(tl.float32)
        b_h = b_h * tl.exp(b_g)[:, None]
        b_err = b_v - tl.sum(b_h * b_k[:, None], axis=0)  # v_t - k_t^T S   [BV]
        b_h += (b_beta * b_k)[:, None] * b_err[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0)
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + p_h, b_h, mask=m_h)


@triton.jit
def _chunk_state_kernel(
    W,
    U0,
    Qeff,
    Oin,
    Kd,
    decay,
    o,
    h0,
    ht,
    block_start,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    c0 = tl.load(block_start + i_n).to(tl.int64)
    c1 = tl.load(block_start + i_n + 1).to(tl.int64)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    m_ck = m_k[None, :] & (o_c[:, None] < C)  # (broadcast to [C, BK])
    m_cv = m_v[None, :] & (o_c[:, None] < C)
    p_h = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + p_h, mask=m_h, other=0.0)
    for c in range(c0, c1):
        blk = c * H + i_h  # block (c, head) of [NB, H, C, *]
        p_ck = blk * C * K + o_c[:, None] * K + o_k[None, :]
        p_cv = blk * C * V + o_c[:, None] * V + o_v[None, :]
        b_w = tl.load(W + p_ck, mask=m_ck, other=0.0)  # [C, BK]
        b_qe = tl.load(Qeff + p_ck, mask=m_ck, other=0.0)
        b_u = tl.load(U0 + p_cv, mask=m_cv, other=0.0) - tl.dot(b_w, b_h, input_precision=PRECISION)
        b_o = tl.load(Oin + p_cv, mask=m_cv, other=0.0) + tl.dot(b_qe, b_h, input_precision=PRECISION)
        tl.store(o + p_cv, b_o, mask=m_cv)
        b_kd = tl.load(Kd + p_ck, mask=m_ck, other=0.0)
        b_dec = tl.load(decay + blk * K + o_k, mask=m_k, other=0.0)  # exp(G_C) per key channel
        b_h = b_h * b_dec[:, None] + tl.dot(tl.trans(b_kd), b_u, input_precision=PRECISION)
    if STORE_HT:
        tl.store(ht + p_h, b_h, mask=m_h)


@triton.jit
def _decayed_grams_kernel(
    q,
    k,
    G,
    Mqk,
    Mkk,
    C: tl.constexpr,
    K: tl.constexpr,
    S: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One program per ((block, head), row sub-chunk a, column sub-chunk b) of the [C, C] Gram matrices
    # M_xk[r, i] = sum_c x[r, c] k[i, c] exp(G[r, c] - G[i, c]) (i <= r), x in (q, k); see chunk.py.
    i_bh = tl.program_id(0).to(tl.int64)
    i_a = tl.program_id(1)
    i_b = tl.program_id(2)
    base = i_bh * C * K
    o_s = tl.arange(0, S)
    rows = i_a * S + o_s
    cols = i_b * S + o_s
    acc_q = tl.zeros([S, S], dtype=tl.float32)
    acc_k = tl.zeros([S, S], dtype=tl.float32)
    if i_b < i_a:
        # Earlier sub-chunk: factor through G_ref = G at row a*S; both factors <= 1, then two tl.dot.
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m = (o_k < K)[None, :]
            p_a = base + rows[:, None] * K + o_k[None, :]
            p_b = base + cols[:, None] * K + o_k[None, :]
            b_ref = tl.load(G + base + i_a * S * K + o_k, mask=o_k < K, other=0.0)
            b_ea = tl.exp(tl.load(G + p_a, mask=m, other=0.0) - b_ref[None, :])
            b_qa = tl.load(q + p_a, mask=m, other=0.0) * b_ea
            b_ka = tl.load(k + p_a, mask=m, other=0.0) * b_ea
            b_kb = tl.load(k + p_b, mask=m, other=0.0) * tl.exp(b_ref[None, :] - tl.load(G + p_b, mask=m, other=0.0))
            b_kbt = tl.trans(b_kb)
            acc_q += tl.dot(b_qa, b_kbt, input_precision=PRECISION)
            acc_k += tl.dot(b_ka, b_kbt, input_precision=PRECISION)
    elif i_b == i_a:
        # Diagonal sub-chunk: exact [S, S, BK] decays, masked to i <= r before exp.
        causal = (o_s[:, None] >= o_s[None, :])[:, :, None]
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m = (o_k < K)[None, :]
            p_a = base + rows[:, None] * K + o_k[None, :]
            b_g = tl.load(G + p_a, mask=m, other=0.0)
            b_q = tl.load(q + p_a, mask=m, other=0.0)
            b_k = tl.load(k + p_a, mask=m, other=0.0)
            b_e = tl.exp(tl.where(causal, b_g[:, None, :] - b_g[None, :, :], float("-inf")))
            b_kd = b_k[None, :, :] * b_e  # [S(r), S(i), BK]
            acc_q += tl.sum(b_q[:, None, :] * b_kd, axis=2)
            acc_k += tl.sum(b_k[:, None, :] * b_kd, axis=2)
    # b > a: the zeros above the diagonal are written too.
    p_m = i_bh * C * C + rows[:, None] * C + cols[None, :]
    tl.store(Mqk + p_m, acc_q)
    tl.store(Mkk + p_m, acc_k)


def decayed_grams_fwd(q, k, G, sub: int, Mqk, Mkk, precision: str = "ieee") -> None:
    """Launch the Gram kernel: q, k, G fp32 contiguous [..., C, K]; writes Mqk, Mkk [..., C, C]."""
    C, K = k.shape[-2], k.shape[-1]
    BH = k.numel() // (C * K)
    BK = min(32, max(16, triton.next_power_of_2(K)))
    _decayed_grams_kernel[(BH, C // sub, C // sub)](q, k, G, Mqk, Mkk, C=C, K=K, S=sub, BK=BK, PRECISION=precision)


def decayed_grams_triton(q, k, G, sub: int):
    """Drop-in for chunk._decayed_grams: returns (Mqk, Mkk) [..., C, C]."""
    q, k, G = (t.contiguous() for t in (q, k, G))
    C = k.shape[-2]
    Mqk = q.new_empty(*k.shape[:-1], C)
    Mkk = q.new_empty(*k.shape[:-1], C)
    if k.numel():
        decayed_grams_fwd(q, k, G, sub, Mqk, Mkk)
    return Mqk, Mkk


def _block_sizes(K: int, V: int) -> tuple[int, int]:
    # tl.dot needs every dim >= 16; BV <= 64 keeps the [BK, BV] fp32 state tile in registers.
    return max(16, triton.next_power_of_2(K)), max(16, min(64, triton.next_power_of_2(V)))


def _cu(info: KDAInputs, device: torch.device) -> torch.Tensor:
    cu = list(info.starts) + [info.starts[-1] + info.lengths[-1]] if info.N else [0]
    return torch.tensor(cu, dtype=torch.int64, device=device)


def fused_recurrent_fwd(q, k, v, g, beta, info: KDAInputs, initial_state, o, final_state) -> None:
    """Launch the recurrent kernel into preallocated buffers: o [B, T, H, V] (v's dtype) and
    final_state fp32 [N, H, K, V] or None. Inputs must already be contiguous."""
    BK, BV = _block_sizes(info.K, info.V)
    h0 = initial_state.float().contiguous() if initial_state is not None else o  # dummy pointer when unused
    grid = (triton.cdiv(info.V, BV), info.N * info.H)
    _fused_recurrent_kda_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        o,
        h0,
        final_state if final_state is not None else o,
        _cu(info, q.device),
        info.scale,
        H=info.H,
        K=info.K,
        V=info.V,
        BK=BK,
        BV=BV,
        HAS_H0=initial_state is not None,
        STORE_HT=final_state is not None,
    )


def fused_recurrent_kda_triton(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=64,
):
    """Recurrent (decode) KDA in Triton; contract as `fused_recurrent_kda` (chunk_size ignored)."""
    info = check_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty_like(v)
    final = torch.empty(info.N, info.H, info.K, info.V, device=q.device) if output_final_state else None
    if info.N * info.H and info.T:
        fused_recurrent_fwd(q, k, v, g, beta, info, initial_state, o, final)
    elif final is not None:
        final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
    return o, final


def chunk_state_fwd(prep, info: KDAInputs, initial_state, o_blocks, final_state, precision: str = "ieee") -> None:
    """Launch the chunk-walking kernel into preallocated fp32 buffers o_blocks [NB, H, C, V] and
    final_state [N, H, K, V] or None."""
    C = prep.layout.C
    BK, BV = _block_sizes(info.K, info.V)
    h0 = initial_state.float().contiguous() if initial_state is not None else o_blocks
    block_start = torch.tensor(prep.layout.block_start, dtype=torch.int64, device=o_blocks.device)
    grid = (triton.cdiv(info.V, BV), info.N * info.H)
    _chunk_state_kernel[grid](
        prep.W,
        prep.U0,
        prep.Qeff.contiguous(),
        prep.Ointra.contiguous(),
        prep.Kd.contiguous(),
        prep.decay,
        o_blocks,
        h0,
        final_state if final_state is not None else o_blocks,
        block_start,
        H=info.H,
        K=info.K,
        V=info.V,
        C=C,
        BK=BK,
        BV=BV,
        HAS_H0=initial_state is not None,
        STORE_HT=final_state is not None,
        PRECISION=precision,
    )


def chunk_kda_triton(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=64,
):
    """Chunked (prefill) KDA: Triton Gram kernel, PyTorch triangular solve and products, Triton
    chunk-walking kernel (module docstring); contract as `chunk_kda`. chunk_size must be a power of
    two >= 16 (tl.dot tiles, 16-row sub-chunks)."""
    info = check_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    check_chunk_size(chunk_size)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two >= 16 for the Triton path, found {chunk_size}")
    prep = prepare_chunks(q, k, v, g, beta, info, chunk_size, grams=decayed_grams_triton)
    o_blocks = torch.empty(prep.layout.num_blocks, info.H, chunk_size, info.V, device=q.device)
    final = torch.empty(info.N, info.H, info.K, info.V, device=q.device) if output_final_state else None
    if info.N * info.H:
        chunk_state_fwd(prep, info, initial_state, o_blocks, final)
    return from_blocks(o_blocks, prep.layout, info, v.dtype), final
