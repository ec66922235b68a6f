"""Row results of the batch-invariant linear must not depend on the other rows in the call."""

import pytest
import torch

from expertmesh.kernels.batch_invariant import PACKING, bmm, linear, packed_weight
from expertmesh.kernels.cpu_features import onednn_prepacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["tensor", "parameter"])
def test_linear_rows_do_not_depend_on_batch(dtype, packed):
    """A plain tensor weight runs F.linear; a parameter runs on its oneDNN prepacked copy (CPU) where oneDNN
    prepacks its dtype here (not bf16 on an AVX2-only CPU: F.linear there too)."""
    gen = torch.Generator().manual_seed(0)
    for k, n in [(64, 288), (1024, 1024), (48, 2816), (16, 4)]:
        w = torch.randn(n, k, generator=gen).to(dtype)
        if packed:
            w = torch.nn.Parameter(w, requires_grad=False)
        assert (packed_weight(w) is not None) == (packed and PACKING and onednn_prepacks(dtype))
        x = torch.randn(1, k, generator=gen).to(dtype)
        alone = linear(x, w)[0]
        for m in (2, 3, 5, 9, 16, 17, 33, 100, 1100):
            others = torch.randn(m, k, generator=gen).to(dtype)
            pos = m // 2
            others[pos] = x[0]
            assert torch.equal(linear(others, w)[pos], alone), (k, n, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_plain_and_follows_writes_to_the_weight(dtype):
    gen = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(96, 64, generator=gen).to(dtype), requires_grad=False)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(linear(x, w).float(), (x.float() @ w.float().T), **tol)
    with torch.no_grad():
        w.mul_(-2)  # written in place: the packed copy is made again
    torch.testing.assert_close(linear(x, w).float(), (x.float() @ w.float().T), **tol)


def test_linear_matches_plain_matmul_closely():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 3, 64, generator=gen), torch.randn(32, 64, generator=gen)
    out = linear(x, w)
    assert out.shape == (7, 3, 32)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_rows_do_not_depend_on_batch(dtype):
    """MLA's absorbed projections (16 heads, nope 128 → latent 512 and back) over any number of tokens."""
    gen = torch.Generator().manual_seed(3)
    for b, k, n in [(16, 128, 512), (16, 512, 128), (4, 48, 80), (2, 16, 4)]:
        w = torch.randn(b, k, n, generator=gen).to(dtype)
        x = torch.randn(b, 1, k, generator=gen).to(dtype)
        alone = bmm(x, w)[:, 0]
        torch.testing.assert_close(alone.float(), (x.float() @ w.float())[:, 0], rtol=2e-2, atol=2e-2 * k**0.5)
        for m in (2, 3, 16, 17, 64, 100):
            others = torch.randn(m, b, k, generator=gen).to(dtype)  # token-major, as the model holds them
            pos = m // 2
            others[pos] = x[:, 0]
            assert torch.equal(bmm(others.transpose(0, 1), w)[:, pos], alone), (b, k, n, m, dtype)


def test_pointwise_rows_do_not_depend_on_batch():
    import torch.nn.functional as F

    from expertmesh.kernels.batch_invariant import pointwise

    gen = torch.Generator().manual_seed(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # several threads available: the batch must still not matter
    try:
        _check_pointwise(pointwise, gen, F)
    finally:
        torch.set_num_threads(threads)  # the rest of the suite runs as configured


def _check_pointwise(pointwise, gen, F):
    for fn in (torch.sigmoid, F.silu, F.softplus, torch.rsqrt, torch.exp):
        for d in (1, 2, 7, 16, 33, 100):
            row = torch.rand(1, d, generator=gen) * 4 + 0.1
            alone = pointwise(fn, row)[0]
            torch.testing.assert_close(alone, fn(row)[0], rtol=1e-6, atol=1e-7)
            for m in (2, 5, 17, 300, 2000):
                batch = torch.rand(m, d, generator=gen) * 4 + 0.1
                batch[m - 1] = row[0]
                assert torch.equal(pointwise(fn, batch)[m - 1], alone), (fn, d, m)


def test_model_rows_do_not_depend_on_the_other_sequences():
    """Two sequences stepped together give bitwise the logits each gives alone."""
    from expertmesh.model.cache import Segment
    from expertmesh.model.config import preset
    from expertmesh.model.transformer import Transformer, init_random_

    model = init_random_(Transformer(preset("tiny")), seed=1)
    a, b = list(range(1, 30)), list(range(100, 107))
    alone_a = model.step(a, model.new_cache())
    alone_b = model.step(b, model.new_cache())
    ca, cb = model.new_cache(), model.new_cache()
    together = model.forward(torch.tensor(a + b), [Segment(0, len(a), ca), Segment(len(a), len(b), cb)])
    assert torch.equal(together[: len(a)], alone_a) and torch.equal(together[len(a) :], alone_b)
