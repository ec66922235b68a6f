"""DSA ops: the reference against dense attention and brute force, the blocked prefill and the paged decode
against the reference (same top-k, same output), the Triton decode kernels (interpreted), input checking."""

from __future__ import annotations

import pytest
import torch

from expertmesh.kernels.backend import use_backend
from expertmesh.kernels.dsa import (
    dsa_attention_reference,
    dsa_decode_paged,
    dsa_decode_paged_reference,
    dsa_decode_paged_torch,
    dsa_prefill,
    lightning_indexer,
    lightning_indexer_reference,
    paged_indexer_scores,
    paged_sparse_attention,
    select_topk,
    sparse,
    topk_indices_reference,
)

NAN = float("nan")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _prefill_inputs(B, Tq, Tk, H, D, Hi, Di, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return r(B, Tq, H, D), r(B, Tk, D), r(B, Tq, Hi, Di), r(B, Tk, Di), torch.randn(B, Tq, Hi, generator=g)


def _paged_inputs(lens, H, D, Hi, Di, bs, max_blocks, seed, dtype=torch.float32):
    """Ragged sequences on a shuffled block table; table slots past a sequence's pages hold junk ids."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    nb = B * max_blocks + 3
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    table = torch.randperm(nb, generator=g)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    for b, n in enumerate(lens):
        table[b, -(-n // bs) :] = -7  # never read: must not matter
    return (
        r(B, H, D),
        r(nb, bs, D),
        r(nb, bs, Di),
        table,
        torch.tensor(lens, dtype=torch.int32),
        r(B, Hi, Di),
        torch.randn(B, Hi, generator=g),
    )


def _dense_causal_attention(q, kv, scale, v_dim):
    """Plain causal MQA attention, written independently of the DSA code: q [B,Tq,H,D], kv [B,Tk,D]."""
    B, Tq, H, D = q.shape
    Tk = kv.shape[1]
    out = torch.empty(B, Tq, H, v_dim, dtype=torch.float64)
    for i in range(Tq):
        visible = kv[:, : Tk - Tq + i + 1].double()  # [B, p+1, D]
        w = torch.softmax(scale * torch.einsum("bhd,bsd->bhs", q[:, i].double(), visible), dim=-1)
        out[:, i] = torch.einsum("bhs,bsv->bhv", w, visible[..., :v_dim])
    return out


# ------------------------------------------------------------------------------------------- reference
def test_reference_with_topk_covering_the_context_is_dense_causal_attention():
    for Tq, Tk in [(9, 9), (4, 11), (1, 6)]:
        q, kv, iq, ik, w = _prefill_inputs(2, Tq, Tk, 3, 20, 2, 8, seed=Tq)
        o = dsa_attention_reference(q, kv, iq, ik, w, topk=Tk, scale=0.3, v_dim=16)
        assert _rel(o, _dense_causal_attention(q, kv, 0.3, 16)) < 1e-6
    o = dsa_attention_reference(q, kv, iq, ik, w, topk=3, scale=0.3, v_dim=16)  # sparsity changes it
    assert _rel(o, _dense_causal_attention(q, kv, 0.3, 16)) > 1e-3


def test_reference_matches_per_query_brute_force():
    q, kv, iq, ik, w = _prefill_inputs(2, 6, 15, 3, 24, 3, 8, seed=1)
    o, idx = dsa_attention_reference(q, kv, iq, ik, w, topk=5, v_dim=20, return_indices=True)
    for b in range(2):
        for i in range(6):
            p = 15 - 6 + i
            s = torch.stack(
                [(w[b, i, h] * (iq[b, i, h].double() @ ik[b, : p + 1].double().T).relu()) for h in range(3)]
            ).sum(0)  # visible scores
            best = sorted(range(p + 1), key=lambda j: (-float(s[j]), j))[:5]  # ties: lower position
            chosen = torch.tensor(sorted(best))
            assert idx[b, i, : len(chosen)].tolist() == chosen.tolist()
            assert (idx[b, i, len(chosen) :] == -1).all()
            ent = kv[b, chosen].double()
            att = torch.softmax(24**-0.5 * q[b, i].double() @ ent.T, dim=-1) @ ent[:, :20]
            assert _rel(o[b, i], att) < 1e-6


def test_reference_indices_are_valid_causal_and_highest_scoring():
    q, kv, iq, ik, w = _prefill_inputs(2, 20, 31, 2, 16, 2, 8, seed=2)
    scores = lightning_indexer_reference(iq, ik, w)
    _, idx = dsa_attention_reference(q, kv, iq, ik, w, topk=7, return_indices=True)
    assert idx.shape == (2, 20, 7) and idx.dtype == torch.int64
    for b in range(2):
        for i in range(20):
            p = 31 - 20 + i
            row = idx[b, i]
            used = row[row >= 0]
            assert len(used) == min(7, p + 1) and (row[len(used) :] == -1).all()
            assert used.tolist() == sorted(set(used.tolist())) and int(used.max()) <= p
            rest = torch.ones(31, dtype=torch.bool)
            rest[used] = False
            rest[p + 1 :] = False
            if rest.any():
                assert scores[b, i, used].min() >= scores[b, i, rest].max()
    assert torch.isinf(scores[0, 0, 12:]).all() and torch.isfinite(scores[0, 0, :12]).all()


def test_indexer_reference_matches_float64_formula():
    _, _, iq, ik, w = _prefill_inputs(2, 5, 9, 1, 1, 5, 12, seed=3)
    want = torch.einsum("bih,bihs->bis", w.double(), torch.einsum("bihd,bsd->bihs", iq.double(), ik.double()).relu())
    got = lightning_indexer_reference(iq, ik, w, causal=False)
    assert _rel(got, want) < 1e-6
    assert torch.equal(lightning_indexer(iq, ik, w, causal=False), got)


def test_topk_ties_go_to_the_lower_position():
    s = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, float("-inf")],
            [0.0, 0.0, 0.0, 0.0, float("-inf"), float("-inf")],
            [2.0, float("-inf"), float("-inf"), float("-inf"), float("-inf"), float("-inf")],
        ]
    )
    want = [[1, 2], [0, 1], [0, -1]]
    assert topk_indices_reference(s, 2).tolist() == want
    assert select_topk(s, 2).tolist() == want


def test_select_topk_matches_reference_on_heavy_ties():
    g = torch.Generator().manual_seed(4)
    for k in [1, 3, 8, 20]:
        s = torch.randint(-2, 3, (50, 20), generator=g).float()  # many ties
        s[torch.rand(50, 20, generator=g) < 0.3] = float("-inf")
        s[0] = float("-inf")
        assert torch.equal(select_topk(s, k), topk_indices_reference(s, k))


# ----------------------------------------------------------------------------------------- prefill
PREFILL = {  # name: (B, Tq, Tk, H, D, Hi, Di, topk, causal, v_dim)
    "topk_below_context": (2, 40, 40, 4, 40, 3, 16, 8, True, 32),
    "topk_covers_context": (1, 12, 12, 2, 24, 2, 8, 20, True, None),
    "context_shorter_than_topk": (2, 5, 9, 2, 24, 2, 8, 16, True, 16),
    "single_query": (3, 1, 37, 2, 24, 2, 8, 9, True, 20),
    "continues_a_cache": (2, 7, 45, 3, 36, 3, 12, 11, True, 27),
    "odd_sizes": (1, 13, 29, 5, 19, 3, 7, 6, True, 11),
    "one_indexer_head_ties": (2, 17, 30, 2, 16, 1, 8, 5, True, 12),
    "not_causal": (2, 6, 23, 2, 16, 2, 8, 7, False, 10),
    "dense_mode": (1, 9, 14, 2, 16, 2, 8, 1 << 62, True, 12),
}


@pytest.mark.parametrize("case", list(PREFILL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_reference(case, dtype, monkeypatch):
    B, Tq, Tk, H, D, Hi, Di, topk, causal, v_dim = PREFILL[case]
    q, kv, iq, ik, w = _prefill_inputs(B, Tq, Tk, H, D, Hi, Di, seed=10 + list(PREFILL).index(case), dtype=dtype)
    o_ref, i_ref = dsa_attention_reference(q, kv, iq, ik, w, topk, causal, v_dim=v_dim, return_indices=True)
    for budget in [sparse.PREFILL_BLOCK_BYTES, 20_000]:  # one block / many blocks
        monkeypatch.setattr(sparse, "PREFILL_BLOCK_BYTES", budget)
        out = torch.full_like(o_ref, NAN)  # poisoned
        o, idx = dsa_prefill(q, kv, iq, ik, w, topk, causal, v_dim=v_dim, return_indices=True, out=out)
        assert o is out and not o.isnan().any() and o.dtype == dtype
        assert torch.equal(idx, i_ref)
        assert _rel(o, o_ref) < TOL[dtype]
        assert torch.equal(lightning_indexer(iq, ik, w, causal), lightning_indexer_reference(iq, ik, w, causal))


def test_a_block_whose_topk_is_most_of_what_it_sees_attends_without_a_gather(monkeypatch):
    """Top-k over a quarter or more of what a block sees (index_topk 4096 in an 8K prompt): one masked dense pass,
    not a [rows, k, D] gather with products per query (that took minutes a step); fewer: the gather. Either way
    the reference's selection and output."""
    gathered, real = [], sparse._attend_gathered
    monkeypatch.setattr(sparse, "_attend_gathered", lambda *a: gathered.append(a[3].shape) or real(*a))
    q, kv, iq, ik, w = _prefill_inputs(1, 32, 64, 2, 24, 2, 8, seed=3)  # one block: its last query sees 64
    for topk, gathers in [(32, False), (16, False), (15, True)]:
        gathered.clear()
        o, idx = dsa_prefill(q, kv, iq, ik, w, topk, return_indices=True)
        o_ref, i_ref = dsa_attention_reference(q, kv, iq, ik, w, topk, return_indices=True)
        assert torch.equal(idx, i_ref) and _rel(o, o_ref) < TOL[torch.float32]
        assert bool(gathered) == gathers, (topk, gathered)


def test_prefill_in_pieces_equals_one_pass():
    """A prompt prefilled in two calls (the second continuing the cache) selects and outputs the same."""
    q, kv, iq, ik, w = _prefill_inputs(1, 30, 30, 2, 24, 2, 8, seed=5)
    whole, i_whole = dsa_prefill(q, kv, iq, ik, w, 6, return_indices=True)
    first, i_first = dsa_prefill(q[:, :18], kv[:, :18], iq[:, :18], ik[:, :18], w[:, :18], 6, return_indices=True)
    second, i_second = dsa_prefill(q[:, 18:], kv, iq[:, 18:], ik, w[:, 18:], 6, return_indices=True)
    assert torch.equal(torch.cat([i_first, i_second], 1), i_whole)
    assert _rel(torch.cat([first, second], 1), whole) < 1e-6


# ------------------------------------------------------------------------------------------ decode
DECODE = {  # name: (context lens, H, D, Hi, Di, block_size, max_blocks, topk, v_dim)
    "ragged_topk_below": ([1, 13, 20, 7], 4, 24, 2, 8, 4, 6, 6, 16),
    "topk_covers_all": ([3, 9], 2, 24, 3, 8, 4, 5, 30, None),
    "odd_block_size": ([21, 1, 5, 34], 3, 20, 1, 12, 7, 5, 5, 13),
    "long_one": ([90], 2, 16, 4, 8, 16, 6, 40, 8),
}


@pytest.mark.parametrize("case", list(DECODE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_reference(case, dtype, monkeypatch):
    lens, H, D, Hi, Di, bs, mb, topk, v_dim = DECODE[case]
    x = _paged_inputs(lens, H, D, Hi, Di, bs, mb, seed=30 + list(DECODE).index(case), dtype=dtype)
    o_ref, i_ref = dsa_decode_paged_reference(*x, topk, v_dim=v_dim, return_indices=True)
    assert i_ref.shape == (len(lens), min(topk, mb * bs))
    for chunk in [sparse.DECODE_CHUNK_TOKENS, 8]:  # one / many GEMM chunks
        monkeypatch.setattr(sparse, "DECODE_CHUNK_TOKENS", chunk)
        out = torch.full_like(o_ref, NAN)
        with use_backend("torch"):
            o, idx = dsa_decode_paged(*x, topk, v_dim=v_dim, return_indices=True, out=out)
        assert o is out and not o.isnan().any()
        assert torch.equal(idx, i_ref)
        assert _rel(o, o_ref) < TOL[dtype]


def test_paged_indexer_scores_are_bitwise_the_reference_scores(monkeypatch):
    """Same arithmetic in the paged, chunked indexer as in the reference: equal bits, hence equal top-k."""
    lens = [37, 5, 64]
    _, _, ikc, table, ctx, iq, w = _paged_inputs(lens, 1, 8, 6, 24, 8, 8, seed=11)
    for chunk in [8, 24, 4096]:
        monkeypatch.setattr(sparse, "DECODE_CHUNK_TOKENS", chunk)
        got = paged_indexer_scores(iq, w, ikc, table, ctx)
        assert got.shape == (3, 64)
        for b, n in enumerate(lens):
            pages = table[b, : -(-n // 8)].long()
            want = lightning_indexer_reference(
                iq[b][None, None], ikc[pages].reshape(-1, 24)[:n][None], w[b][None, None]
            )[0, 0]
            assert torch.equal(got[b, :n], want) and torch.isinf(got[b, n:]).all()


def test_paged_decode_equals_prefill_of_the_last_query():
    """Decode over pages == the contiguous prefill path with Tq = 1 on the same context."""
    lens = [11, 26]
    q, kvc, ikc, table, ctx, iq, w = _paged_inputs(lens, 2, 24, 2, 8, 4, 7, seed=6)
    o = dsa_decode_paged_torch(q, kvc, ikc, table, ctx, iq, w, 5, scale=0.2)
    for b, n in enumerate(lens):
        pages = table[b, : -(-n // 4)].long()
        kv, ik = kvc[pages].reshape(-1, 24)[:n], ikc[pages].reshape(-1, 8)[:n]
        ob = dsa_prefill(q[b][None, None], kv[None], iq[b][None, None], ik[None], w[b][None, None], 5, scale=0.2)
        assert _rel(o[b], ob[0, 0]) < 1e-6


@pytest.mark.parametrize("topk", [5, 300])  # the indexer selects / topk covers the whole context
def test_paged_decode_bits_do_not_depend_on_the_page_size(topk):
    """A sequence's decode output is the same bits whether its cache is pages of 1, 4 or 16 tokens or one
    contiguous block (what the reference model's DSACache passes), so serving and the reference agree exactly;
    likewise the dense MLA decode."""
    from expertmesh.kernels.dsa import mla_decode_paged

    g = torch.Generator().manual_seed(21)
    n, H, D, Hi, Di = 101, 2, 24, 3, 8
    q, kv, ik = torch.randn(1, H, D, generator=g), torch.randn(n, D, generator=g), torch.randn(n, Di, generator=g)
    iq, w = torch.randn(1, Hi, Di, generator=g), torch.randn(1, Hi, generator=g)
    lens = torch.tensor([n], dtype=torch.int32)
    one = torch.zeros(1, 1, dtype=torch.int32)
    want = dsa_decode_paged_torch(q, kv[None], ik[None], one, lens, iq, w, topk, scale=0.3, v_dim=16)
    want_mla = mla_decode_paged(q, kv[None], one, lens, scale=0.3, v_dim=16)
    for bs in (1, 4, 16):
        pages = -(-n // bs)
        order = torch.randperm(pages + 2, generator=g)  # physical blocks in any order
        kvc, ikc = torch.randn(pages + 2, bs, D, generator=g), torch.randn(pages + 2, bs, Di, generator=g)
        pos = torch.arange(n)
        kvc[order[pos // bs], pos % bs], ikc[order[pos // bs], pos % bs] = kv, ik
        table = order[:pages][None].to(torch.int32)
        got = dsa_decode_paged_torch(q, kvc, ikc, table, lens, iq, w, topk, scale=0.3, v_dim=16)
        assert torch.equal(got, want), bs
        assert torch.equal(mla_decode_paged(q, kvc, table, lens, scale=0.3, v_dim=16), want_mla), bs
    dense = _dense_causal_attention(q[:, None], kv[None], 0.3, 16)[:, 0]
    assert _rel(want_mla, dense) < 1e-6


# ------------------------------------------------------------------------------- Triton (interpreter)
def _triton():
    pytest.importorskip("triton")
    from expertmesh.kernels.dsa import triton_dsa

    return triton_dsa


@pytest.mark.triton
def test_triton_indexer_and_attention_kernels():
    td = _triton()
    q, kvc, ikc, table, ctx, iq, w = _paged_inputs([5, 19, 1], 3, 40, 3, 16, 4, 6, seed=7)
    scores = torch.full((3, 24), NAN)
    td.paged_indexer_scores_triton(iq, w, ikc, table, ctx, out=scores)
    want = paged_indexer_scores(iq, w, ikc, table, ctx, n_pages=6)
    assert not scores.isnan().any()
    assert torch.equal(torch.isinf(scores), torch.isinf(want))
    fin = torch.isfinite(want)
    assert _rel(scores[fin], want[fin]) < 1e-6
    idx = torch.tensor([[0, 2, 4, -1, -1, -1, -1], [1, 3, 4, 9, 13, 17, 18], [0, -1, -1, -1, -1, -1, -1]])
    out = torch.full((3, 3, 32), NAN)
    td.paged_sparse_attention_triton(q, kvc, table, ctx, idx, 0.15, 32, out=out)
    assert not out.isnan().any()
    assert _rel(out, paged_sparse_attention(q, kvc, table, idx, 0.15, 32)) < 1e-5


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_matches_reference(dtype):
    _triton()
    for lens, topk in [([1, 13, 22, 7], 6), ([9, 3], 30)]:
        x = _paged_inputs(lens, 20, 72, 2, 8, 4, 6, seed=8 + topk, dtype=dtype)  # 20 heads: 2 head tiles
        o_ref, i_ref = dsa_decode_paged_reference(*x, topk, v_dim=64, return_indices=True)
        out = torch.full_like(o_ref, NAN)
        with use_backend("triton"):
            o, idx = dsa_decode_paged(*x, topk, v_dim=64, return_indices=True, out=out)
        assert o is out and not o.isnan().any()
        assert torch.equal(idx, i_ref)
        assert _rel(o, o_ref) < TOL[dtype]


# ---------------------------------------------------------------------------------------- validation
def _good_prefill():
    q, kv, iq, ik, w = _prefill_inputs(1, 3, 5, 2, 8, 2, 4, seed=9)
    return dict(q=q, kv=kv, index_q=iq, index_k=ik, index_weights=w, topk=2)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(q=torch.randn(3, 2, 8)), r"q: expected shape \[B, Tq, H, D\], found \[3, 2, 8\]"),
        (dict(kv=torch.randn(1, 5, 7)), r"kv: expected shape \[B=1, Tk, D=8\], found \[1, 5, 7\]"),
        (dict(kv=torch.randn(1, 5, 8).bfloat16()), r"kv: expected dtype torch.float32 \(same as q\)"),
        (dict(index_k=torch.randn(1, 6, 4)), r"index_k: expected shape \[B=1, Tk=5, Di=4\], found \[1, 6, 4\]"),
        (dict(index_weights=torch.randn(1, 3)), r"index_weights: expected shape"),
        (dict(index_q=torch.randn(1, 3, 2, 4).long()), r"index_q: expected dtype in"),
        (dict(topk=0), r"topk: expected an int >= 1, found 0"),
        (dict(v_dim=9), r"v_dim: expected an int in \[1, D=8\], found 9"),
        (dict(out=torch.empty(1, 3, 2, 4)), r"out: expected shape"),
    ],
)
def test_prefill_rejects_bad_inputs(changes, match):
    args = {**_good_prefill(), **changes}
    for fn in (dsa_prefill, dsa_attention_reference):
        with pytest.raises(ValueError, match=match):
            fn(**args)


def test_prefill_rejects_more_causal_queries_than_context():
    a = _good_prefill()
    q, iq, w = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2)
    with pytest.raises(ValueError, match=r"Tq <= Tk=5 is expected; found Tq=6"):
        dsa_prefill(q, a["kv"], iq, a["index_k"], w, 2)
    dsa_prefill(q, a["kv"], iq, a["index_k"], w, 2, causal=False)  # fine without causality


@pytest.mark.parametrize(
    "index,value,match",
    [
        (
            4,
            torch.tensor([3, 0], dtype=torch.int32),
            r"context_lens: expected values in \[1, max_blocks\*block_size=24\]",
        ),
        (4, torch.tensor([3, 25], dtype=torch.int32), r"context_lens: expected values in"),
        (4, torch.tensor([3.0, 4.0]), r"context_lens: expected dtype in"),
        (3, torch.tensor([[0, 1, 2, 3, 4, 5], [99, 7, 8, 9, 10, 11]], dtype=torch.int32), r"block_table: expected"),
        (3, torch.zeros(2, 6, dtype=torch.float32), r"block_table: expected dtype in"),
        (2, torch.randn(15, 4, 9), r"index_k_cache: expected shape \[num_blocks=15, block_size=4, Di=8\]"),
        (0, torch.randn(2, 4), r"q: expected shape \[B, H, D\], found \[2, 4\]"),
    ],
)
@pytest.mark.parametrize("host_check_max", [4096, 0])  # the values checked as host integers, and as tensors
def test_decode_rejects_bad_inputs(index, value, match, host_check_max, monkeypatch):
    from expertmesh.kernels.dsa import naive

    monkeypatch.setattr(naive, "HOST_CHECK_MAX_BLOCKS", host_check_max)
    x = list(_paged_inputs([3, 4], 2, 16, 2, 8, 4, 6, seed=10))
    x[index] = value
    for fn in (dsa_decode_paged_torch, dsa_decode_paged_reference):
        with pytest.raises(ValueError, match=match):
            fn(*x, 4)
