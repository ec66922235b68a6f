"""Row-invariant linear / bmm: the contract, the packed weight layout, and a short PyTorch reference.

    linear(x [M, K] bf16, w_packed, N, K) → y [M, N] bf16,   y[m, n] = round_bf16(Σ_k x[m, k] · w[n, k])
    bmm(x [B, M, K] bf16, w [B, K, N] bf16) → y [B, M, N],    y[b, m, n] = round_bf16(Σ_k x[b, m, k] · w[b, k, n])

accumulated in fp32, rounded to bf16 once. `w_packed = pack_weight(w)` for w [N, K]: groups of 64 output columns
with K pairs interleaved, [ceil(N/64), ceil(K/2), 64, 2], zero-padded (the operand layout of AVX512-BF16's
VDPBF16PS; see kernels/linear/cpu/row_invariant_linear.cpp). The reference computes the same sums with an fp32
matmul, whose summation order differs from the kernel's fixed one: the two agree to fp32 rounding before the
bf16 rounding (so within about one bf16 ulp), not bitwise. `matmul_in_tile_order` spells out, step by step, the
order of the kernel's AMX path (the tile unit's per-instruction sums): it gives that path's bits exactly.
"""

from __future__ import annotations

import torch

GROUP = 64  # output columns per packed group


def _shape(t: torch.Tensor) -> str:
    return "[" + ",".join(str(s) for s in t.shape) + "]"


def check_linear_inputs(x: torch.Tensor, w_packed: torch.Tensor, n: int, k: int) -> None:
    """Raise ValueError / TypeError naming the tensor that does not fit the contract."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(f"x: expected a bfloat16 tensor, found {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected [..., K={k}], found {_shape(x)}")
    if not isinstance(w_packed, torch.Tensor) or w_packed.dtype != torch.bfloat16:
        raise TypeError(
            f"w_packed: expected a bfloat16 tensor, found {getattr(w_packed, 'dtype', type(w_packed).__name__)}"
        )
    want = (-(-n // GROUP), -(-k // 2), GROUP, 2)
    if tuple(w_packed.shape) != want:
        raise ValueError(
            f"w_packed: expected {list(want)} (pack_weight of an [N={n}, K={k}] weight), found {_shape(w_packed)}"
        )
    if x.device != w_packed.device:
        raise ValueError(f"x: on {x.device}, w_packed on {w_packed.device}")


def check_bmm_inputs(x: torch.Tensor, w: torch.Tensor) -> None:
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
            raise TypeError(f"{name}: expected a bfloat16 tensor, found {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 3:
            raise ValueError(f"{name}: expected rank 3, found {_shape(t)}")
    if w.shape[0] != x.shape[0] or w.shape[1] != x.shape[2]:
        raise ValueError(f"w: expected [B={x.shape[0]}, K={x.shape[2]}, N] for x {_shape(x)}, found {_shape(w)}")
    if x.device != w.device:
        raise ValueError(f"x: on {x.device}, w on {w.device}")


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bf16 → [ceil(N/64), ceil(K/2), 64, 2]: element [g, p, c, j] = w[64g + c, 2p + j] (0 outside w)."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2:
        raise TypeError(
            f"w: expected a 2-D bfloat16 tensor [N, K], found "
            f"{getattr(w, 'dtype', type(w).__name__)} {_shape(w) if isinstance(w, torch.Tensor) else ''}"
        )
    n, k = w.shape
    g, p = -(-n // GROUP), -(-k // 2)
    padded = torch.nn.functional.pad(w.detach(), (0, 2 * p - k, 0, g * GROUP - n))
    return padded.view(g, GROUP, p, 2).permute(0, 2, 1, 3).contiguous()


def pack_bmm_weight(w: torch.Tensor) -> torch.Tensor:
    """A bmm weight w [B, K, N] bf16 → [B, ceil(N/64), ceil(K/2), 64, 2]: each w[b] packed as `pack_weight` packs
    its transpose [N, K] (what `cpu_kernel.bmm_packed` reads; the same sums as `bmm` on w)."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 3:
        raise TypeError(
            f"w: expected a 3-D bfloat16 tensor [B, K, N], found "
            f"{getattr(w, 'dtype', type(w).__name__)} {_shape(w) if isinstance(w, torch.Tensor) else ''}"
        )
    b, k, n = w.shape
    g, p = -(-n // GROUP), -(-k // 2)
    padded = torch.nn.functional.pad(w.detach().transpose(1, 2), (0, 2 * p - k, 0, g * GROUP - n))
    return padded.reshape(b, g, GROUP, p, 2).permute(0, 1, 3, 2, 4).contiguous()


def unpack_weight(w_packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_weight`: [N, K]."""
    g, p = w_packed.shape[:2]
    return w_packed.permute(0, 2, 1, 3).reshape(g * GROUP, 2 * p)[:n, :k]


def linear(x: torch.Tensor, w_packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The reference: fp32 matmul of the unpacked weight, rounded to bf16."""
    check_linear_inputs(x, w_packed, n, k)
    return (x.float() @ unpack_weight(w_packed, n, k).float().T).to(torch.bfloat16)


def bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference: fp32 batched matmul, rounded to bf16."""
    check_bmm_inputs(x, w)
    return torch.bmm(x.float(), w.float()).to(torch.bfloat16)


TILE_PAIRS = 16  # K pairs per AMX TDPBF16PS


def matmul_in_tile_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ w [N, K]^T → [M, N] bf16, summed as AMX-BF16's TDPBF16PS does (the kernel's isa amx, found
    bitwise on this project's CPU): K in blocks of 16 pairs (2p, 2p+1); in each block the even products and the odd
    products are summed apart in fp32, in pair order from +0, and the accumulator (from +0) takes their sum:
    c = c + (S_even + S_odd). A bf16 product is exact in fp32, so every `+` below is one fp32 rounding. Subnormals
    are not flushed here (the tile unit flushes them): the same bits for inputs with none. Slow: tests only."""
    return matmul_in_tile_order_fp32(x, w).to(torch.bfloat16)


def matmul_in_tile_order_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`matmul_in_tile_order` before its rounding to bf16: the fp32 accumulators [M, N]."""
    m, k = x.shape
    xf = torch.nn.functional.pad(x.float(), (0, k % 2))
    wf = torch.nn.functional.pad(w.float(), (0, k % 2))
    c = torch.zeros(m, w.shape[0])
    pairs = xf.shape[1] // 2
    for p0 in range(0, pairs, TILE_PAIRS):
        s_even, s_odd = torch.zeros_like(c), torch.zeros_like(c)
        for p in range(p0, min(pairs, p0 + TILE_PAIRS)):
            s_even = s_even + xf[:, 2 * p, None] * wf[None, :, 2 * p]
            s_odd = s_odd + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
        c = c + (s_even + s_odd)
    return c


FP32_LANES = 16  # the fp32 linear's partial sums (one AVX-512 vector)


def linear_fp32_in_lane_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ w [N, K]^T fp32 → [M, N] fp32 as the kernel's fp32 linear sums (`cpu_kernel.linear_fp32`):
    16 lanes, lane j adds the rounded products x[k]·w[k] of k = 16c + j in ascending c from +0 (a short last chunk
    only its first lanes), then the lanes folded by halves: l[i] += l[i + 8], then + 4, + 2, + 1. Slow: tests."""
    m, k = x.shape
    acc = torch.zeros(m, w.shape[0], FP32_LANES)
    for c0 in range(0, k, FP32_LANES):
        r = min(FP32_LANES, k - c0)
        acc[..., :r] = acc[..., :r] + x[:, None, c0 : c0 + r] * w[None, :, c0 : c0 + r]
    h = FP32_LANES // 2
    while h >= 1:
        acc = acc[..., :h] + acc[..., h : 2 * h]
        h //= 2
    return acc[..., 0]
