"""MXFP4 quantise / dequantise against the OCP MX v1.0 rules, checked by an independent per-block oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.kernels.backend import use_backend
from expertmesh.kernels.mxfp4 import FP4_VALUES, dequantize_mxfp4, dequantize_mxfp4_torch, quantize_mxfp4

SPEC_CODES = {  # E2M1 code → value (OCP MX v1.0, table of FP4 E2M1 values)
    0x0: 0.0,
    0x1: 0.5,
    0x2: 1.0,
    0x3: 1.5,
    0x4: 2.0,
    0x5: 3.0,
    0x6: 4.0,
    0x7: 6.0,
    0x8: -0.0,
    0x9: -0.5,
    0xA: -1.0,
    0xB: -1.5,
    0xC: -2.0,
    0xD: -3.0,
    0xE: -4.0,
    0xF: -6.0,
}


# ------------------------------------------------------------------------------------------ oracle
def _oracle_block(vals: list[float], rounding: str) -> tuple[int, list[int]]:
    """One block by the spec, in Python float64 (exact for fp32 inputs): (E8M0 byte, 4-bit codes)."""
    if any(not math.isfinite(v) for v in vals):
        return 0xFF, [0] * len(vals)
    amax = max(abs(v) for v in vals)
    if amax == 0:
        e = -127
    else:
        e = math.frexp(amax)[1] - 1 - 2  # floor(log2 amax) - emax(E2M1)
        if rounding == "ceil":  # smallest e with amax <= 6 * 2^e
            while amax > math.ldexp(6.0, e):
                e += 1
            while amax <= math.ldexp(6.0, e - 1):
                e -= 1
        e = max(-127, min(127, e))
    codes = []
    for v in vals:
        a = abs(math.ldexp(v, -e))
        best = min(range(8), key=lambda c: (abs(FP4_VALUES[c] - a), c % 2))  # nearest, ties to the even code
        codes.append(best | (8 if math.copysign(1.0, v) < 0 else 0))  # the sign survives rounding to 0
    return e + 127, codes


def _oracle(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.reshape(-1, 32).double().tolist()
    scales, codes = zip(*(_oracle_block(r, rounding) for r in rows))
    return torch.tensor(scales), torch.tensor(codes)


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., K/2] → codes [..., K] (even element = low nibble)."""
    b = blocks.to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*blocks.shape[:-1], -1)


def _random_blocks(gen: torch.Generator, n_blocks: int) -> torch.Tensor:
    """[n_blocks, 32] fp32 spanning the whole range: per-block magnitudes from subnormal to near fp32 max,
    outliers, exact zeros and exact grid values mixed in."""
    x = torch.randn(n_blocks, 32, generator=gen, dtype=torch.float64)
    log10_mag = torch.empty(n_blocks, 1, dtype=torch.float64).uniform_(-44, 37, generator=gen)
    x = x * 10**log10_mag
    outlier = torch.rand(n_blocks, 32, generator=gen) < 0.03
    x = torch.where(outlier, x * 300, x)
    x = torch.where(torch.rand(n_blocks, 32, generator=gen) < 0.05, 0.0, x)
    x = x.float()
    return torch.where(torch.isfinite(x), x, 3e38)


def _tie_blocks(gen: torch.Generator, n_blocks: int) -> torch.Tensor:
    """[n_blocks, 32] fp32 of grid values and exact midpoints (ties) × 2^e, element 0 = ±4 or ±6 · 2^e so that
    both roundings pick scale 2^e; e spans the whole E8M0 range."""
    table = torch.tensor(list(FP4_VALUES) + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    v = table[torch.randint(0, len(table), (n_blocks, 32), generator=gen)]
    v[:, 0] = torch.where(torch.rand(n_blocks, generator=gen) < 0.5, 4.0, 6.0)
    v = torch.where(torch.rand(n_blocks, 32, generator=gen) < 0.5, -v, v)
    e = torch.randint(-127, 126, (n_blocks, 1), generator=gen)
    return torch.ldexp(v, e.double()).float()


# ------------------------------------------------------------------------------------------- tests
def test_all_16_codes_decode_to_spec_values():
    codes = torch.arange(16, dtype=torch.uint8)
    for s in (0, 1, 100, 127, 130, 252):
        blocks = (codes[0::2] | (codes[1::2] << 4)).repeat(2).reshape(1, 16)  # codes 0..15, twice
        scales = torch.tensor([[s]], dtype=torch.uint8)
        out = dequantize_mxfp4(blocks, scales, torch.float32)[0]
        want = torch.tensor([math.ldexp(SPEC_CODES[c % 16], s - 127) for c in range(32)], dtype=torch.float64)
        assert torch.equal(out.double(), want), s
        assert torch.equal(torch.signbit(out), torch.signbit(want)), s
        out_bf16 = dequantize_mxfp4(blocks, scales, torch.bfloat16)[0]
        assert torch.equal(out_bf16.double(), want), s  # exact in bf16 as well


def test_nan_scale_decodes_whole_block_to_nan():
    blocks = torch.randint(0, 256, (3, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scales = torch.tensor([[127], [0xFF], [120]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_representable_values_round_trip_exactly(rounding):
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (64, 32), generator=gen)
    codes[:8] = torch.where(codes[:8] == 0, 8, codes[:8])  # some -0 codes: they come back as -0
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = torch.randint(0, 253, (64, 1), dtype=torch.uint8, generator=gen)  # ≤ 0xFC: nothing overflows fp32
    scales[0, 0], scales[1, 0] = 0, 252
    v = dequantize_mxfp4(blocks, scales, torch.float32)
    b2, s2 = quantize_mxfp4(v, scale_rounding=rounding)
    back = dequantize_mxfp4(b2, s2, torch.float32)
    assert torch.equal(back, v) and torch.equal(torch.signbit(back), torch.signbit(v))
    # The bytes themselves come back under "floor" when a block holds a ±4 or ±6 (−0 included: OCP keeps its sign).
    canon = (codes & 7).amax(dim=-1) >= 6
    if rounding == "floor":
        assert canon[:8].sum() > 4 and canon.sum() > 40
        assert torch.equal(b2[canon], blocks[canon]) and torch.equal(s2[canon], scales[canon])


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_matches_oracle_on_wide_range_inputs(rounding):
    gen = torch.Generator().manual_seed(2 if rounding == "floor" else 3)
    x = torch.cat([_random_blocks(gen, 400), _tie_blocks(gen, 100)])
    blocks, scales = quantize_mxfp4(x, scale_rounding=rounding)
    want_scales, want_codes = _oracle(x, rounding)
    assert torch.equal(scales.reshape(-1).long(), want_scales)
    assert torch.equal(_codes(blocks).reshape(-1, 32), want_codes)
    assert (scales == 0).any()  # the subnormal range was exercised


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_error_within_half_a_grid_step_except_saturation(rounding):
    gen = torch.Generator().manual_seed(4)
    x = _random_blocks(gen, 400).double()
    blocks, scales = quantize_mxfp4(x.float(), scale_rounding=rounding)
    y = dequantize_mxfp4(blocks, scales, torch.float32).double()
    scale = torch.ldexp(torch.ones(scales.shape, dtype=torch.float64), scales.long() - 127)
    scale = scale.repeat_interleave(32, dim=-1)
    a = (x / scale).abs()  # magnitude on the block's grid
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0)) * scale
    saturated = a > 6
    assert torch.all(((y - x).abs() <= half_step) | saturated)
    assert torch.all(y[saturated].abs() == 6 * scale[saturated])
    if rounding == "ceil":
        assert not saturated.any()  # ceil never clips
    else:
        assert saturated.any()  # floor does clip (amax/scale in [4, 8))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=32, max_size=32),
    st.sampled_from(["floor", "ceil"]),
)
def test_property_any_finite_block_matches_oracle(vals, rounding):
    x = torch.tensor(vals, dtype=torch.float32)
    blocks, scales = quantize_mxfp4(x, scale_rounding=rounding)
    s, codes = _oracle_block([float(v) for v in x.tolist()], rounding)
    assert int(scales[0]) == s
    assert _codes(blocks).tolist() == codes


def test_ties_round_to_even_and_saturate():
    # On scale 2^0 (amax 6): midpoints go to the even code; above 6 saturates.
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, 6.0, 0.26, 4.9] + [0.0] * 20)
    b, s = quantize_mxfp4(x)
    assert int(s[0]) == 127
    got = dequantize_mxfp4(b, s, torch.float32)[:12].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.0, 6.0, 0.5, 4.0]
    b, s = quantize_mxfp4(torch.tensor([7.9] + [1.0] * 31))  # floor: scale 2^0, 7.9 saturates to 6
    assert int(s[0]) == 127 and dequantize_mxfp4(b, s, torch.float32)[0] == 6.0


def test_zero_nan_and_inf_blocks():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))
    x[0] = 0.0
    x[1, 7] = float("nan")
    x[2, 0] = float("-inf")
    b, s = quantize_mxfp4(x)
    assert int(s[0]) == 0 and (b[0] == 0).all()  # valid (minimum) scale, zero codes
    assert int(s[1]) == 0xFF and int(s[2]) == 0xFF
    y = dequantize_mxfp4(b, s, torch.float32)
    assert (y[0] == 0).all() and y[1].isnan().all() and y[2].isnan().all() and not y[3].isnan().any()
    b_c, s_c = quantize_mxfp4(x, scale_rounding="ceil")
    assert int(s_c[0]) == 0 and int(s_c[1]) == 0xFF and int(s_c[2]) == 0xFF


def test_tiny_and_subnormal_inputs():
    tiny = torch.tensor([1e-45, -1e-42, 2**-130, 2**-126] + [0.0] * 28)
    b, s = quantize_mxfp4(tiny)
    assert int(s[0]) == 0  # exponent clamps at -127
    y = dequantize_mxfp4(b, s, torch.float32)
    want_s, want_codes = _oracle(tiny, "floor")
    assert int(want_s[0]) == 0 and _codes(b).tolist() == want_codes[0].tolist()
    # 2^-126 = 2 · 2^-127 (code 4) and 2^-130 < 0.25 · 2^-127 → 0: decoded exactly, subnormal scale included
    assert y[3] == 2**-126 and y[2] == 0


def test_leading_batch_dims_and_input_dtypes():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 4, 64, generator=gen)
    b, s = quantize_mxfp4(x)
    assert b.shape == (2, 3, 4, 32) and s.shape == (2, 3, 4, 2) and b.dtype == s.dtype == torch.uint8
    b_flat, s_flat = quantize_mxfp4(x.reshape(-1, 64))
    assert torch.equal(b.reshape(-1, 32), b_flat) and torch.equal(s.reshape(-1, 2), s_flat)
    y = dequantize_mxfp4(b, s, torch.float32)
    assert y.shape == x.shape and torch.equal(y.reshape(-1, 64), dequantize_mxfp4(b_flat, s_flat, torch.float32))
    # bf16 / fp64 input: the same codes as the fp32 copy of the same values (exact upcast)
    xb = x.bfloat16()
    assert all(torch.equal(p, q) for p, q in zip(quantize_mxfp4(xb), quantize_mxfp4(xb.float())))
    assert all(torch.equal(p, q) for p, q in zip(quantize_mxfp4(x.double()), quantize_mxfp4(x)))
    assert dequantize_mxfp4(b, s).dtype == torch.bfloat16


def test_block_size_other_than_32():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7))
    b, s = quantize_mxfp4(x, block_size=16)
    assert s.shape == (3, 4)
    y = dequantize_mxfp4(b, s, torch.float32, block_size=16)
    # exactly the spec's encoding of each 16-element block (the oracle), not merely close
    want = [
        _oracle_block(blk, "floor")
        for row in x.double().tolist()
        for blk in (row[i : i + 16] for i in range(0, 64, 16))
    ]
    assert s.flatten().tolist() == [e for e, _ in want]
    assert _codes(b).flatten().tolist() == [c for _, cs in want for c in cs]
    assert ((y - x).norm() / x.norm()) < 0.2


def test_bad_inputs_raise_value_error_naming_the_tensor():
    with pytest.raises(ValueError, match=r"x: last dim K=48 must be a multiple of block_size=32"):
        quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match=r"x: expected a floating-point dtype"):
        quantize_mxfp4(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"scale_rounding"):
        quantize_mxfp4(torch.randn(32), scale_rounding="round")
    good_b, good_s = quantize_mxfp4(torch.randn(2, 64))
    with pytest.raises(ValueError, match=r"blocks: expected dtype torch.uint8, found torch.int32"):
        dequantize_mxfp4(good_b.int(), good_s)
    with pytest.raises(ValueError, match=r"scales: expected last dim 2"):
        dequantize_mxfp4(good_b, good_s[:, :1])
    with pytest.raises(ValueError, match=r"scales: expected leading dims \[2\]"):
        dequantize_mxfp4(good_b, good_s[:1])
    with pytest.raises(ValueError, match=r"dtype"):
        dequantize_mxfp4(good_b, good_s, torch.int32)


def test_triton_dequant_matches_reference_interpreted():
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(8)
    blocks = torch.randint(0, 256, (3, 5, 32), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 256, (3, 5, 2), dtype=torch.uint8, generator=gen)  # includes 0x00 and 0xFF
    scales[0, 0, 0], scales[1, 1, 1] = 0, 0xFF
    for dtype in (torch.float32, torch.bfloat16):
        ref = dequantize_mxfp4_torch(blocks, scales, dtype)
        with use_backend("triton"):
            out = dequantize_mxfp4(blocks, scales, dtype)
        assert out.dtype == dtype and out.shape == ref.shape
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(ref))  # bitwise on non-NaN (incl. ±inf)
