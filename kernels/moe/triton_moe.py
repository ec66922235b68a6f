"""Grouped MXFP4 MoE GEMM in Triton (same contract as `naive.moe_expert_outputs`).

The (token, slot) pairs are sorted by expert on the host side (`grouped.group_by_expert`) and cut into tiles
of BLOCK_M rows that never straddle two experts; experts without tokens get no tiles. Two launches:
  1. gate_up + activation: program (tile, n-block) computes g = x·W_gate^T and u = x·W_up^T for BLOCK_N columns
     and writes h = act(g, u) (fp32) into a [n_valid, I] buffer in sorted-row order; act is SwiGLU silu(g)·u or
     SiTU β·tanh(g/β)·σ(g)·β_lin·tanh(u/β_lin) (`kernels.activation`, a compile-time switch: the SwiGLU code is
     what it was before SiTU). SiTU's σ and tanh each come from one exp of a non-positive argument (`_sigmoid`,
     `_tanh`), so nothing overflows, on a GPU or under the interpreter;
  2. down: program (tile, n-block) computes h·W2^T and stores it to the slot's row of out [T·K, H].
Weights are decoded inside the K loop from packed nibbles and E8M0 scales (never a whole dequantised
matrix): the byte at packed column j holds elements 2j (low nibble) and 2j+1 (high), so each step loads the
activations' even and odd columns and issues two dots, one per nibble plane.

Precision: every dot is fp32 "ieee" (no TF32) on fp32 operands (bf16/fp16 x is upcast on load), and h stays
fp32, as in the reference. (bf16 tensor-core dots would be exact on the decoded weights but round h; they are
left out because Triton 3.9's interpreter computes bf16 tl.dot wrongly, so CI could not test them.)
Batch invariance holds by construction: one fixed tile configuration (no autotuning on T), no split-K, so
every output element is reduced in the same order whatever other rows share its tile. Slots with id -1 are
zero-filled. Not yet run on a GPU: only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertmesh.kernels.activation import SWIGLU, GatedActivation, check_activation
from expertmesh.kernels.moe.experts import MXFP4Experts
from expertmesh.kernels.moe.grouped import group_by_expert
from expertmesh.kernels.moe.naive import check_moe_inputs
from expertmesh.kernels.mxfp4.triton_mxfp4 import e2m1_value, e8m0_scale

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _decode_plane(w_ptrs, s_ptrs, mask):
    """Packed bytes [BN, BK/2] + their scale bytes → (low-nibble values, high-nibble values) fp32."""
    packed = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32)
    scale = e8m0_scale(tl.load(s_ptrs, mask=mask, other=127).to(tl.int32))
    return e2m1_value(packed & 0xF) * scale, e2m1_value(packed >> 4) * scale


@triton.jit
def _dot(a, b_t, acc):
    """acc + a [BM, BK/2] · b_t^T ([BN, BK/2]), fp32 operands, IEEE fp32 (no TF32)."""
    return tl.dot(a, tl.trans(b_t), acc, input_precision="ieee")


@triton.jit
def _tanh(x):
    """tanh in fp32 from e = exp(-2|x|) ∈ [0, 1] (never overflows; ±1 exactly once |x| > 9): sign(x)·(1-e)/(1+e),
    and below |x| = 2^-4, where 1 - e cancels, the odd Taylor polynomial to x^7 (truncation < 1e-11 relative).
    Measured in fp32 against fp64 tanh: |error| ≤ 1.1e-7 absolute, ≤ 1.1e-6 relative (near |x| = 2^-4)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(ax < 0.0625, small, tl.where(x < 0, -big, big))


@triton.jit
def _sigmoid(x):
    """σ(x) in fp32 from e = exp(-|x|) ∈ [0, 1] (no overflow): 1/(1+e) for x ≥ 0, e/(1+e) below."""
    e = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + e)
    return tl.where(x >= 0, r, e * r)


@triton.jit
def _gate_up_act_kernel(
    x_ptr,
    slots_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    wb_ptr,
    ws_ptr,
    h_ptr,
    H,
    I,
    TOPK,
    beta,
    linear_beta,
    stride_xt,
    stride_wbe,
    stride_wbn,
    stride_wse,
    stride_wsn,
    stride_hm,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SITU: tl.constexpr,
    CAP_UP: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    r0, r1 = tl.load(tile_start_ptr + pid_m), tl.load(tile_end_ptr + pid_m)
    rm = r0 + tl.arange(0, BM)  # sorted-row positions
    mask_m = rm < r1
    tok = tl.load(slots_ptr + rm, mask=mask_m, other=0) // TOPK  # token of each slot
    rn = pid_n * BN + tl.arange(0, BN)  # gate rows (up rows: I + rn)
    mask_n = rn < I
    j = tl.arange(0, BK // 2)
    wg = wb_ptr + e * stride_wbe + rn[:, None] * stride_wbn
    wu = wg + I * stride_wbn
    sg = ws_ptr + e * stride_wse + rn[:, None] * stride_wsn
    su = sg + I * stride_wsn
    x_rows = x_ptr + tok[:, None].to(tl.int64) * stride_xt
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        col = k0 + 2 * j  # even element columns of this step
        mask_k = col < H
        xm = mask_m[:, None] & mask_k[None, :]
        x_even = tl.load(x_rows + col[None, :], mask=xm, other=0.0).to(tl.float32)
        x_odd = tl.load(x_rows + col[None, :] + 1, mask=xm, other=0.0).to(tl.float32)
        wm = mask_n[:, None] & mask_k[None, :]
        pcol = (k0 // 2 + j)[None, :]
        scol = (col // 32)[None, :]
        g_lo, g_hi = _decode_plane(wg + pcol, sg + scol, wm)
        u_lo, u_hi = _decode_plane(wu + pcol, su + scol, wm)
        acc_g = _dot(x_even, g_lo, acc_g)
        acc_g = _dot(x_odd, g_hi, acc_g)
        acc_u = _dot(x_even, u_lo, acc_u)
        acc_u = _dot(x_odd, u_hi, acc_u)
    if SITU:
        a = beta * _tanh(acc_g / beta)  # β·tanh(g/β)
        a = a * _sigmoid(acc_g)  # · σ(g)
        if CAP_UP:
            acc_u = linear_beta * _tanh(acc_u / linear_beta)  # β_lin·tanh(u/β_lin)
        h = a * acc_u
    else:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(g) · u
    tl.store(
        h_ptr + rm[:, None].to(tl.int64) * stride_hm + rn[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _down_kernel(
    h_ptr,
    slots_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    wb_ptr,
    ws_ptr,
    out_ptr,
    H,
    I,
    stride_hm,
    stride_wbe,
    stride_wbn,
    stride_wse,
    stride_wsn,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    r0, r1 = tl.load(tile_start_ptr + pid_m), tl.load(tile_end_ptr + pid_m)
    rm = r0 + tl.arange(0, BM)
    mask_m = rm < r1
    slot = tl.load(slots_ptr + rm, mask=mask_m, other=0)
    rn = pid_n * BN + tl.arange(0, BN)  # output columns (rows of W2)
    mask_n = rn < H
    j = tl.arange(0, BK // 2)
    wrow = wb_ptr + e * stride_wbe + rn[:, None] * stride_wbn
    srow = ws_ptr + e * stride_wse + rn[:, None] * stride_wsn
    h_rows = h_ptr + rm[:, None].to(tl.int64) * stride_hm
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        col = k0 + 2 * j
        mask_k = col < I
        hm = mask_m[:, None] & mask_k[None, :]
        h_even = tl.load(h_rows + col[None, :], mask=hm, other=0.0)
        h_odd = tl.load(h_rows + col[None, :] + 1, mask=hm, other=0.0)
        w_lo, w_hi = _decode_plane(
            wrow + (k0 // 2 + j)[None, :], srow + (col // 32)[None, :], mask_n[:, None] & mask_k[None, :]
        )
        acc = _dot(h_even, w_lo, acc)
        acc = _dot(h_odd, w_hi, acc)
    tl.store(out_ptr + slot[:, None] * stride_om + rn[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


def _tile_schedule(counts: list[int], block_m: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert segments of the sorted valid rows → tiles (expert, start, end) of ≤ block_m rows, int32."""
    te, ts, tn = [], [], []
    off = 0
    for e, n in enumerate(counts):
        for s in range(off, off + n, block_m):
            te.append(e)
            ts.append(s)
            tn.append(min(s + block_m, off + n))
        off += n
    mk = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return mk(te), mk(ts), mk(tn)


def moe_expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: MXFP4Experts,
    *,
    out: torch.Tensor | None = None,
    activation: GatedActivation = SWIGLU,
) -> torch.Tensor:
    """Triton grouped MXFP4 path. Contract: `expertmesh.kernels.moe.naive.moe_expert_outputs`."""
    s = check_moe_inputs(x, topk_ids, experts, out)
    act = check_activation(activation)
    T, K, E, H, I = s.T, s.K, s.E, s.H, s.I
    if out is None:
        out = torch.empty(T, K, H, dtype=x.dtype, device=x.device)
    flat_out = out.view(T * K, H)
    # The kernel stores fp32; other dtypes are rounded by torch's copy_ (round-to-nearest-even, as the
    # reference), not by the in-kernel cast, which Triton's interpreter implements as truncation.
    target = flat_out if x.dtype == torch.float32 else torch.empty(T * K, H, dtype=torch.float32, device=x.device)
    order, counts, n_invalid = group_by_expert(topk_ids, E)
    if n_invalid:
        target.index_fill_(0, order[:n_invalid], 0)
    n_valid = T * K - n_invalid
    if n_valid == 0:
        if target is not flat_out:
            flat_out.copy_(target)
        return out
    slots = order[n_invalid:].contiguous()
    tile_e, tile_s, tile_n = _tile_schedule(counts, BLOCK_M, x.device)
    n_tiles = tile_e.numel()
    x = x.contiguous()
    w13_blocks, w13_scales, w2_blocks, w2_scales = experts.contiguous()
    h = torch.empty(n_valid, I, dtype=torch.float32, device=x.device)
    situ = act.kind == "situ"
    _gate_up_act_kernel[(n_tiles, triton.cdiv(I, BLOCK_N))](
        x,
        slots,
        tile_e,
        tile_s,
        tile_n,
        w13_blocks,
        w13_scales,
        h,
        H,
        I,
        K,
        act.beta if situ else 1.0,
        act.linear_beta if act.caps_up else 1.0,
        x.stride(0),
        w13_blocks.stride(0),
        w13_blocks.stride(1),
        w13_scales.stride(0),
        w13_scales.stride(1),
        h.stride(0),
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
        SITU=situ,
        CAP_UP=act.caps_up,
    )
    _down_kernel[(n_tiles, triton.cdiv(H, BLOCK_N))](
        h,
        slots,
        tile_e,
        tile_s,
        tile_n,
        w2_blocks,
        w2_scales,
        target,
        H,
        I,
        h.stride(0),
        w2_blocks.stride(0),
        w2_blocks.stride(1),
        w2_scales.stride(0),
        w2_scales.stride(1),
        target.stride(0),
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )
    if target is not flat_out:
        flat_out.copy_(target)
    return out
