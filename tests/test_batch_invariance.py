"""Row results of the batch-invariant linear must not depend on the other rows in the call."""
import torch

from expertmesh.kernels.batch_invariant import linear


def test_linear_rows_do_not_depend_on_batch():
    gen = torch.Generator().manual_seed(0)
    for k, n in [(64, 288), (1024, 1024), (48, 2816), (16, 4)]:
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(1, k, generator=gen)
        alone = linear(x, w)[0]
        for m in (2, 3, 5, 9, 16, 17, 33, 100):
            others = torch.randn(m, k, generator=gen)
            pos = m // 2
            others[pos] = x[0]
            assert torch.equal(linear(others, w)[pos], alone), (k, n, m)


def test_linear_matches_plain_matmul_closely():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 3, 64, generator=gen), torch.randn(32, 64, generator=gen)
    out = linear(x, w)
    assert out.shape == (7, 3, 32)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)
