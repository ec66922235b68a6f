"""KDA ops: chunked / recurrent / Triton paths against the step-by-step reference."""

from __future__ import annotations

import os

# The Triton kernels are decorated when triton_kda is first imported: run them under the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from expertmesh.kernels.backend import use_backend  # noqa: E402
from expertmesh.kernels.kda import chunk_kda, fused_recurrent_kda, kda_recurrent_reference  # noqa: E402
from expertmesh.kernels.kda.chunk import _decayed_grams, prepare_chunks, state_passing_torch  # noqa: E402  # noqa: E402
from expertmesh.kernels.kda.chunk import chunk_kda as chunk_kda_torch
from expertmesh.kernels.kda.fused_recurrent import fused_recurrent_kda as fused_recurrent_kda_torch  # noqa: E402
from expertmesh.kernels.kda.naive import check_kda_inputs  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make_inputs(B, T, H, K, V, dtype=torch.float32, seed=0, strong=True):
    """Model-like inputs: q, k L2-normalised per head, g = log-sigmoid (some channels decay hard), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(2 * torch.randn(B, T, H, K, generator=gen) + 2)
    if strong:
        g[..., : max(1, K // 4)] *= 10  # strong decays on a quarter of channels
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta, h0


def rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def assert_close(out, ref, dtype=torch.float32, what="o"):
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = rel(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]}"


# ---------------------------------------------------------------------------------------------- reference
def test_reference_matches_per_head_float64_loop():
    # An independent, scalar-structured check of the reference itself: per (b, h), float64, matrices only.
    q, k, v, g, beta, h0 = make_inputs(2, 9, 2, 8, 4, seed=1)
    o, S = kda_recurrent_reference(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True)
    for b in range(2):
        for h in range(2):
            St = h0[b, h].double()
            for t in range(9):
                St = torch.diag(g[b, t, h].double().exp()) @ St
                kt, vt = k[b, t, h].double(), v[b, t, h].double()
                St = St + beta[b, t, h].double() * torch.outer(kt, vt - kt @ St)
                torch.testing.assert_close(o[b, t, h].double(), 0.7 * q[b, t, h].double() @ St, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(S[b, h].double(), St, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- chunk
@pytest.mark.parametrize(
    "B,T,H,K,V,C",
    [
        (2, 100, 2, 32, 16, 32),
        (1, 130, 3, 16, 24, 64),
        (2, 1, 2, 16, 16, 64),
        (2, 45, 2, 16, 16, 20),
        (1, 64, 1, 8, 8, 16),
    ],
)
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_matches_reference_fp32(B, T, H, K, V, C, with_h0):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, seed=T + C)
    h0 = h0 if with_h0 else None
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    assert o.shape == o_ref.shape and o.dtype == torch.float32 and s.shape == (B, H, K, V)
    assert_close(o, o_ref)
    assert_close(s, s_ref, what="final_state")
    o2, none = chunk_kda(q, k, v, g, beta, initial_state=h0, chunk_size=C)
    assert none is None and torch.equal(o2, o)


def test_chunk_custom_scale_and_extreme_decay():
    # g = -60 per step on some channels: cumulative log-gates reach -3000 inside a chunk, so any exp(-G)
    # would overflow; the chunked form must stay finite and exact.
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 16, 16, seed=3)
    g[..., :4] = -60.0
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    assert_close(o, o_ref)
    assert_close(s, s_ref, what="final_state")


def test_decayed_grams_subchunk_equals_direct_form():
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(3, 64, 16, generator=gen), torch.randn(3, 64, 16, generator=gen)
    G = F.logsigmoid(torch.randn(3, 64, 16, generator=gen)).cumsum(1)
    decay = (G[:, :, None] - G[:, None, :]).clamp(max=0).exp()  # [b, r, i, c], the plain [C, C, K] form
    for sub in (8, 16, 64):
        Mqk, Mkk = _decayed_grams(q, k, G, sub)
        for x, M in ((q, Mqk), (k, Mkk)):
            torch.testing.assert_close(M, torch.einsum("brc,bic,bric->bri", x, k, decay).tril(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", [chunk_kda_torch, fused_recurrent_kda_torch], ids=["chunk", "fused_recurrent"])
@pytest.mark.parametrize("T", [1, 20])
def test_inputs_not_modified(op, T):
    args = make_inputs(2, T, 2, 16, 16, seed=13)
    copies = [t.clone() for t in args]
    op(*args[:5], initial_state=args[5], output_final_state=True)
    for name, t, c in zip(("q", "k", "v", "g", "beta", "initial_state"), args, copies):
        assert torch.equal(t, c), f"{name} was modified in place"


def test_chunk_groups_of_blocks_agree(monkeypatch):
    # prepare_chunks walks blocks in groups bounded by TEMP_ELEMENTS: one block per group must not change results.
    import expertmesh.kernels.kda.chunk as chunk_mod

    q, k, v, g, beta, h0 = make_inputs(2, 90, 2, 16, 16, seed=14)
    o1, s1 = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    monkeypatch.setitem(chunk_mod.TEMP_ELEMENTS, "cpu", 1)
    o2, s2 = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    torch.testing.assert_close(o2, o1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s2, s1, rtol=1e-6, atol=1e-6)


def test_chunk_state_passing_writes_every_block():
    q, k, v, g, beta, h0 = make_inputs(2, 40, 2, 16, 16, seed=5)
    info = check_kda_inputs(q, k, v, g, beta)
    prep = prepare_chunks(q, k, v, g, beta, info, 16)
    o_blocks = torch.full((prep.layout.num_blocks, 2, 16, 16), float("nan"))
    state_passing_torch(prep, h0.clone(), o_blocks)
    assert not torch.isnan(o_blocks).any()


# ---------------------------------------------------------------------------------------------- recurrent
@pytest.mark.parametrize("B,T,H,K,V", [(3, 1, 2, 32, 16), (2, 5, 3, 16, 24), (1, 33, 1, 16, 16)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_fused_recurrent_matches_reference_fp32(B, T, H, K, V, with_h0):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, seed=10 + T)
    h0 = h0 if with_h0 else None
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == o_ref.shape
    assert_close(o, o_ref)
    assert_close(s, s_ref, what="final_state")


@pytest.mark.parametrize("op", [chunk_kda_torch, fused_recurrent_kda_torch], ids=["chunk", "fused_recurrent"])
def test_bf16_inputs(op):
    q, k, v, g, beta, h0 = make_inputs(2, 50, 2, 32, 32, dtype=torch.bfloat16, seed=6)
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close(o, o_ref, torch.bfloat16)
    assert_close(s, s_ref, torch.bfloat16, what="final_state")


# ---------------------------------------------------------------------------------------------- varlen, continuity
LENS = [5, 0, 37, 16, 1]


def _check_varlen(op, lens, **kw):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    H, K, V = 2, 16, 16
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), H, K, V, seed=7)
    h0 = torch.randn(len(lens), H, K, V, generator=torch.Generator().manual_seed(8))
    o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw)
    assert o.shape == v.shape and s.shape == (len(lens), H, K, V)
    for n in range(len(lens)):
        a, b = int(cu[n]), int(cu[n + 1])
        o_ref, s_ref = kda_recurrent_reference(
            q[:, a:b],
            k[:, a:b],
            v[:, a:b],
            g[:, a:b],
            beta[:, a:b],
            initial_state=h0[n : n + 1],
            output_final_state=True,
        )
        if b > a:
            assert_close(o[:, a:b], o_ref, what=f"o of sequence {n}")
        assert_close(s[n : n + 1], s_ref, what=f"final_state of sequence {n}")


@pytest.mark.parametrize("op", [chunk_kda_torch, fused_recurrent_kda_torch], ids=["chunk", "fused_recurrent"])
def test_varlen_equals_per_sequence_runs(op):
    _check_varlen(op, LENS, chunk_size=16)


@pytest.mark.parametrize("split", [1, 37, 64])
def test_prefill_then_decode_continuity(split):
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 16, 16, seed=9)
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o1, s1 = chunk_kda(
        *(t[:, :split] for t in (q, k, v, g, beta)), initial_state=h0, output_final_state=True, chunk_size=32
    )
    s2, outs = s1, [o1]
    for t0 in range(split, 70, 4):  # decode a few tokens per call
        sl = slice(t0, min(t0 + 4, 70))
        o2, s2 = fused_recurrent_kda(*(t[:, sl] for t in (q, k, v, g, beta)), initial_state=s2, output_final_state=True)
        outs.append(o2)
    assert_close(torch.cat(outs, 1), o_ref)
    assert_close(s2, s_ref, what="final_state")


@pytest.mark.parametrize("op", [chunk_kda_torch, fused_recurrent_kda_torch], ids=["chunk", "fused_recurrent"])
def test_batch_invariance(op):
    # docs/architecture.md "Determinism": a sequence's outputs must not depend on what else is in the batch (bitwise).
    q, k, v, g, beta, h0 = make_inputs(6, 3, 2, 32, 32, seed=16)
    o6, s6 = op(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o1, s1 = op(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=h0[:1], output_final_state=True)
    assert torch.equal(o1, o6[:1]) and torch.equal(s1, s6[:1])


# ---------------------------------------------------------------------------------------------- Triton (interpreter)
def _triton():
    pytest.importorskip("triton")
    from expertmesh.kernels.kda import triton_kda

    return triton_kda


@pytest.mark.parametrize("kind", ["fused_recurrent", "chunk"])
def test_triton_matches_reference(kind):
    tk = _triton()
    q, k, v, g, beta, h0 = make_inputs(2, 7 if kind == "fused_recurrent" else 40, 2, 16, 16, seed=11)
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    info = check_kda_inputs(q, k, v, g, beta)
    nan = float("nan")
    final = torch.full((2, 2, 16, 16), nan)
    if kind == "fused_recurrent":
        o = torch.full_like(v, nan)  # poisoned: every element must be written
        tk.fused_recurrent_fwd(q, k, v, g, beta, info, h0, o, final)
    else:
        prep = prepare_chunks(q, k, v, g, beta, info, 16, grams=tk.decayed_grams_triton)
        o_blocks = torch.full((prep.layout.num_blocks, 2, 16, 16), nan)
        tk.chunk_state_fwd(prep, info, h0, o_blocks, final)
        assert not torch.isnan(o_blocks).any()
        o = tk.from_blocks(o_blocks, prep.layout, info, v.dtype)
    assert_close(o, o_ref)
    assert_close(final, s_ref, what="final_state")


def test_triton_decayed_grams_match_torch():
    tk = _triton()
    gen = torch.Generator().manual_seed(15)
    q, k = torch.randn(2, 32, 20, generator=gen), torch.randn(2, 32, 20, generator=gen)  # K=20: a partial K tile
    g = F.logsigmoid(2 * torch.randn(2, 32, 20, generator=gen))
    g[..., :3] = -60.0  # exp(-G) would overflow
    G = g.cumsum(1)
    Mqk, Mkk = torch.full((2, 32, 32), float("nan")), torch.full((2, 32, 32), float("nan"))
    tk.decayed_grams_fwd(q, k, G, 16, Mqk, Mkk)
    ref_qk, ref_kk = _decayed_grams(q, k, G, 16)
    assert_close(Mqk, ref_qk, what="Mqk")
    assert_close(Mkk, ref_kk, what="Mkk")


def test_triton_dispatch_varlen_and_bf16():
    _triton()
    with use_backend("triton"):
        _check_varlen(fused_recurrent_kda, [3, 0, 4])
        _check_varlen(chunk_kda, [3, 0, 20], chunk_size=16)
        q, k, v, g, beta, h0 = make_inputs(2, 7, 2, 16, 16, dtype=torch.bfloat16, seed=12)
        o_ref, _ = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0)
        o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0)
        assert o.dtype == torch.bfloat16 and s is None
        assert_close(o, o_ref, torch.bfloat16)
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_kda(q, k, v, g, beta, chunk_size=20)


# ---------------------------------------------------------------------------------------------- validation
def _bad(**changes):
    q, k, v, g, beta, h0 = make_inputs(1, 6, 2, 8, 4, strong=False)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=None, cu_seqlens=None)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(q=torch.randn(6, 2, 8)), r"q: expected rank 4"),
        (dict(k=torch.randn(1, 6, 2, 4)), r"k: expected shape \[1,6,2,8\]"),
        (dict(v=torch.randn(1, 5, 2, 4)), r"v: expected shape \[1,6,2,V\]"),
        (dict(g=torch.randn(1, 6, 2, 4)), r"g: expected shape"),
        (dict(beta=torch.rand(1, 6, 3)), r"beta: expected shape \[1,6,2\]"),
        (dict(v=torch.randn(1, 6, 2, 4, dtype=torch.float64)), r"q, k, v: expected one dtype"),
        (dict(beta=torch.ones(1, 6, 2, dtype=torch.int64)), r"beta: expected a floating-point dtype"),
        (dict(initial_state=torch.zeros(2, 2, 8, 4)), r"initial_state: expected shape \[1,2,8,4\]"),
        (dict(cu_seqlens=torch.tensor([0, 4, 2, 6])), r"cu_seqlens: expected non-decreasing"),
        (dict(cu_seqlens=torch.tensor([0, 4, 5])), r"cu_seqlens: expected to end at T=6"),
        (dict(cu_seqlens=torch.tensor([1, 6])), r"cu_seqlens: expected to start at 0"),
        (dict(cu_seqlens=torch.tensor([0.0, 6.0])), r"cu_seqlens: expected an int32/int64"),
        (
            dict(cu_seqlens=torch.tensor([0, 3, 6]), initial_state=torch.zeros(1, 2, 8, 4)),
            r"initial_state: expected shape \[2,",
        ),
    ],
)
@pytest.mark.parametrize("op", [chunk_kda_torch, fused_recurrent_kda_torch], ids=["chunk", "fused_recurrent"])
def test_bad_inputs_raise(op, changes, match):
    with pytest.raises(ValueError, match=match):
        op(**_bad(**changes))


def test_varlen_needs_batch_one():
    q, k, v, g, beta, _ = make_inputs(2, 6, 2, 8, 4)
    with pytest.raises(ValueError, match="B == 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], chunk_size=0)
