"""The CPU row-norm / rotary kernel (kernels/norm): against the PyTorch forms (naive.py) on fresh random inputs,
bitwise row invariance (a row alone vs inside batches of 3 / 17 / 300 rows at several positions, 1 vs 2 threads),
odd widths, both rotary layouts on strided [T, H, D] views, bad inputs, and the model's use of it."""

import pytest
import torch

from expertmesh.kernels.norm import cpu_kernel as ck
from expertmesh.kernels.norm import naive
from expertmesh.model import layers as M

pytestmark = pytest.mark.skipif(not ck.built(), reason=f"kernel not built ({ck.EXTENSION.build_error})")

DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [1, 7, 16, 33, 100, 512, 1031]
EPS = 1e-6


def _rand(gen, *shape, dtype=torch.float32, scale=1.0, shift=0.0):
    """Random values with no zeros (|v| ≥ 2^-4 before scaling): a zero could hide a wrong product."""
    v = torch.randn(*shape, generator=gen)
    v = torch.where(v.abs() < 2**-4, torch.full_like(v, 2**-4).copysign(v), v)
    return (v * scale + shift).to(dtype)


def _close(got, ref):
    """fp32: to fp32 rounding (the row sums run in another order); bf16: within one bf16 ulp of the reference."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    else:
        diff = (got.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2**-7 + 1e-30).all(), diff.max()
        assert (diff > 0).float().mean() < 0.01  # rounding-boundary cases only


def _norm_cases(gen, x, dtype):
    d = x.shape[-1]
    w = _rand(gen, d, dtype=dtype, shift=1.0)
    b = _rand(gen, d, dtype=dtype, scale=0.5)
    yield "rms_norm", ck.rms_norm(x, w, EPS), naive.rms_norm(x, w, EPS)
    yield "layer_norm", ck.layer_norm(x, w, b, EPS), naive.layer_norm(x, w, b, EPS)
    yield "l2_normalize", ck.l2_normalize(x, EPS), naive.l2_normalize(x, EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", WIDTHS)
def test_norms_match_reference(dtype, d):
    gen = torch.Generator().manual_seed(d)
    for shape in [(5, d), (3, 4, d), (d,)]:
        x = _rand(gen, *shape, dtype=dtype, scale=3.0, shift=0.5)  # an offset: layer_norm's centring matters
        for name, got, ref in _norm_cases(gen, x, dtype):
            if name == "l2_normalize":
                assert got.dtype == torch.float32
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
            else:
                _close(got, ref)


def test_norms_weight_dtypes_and_strided_rows():
    """fp32 x with bf16 parameters (and the reverse), and x a strided view (rows of a wider buffer, a transpose)."""
    gen = torch.Generator().manual_seed(3)
    buf = _rand(gen, 6, 3, 200)
    for x in (buf[:, 1, 37:137], buf.transpose(0, 1)[..., :100], buf[::2, :, 100:]):
        assert not x.is_contiguous()
        for wd in DTYPES:
            w, b = _rand(gen, x.shape[-1], dtype=wd), _rand(gen, x.shape[-1], dtype=wd)
            torch.testing.assert_close(ck.rms_norm(x, w, EPS), naive.rms_norm(x, w, EPS), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(
                ck.layer_norm(x, w, b, EPS), naive.layer_norm(x, w, b, EPS), rtol=1e-6, atol=1e-6
            )
            torch.testing.assert_close(ck.l2_normalize(x, EPS), naive.l2_normalize(x, EPS), rtol=1e-6, atol=1e-6)
            assert ck.rms_norm(x, w, EPS).is_contiguous()
    xb = _rand(gen, 4, 64, dtype=torch.bfloat16)
    w32 = _rand(gen, 64, shift=1.0)
    _close(ck.rms_norm(xb, w32, EPS), naive.rms_norm(xb, w32, EPS))
    w16 = w32.half()  # other float dtypes are widened, as .float()
    _close(ck.rms_norm(xb, w16, EPS), naive.rms_norm(xb, w16, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [2, 6, 34, 64, 100, 128])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_is_bitwise_the_reference(dtype, d, interleaved):
    """The same fp32 operations on the same operands: bitwise equal, on [T, D], [T, H, D] and strided views."""
    gen = torch.Generator().manual_seed(d * 2 + interleaved)
    t, h, nope = 9, 5, 24
    cos, sin = _rand(gen, t, d // 2), _rand(gen, t, d // 2)
    q = _rand(gen, t, h, nope + d, dtype=dtype)
    views = [
        _rand(gen, t, d, dtype=dtype),
        _rand(gen, t, h, d, dtype=dtype),
        q[:, :, nope:],
        _rand(gen, h, t, d, dtype=dtype).transpose(0, 1),
        _rand(gen, t, 2, 3, d, dtype=dtype)[:, :, 1:],
    ]
    for x in views:
        got = ck.rotary(x, cos, sin, interleaved)
        ref = naive.rotary(x, cos, sin, interleaved)
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got, ref), (x.shape, x.stride())
    # a non-contiguous cos / sin (a slice of a wider table) is read as its values
    wide_c, wide_s = _rand(gen, t, d), _rand(gen, t, d)
    c, s = wide_c[:, : d // 2], wide_s[:, d // 2 :]
    x = views[1]
    assert torch.equal(ck.rotary(x, c, s, interleaved), naive.rotary(x, c.contiguous(), s.contiguous(), interleaved))


def _all_ops(gen, d, dtype):
    """(name, fn(x [R, d], pos [R] token positions) → out) for every op, with fixed parameters and tables."""
    w, b = _rand(gen, d, dtype=dtype, shift=1.0), _rand(gen, d, dtype=dtype)
    cos, sin = _rand(gen, 400, d // 2), _rand(gen, 400, d // 2)
    return [
        ("rms_norm", lambda x, p: ck.rms_norm(x, w, EPS)),
        ("layer_norm", lambda x, p: ck.layer_norm(x, w, b, EPS)),
        ("l2_normalize", lambda x, p: ck.l2_normalize(x, EPS)),
        ("rotary_half", lambda x, p: ck.rotary(x, cos[p], sin[p], False)),
        ("rotary_interleaved", lambda x, p: ck.rotary(x, cos[p], sin[p], True)),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_bitwise_batch_invariant(dtype, two_threads):
    gen = torch.Generator().manual_seed(7)
    for d in (34, 100, 1024):
        ops = _all_ops(gen, d, dtype)
        row = _rand(gen, 1, d, dtype=dtype, scale=2.0)
        pos = torch.tensor([123])
        torch.set_num_threads(1)
        alone = {name: fn(row, pos) for name, fn in ops}
        torch.set_num_threads(2)
        for name, fn in ops:
            assert torch.equal(fn(row, pos), alone[name]), (name, d)
        for m in (3, 17, 300):
            for at in (0, m // 2, m - 1):
                batch = _rand(gen, m, d, dtype=dtype, scale=2.0)
                batch[at] = row[0]
                p = torch.randint(0, 400, (m,), generator=gen)
                p[at] = 123
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for name, fn in ops:
                        assert torch.equal(fn(batch, p)[at], alone[name][0]), (name, d, m, at, threads)


def test_bad_inputs_name_the_tensor():
    x = torch.randn(4, 8)
    w, _b = torch.randn(8), torch.randn(8)
    cos, sin = torch.randn(4, 4), torch.randn(4, 4)
    cases = [
        (lambda: ck.rms_norm(x.half(), w, EPS), TypeError, "x: expected float32 or bfloat16"),
        (lambda: ck.rms_norm(x.long(), w, EPS), TypeError, "x: expected float32 or bfloat16"),
        (lambda: ck.rms_norm(x, torch.randn(9), EPS), ValueError, r"weight: expected \[8\]"),
        (lambda: ck.rms_norm(x, torch.randn(2, 4), EPS), ValueError, "weight: expected"),
        (lambda: ck.rms_norm(x, w.long(), EPS), TypeError, "weight: expected a floating tensor"),
        (lambda: ck.layer_norm(x, w, torch.randn(7), EPS), ValueError, "bias: expected"),
        (lambda: ck.l2_normalize(x.to(torch.float64), EPS), TypeError, "x: expected"),
        (lambda: ck.rotary(torch.randn(4, 7), cos, sin, False), ValueError, "x: expected an even last dim"),
        (lambda: ck.rotary(x, torch.randn(4, 5), sin, False), ValueError, r"cos: expected \[4, 4\]"),
        (lambda: ck.rotary(x, cos, torch.randn(3, 4), True), ValueError, "sin: expected"),
        (lambda: ck.rotary(x, cos, sin.bfloat16(), False), TypeError, "sin: expected float32"),
        (lambda: ck.rotary(torch.randn(8), cos, sin, False), ValueError, "x: expected at least 2 dims"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_empty_inputs():
    assert ck.rms_norm(torch.randn(0, 8), torch.randn(8), EPS).shape == (0, 8)
    assert ck.rotary(torch.randn(0, 3, 8), torch.randn(0, 4), torch.randn(0, 4), True).shape == (0, 3, 8)


@torch.no_grad()
def test_model_runs_the_kernel_on_cpu():
    """The model's norms / rotary / l2 give the kernel's bits on CPU, the PyTorch forms with the kernel off and
    under autograd (the op has no backward)."""
    gen = torch.Generator().manual_seed(11)
    norm, ln = M.RMSNorm(100, EPS), M.LayerNorm(100)
    with torch.no_grad():
        norm.weight.copy_(_rand(gen, 100, shift=1.0))
        ln.weight.copy_(_rand(gen, 100, shift=1.0))
        ln.bias.copy_(_rand(gen, 100))
    x = _rand(gen, 6, 100)
    cos, sin = _rand(gen, 6, 50), _rand(gen, 6, 50)
    q = _rand(gen, 6, 3, 124)[:, :, 24:]
    assert ck.takes(x, norm.weight)
    assert torch.equal(norm(x), ck.rms_norm(x, norm.weight, EPS))
    assert torch.equal(ln(x), ck.layer_norm(x, ln.weight, ln.bias, EPS))
    assert torch.equal(M.l2_normalize(x, EPS), ck.l2_normalize(x, EPS))
    for style in ("half", "interleaved"):
        assert torch.equal(M.rotary(q, (cos, sin), style), ck.rotary(q, cos, sin, style == "interleaved"))
    assert M.rotary(q, (cos, sin), "none") is q
    with torch.enable_grad():
        xg = x.clone().requires_grad_(True)
        assert not ck.takes(xg, norm.weight)
        y = norm(xg)
        assert y.grad_fn is not None
        y.sum().backward()
        assert xg.grad is not None and norm.weight.grad is not None
        assert torch.equal(y.detach(), naive.rms_norm(x, norm.weight, EPS))


def test_env_turns_the_kernel_off(monkeypatch):
    x, w = torch.randn(3, 16), torch.randn(16)
    monkeypatch.setenv("EXPERTMESH_CPU_NORM_KERNEL", "0")
    ck.refresh()
    try:
        assert not ck.enabled() and not ck.available() and not ck.takes(x, w)
        with torch.no_grad():
            assert torch.equal(M.RMSNorm(16, EPS)(x), naive.rms_norm(x, torch.ones(16), EPS))
    finally:
        monkeypatch.delenv("EXPERTMESH_CPU_NORM_KERNEL")
        ck.refresh()
    with torch.no_grad():
        assert ck.takes(x, w)
