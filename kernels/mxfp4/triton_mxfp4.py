"""Triton MXFP4 dequantisation (same contract as `naive.dequantize_mxfp4`).

On contiguous tensors the packed byte b (flat index over [..., K/2]) holds elements 2b and 2b+1 of the flat
[..., K] output, and its scale is flat scale b // (block_size / 2): K/2 bytes per row = (K/bs) scales · (bs/2).
Each program decodes BLOCK packed bytes; the E2M1 value is computed arithmetically (no table) and the E8M0
scale is built from its bits, so the result is exact, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertmesh.kernels.mxfp4.naive import check_mxfp4

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def e2m1_value(code):
    """E2M1 code (int32, 0..15) → fp32 value: bits 1-2 exponent, bit 0 mantissa, bit 3 sign."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    # e == 0: subnormal 0 / 0.5; else 2^(e-1) · (1 + m/2)  → 1, 1.5, 2, 3, 4, 6
    pow2 = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    val = tl.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def e8m0_scale(s):
    """E8M0 byte (int32, 0..255) → fp32 2^(s-127) built from bits (s = 0 → the fp32 subnormal 2^-127, 0xFF → NaN)."""
    bits = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant_kernel(
    blocks_ptr, scales_ptr, out_ptr, n_bytes, HALF_BS: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    b = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = b < n_bytes
    packed = tl.load(blocks_ptr + b, mask=mask, other=0).to(tl.int32)
    s = tl.load(scales_ptr + b // HALF_BS, mask=mask, other=0).to(tl.int32)
    scale = e8m0_scale(s)
    lo = e2m1_value(packed & 0xF) * scale
    hi = e2m1_value(packed >> 4) * scale
    if BF16_BITS:
        # bf16 output through an int16 view: the value is exact in bf16, so its bf16 bits are the top half of
        # its fp32 bits (NaN/inf and subnormals included) — no float conversion involved (Triton's interpreter
        # flushes bf16 subnormals in its casts).
        lo = (lo.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
        hi = (hi.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    tl.store(out_ptr + 2 * b, lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + 2 * b + 1, hi.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, block_size: int = 32
) -> torch.Tensor:
    """Triton version of `expertmesh.kernels.mxfp4.naive.dequantize_mxfp4` (fp32 / bf16 exact; fp16 rounded)."""
    K = check_mxfp4(blocks, scales, block_size)
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(map(str, _OUT_DTYPES))}, found {dtype}")
    blocks, scales = blocks.contiguous(), scales.contiguous()
    out = torch.empty(*blocks.shape[:-1], K, dtype=dtype, device=blocks.device)
    n_bytes = blocks.numel()
    if n_bytes == 0:
        return out
    BLOCK = 1024
    bf16 = dtype == torch.bfloat16
    _dequant_kernel[(triton.cdiv(n_bytes, BLOCK),)](
        blocks,
        scales,
        out.view(torch.int16) if bf16 else out,
        n_bytes,
        HALF_BS=block_size // 2,
        BF16_BITS=bf16,
        BLOCK=BLOCK,
    )
    return out
