"""Kimi K3's attention-residual mix as one C++ op (kernels/norm residual_mix) against its PyTorch form
(naive.residual_mix) on fresh random inputs, bitwise row invariance (a row alone vs inside a batch, 1 vs 2 threads),
bad inputs, and the model's ResidualMix taking it (or the PyTorch form with the kernel off)."""

import pytest
import torch

from expertmesh.kernels.norm import cpu_kernel as ck
from expertmesh.kernels.norm import naive
from expertmesh.model.transformer import ResidualMix

pytestmark = pytest.mark.skipif(not ck.built(), reason=f"kernel not built ({ck.EXTENSION.build_error})")
EPS = 1e-6


def _sources(gen, j, n, d, dtype):
    return [torch.randn(n, d, generator=gen).to(dtype) for _ in range(j)]


def _weights(gen, d):
    return torch.randn(d, generator=gen), torch.randn(d, generator=gen) * 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("j,n,d", [(1, 3, 7), (2, 1, 1024), (3, 5, 100), (5, 37, 1031)])
def test_matches_the_pytorch_form(dtype, j, n, d):
    gen = torch.Generator().manual_seed(j * 1000 + d)
    src, (nw, pw) = _sources(gen, j, n, d, dtype), _weights(gen, d)
    got, ref = ck.residual_mix(src, nw, pw, EPS), naive.residual_mix(src, nw, pw, EPS)
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape == (n, d)
    if dtype == torch.float32:  # the row sums run in another order; exp carries the scores' rounding into p
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    else:
        # one bf16 ulp of the output, plus what the probabilities' fp32 rounding moves where the sources cancel
        diff = (got.float() - ref.float()).abs()
        scale = torch.stack(src).float().abs().amax(0)
        assert (diff <= ref.float().abs() * 2**-7 + scale * 1e-4).all(), diff.max()
        assert (diff > 0).float().mean() < 0.05  # rounding-boundary cases only
    assert j == 1 or not torch.equal(got, src[-1])  # a mix, not the stream passed through (one source: itself)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_has_the_same_bits_alone_and_inside_a_batch(threads):
    gen = torch.Generator().manual_seed(7)
    d = 1024
    nw, pw = _weights(gen, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            batch = _sources(gen, 3, 300, d, dtype)
            full = ck.residual_mix(batch, nw, pw, EPS)
            for r in (0, 17, 299):
                alone = ck.residual_mix([s[r : r + 1] for s in batch], nw, pw, EPS)
                assert torch.equal(alone[0], full[r]), (dtype, r)
    finally:
        torch.set_num_threads(before)


def test_bad_inputs_are_named():
    gen = torch.Generator().manual_seed(3)
    nw, pw = _weights(gen, 8)
    a, b = torch.randn(2, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="sources: expected at least one"):
        ck.residual_mix([], nw, pw, EPS)
    with pytest.raises(ValueError, match="sources: expected every source of shape"):
        ck.residual_mix([a, b], nw, pw, EPS)
    with pytest.raises(TypeError, match="sources: expected one dtype"):
        ck.residual_mix([a.bfloat16(), torch.randn(2, 8)], nw, pw, EPS)
    with pytest.raises(ValueError, match="proj_weight: expected \\[8\\]"):
        ck.residual_mix([a], nw, torch.randn(9), EPS)
    assert torch.isfinite(ck.residual_mix([a, torch.randn(2, 8)], nw, pw, EPS)).all()  # still serving


def test_the_model_mix_takes_the_kernel_and_falls_back(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    d = 64
    mix = ResidualMix(d, EPS)
    with torch.no_grad():
        mix.norm.weight.copy_(torch.randn(d, generator=gen))
        mix.proj.weight.copy_(torch.randn(1, d, generator=gen))
    blocks, current = _sources(gen, 2, 4, d, torch.bfloat16), torch.randn(4, d, generator=gen).bfloat16()
    args = ([*blocks, current], mix.norm.weight, mix.proj.weight[0], EPS)
    with torch.no_grad():
        assert torch.equal(mix(blocks, current), ck.residual_mix(*args))
        monkeypatch.setenv("EXPERTMESH_CPU_NORM_KERNEL", "0")
        ck.refresh()
        try:
            assert torch.equal(mix(blocks, current), naive.residual_mix(*args))
        finally:
            monkeypatch.delenv("EXPERTMESH_CPU_NORM_KERNEL")
            ck.refresh()
