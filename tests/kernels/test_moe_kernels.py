"""Grouped MXFP4 MoE: the grouped CPU path and the Triton kernel (interpreted) against the reference, the
canonical combine, batch invariance, the dequant cache, and input checking — with SwiGLU and with Kimi K3's SiTU
(`kernels/activation.py`), including gates and ups far past SiTU's soft caps."""

from __future__ import annotations

import pytest
import torch

from expertmesh.kernels.activation import SWIGLU, GatedActivation, gated_act
from expertmesh.kernels.backend import use_backend
from expertmesh.kernels.moe import (
    MXFP4Experts,
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
from expertmesh.kernels.mxfp4 import dequantize_mxfp4


def _weights(E: int, H: int, I: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return MXFP4Experts.quantize(
        torch.randn(E, 2 * I, H, generator=gen) * H**-0.5, torch.randn(E, H, I, generator=gen) * I**-0.5
    )


def _routing(T: int, K: int, E: int, gen: torch.Generator, experts=None, p_skip: float = 0.0) -> torch.Tensor:
    """[T, K] distinct experts per token from `experts` (default all), a fraction p_skip set to -1."""
    pool = torch.arange(E) if experts is None else torch.tensor(experts)
    ids = (
        torch.stack([pool[torch.randperm(len(pool), generator=gen)[:K]] for _ in range(T)])
        if T
        else torch.empty(0, K, dtype=torch.int64)
    )
    skip = torch.rand(T, K, generator=gen) < p_skip
    return torch.where(skip, -1, ids)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


ACTS = {  # name: activation (published K3 caps; β_lin = 0: up uncapped; tight caps that saturate at |g| ~ 1)
    "swiglu": SWIGLU,
    "situ": GatedActivation("situ", beta=4.0, linear_beta=25.0),
    "situ_nocap": GatedActivation("situ", beta=4.0, linear_beta=0.0),
    "situ_tight": GatedActivation("situ", beta=0.5, linear_beta=0.25),
}


def _act64(g: torch.Tensor, u: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """act(g, u) in fp64, written out from the formula (independent of kernels/activation.py)."""
    g, u = g.double(), u.double()
    if act.kind == "swiglu":
        return torch.nn.functional.silu(g) * u
    a = act.beta * torch.tanh(g / act.beta) * torch.sigmoid(g)
    return a * (act.linear_beta * torch.tanh(u / act.linear_beta) if act.linear_beta > 0 else u)


CASES = {  # name: (T, K, E, H, I, allowed experts or None, p_skip)
    "odd_T": (7, 3, 5, 64, 32, None, 0.0),
    "empty_experts": (9, 2, 6, 64, 64, [1, 4], 0.0),
    "one_expert": (11, 1, 4, 96, 32, [2], 0.0),
    "skips": (13, 4, 8, 64, 32, None, 0.4),
    "single_token": (1, 4, 8, 128, 64, None, 0.0),
    "many_tokens": (70, 2, 3, 64, 32, None, 0.1),
}


# SwiGLU and SiTU with the published caps on every case and dtype; the other SiTU variants on two cases, fp32
GROUPED_PARAMS = [
    pytest.param(c, d, a, id=f"{str(d)[6:]}-{c}-{a}")
    for a in ACTS
    for d in (torch.float32, torch.bfloat16)
    for c in CASES
    if a in ("swiglu", "situ") or (d == torch.float32 and c in ("odd_T", "skips"))
]


@pytest.mark.parametrize("case,dtype,act", GROUPED_PARAMS)
def test_grouped_matches_reference(case, dtype, act):
    T, K, E, H, I, experts, p_skip = CASES[case]
    activation = ACTS[act]
    gen = torch.Generator().manual_seed(100 + list(CASES).index(case))
    w = _weights(E, H, I, seed=len(case))
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = _routing(T, K, E, gen, experts, p_skip)
    ids[0, 0] = -1 if p_skip else ids[0, 0]
    ref = moe_expert_outputs_reference(x, ids, w, activation=activation)
    out = torch.full((T, K, H), float("nan"), dtype=dtype)  # poisoned: every element must be written
    got = moe_expert_outputs_grouped(x, ids, w, out=out, activation=activation)
    assert got is out and got.dtype == dtype and got.shape == (T, K, H)
    assert not got.isnan().any()
    assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got, ref)  # same per-row arithmetic: bitwise equal
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
                want[t, k] = w2[e] @ _act64(gu[:I], gu[I:], activation)
    assert _rel(ref, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    if act == "swiglu":  # the default is SwiGLU
        assert torch.equal(moe_expert_outputs_reference(x, ids, w), ref)
    else:  # and SiTU is not SwiGLU
        assert _rel(moe_expert_outputs_reference(x, ids, w), ref) > 1e-2  # ≫ the 1e-5 tolerance


@pytest.mark.parametrize("act", ["situ", "situ_nocap"])
def test_situ_saturated_gates_match_reference(act):
    """|g| ≫ β and |u| ≫ β_lin (≈ 300 against 4 and 25): tanh at ±1, σ(g) at 0 / 1 (exp(-g) overflows for
    g < -88); the grouped path stays bitwise the reference, which stays within fp32 rounding of fp64."""
    T, K, E, H, I = 12, 2, 3, 64, 64
    activation = ACTS[act]
    gen = torch.Generator().manual_seed(31)
    w = _weights(E, H, I, seed=30)
    x = torch.randn(T, H, generator=gen) * 300  # W13 x ~ 300 (weights scaled by H^-1/2)
    ids = _routing(T, K, E, gen)
    w13 = dequantize_mxfp4(w[0], w[1], torch.float64)
    w2 = dequantize_mxfp4(w[2], w[3], torch.float64)
    gu = torch.einsum("eih,th->tei", w13, x.double())  # [T, E, 2I]
    g, u = gu[..., :I], gu[..., I:]
    assert (g.abs() > 10 * activation.beta).float().mean() > 0.8  # saturated gates, both signs
    assert (g < -100).any() and (g > 100).any()
    assert (u.abs() > 4 * 25.0).float().mean() > 0.6  # ups far past the published β_lin
    ref = moe_expert_outputs_reference(x, ids, w, activation=activation)
    assert ref.isfinite().all()
    assert torch.equal(moe_expert_outputs_grouped(x, ids, w, activation=activation), ref)
    want = torch.stack(
        [torch.stack([w2[e] @ _act64(g[t, e], u[t, e], activation) for e in ids[t].tolist()]) for t in range(T)]
    )
    assert _rel(ref, want) < 1e-5


def test_gated_act_reference():
    """gated_act against the fp64 formula (tanh and σ saturated and not), SwiGLU bitwise its pre-SiTU arithmetic."""
    import torch.nn.functional as F

    from expertmesh.kernels.batch_invariant import pointwise

    gen = torch.Generator().manual_seed(32)
    g = torch.cat([torch.randn(40, 96, generator=gen), torch.randn(40, 96, generator=gen) * 300])
    u = torch.cat([torch.randn(40, 96, generator=gen), torch.randn(40, 96, generator=gen) * 300])
    for name, act in ACTS.items():
        got = gated_act(g, u, act)
        assert got.dtype == torch.float32 and got.shape == g.shape
        want = _act64(g, u, act)
        assert ((got.double() - want).abs() <= 1e-6 * want.abs() + 1e-30).all(), name
    assert torch.equal(gated_act(g, u, SWIGLU), pointwise(F.silu, g) * u)
    gb, ub = g.bfloat16(), u.bfloat16()
    assert torch.equal(gated_act(gb, ub, SWIGLU).bfloat16(), pointwise(F.silu, gb) * ub)  # bf16 GEMM path
    situ = ACTS["situ"]
    assert gated_act(gb, ub, situ).dtype == torch.float32
    assert torch.equal(gated_act(gb, ub, situ), gated_act(gb.float(), ub.float(), situ))
    # the caps: |β·tanh(g/β)·σ(g)| < β, |β_lin·tanh(u/β_lin)| ≤ β_lin
    big = torch.tensor([[1e4, -1e4, 80.0, -200.0, 0.0]])
    out = gated_act(big, torch.full_like(big, 1e6), situ)
    assert torch.equal(out, torch.tensor([[100.0, -0.0, 100.0, -0.0, 0.0]]))


def test_activation_validation_names_the_field():
    assert SWIGLU == GatedActivation() and SWIGLU.kind == "swiglu"
    assert GatedActivation("situ", 4, 0).linear_beta == 0.0 and isinstance(GatedActivation("situ", 4).beta, float)
    with pytest.raises(ValueError, match=r"^kind: expected one of swiglu, situ, found 'gelu'"):
        GatedActivation("gelu")
    for beta in (0.0, -4.0):
        with pytest.raises(ValueError, match=r"^beta: expected > 0"):
            GatedActivation("situ", beta=beta)
    for beta in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^beta: expected a finite number"):
            GatedActivation("situ", beta=beta)
    with pytest.raises(ValueError, match=r"^beta: expected a real number, found str"):
        GatedActivation("situ", beta="4")
    with pytest.raises(ValueError, match=r"^linear_beta: expected ≥ 0"):
        GatedActivation("situ", linear_beta=-1.0)
    with pytest.raises(ValueError, match=r"^linear_beta: expected a real number, found NoneType"):
        GatedActivation("situ", linear_beta=None)
    with pytest.raises(ValueError, match=r"^up: expected the shape of gate"):
        gated_act(torch.randn(2, 4), torch.randn(2, 5), SWIGLU)
    with pytest.raises(AttributeError):
        SWIGLU.kind = "situ"  # frozen
    w = _weights(2, 64, 32, seed=33)
    x, ids = torch.randn(3, 64), torch.zeros(3, 1, dtype=torch.int64)
    for fn in (moe_expert_outputs_grouped, moe_expert_outputs_reference, moe_expert_outputs):
        with pytest.raises(ValueError, match=r"^activation: expected a GatedActivation, found str"):
            fn(x, ids, w, activation="situ")
        with pytest.raises(ValueError, match=r"^activation: expected a GatedActivation"):
            fn(x[:0], ids[:0], w, activation="situ")  # checked even with no rows


def test_empty_batches():
    w = _weights(3, 64, 32, seed=12)
    for T, K in ((0, 2), (4, 0)):
        x = torch.randn(T, 64)
        ids = torch.zeros(T, K, dtype=torch.int64)
        for fn in (moe_expert_outputs_grouped, moe_expert_outputs_reference):
            assert fn(x, ids, w).shape == (T, K, 64)
    out = torch.full((2, 2, 64), float("nan"))
    got = moe_expert_outputs_grouped(torch.randn(2, 64), torch.full((2, 2), -1), w, out=out)
    assert (got == 0).all()  # every slot skipped: all zeros


@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_dense_variant_and_dispatch_match(act):
    T, K, E, H, I = 10, 2, 4, 64, 32
    activation = ACTS[act]
    gen = torch.Generator().manual_seed(11)
    w = _weights(E, H, I, seed=3)
    x = torch.randn(T, H, generator=gen)
    ids = _routing(T, K, E, gen, p_skip=0.2)
    ref = moe_expert_outputs_reference(x, ids, w, activation=activation)
    w13, w2 = dequantize_mxfp4(w[0], w[1], torch.float32), dequantize_mxfp4(w[2], w[3], torch.float32)
    dense = moe_expert_outputs_dense(x, ids, w13, w2, activation=activation)
    assert torch.equal(dense, ref)
    with use_backend("torch"):
        assert torch.equal(moe_expert_outputs(x, ids, w, activation=activation), ref)
    # bf16 GEMMs (benchmarks): the activation still in fp32, near the fp32 result
    assert _rel(moe_expert_outputs_dense(x, ids, w13.bfloat16(), w2.bfloat16(), activation=activation), ref) < 2e-2


def test_combine_rank_order_and_forward():
    T, K, H = 6, 4, 32
    gen = torch.Generator().manual_seed(12)
    outputs = torch.randn(T, K, H, generator=gen)
    weights = torch.rand(T, K, generator=gen)
    want = torch.zeros(T, H)
    for k in range(K):  # the canonical order, spelled out
        want = want + outputs[:, k] * weights[:, k : k + 1]
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
    ref = moe_reference(x, ids, weights, w)
    with use_backend("torch"):  # the PyTorch path: bitwise the reference
        assert torch.equal(moe_forward(x, ids, weights, w), ref)
    # auto on CPU may run the fused C++ kernel (its own reduction order): the dispatching path, fp32 rounding apart
    fwd = moe_forward(x, ids, weights, w)
    assert torch.equal(fwd, moe_combine(moe_expert_outputs(x, ids, w), weights))
    assert _rel(fwd, ref) < 1e-5
    assert torch.equal(ref, moe_combine(moe_expert_outputs_reference(x, ids, w), weights))
    # SiTU through moe_forward / moe_reference
    situ = ACTS["situ"]
    ref_situ = moe_reference(x, ids, weights, w, activation=situ)
    assert torch.equal(ref_situ, moe_combine(moe_expert_outputs_reference(x, ids, w, activation=situ), weights))
    assert _rel(ref_situ, ref) > 1e-2
    with use_backend("torch"):
        assert torch.equal(moe_forward(x, ids, weights, w, activation=situ), ref_situ)
    fwd_situ = moe_forward(x, ids, weights, w, activation=situ)
    assert torch.equal(fwd_situ, moe_combine(moe_expert_outputs(x, ids, w, activation=situ), weights))
    assert _rel(fwd_situ, ref_situ) < 1e-5


@pytest.mark.parametrize("impl,act", [("grouped", "swiglu"), ("reference", "swiglu"), ("grouped", "situ")])
def test_batch_invariance_bitwise(impl, act):
    """A token's rows are bitwise identical alone and inside batches of 1, 3, 17, 64 other tokens."""
    base = moe_expert_outputs_grouped if impl == "grouped" else moe_expert_outputs_reference

    def fn(x, ids, w):
        scale = 8 if act == "situ" else 1  # × 8: gates on both sides of SiTU's cap
        return base(x * scale, ids, w, activation=ACTS[act])

    E, K, H, I = 8, 4, 256, 128
    w = _weights(E, H, I, seed=5)
    gen = torch.Generator().manual_seed(13)
    probes = torch.randn(3, H, generator=gen)
    probe_ids = _routing(3, K, E, gen, p_skip=0.1)
    for dtype in (torch.float32, torch.bfloat16):
        alone = [fn(probes[i : i + 1].to(dtype), probe_ids[i : i + 1], w)[0] for i in range(3)]
        for n_other in (1, 3, 17, 64):
            others = torch.randn(n_other, H, generator=gen)
            other_ids = _routing(n_other, K, E, gen, p_skip=0.1)
            for i in range(3):
                pos = int(torch.randint(0, n_other + 1, (1,), generator=gen))
                x = torch.cat([others[:pos], probes[i : i + 1], others[pos:]]).to(dtype)
                ids = torch.cat([other_ids[:pos], probe_ids[i : i + 1], other_ids[pos:]])
                got = fn(x, ids, w)[pos]
                assert torch.equal(got, alone[i]), (impl, dtype, n_other, i, pos)


def test_swiglu_rows_independent_of_batch_under_odd_thread_count():
    """ATen splits elementwise ops ≥ 32768 elements across threads; with 3 threads the split is not 32-aligned and
    tail elements take silu's scalar path (different bits). The chunked swiglu must not care."""
    from expertmesh.kernels.moe.naive import swiglu

    I = 512
    pool = torch.randn(200, 2 * I, generator=torch.Generator().manual_seed(16))
    alone = torch.cat([swiglu(pool[i : i + 1]) for i in range(200)])
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for m in (64, 160, 200):
            assert torch.equal(swiglu(pool[:m]), alone[:m]), m
    finally:
        torch.set_num_threads(threads)
    assert _rel(alone, torch.nn.functional.silu(pool[:, :I]) * pool[:, I:]) < 1e-6


def test_situ_rows_independent_of_batch_under_odd_thread_count():
    """The same for SiTU's tanh and sigmoid (ATen's scalar tails round them differently too)."""
    from expertmesh.kernels.moe.naive import swiglu

    I, situ = 512, ACTS["situ"]
    pool = torch.randn(200, 2 * I, generator=torch.Generator().manual_seed(17)) * 30
    alone = torch.cat([swiglu(pool[i : i + 1], activation=situ) for i in range(200)])
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for m in (64, 160, 200):
            assert torch.equal(swiglu(pool[:m], activation=situ), alone[:m]), m
    finally:
        torch.set_num_threads(threads)
    assert _rel(alone, _act64(pool[:, :I], pool[:, I:], situ)) < 1e-6


def test_dequant_cache_follows_weight_changes():
    T, K, E, H, I = 5, 2, 4, 64, 32
    gen = torch.Generator().manual_seed(14)
    w = _weights(E, H, I, seed=6)
    x = torch.randn(T, H, generator=gen)
    ids = _routing(T, K, E, gen)
    set_dequant_cache_bytes(64 * 2**20)
    try:
        cache = dequant_cache()
        first = moe_expert_outputs_grouped(x, ids, w)
        hits = cache.hits
        assert torch.equal(moe_expert_outputs_grouped(x, ids, w), first) and cache.hits > hits
        # in place: new values in the same tensors
        new = _weights(E, H, I, seed=7)
        w[0].copy_(new[0])
        w[3][:] = new[3]
        changed = moe_expert_outputs_grouped(x, ids, w)
        assert torch.equal(changed, moe_expert_outputs_reference(x, ids, w))
        assert not torch.equal(changed, first)
        # new tensor objects
        w2 = _weights(E, H, I, seed=8)
        assert torch.equal(moe_expert_outputs_grouped(x, ids, w2), moe_expert_outputs_reference(x, ids, w2))
        # a tiny budget still gives the right answer (entries evicted or not cached)
        set_dequant_cache_bytes(1000)
        assert torch.equal(moe_expert_outputs_grouped(x, ids, w2), moe_expert_outputs_reference(x, ids, w2))
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
        ((x[0], ids, w), r"x: expected rank 2"),
        ((x.long(), ids, w), r"x: expected a floating-point dtype"),
        ((torch.randn(T, 48), ids, w), r"x: hidden size H=48"),
        ((x, ids.int(), w), r"topk_ids: expected dtype torch.int64, found torch.int32"),
        ((x, ids[:2], w), r"topk_ids: expected shape \[3,K\]"),
        ((x, ids + E, w), r"topk_ids: expected values in \[-1, 4\)"),
        ((x, ids - 2, w), r"topk_ids: expected values in \[-1, 4\)"),
        ((x, ids, tuple(w)), r"experts: expected an MXFP4Experts bundle, found tuple"),
        (
            (x, ids, w._replace(gate_up_blocks=w.gate_up_blocks[:, :, :16])),
            r"gate_up_blocks: expected shape \[E,2I,32\]",
        ),
        ((x, ids, w._replace(gate_up_blocks=w.gate_up_blocks.int())), r"gate_up_blocks: expected dtype torch.uint8"),
        ((x, ids, w._replace(gate_up_scales=w.gate_up_scales[:3])), r"gate_up_scales: expected shape \[4,64,2\]"),
        ((x, ids, w._replace(down_blocks=w.down_blocks[:, :32])), r"down_blocks: expected shape \[4,64,16\]"),
        ((x, ids, w._replace(down_scales=w.down_scales.float())), r"down_scales: expected dtype torch.uint8"),
    ]
    for fn in fns:
        for args, msg in bad:
            with pytest.raises(ValueError, match=msg):
                fn(*args)
        with pytest.raises(ValueError, match=r"out: expected shape \[3,2,64\]"):
            fn(x, ids, w, out=torch.empty(T, K, H + 1))
        with pytest.raises(ValueError, match=r"out: expected dtype torch.float32"):
            fn(x, ids, w, out=torch.empty(T, K, H, dtype=torch.bfloat16))
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
        ref = moe_expert_outputs_reference(x, ids, w)
        out = torch.full((T, K, H), float("nan"), dtype=dtype)
        got = moe_expert_outputs_triton(x, ids, w, out=out)
        assert got is out and not got.isnan().any()
        assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2), (T, dtype)
        assert (got[ids == -1] == 0).all()
    with use_backend("triton"):  # the dispatcher picks it when forced
        x = torch.randn(3, H, generator=gen)
        ids = torch.tensor([[1], [-1], [1]])
        assert _rel(moe_expert_outputs(x, ids, w), moe_expert_outputs_reference(x, ids, w)) < 1e-5


@pytest.mark.parametrize("act", ["situ", "situ_nocap", "situ_tight"])
def test_triton_situ_matches_reference_interpreted(act):
    """SiTU in the gate/up kernel (exp-based tanh and σ): normal inputs, then gates and ups far past the caps."""
    pytest.importorskip("triton")
    from expertmesh.kernels.moe.triton_moe import moe_expert_outputs as moe_expert_outputs_triton

    activation = ACTS[act]
    E, H, I = 4, 64, 64
    w = _weights(E, H, I, seed=34)
    gen = torch.Generator().manual_seed(35)
    ids_a = torch.tensor([[0, 2], [2, -1], [3, 0], [0, 3], [2, 0]])
    ids_b = torch.full((19, 1), 1, dtype=torch.int64)
    cases = [(ids_a, torch.float32, 1.0), (ids_a, torch.float32, 300.0)]
    if act == "situ":  # the published caps: bf16, two M tiles, too
        cases += [(ids_a, torch.bfloat16, 1.0), (ids_b, torch.bfloat16, 300.0)]
    for ids, dtype, scale in cases:
        T, K = ids.shape
        x = (torch.randn(T, H, generator=gen) * scale).to(dtype)
        ref = moe_expert_outputs_reference(x, ids, w, activation=activation)
        out = torch.full((T, K, H), float("nan"), dtype=dtype)
        got = moe_expert_outputs_triton(x, ids, w, out=out, activation=activation)
        assert got is out and got.isfinite().all()
        assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2), (T, dtype, scale)
        assert (got[ids == -1] == 0).all()
        assert _rel(moe_expert_outputs_reference(x, ids, w), got) > 1e-2  # the activation is not ignored
    with use_backend("triton"):  # the dispatcher passes it through
        x = torch.randn(3, H, generator=gen)
        ids = torch.tensor([[1], [-1], [1]])
        assert (
            _rel(
                moe_expert_outputs(x, ids, w, activation=activation),
                moe_expert_outputs_reference(x, ids, w, activation=activation),
            )
            < 1e-5
        )
