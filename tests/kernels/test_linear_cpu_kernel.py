"""The row-invariant bf16 linear / bmm CPU kernel (kernels/linear): against the fp32 reference, bitwise row
invariance (rows alone vs inside larger calls, at other positions, 1 vs 2 threads) on every path this CPU runs,
the AVX512-BF16 and the FMA (AVX-512, AVX2) paths vs the portable loop (same bits), the AMX path (tiles and its
1-2 row vector path) against the tile-order reference bit for bit, odd shapes, strided inputs, bad inputs, and its use by kernels.batch_invariant."""

import pytest
import torch

from expertmesh.kernels.linear import cpu_kernel as ck
from expertmesh.kernels.linear import naive

pytestmark = pytest.mark.skipif(not ck.built(), reason=f"kernel not built ({ck.EXTENSION.build_error})")


FAST = [isa for isa in ck.FAST_ISAS if ck.built() and ck.runs(isa)]
ISAS = ["auto", "portable"] + FAST
# the paths that take the portable loop's steps (VDPBF16PS, or fp32 FMAs on AVX-512 / AVX2): its bits exactly
SAME_STEPS = [isa for isa in ("avx512bf16", "avx512", "avx2") if isa in FAST]


def _bf16(gen, *shape, scale=1.0):
    """Random bf16 with no zeros (|v| ≥ 2^-4 · scale): a zero input could hide a wrong product."""
    v = torch.randn(*shape, generator=gen)
    v = torch.where(v.abs() < 2**-4, torch.full_like(v, 2**-4).copysign(v), v)
    return (v * scale).bfloat16()


def _close(got, x, w):
    """Within about one bf16 rounding of the fp32 result (the kernel's order differs from the matmul's)."""
    ref = x.float() @ w.float().T
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=1 / 128, atol=1e-5 * x.shape[-1])


@pytest.mark.parametrize("n,k", [(64, 64), (100, 37), (513, 129), (40, 31), (7, 1), (130, 256)])
def test_linear_matches_reference(n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w, x = _bf16(gen, n, k), _bf16(gen, 5, k)
    wp = ck.pack_weight(w)
    assert torch.equal(naive.unpack_weight(wp, n, k), w)
    got = ck.linear(x, wp, n, k)
    _close(got, x, w)
    ref = naive.linear(x, wp, n, k)
    assert (got.float() - ref.float()).abs().max() <= (ref.float().abs() * 2**-7).max()
    for isa in SAME_STEPS:  # same bits on both paths (AMX: its own, checked against the reference)
        assert torch.equal(ck.linear(x, wp, n, k, isa="portable"), ck.linear(x, wp, n, k, isa=isa))
    for isa in FAST:
        _close(ck.linear(x, wp, n, k, isa=isa), x, w)


@pytest.mark.parametrize("isa", ISAS)
def test_linear_rows_are_bitwise_batch_invariant(isa, two_threads):
    gen = torch.Generator().manual_seed(1)
    for n, k in [(96, 64), (70, 33)] + ([(576, 1024), (200, 47)] if isa != "portable" else []):
        w = _bf16(gen, n, k, scale=k**-0.5)
        wp = ck.pack_weight(w)
        row = _bf16(gen, 1, k)
        alone = ck.linear(row, wp, n, k, isa=isa)[0]
        for m in (2, 3, 17, 64, 300):
            for pos in (0, m // 2, m - 1):
                batch = _bf16(gen, m, k)
                batch[pos] = row[0]
                assert torch.equal(ck.linear(batch, wp, n, k, isa=isa)[pos], alone), (n, k, m, pos)
        torch.set_num_threads(1)
        batch = _bf16(gen, 300, k)
        one = ck.linear(batch, wp, n, k, isa=isa)
        torch.set_num_threads(2)
        assert torch.equal(ck.linear(batch, wp, n, k, isa=isa), one)


@pytest.mark.parametrize("isa", ISAS)
def test_bmm_rows_are_bitwise_batch_invariant(isa, two_threads):
    gen = torch.Generator().manual_seed(2)
    shapes = [(3, 48, 80), (2, 37, 70)] + ([(16, 128, 512), (16, 512, 128)] if isa != "portable" else [])
    for b, k, n in shapes:
        w = _bf16(gen, b, k, n, scale=k**-0.5)
        row = _bf16(gen, b, 1, k)
        alone = ck.bmm(row, w, isa=isa)[:, 0]
        torch.testing.assert_close(alone.float(), (row.float() @ w.float())[:, 0], rtol=1 / 128, atol=1e-5 * k)
        for m in (2, 3, 17, 64, 300):
            for pos in (0, m // 2, m - 1):
                tokens = _bf16(gen, m, b, k)  # token-major: x is a strided view, as the model's
                tokens[pos] = row[:, 0]
                got = ck.bmm(tokens.transpose(0, 1), w, isa=isa)
                assert torch.equal(got[:, pos], alone), (b, k, n, m, pos)
        tokens = _bf16(gen, 300, b, k).transpose(0, 1)
        torch.set_num_threads(1)
        one = ck.bmm(tokens, w, isa=isa)
        torch.set_num_threads(2)
        assert torch.equal(ck.bmm(tokens, w, isa=isa), one)
        assert torch.equal(ck.bmm(tokens.contiguous(), w, isa=isa), one)
        torch.testing.assert_close(one.float(), tokens.float() @ w.float(), rtol=1 / 128, atol=1e-5 * k)


@pytest.mark.skipif("amx" not in FAST, reason="this CPU (or its operating system) has no AMX-BF16")
@pytest.mark.parametrize("k", [1, 31, 32, 33, 64, 100, 513])
def test_amx_gives_the_tile_order_reference_bits(k, two_threads):
    """The AMX path, in tiles (3+ rows) and on the vector units (1-2 rows), gives exactly the bits of the tile
    unit's order spelled out in PyTorch (naive.matmul_in_tile_order): the hardware is the oracle of that order."""
    gen = torch.Generator().manual_seed(10_000 + k)
    n, half = 70, k // 2
    # Each row's products cancel in pairs (x = [u, -u reversed, t], w = [v, v reversed, s]), so what is left is the
    # fp32 rounding of the partial sums (plus t.s, small): only the tile unit's own order gives those bits — the
    # VDPBF16PS order differs on most outputs here.
    u, v = _bf16(gen, 19, half), _bf16(gen, n, half)
    x = torch.cat([u, -u.flip(1), _bf16(gen, 19, k - 2 * half, scale=2**-12)], 1)
    w = torch.cat([v, v.flip(1), _bf16(gen, n, k - 2 * half)], 1)
    want = naive.matmul_in_tile_order(x, w)
    assert want.ne(0).any()
    wp = ck.pack_weight(w)
    for rows in (slice(0, 1), slice(4, 6), slice(0, 19)):
        assert torch.equal(ck.linear(x[rows], wp, n, k, isa="amx"), want[rows]), rows
    wb = torch.stack([w.T, w.T.flip(1)])  # bmm: [2, K, N], the second item's columns reversed
    xb = torch.stack([x, x.flip(0)])
    got = ck.bmm(xb, wb, isa="amx")
    assert torch.equal(got[0], want) and torch.equal(got[1], want.flip(0).flip(1))
    for rows in (slice(0, 1), slice(3, 5)):
        assert torch.equal(ck.bmm(xb[:, rows], wb, isa="amx")[0], want[rows]), rows


def test_bmm_paths_agree_and_accept_strided_weights():
    gen = torch.Generator().manual_seed(3)
    for b, m, k, n in [(2, 5, 37, 70), (3, 9, 64, 200), (1, 1, 1, 3)]:
        x = _bf16(gen, b, m, k)
        w = _bf16(gen, b, k, n)
        got = ck.bmm(x, w)
        for isa in SAME_STEPS:
            assert torch.equal(ck.bmm(x, w, isa="portable"), ck.bmm(x, w, isa=isa))
        for isa in FAST:
            torch.testing.assert_close(
                ck.bmm(x, w, isa=isa).float(), x.float() @ w.float(), rtol=1 / 128, atol=1e-5 * k
            )
        assert torch.equal(
            naive.bmm(x, w).float().sub(got.float()).abs().le(got.float().abs() * 2**-7 + 1e-6).all(),
            torch.tensor(True),
        )
        wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # column-major weight: copied to rows, same result
        assert torch.equal(ck.bmm(x, wt), got)
        xs = _bf16(gen, b, m, 2 * k)[:, :, ::2]  # non-unit stride along K: copied, same result
        assert torch.equal(ck.bmm(xs, w), ck.bmm(xs.contiguous(), w))


@pytest.mark.parametrize("isa", ISAS)
def test_bmm_on_a_packed_weight_gives_bmm_s_bits(isa, two_threads):
    """bmm_packed (the weight packed once, `naive.pack_bmm_weight`) gives exactly `bmm`'s bits on every path: odd K,
    N off the 64-column groups, 1-2 rows (AMX's vector path), tiles, a strided token-major x."""
    gen = torch.Generator().manual_seed(7)
    for b, k, n in [(3, 37, 70), (2, 64, 200), (16, 128, 130), (1, 1, 3)]:
        w = _bf16(gen, b, k, n, scale=k**-0.5)
        wp = naive.pack_bmm_weight(w)
        assert wp.shape == (b, -(-n // 64), -(-k // 2), 64, 2)
        for m in (1, 2, 3, 17, 40):
            x = _bf16(gen, m, b, k).transpose(0, 1)
            assert torch.equal(ck.bmm_packed(x, wp, n, k, isa=isa), ck.bmm(x, w, isa=isa)), (b, k, n, m)
    with pytest.raises(ValueError, match="w_packed: expected"):
        ck.bmm_packed(_bf16(gen, 2, 1, 16), naive.pack_bmm_weight(_bf16(gen, 2, 16, 8)), 70, 16)
    with pytest.raises(ValueError, match=r"x: expected a bfloat16 \[B, M, K=16\]"):
        ck.bmm_packed(_bf16(gen, 2, 1, 15), naive.pack_bmm_weight(_bf16(gen, 2, 16, 8)), 8, 16)


def test_linear_accepts_a_strided_row_view():
    gen = torch.Generator().manual_seed(4)
    w = _bf16(gen, 80, 48)
    wp = ck.pack_weight(w)
    big = _bf16(gen, 6, 100)
    x = big[:, 10:58]  # rows of a wider tensor (row stride 100)
    assert torch.equal(ck.linear(x, wp, 80, 48), ck.linear(x.contiguous(), wp, 80, 48))
    x3 = _bf16(gen, 2, 3, 48)
    assert ck.linear(x3, wp, 80, 48).shape == (2, 3, 80)
    assert ck.linear(x3[:, :0], wp, 80, 48).shape == (2, 0, 80)


def test_bad_inputs_name_the_tensor():
    gen = torch.Generator().manual_seed(5)
    w = _bf16(gen, 32, 16)
    wp = ck.pack_weight(w)
    with pytest.raises(TypeError, match="x: expected a bfloat16"):
        ck.linear(torch.randn(2, 16), wp, 32, 16)
    with pytest.raises(ValueError, match=r"x: expected \[..., K=16\]"):
        ck.linear(_bf16(gen, 2, 15), wp, 32, 16)
    with pytest.raises(ValueError, match="w_packed: expected"):
        ck.linear(_bf16(gen, 2, 16), wp, 100, 16)
    with pytest.raises(TypeError, match="w_packed: expected a bfloat16"):
        ck.linear(_bf16(gen, 2, 16), wp.float(), 32, 16)
    with pytest.raises(TypeError, match="w: expected a 2-D bfloat16"):
        ck.pack_weight(torch.randn(32, 16))
    with pytest.raises(TypeError, match="w: expected a bfloat16"):
        ck.bmm(_bf16(gen, 2, 3, 16), torch.randn(2, 16, 8))
    with pytest.raises(ValueError, match="x: expected rank 3"):
        ck.bmm(_bf16(gen, 3, 16), _bf16(gen, 2, 16, 8))
    with pytest.raises(ValueError, match=r"w: expected \[B=2, K=16, N\]"):
        ck.bmm(_bf16(gen, 2, 3, 16), _bf16(gen, 2, 15, 8))
    with pytest.raises(ValueError, match="isa"):
        ck.linear(_bf16(gen, 2, 16), wp, 32, 16, isa="sse")


@pytest.mark.skipif(not ck.available(), reason="the fast path needs AVX512-BF16 (or the kernel is off)")
def test_batch_invariant_uses_the_kernel_for_bf16_parameters(two_threads):
    from expertmesh.kernels import batch_invariant as bi

    gen = torch.Generator().manual_seed(6)
    w = torch.nn.Parameter(_bf16(gen, 96, 64), requires_grad=False)
    x = _bf16(gen, 1, 64)
    kw = bi.kernel_weight(w)
    assert kw is not None and kw is bi.kernel_weight(w)  # cached
    assert torch.equal(bi.linear(x, w), ck.linear(x, kw, 96, 64))
    with torch.no_grad():
        w.mul_(-2)  # written in place: packed again
    assert bi.kernel_weight(w) is not kw
    assert torch.equal(bi.linear(x, w), ck.linear(x, ck.pack_weight(w.detach()), 96, 64))
    assert bi.kernel_weight(torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)) is None  # fp32: oneDNN
    wb = _bf16(gen, 4, 32, 24)
    xb = _bf16(gen, 4, 3, 32)
    assert torch.equal(bi.bmm(xb, wb), ck.bmm(xb, wb))
    assert (id(wb),) in bi._kernel_packed  # a tensor of its own: its packed copy, kept
    assert torch.equal(bi._kernel_packed[id(wb),][1], naive.pack_bmm_weight(wb))
    view = wb.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :20]  # a view: the plain kernel, nothing kept
    assert torch.equal(bi.bmm(xb, view), ck.bmm(xb, view)) and (id(view),) not in bi._kernel_packed


@pytest.mark.skipif(not ck.available(), reason="the fast path needs AVX512-BF16 (or the kernel is off)")
@pytest.mark.parametrize("isa", FAST)
def test_fused_projections_give_each_projection_s_own_bits(two_threads, monkeypatch, isa):
    """linear_fused (projections that share an input, one kernel call on their packed concatenation) gives every
    output bitwise what its own `linear` gives, for decode-sized and tile-sized calls and widths that are not
    multiples of the kernel's 64-column groups; rewriting one weight in place repacks the concatenation."""
    from expertmesh.kernels import batch_invariant as bi

    monkeypatch.setattr(ck, "_default", isa)
    gen = torch.Generator().manual_seed(8)
    k = 96
    weights = [torch.nn.Parameter(_bf16(gen, n, k), requires_grad=False) for n in (64, 40, 128, 7)]
    for m in (1, 2, 3, 17, 40):
        x = _bf16(gen, m, k)
        fused = bi.linear_fused(x, weights)
        assert [y.shape for y in fused] == [(m, w.shape[0]) for w in weights]
        for y, w in zip(fused, weights):
            assert torch.equal(y, ck.linear(x, ck.pack_weight(w.detach()), w.shape[0], k))
    assert bi.fused_kernel_weight(weights) is bi.fused_kernel_weight(weights)  # cached
    x = _bf16(gen, 3, 32, k)  # leading dims kept
    with torch.no_grad():
        weights[1].mul_(-3)
    for y, w in zip(bi.linear_fused(x, weights), weights):
        assert torch.equal(y, bi.linear(x, w))
    assert bi.fused_kernel_weight(weights[:2] + [torch.nn.Parameter(torch.randn(5, k), requires_grad=False)]) is None


@pytest.mark.skipif(not ck.built(), reason="the kernel did not build here")
@pytest.mark.parametrize("vector", [False, True])
def test_fp32_linear_gives_the_lane_order_reference_bits_in_any_batch(two_threads, vector):
    """The fp32 linear (routing / indexer-head weights): bitwise `naive.linear_fp32_in_lane_order` on fresh random
    inputs, K with and without a short last chunk, N off the 3-column blocks, 1-40 rows; a row's bits the same
    alone and in any batch; both paths the same bits. Summing in another order (ATen's) gives other bits here."""
    from expertmesh.kernels.linear.naive import linear_fp32_in_lane_order

    if vector and not ck.EXTENSION.load().f32_vector():
        pytest.skip("no AVX-512 here")
    gen = torch.Generator().manual_seed(11)
    differs = False
    for m, n, k in [(1, 64, 1024), (40, 16, 1024), (9, 7, 37), (3, 70, 200), (1, 1, 1), (17, 5, 16)]:
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        y = ck.linear_fp32(x, w, vector=vector)
        assert torch.equal(y, linear_fp32_in_lane_order(x, w))
        for i in range(m):
            assert torch.equal(ck.linear_fp32(x[i : i + 1], w, vector=vector), y[i : i + 1])
        differs |= not torch.equal(y, x @ w.T)
    assert differs
    with pytest.raises(ValueError, match="linear_fp32"):
        ck.linear_fp32(x.bfloat16(), w)


def test_batch_invariant_runs_fp32_weights_on_the_kernel():
    """bi.linear with an fp32 parameter takes the fp32 kernel where the fast path runs (no oneDNN copy made)."""
    from expertmesh.kernels import batch_invariant as bi
    from expertmesh.kernels.linear.naive import linear_fp32_in_lane_order

    gen = torch.Generator().manual_seed(12)
    w = torch.nn.Parameter(torch.randn(24, 64, generator=gen), requires_grad=False)
    x = torch.randn(5, 64, generator=gen)
    if not ck.available():
        pytest.skip("the fast path needs AVX512-BF16 (or the kernel is off)")
    assert torch.equal(bi.linear(x, w), linear_fp32_in_lane_order(x, w))
    assert (id(w),) not in bi._packed


def test_project_keeps_fp32_and_biased_projections_apart():
    """model.project: bf16 projections without a bias fused, an fp32 one (routing, indexer weights) and a biased
    one computed alone, results in the order asked."""
    from expertmesh.model.layers import Linear, project

    gen = torch.Generator().manual_seed(9)
    layers = [Linear(48, 64), Linear(48, 10), Linear(48, 16, bias=True), Linear(48, 64)]
    for layer in layers:
        torch.nn.init.normal_(layer.weight, generator=gen)
        if layer.bias is not None:
            torch.nn.init.normal_(layer.bias, generator=gen)
    layers = [layers[0].bfloat16(), layers[1], layers[2].bfloat16(), layers[3].bfloat16()]
    x = _bf16(gen, 5, 48)
    with torch.no_grad():
        for y, layer in zip(project(x, *layers), layers):
            assert torch.equal(y, layer(x))


@pytest.mark.skipif(not ck.available(), reason="the fast path needs AVX512-BF16 (or the kernel is off)")
def test_bf16_model_rows_do_not_depend_on_the_other_sequences():
    """The tiny model in bf16 (its projections and MLA's absorbed bmm on the kernel, no oneDNN copies): two
    sequences stepped together give bitwise the logits each gives alone."""
    from expertmesh.kernels import batch_invariant as bi
    from expertmesh.model.cache import Segment
    from expertmesh.model.config import preset
    from expertmesh.model.transformer import Transformer, init_random_

    model = init_random_(Transformer(preset("tiny")), seed=1).to(torch.bfloat16)
    a, b = list(range(1, 20)), list(range(100, 105))
    with torch.no_grad():
        alone_a = model.step(a, model.new_cache())
        alone_b = model.step(b, model.new_cache())
        ca, cb = model.new_cache(), model.new_cache()
        together = model.forward(torch.tensor(a + b), [Segment(0, len(a), ca), Segment(len(a), len(b), cb)])
    assert torch.equal(together[: len(a)], alone_a) and torch.equal(together[len(a) :], alone_b)
    weights = [p for n, p in model.named_parameters() if p.dim() == 2 and n.endswith("weight")]
    alone = {i for (i,) in bi._kernel_packed}
    fused = {i for ids in bi._fused_packed for i in ids}
    assert any(id(p) in alone for p in weights) and any(id(p) in fused for p in weights)
    kernel = alone | fused
    assert not any((id(p),) in bi._packed for p in weights if id(p) in kernel)  # one copy, not two
    assert not any(id(p) in alone for p in weights if id(p) in fused)


def test_the_isa_of_auto_comes_from_the_environment(monkeypatch):
    """EXPERTMESH_CPU_LINEAR_ISA picks what isa="auto" runs (once per process); an unknown or absent path is refused
    naming the variable."""
    gen = torch.Generator().manual_seed(7)
    w, x = _bf16(gen, 70, 200), _bf16(gen, 9, 200)
    wp = ck.pack_weight(w)
    for isa in ["portable"] + FAST:
        monkeypatch.setattr(ck, "_default", None)
        monkeypatch.setenv("EXPERTMESH_CPU_LINEAR_ISA", isa)
        assert ck.default_isa() == isa
        assert torch.equal(ck.linear(x, wp, 70, 200), ck.linear(x, wp, 70, 200, isa=isa))
    monkeypatch.setattr(ck, "_default", None)
    monkeypatch.setenv("EXPERTMESH_CPU_LINEAR_ISA", "sse")
    with pytest.raises(ValueError, match="EXPERTMESH_CPU_LINEAR_ISA"):
        ck.default_isa()
    monkeypatch.setattr(ck, "_default", None)
    monkeypatch.delenv("EXPERTMESH_CPU_LINEAR_ISA")
    assert ck.default_isa() == ck.best_isa()
