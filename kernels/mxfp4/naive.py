"""MXFP4 (OCP Microscaling v1.0, FP4 E2M1 elements + one E8M0 scale per block of 32): the reference.

Layout along the last dim of a [..., K] tensor (the gpt-oss checkpoint layout):
    blocks  uint8 [..., K // 2]            two E2M1 codes per byte, element 2j in the LOW nibble, 2j+1 in the high
    scales  uint8 [..., K // block_size]   E8M0 exponents, bias 127: scale = 2^(s - 127); 0xFF = NaN

E2M1 code: bit 3 = sign, bits 0-2 index FP4_VALUES = [0, 0.5, 1, 1.5, 2, 3, 4, 6] (value = sign · FP4_VALUES[c & 7]).
Every decoded value (code value × 2^(s-127)) is exact in fp32 and bf16 (≤ 2 significant bits, exponent in range)
unless it reaches 2^128 (scales 0xFD/0xFE with large codes), which overflows to ±inf. "floor" quantisation of
finite fp32 never produces such a pair (scales ≤ 0xFC); "ceil" can, for |x| above ~2^127.

These functions are vectorised PyTorch and run on any device; `expertmesh.kernels.mxfp4` dispatches
`dequantize_mxfp4` to a Triton kernel on CUDA.
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# Shared exponents representable by a finite E8M0 scale: 2^-127 (0x00) .. 2^127 (0xFE).
EXP_MIN, EXP_MAX = -127, 127
E2M1_EMAX = 2  # exponent of the largest E2M1 value (6 = 1.5 · 2^2): the "floor" rule subtracts it
ROUNDINGS = ("floor", "ceil")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ",".join(str(s) for s in t.shape) + "]"


def fp4_lut(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 code values [16] (codes 8-15 are the negatives of 0-7; code 8 is -0.0)."""
    pos = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos]).to(dtype)


def pow2_exact(e: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2^e exactly for integer e in [-1022, 1023] (built from float64 bits, then cast: exact for every 2^e the
    target dtype can hold, including fp32 subnormals such as 2^-127)."""
    bits = (e.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64).to(dtype)


def e8m0_lut(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256 E8M0 scale values [256]: 2^(s - 127) for s < 255, NaN for 0xFF."""
    s = torch.arange(256, device=device)
    out = pow2_exact(s - E8M0_BIAS, torch.float64)
    out[E8M0_NAN] = float("nan")
    return out.to(dtype)


def quantize_mxfp4(
    x: torch.Tensor, *, block_size: int = 32, scale_rounding: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `x` [..., K] to MXFP4 along the last dim → (blocks uint8 [..., K // 2], scales uint8 [..., K // bs]).

    Per block of `block_size` elements with amax = max |x|:
      - "floor" (OCP MX v1.0): shared exponent e = floor(log2(amax)) − 2, clamped to [-127, 127]. amax / 2^e
        lies in [4, 8); elements above 6 · 2^e saturate to ±6.
      - "ceil" (no clipping): e = ceil(log2(amax / 6)), clamped: every |x| / 2^e ≤ 6.
    Elements x / 2^e round to nearest, ties to even, onto ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, keeping the sign: a
    negative element (or −0) that rounds to zero gets code 0b1000 (−0), as the OCP spec encodes it. Subnormal or tiny inputs are handled exactly: e clamps at -127 and the elements round on
    that grid (often to 0). An all-zero block gets scale 0x00 (2^-127) and zero codes; a block holding a NaN or
    ±Inf gets scale 0xFF (NaN) and zero codes. Computed in fp32 (fp64 for fp64 input); bf16/fp16 are exact in it.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, found {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"x: expected a floating-point dtype ({', '.join(map(str, _FLOATS))}), found {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x: expected rank >= 1 [..., K], found rank 0")
    if scale_rounding not in ROUNDINGS:
        raise ValueError(f"scale_rounding: expected one of {ROUNDINGS}, found {scale_rounding!r}")
    if not isinstance(block_size, int) or block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size: expected a positive even int, found {block_size!r}")
    K = x.shape[-1]
    if K % block_size:
        raise ValueError(f"x: last dim K={K} must be a multiple of block_size={block_size} (shape {_shape(x)})")

    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    lead = x.shape[:-1]
    xb = x.to(cdt).reshape(*lead, K // block_size, block_size)  # [..., nb, bs]
    amax = xb.abs().amax(dim=-1)  # [..., nb]; NaN / inf propagate
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, 0)

    # floor(log2(amax)) exactly, subnormals included: amax = m · 2^p with m in [0.5, 1) → floor(log2) = p - 1.
    mant, p = torch.frexp(amax)
    flog2 = p.to(torch.int32) - 1
    if scale_rounding == "floor":
        exp = flog2 - E2M1_EMAX
    else:
        # smallest e with amax ≤ 6 · 2^e: writing amax = m' · 2^flog2 with m' in [1, 2),
        # e = flog2 - 2 if m' ≤ 1.5 else flog2 - 1
        exp = flog2 - 2 + (mant * 2 > 1.5).to(torch.int32)
    exp = torch.where(amax > 0, exp, EXP_MIN).clamp(EXP_MIN, EXP_MAX)  # zero block: min scale

    # x · 2^-e is exact (power-of-two scaling) except results below the fp32 normal range, far below 0.25 → 0 anyway.
    a = xb * pow2_exact(-exp, cdt).unsqueeze(-1)  # [..., nb, bs]
    mag = a.abs()
    # Round half to even onto the E2M1 grid: it is evenly spaced by 0.5 · 2^r in region r (r = 0: [0, 2),
    # 1: [2, 4), 2: [4, 8)), so round(mag / step) (torch.round: ties to even) lands on it, and the code is
    # q + 2r, whose parity is q's (ties go to the even code, as the spec wants); codes past 7 saturate to ±6.
    r = (mag >= 2).to(torch.int32) + (mag >= 4).to(torch.int32)
    inv_step = torch.tensor([2.0, 1.0, 0.5], dtype=cdt, device=x.device)[r]
    q = torch.round(mag * inv_step).to(torch.int32)
    code = (q + 2 * r).clamp_(max=7).to(torch.uint8)
    code = torch.where(torch.signbit(a), code | 0x8, code)
    if not bool(finite.all()):
        code = torch.where(finite.unsqueeze(-1), code, 0)

    scales = torch.where(finite, exp + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    code = code.reshape(*lead, K // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), scales.contiguous()


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, block_size: int = 32) -> int:
    """Check an MXFP4 pair; return K (elements per row). Raises ValueError naming the tensor."""
    for name, t in (("blocks", blocks), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise ValueError(f"{name}: expected dtype torch.uint8, found {t.dtype}")
        if t.dim() < 1:
            raise ValueError(f"{name}: expected rank >= 1, found rank 0")
    if not isinstance(block_size, int) or block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size: expected a positive even int, found {block_size!r}")
    if blocks.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"scales: expected leading dims {list(blocks.shape[:-1])} (as blocks {_shape(blocks)}), "
            f"found {_shape(scales)}"
        )
    if blocks.shape[-1] * 2 != scales.shape[-1] * block_size:
        raise ValueError(
            f"scales: expected last dim {blocks.shape[-1] * 2 // block_size} (= 2 · blocks last dim "
            f"{blocks.shape[-1]} / block_size {block_size}), found {_shape(scales)}"
        )
    if blocks.device != scales.device:
        raise ValueError(f"scales: expected device {blocks.device} (as blocks), found {scales.device}")
    return blocks.shape[-1] * 2


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, block_size: int = 32
) -> torch.Tensor:
    """blocks uint8 [..., K // 2] + scales uint8 [..., K // block_size] → [..., K] in `dtype`.

    Exact: code value × 2^(scale − 127) (see the module docstring for the one overflow case; fp16 output is
    rounded to fp16's range). A 0xFF scale makes its whole block NaN. Vectorised with lookup tables.
    """
    K = check_mxfp4(blocks, scales, block_size)
    if dtype not in _FLOATS:
        raise ValueError(f"dtype: expected a floating-point dtype, found {dtype}")
    # Products of a ≤2-significant-bit value and a power of two are exact wherever the dtype has the range:
    # compute in the target dtype directly, except fp16 (too little range) which goes through fp32.
    cdt = torch.float32 if dtype == torch.float16 else dtype
    lead = blocks.shape[:-1]
    # One gather of value pairs per byte (table [256, 2]: low nibble first), one per scale, one multiply.
    lut = fp4_lut(cdt, blocks.device)
    pairs = torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=-1)  # byte v → (lut[v&15], lut[v>>4])
    vals = pairs.index_select(0, blocks.reshape(-1).to(torch.int32))
    scale = e8m0_lut(cdt, blocks.device).index_select(0, scales.reshape(-1).to(torch.int32))
    out = vals.view(-1, block_size).mul_(scale.unsqueeze(-1))
    return out.view(*lead, K).to(dtype)
