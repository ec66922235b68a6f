"""Grouped MXFP4 MoE: the grouped CPU path and the Triton kernel (interpreted) against the reference, the
canonical combine, batch invariance, the dequant cache, and input checking."""
from __future__ import annotations

import pytest
import torch

from expertmesh.kernels.backend import use_backend
from expertmesh.kernels.moe import (
    dequant_cache,
    moe_combine,
    moe_expert_outputs,
    moe_expert_outputs_dense,
    moe_expert_outputs_grouped,
    moe_expert_outputs_reference,
    moe_forward,
    moe_reference,
    set_dequant_cache_bytes,
)
from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def _weights(E: int, H: int, I: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = quantize_mxfp4(torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5)
    w2 = quantize_mxfp4(torch.randn(E, H, I, generator=gen) * I ** -0.5)
    return (*w13, *w2)


def _routing(T: int, K: int, E: int, gen: torch.Generator, experts=None, p_skip: float = 0.0) -> torch.Tensor:
    """[T, K] distinct experts per token from `experts` (default all), a fraction p_skip set to -1."""
    pool = torch.arange(E) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:K]] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    skip = torch.rand(T, K, generator=gen) < p_skip
    return torch.where(skip, -1, ids)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


CASES = {   # name: (T, K, E, H, I, allowed experts or None, p_skip)
    "odd_T": (7, 3, 5, 64, 32, None, 0.0),
    "empty_experts": (9, 2, 6, 64, 64, [1, 4], 0.0),
    "one_expert": (11, 1, 4, 96, 32, [2], 0.0),
    "skips": (13, 4, 8, 64, 32, None, 0.4),
    "single_token": (1, 4, 8, 128, 64, None, 0.0),
    "many_tokens": (70, 2, 3, 64, 32, None, 0.1),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matches_reference(case, dtype):
    T, K, E, H, I, experts, p_skip = CASES[case]
    gen = torch.Generator().manual_seed(100 + list(CASES).index(case))
    w = _weights(E, H, I, seed=len(case))
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = _routing(T, K, E, gen, experts, p_skip)
    ids[0, 0] = -1 if p_skip else ids[0, 0]
    ref = moe_expert_outputs_reference(x, ids, *w)
    out = torch.full((T, K, H), float("nan"), dtype=dtype)          # poisoned: every element must be written
    got = moe_expert_outputs_grouped(x, ids, *w, out=out)
    assert got is out and got.dtype == dtype and got.shape == (T, K, H)
    assert not got.isnan().any()
    assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got, ref)                                    # same per-row arithmetic: bitwise equal
    assert (got[ids == -1] == 0).all() and (ref[ids == -1] == 0).all()
    assert (got[ids >= 0].abs().sum(-1) > 0).all()
    # The reference itself against a from-scratch fp64 computation (dequantise everything, loop over slots).
    w13 = dequantize_mxfp4(w[0], w[1], torch.float64)
    w2 = dequantize_mxfp4(w[2], w[3], torch.float64)
    want = torch.zeros(T, K, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e >= 0:
                gu = w13[e] @ x[t].double()
                want[t, k] = w2[e] @ (torch.nn.functional.silu(gu[:I]) * gu[I:])
    assert _rel(ref, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_empty_batches():
    w = _weights(3, 64, 32, seed=12)
    for T, K in ((0, 2), (4, 0)):
        x = torch.randn(T, 64)
        ids = torch.zeros(T, K, dtype=torch.int64)
        for fn in (moe_expert_outputs_grouped, moe_expert_outputs_reference):
            assert fn(x, ids, *w).shape == (T, K, 64)
    out = torch.full((2, 2, 64), float("nan"))
    got = moe_expert_outputs_grouped(torch.randn(2, 64), torch.full((2, 2), -1), *w, out=out)
    assert (got == 0).all()                                         # every slot skipped: all zeros


def test_dense_variant_and_dispatch_match():
    T, K, E, H, I = 10, 2, 4, 64, 32
    gen = torch.Generator().manual_seed(11)
    w = _weights(E, H, I, seed=3)
    x = torch.randn(T, H, generator=gen)
    ids = _routing(T, K, E, gen, p_skip=0.2)
    ref = moe_expert_outputs_reference(x, ids, *w)
    dense = moe_expert_outputs_dense(x, ids, dequantize_mxfp4(w[0], w[1], torch.float32),
                                     dequantize_mxfp4(w[2], w[3], torch.float32))
    assert torch.equal(dense, ref)
    with use_backend("torch"):
        assert torch.equal(moe_expert_outputs(x, ids, *w), ref)


def test_combine_rank_order_and_forward():
    T, K, H = 6, 4, 32
    gen = torch.Generator().manual_seed(12)
    outputs = torch.randn(T, K, H, generator=gen)
    weights = torch.rand(T, K, generator=gen)
    want = torch.zeros(T, H)
    for k in range(K):                                             # the canonical order, spelled out
        want = want + outputs[:, k] * weights[:, k:k + 1]
    out = torch.full((T, H), float("nan"))
    got = moe_combine(outputs, weights, out=out)
    assert got is out and torch.equal(got, want)
    assert _rel(got, (outputs.double() * weights.double()[..., None]).sum(1)) < 1e-6
    # each token's sum depends only on its own rows
    assert torch.equal(moe_combine(outputs[2:3], weights[2:3]), got[2:3])
    got_bf16 = moe_combine(outputs.bfloat16(), weights)
    assert got_bf16.dtype == torch.bfloat16
    assert torch.equal(got_bf16, moe_combine(outputs.bfloat16().float(), weights).bfloat16())
    assert moe_combine(torch.randn(3, 0, H), torch.randn(3, 0)).abs().sum() == 0

    E, I = 5, 32
    w = _weights(E, H, I, seed=4)
    x = torch.randn(T, H, generator=gen)
    ids = _routing(T, K, E, gen, p_skip=0.2)
    ref = moe_reference(x, ids, weights, *w)
    with use_backend("torch"):                                     # the PyTorch path: bitwise the reference
        assert torch.equal(moe_forward(x, ids, weights, *w), ref)
    # auto on CPU may run the fused C++ kernel (its own reduction order): the dispatching path, fp32 rounding apart
    fwd = moe_forward(x, ids, weights, *w)
    assert torch.equal(fwd, moe_combine(moe_expert_outputs(x, ids, *w), weights))
    assert _rel(fwd, ref) < 1e-5
    assert torch.equal(ref, moe_combine(moe_expert_outputs_reference(x, ids, *w), weights))


@pytest.mark.parametrize("impl", ["grouped", "reference"])
def test_batch_invariance_bitwise(impl):
    """A token's rows are bitwise identical alone and inside batches of 1, 3, 17, 64 other tokens."""
    fn = moe_expert_outputs_grouped if impl == "grouped" else moe_expert_outputs_reference
    E, K, H, I = 8, 4, 256, 128
    w = _weights(E, H, I, seed=5)
    gen = torch.Generator().manual_seed(13)
    probes = torch.randn(3, H, generator=gen)
    probe_ids = _routing(3, K, E, gen, p_skip=0.1)
    for dtype in (torch.float32, torch.bfloat16):
        alone = [fn(probes[i:i + 1].to(dtype), probe_ids[i:i + 1], *w)[0] for i in range(3)]
        for n_other in (1, 3, 17, 64):
            others = torch.randn(n_other, H, generator=gen)
            other_ids = _routing(n_other, K, E, gen, p_skip=0.1)
            for i in range(3):
                pos = int(torch.randint(0, n_other + 1, (1,), generator=gen))
                x = torch.cat([others[:pos], probes[i:i + 1], others[pos:]]).to(dtype)
                ids = torch.cat([other_ids[:pos], probe_ids[i:i + 1], other_ids[pos:]])
                got = fn(x, ids, *w)[pos]
                assert torch.equal(got, alone[i]), (impl, dtype, n_other, i, pos)


def test_swiglu_rows_independent_of_batch_under_odd_thread_count():
    """ATen splits elementwise ops ≥ 32768 elements across threads; with 3 threads the split is not 32-aligned and
    tail elements take silu's scalar path (different bits). The chunked swiglu must not care."""
    from expertmesh.kernels.moe.naive import swiglu
    I = 512
    pool = torch.randn(200, 2 * I, generator=torch.Generator().manual_seed(16))
    alone = torch.cat([swiglu(pool[i:i + 1]) for i in range(200)])
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for m in (64, 160, 200):
            assert torch.equal(swiglu(pool[:m]), alone[:m]), m
    finally:
        torch.set_num_threads(threads)
    assert _rel(alone, torch.nn.functional.silu(pool[:, :I]) * pool[:, I:]) < 1e-6


def test_dequant_cache_follows_weight_changes():
    T, K, E, H, I = 5, 2, 4, 64, 32
    gen = torch.Generator().manual_seed(14)
    w = list(_weights(E, H, I, seed=6))
    x = torch.randn(T, H, generator=gen)
    ids = _routing(T, K, E, gen)
    set_dequant_cache_bytes(64 * 2**20)
    try:
        cache = dequant_cache()
        first = moe_expert_outputs_grouped(x, ids, *w)
        hits = cache.hits
        assert torch.equal(moe_expert_outputs_grouped(x, ids, *w), first) and cache.hits > hits
        # in place: new values in the same tensors
        new = _weights(E, H, I, seed=7)
        w[0].copy_(new[0])
        w[3][:] = new[3]
        changed = moe_expert_outputs_grouped(x, ids, *w)
        assert torch.equal(changed, moe_expert_outputs_reference(x, ids, *w))
        assert not torch.equal(changed, first)
        # new tensor objects
        w2 = list(_weights(E, H, I, seed=8))
        assert torch.equal(moe_expert_outputs_grouped(x, ids, *w2), moe_expert_outputs_reference(x, ids, *w2))
        # a tiny budget still gives the right answer (entries evicted or not cached)
        set_dequant_cache_bytes(1000)
        assert torch.equal(moe_expert_outputs_grouped(x, ids, *w2), moe_expert_outputs_reference(x, ids, *w2))
        assert cache.nbytes <= 1000
    finally:
        set_dequant_cache_bytes(256 * 2**20)


def test_bad_inputs_raise_value_error_naming_the_tensor():
    T, K, E, H, I = 3, 2, 4, 64, 32
    w = _weights(E, H, I, seed=9)
    x = torch.randn(T, H)
    ids = torch.zeros(T, K, dtype=torch.int64)
    fns = [moe_expert_outputs_grouped, moe_expert_outputs_reference]
    bad = [
        ((x[0], ids, *w), r"x: expected rank 2"),
        ((x.long(), ids, *w), r"x: expected a floating-point dtype"),
        ((torch.randn(T, 48), ids, *w), r"x: hidden size H=48"),
        ((x, ids.int(), *w), r"topk_ids: expected dtype torch.int64, found torch.int32"),
        ((x, ids[:2], *w), r"topk_ids: expected shape \[3,K\]"),
        ((x, ids + E, *w), r"topk_ids: expected values in \[-1, 4\)"),
        ((x, ids - 2, *w), r"topk_ids: expected values in \[-1, 4\)"),
        ((x, ids, w[0][:, :, :16], *w[1:]), r"w13_blocks: expected shape \[E,2I,32\]"),
        ((x, ids, w[0].int(), *w[1:]), r"w13_blocks: expected dtype torch.uint8"),
        ((x, ids, w[0], w[1][:3], *w[2:]), r"w13_scales: expected shape \[4,64,2\]"),
        ((x, ids, *w[:2], w[2][:, :32], w[3]), r"w2_blocks: expected shape \[4,64,16\]"),
        ((x, ids, *w[:3], w[3].float()), r"w2_scales: expected dtype torch.uint8"),
    ]
    for fn in fns:
        for args, msg in bad:
            with pytest.raises(ValueError, match=msg):
                fn(*args)
        with pytest.raises(ValueError, match=r"out: expected shape \[3,2,64\]"):
            fn(x, ids, *w, out=torch.empty(T, K, H + 1))
        with pytest.raises(ValueError, match=r"out: expected dtype torch.float32"):
            fn(x, ids, *w, out=torch.empty(T, K, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"outputs: expected rank 3"):
        moe_combine(torch.randn(T, H), torch.randn(T, K))
    with pytest.raises(ValueError, match=r"topk_weights: expected shape \[3,2\]"):
        moe_combine(torch.randn(T, K, H), torch.randn(T, K + 1))
    with pytest.raises(ValueError, match=r"topk_weights: expected a floating-point dtype"):
        moe_combine(torch.randn(T, K, H), torch.ones(T, K, dtype=torch.int64))


# ------------------------------------------------------------------------- Triton (TRITON_INTERPRET=1)
def test_triton_matches_reference_interpreted():
    pytest.importorskip("triton")
    from expertmesh.kernels.moe.triton_moe import moe_expert_outputs as moe_expert_outputs_triton

    E, H, I = 4, 64, 64
    w = _weights(E, H, I, seed=10)
    gen = torch.Generator().manual_seed(15)
    # T=5 K=2 with an empty expert and a skipped slot; T=19 with every token on one expert (two M tiles).
    ids_a = torch.tensor([[0, 2], [2, -1], [3, 0], [0, 3], [2, 0]])
    ids_b = torch.full((19, 1), 1, dtype=torch.int64)
    for ids, dtype in ((ids_a, torch.float32), (ids_a, torch.bfloat16), (ids_b, torch.float32)):
        T, K = ids.shape
        x = torch.randn(T, H, generator=gen).to(dtype)
        ref = moe_expert_outputs_reference(x, ids, *w)
        out = torch.full((T, K, H), float("nan"), dtype=dtype)
        got = moe_expert_outputs_triton(x, ids, *w, out=out)
        assert got is out and not got.isnan().any()
        assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2), (T, dtype)
        assert (got[ids == -1] == 0).all()
    with use_backend("triton"):                                   # the dispatcher picks it when forced
        x = torch.randn(3, H, generator=gen)
        ids = torch.tensor([[1], [-1], [1]])
        assert _rel(moe_expert_outputs(x, ids, *w), moe_expert_outputs_reference(x, ids, *w)) < 1e-5
