"""The fused CPU MXFP4 kernels (kernels/moe/cpu/mxfp4_moe.cpp) against the references: exact decode of every code
and scale byte, fp32-rounding agreement with the naive MoE and dense paths, the same bits on every ISA path,
batch and thread-count invariance, the dispatcher's choice and the fallback when the build fails.

Tolerances: the kernel reduces each dot product in its own fixed order (16 lanes over element pairs, per-block
scale), not the BLAS order of the reference, so results agree to fp32 rounding, not bitwise: per element
|ours − exact| ≤ 1e-5 · Σ_k |w_k x_k| (dense), and relative Frobenius error < 1e-5 (MoE, fp32; 1e-2 bf16 output).
Decoding is checked bitwise (one-hot activations make each output one dequantised weight). The activation between
the GEMMs (SwiGLU, or SiTU, with the kernel's own vector exp / tanh) is checked the same way, at normal and
saturated gates, and on its own against the float64 function (`gated_activation`).
Skipped (not failed) only where the extension cannot be built on this machine."""

from __future__ import annotations

import logging

import pytest
import torch

from expertmesh.kernels.activation import SWIGLU, GatedActivation
from expertmesh.kernels.backend import use_backend
from expertmesh.kernels.moe import (
    MXFP4Experts,
    cpu_activation_runs,
    cpu_kernel,
    moe_expert_outputs,
    moe_expert_outputs_cpu,
    moe_expert_outputs_grouped,
    moe_expert_outputs_reference,
)
from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4


@pytest.fixture(scope="module", autouse=True)
def built():
    if not cpu_kernel.enabled():
        pytest.skip("EXPERTMESH_CPU_KERNEL turns the fused CPU kernel off")
    if cpu_kernel.load() is None:
        pytest.skip(f"the fused CPU kernel cannot be built here: {cpu_kernel.build_error}")


def _isas() -> list[str]:
    """portable always; avx2 / avx512 / avx512bf16 where this CPU has them (the best one is what auto picks)."""
    order = ["portable", "avx2", "avx512", "avx512bf16"]
    return order[: order.index(cpu_kernel.best_isa()) + 1]


def _weights(E: int, H: int, I: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = quantize_mxfp4(torch.randn(E, 2 * I, H, generator=gen) * H**-0.5)
    w2 = quantize_mxfp4(torch.randn(E, H, I, generator=gen) * I**-0.5)
    return MXFP4Experts(*w13, *w2)


def _random_mxfp4(N: int, K: int, gen: torch.Generator, lo: int = 112, hi: int = 136):
    """Random bytes (every code, −0 included) and scales in [lo, hi)."""
    blocks = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(lo, hi, (N, K // 32), dtype=torch.uint8, generator=gen)
    return blocks, scales


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_decode_is_exact_for_every_code_and_scale_byte():
    """One-hot activations: output n is weight (n, k) itself, bitwise (−0 comes out +0), for all 256 scale bytes:
    subnormal 2^-127, 2^127 (6 · 2^127 overflows to inf, as in the reference) and 0xFF (NaN: as in any matrix
    product, a NaN weight makes its whole output NaN, whatever x is there)."""
    K = 64
    codes = torch.arange(256, dtype=torch.uint8)
    blocks = codes.repeat_interleave(K // 2).reshape(256, K // 2)  # row n: byte n repeated
    blocks = blocks.roll(1, 1) ^ torch.arange(K // 2, dtype=torch.uint8)  # every code in every position
    scales = torch.stack([codes, codes + 128], dim=1).contiguous()  # [256, 2]: all bytes, both blocks
    want = dequantize_mxfp4(blocks, scales, torch.float32) + 0.0  # [256, K]; + 0.0: −0 → +0
    want[(scales == 0xFF).any(1)] = float("nan")
    eye = torch.eye(K)
    for isa in _isas():
        got = cpu_kernel.mxfp4_linear(eye, blocks, scales, isa=isa).T  # [256, K]
        assert torch.equal(got.isnan(), want.isnan()), isa
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)), isa
    assert want.isinf().any() and want.isnan().any() and (want.abs() == 2.0**-128).any()


@pytest.mark.parametrize("M,N,K", [(1, 1, 32), (1, 37, 96), (3, 64, 64), (5, 33, 160), (9, 7, 1024)])
def test_dense_matches_exact_within_fp32_rounding(M, N, K):
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    blocks, scales = _random_mxfp4(N, K, gen)
    x = torch.randn(M, K, generator=gen)
    w = dequantize_mxfp4(blocks, scales, torch.float64)
    exact = x.double() @ w.T
    bound = 1e-5 * (x.double().abs() @ w.abs().T)
    outs = [cpu_kernel.mxfp4_linear(x, blocks, scales, isa=isa) for isa in _isas()]
    for got in outs:
        assert got.dtype == torch.float32 and got.shape == (M, N)
        assert ((got.double() - exact).abs() <= bound).all()
        assert torch.equal(got, outs[0])  # same bits on every ISA path
    # rows alone = rows in the batch; bf16 input is the same computation on the widened values
    for m in range(M):
        assert torch.equal(cpu_kernel.mxfp4_linear(x[m : m + 1], blocks, scales), outs[0][m : m + 1])
    xb = x.bfloat16()
    assert torch.equal(
        cpu_kernel.mxfp4_linear(xb, blocks, scales), cpu_kernel.mxfp4_linear(xb.float(), blocks, scales).bfloat16()
    )


def test_nan_scale_block_poisons_only_its_rows():
    gen = torch.Generator().manual_seed(3)
    blocks, scales = _random_mxfp4(9, 128, gen)
    scales[4, 2] = 0xFF
    x = torch.randn(2, 128, generator=gen)
    got = cpu_kernel.mxfp4_linear(x, blocks, scales)
    assert got[:, 4].isnan().all()
    assert not got[:, [0, 1, 2, 3, 5, 6, 7, 8]].isnan().any()


MOE_CASES = {  # name: (T, K, E, H, I, p_skip)
    "single_token": (1, 4, 8, 128, 64, 0.0),
    "odd": (7, 3, 5, 96, 32, 0.2),
    "skips": (13, 4, 8, 64, 96, 0.4),
    "many_tokens": (70, 2, 3, 64, 32, 0.1),
}


ACTS = {  # name: activation (published K3 caps; β_lin = 0: up uncapped; tight caps that saturate at |g| ~ 1)
    "swiglu": SWIGLU,
    "situ": GatedActivation("situ", beta=4.0, linear_beta=25.0),
    "situ_nocap": GatedActivation("situ", beta=4.0, linear_beta=0.0),
    "situ_tight": GatedActivation("situ", beta=0.5, linear_beta=0.25),
}


# SwiGLU and SiTU with the published caps on every case and dtype; the other SiTU variants on two cases, fp32
MOE_PARAMS = [
    pytest.param(c, d, a, id=f"{str(d)[6:]}-{c}-{a}")
    for a in ACTS
    for d in (torch.float32, torch.bfloat16)
    for c in MOE_CASES
    if a in ("swiglu", "situ") or (d == torch.float32 and c in ("odd", "skips"))
]


@pytest.mark.parametrize("case,dtype,act", MOE_PARAMS)
def test_moe_matches_reference(case, dtype, act):
    T, K, E, H, I, p_skip = MOE_CASES[case]
    activation = ACTS[act]
    gen = torch.Generator().manual_seed(200 + list(MOE_CASES).index(case))
    w = _weights(E, H, I, seed=len(case))
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.randint(0, E, (T, K), generator=gen)
    ids[torch.rand(T, K, generator=gen) < p_skip] = -1
    ref = moe_expert_outputs_reference(x, ids, w, activation=activation)
    if act != "swiglu":  # SiTU is not SwiGLU
        assert _rel(moe_expert_outputs_reference(x, ids, w), ref) > 1e-2
    outs = []
    for isa in _isas():
        out = torch.full((T, K, H), float("nan"), dtype=dtype)  # poisoned: every element written
        got = moe_expert_outputs_cpu(x, ids, w, out=out, isa=isa, activation=activation)
        assert got is out and got.dtype == dtype
        assert not got.isnan().any()
        assert (got[ids == -1] == 0).all() and (got[ids >= 0].abs().sum(-1) > 0).all()
        assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2), isa
        outs.append(got)
    for got in outs[1:]:
        assert torch.equal(got, outs[0])  # same bits on every ISA path


@pytest.mark.parametrize("act", ["situ", "situ_nocap"])
def test_moe_situ_saturated_gates_match_reference(act):
    """Gates and ups ≈ 300 (|g| ≫ β = 4, |u| ≫ β_lin = 25): tanh at ±1, σ at 0 / 1 (exp(-g) = inf below -88)."""
    T, K, E, H, I = 12, 2, 3, 64, 64
    activation = ACTS[act]
    gen = torch.Generator().manual_seed(31)
    w = _weights(E, H, I, seed=30)
    x = torch.randn(T, H, generator=gen) * 300
    ids = torch.randint(0, E, (T, K), generator=gen)
    gu = torch.einsum("eih,th->tei", dequantize_mxfp4(w[0], w[1], torch.float64), x.double())
    g, u = gu[..., :I], gu[..., I:]
    assert (g.abs() > 40).float().mean() > 0.8 and (g < -100).any() and (g > 100).any()
    assert (u.abs() > 100).float().mean() > 0.6
    ref = moe_expert_outputs_reference(x, ids, w, activation=activation)
    outs = [moe_expert_outputs_cpu(x, ids, w, isa=isa, activation=activation) for isa in _isas()]
    for got in outs:
        assert got.isfinite().all()
        assert _rel(got, ref) < 1e-5
        assert torch.equal(got, outs[0])
    assert _rel(moe_expert_outputs_reference(x, ids, w), ref) > 0.5  # SwiGLU is uncapped: far apart


@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_moe_batch_and_thread_invariance_bitwise(act):
    """A token's rows are bitwise the same alone, in batches of 1..64 other tokens, and with 1, 2 or 3 threads."""
    E, K, H, I = 8, 4, 256, 128
    w = _weights(E, H, I, seed=5)
    gen = torch.Generator().manual_seed(13)
    activation, scale = ACTS[act], (8.0 if act == "situ" else 1.0)  # × 8: gates on both sides of β
    probes = torch.randn(3, H, generator=gen) * scale
    probe_ids = torch.randint(-1, E, (3, K), generator=gen)
    alone = [
        moe_expert_outputs_cpu(probes[i : i + 1], probe_ids[i : i + 1], w, activation=activation)[0] for i in range(3)
    ]
    threads = torch.get_num_threads()
    try:
        for n_threads, n_other in ((threads, 1), (threads, 3), (1, 17), (3, 64), (threads, 64)):
            torch.set_num_threads(n_threads)
            others = torch.randn(n_other, H, generator=gen) * scale
            other_ids = torch.randint(-1, E, (n_other, K), generator=gen)
            for i in range(3):
                pos = int(torch.randint(0, n_other + 1, (1,), generator=gen))
                x = torch.cat([others[:pos], probes[i : i + 1], others[pos:]])
                ids = torch.cat([other_ids[:pos], probe_ids[i : i + 1], other_ids[pos:]])
                got = moe_expert_outputs_cpu(x, ids, w, activation=activation)[pos]
                assert torch.equal(got, alone[i]), (n_threads, n_other, i)
    finally:
        torch.set_num_threads(threads)


def test_dispatcher_uses_the_kernel_on_cpu_and_the_switches_turn_it_off(monkeypatch):
    T, K, E, H, I = 6, 2, 4, 64, 32
    w = _weights(E, H, I, seed=8)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(-1, E, (T, K), generator=gen)
    fused = moe_expert_outputs_cpu(x, ids, w)
    grouped = moe_expert_outputs_grouped(x, ids, w)
    assert not torch.equal(fused, grouped)  # different reduction orders: a check that can tell them apart
    assert torch.equal(moe_expert_outputs(x, ids, w), fused)
    with use_backend("torch"):
        assert torch.equal(moe_expert_outputs(x, ids, w), grouped)
    situ = ACTS["situ"]  # the activation passes through
    fused_situ = moe_expert_outputs_cpu(x, ids, w, activation=situ)
    assert torch.equal(moe_expert_outputs(x, ids, w, activation=situ), fused_situ)
    with use_backend("torch"):
        assert torch.equal(
            moe_expert_outputs(x, ids, w, activation=situ), moe_expert_outputs_grouped(x, ids, w, activation=situ)
        )
    monkeypatch.setenv("EXPERTMESH_CPU_KERNEL", "0")
    assert torch.equal(moe_expert_outputs(x, ids, w), grouped)
    assert torch.equal(
        moe_expert_outputs(x, ids, w, activation=situ), moe_expert_outputs_grouped(x, ids, w, activation=situ)
    )


def test_failed_build_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    T, _K, E, H, I = 4, 2, 3, 64, 32
    w = _weights(E, H, I, seed=10)
    x = torch.randn(T, H)
    ids = torch.tensor([[0, 1], [2, -1], [1, 0], [-1, -1]])
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    monkeypatch.setattr(cpu_kernel, "EXTENSION", "expertmesh_mxfp4_cpu_broken_test")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setattr(cpu_kernel, "_ops", None)
    monkeypatch.setattr(cpu_kernel, "build_error", None)
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert torch.equal(moe_expert_outputs(x, ids, w), moe_expert_outputs_grouped(x, ids, w))
        assert torch.equal(moe_expert_outputs(x, ids, w), moe_expert_outputs_grouped(x, ids, w))
    warnings = [r for r in caplog.records if r.name == cpu_kernel.__name__]
    assert len(warnings) == 1 and "PyTorch path" in warnings[0].getMessage()
    assert cpu_kernel.build_error and not cpu_kernel.available()
    with pytest.raises(RuntimeError, match="not available"):
        moe_expert_outputs_cpu(x, ids, w)


def test_bad_inputs_raise_value_error_naming_the_tensor():
    w = _weights(2, 64, 32, seed=11)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"topk_ids: expected values in \[-1, 2\)"):
        moe_expert_outputs_cpu(x, torch.full((3, 1), 2), w)
    with pytest.raises(ValueError, match=r"x: hidden size H=48"):
        moe_expert_outputs_cpu(torch.randn(3, 48), torch.zeros(3, 1, dtype=torch.int64), w)
    with pytest.raises(ValueError, match=r"x: expected last dim 64"):
        cpu_kernel.mxfp4_linear(torch.randn(2, 32), w[0][0], w[1][0])
    with pytest.raises(ValueError, match=r"isa: expected one of"):
        cpu_kernel.mxfp4_linear(x, w[0][0], w[1][0], isa="neon")
    ids = torch.zeros(3, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^activation: expected a GatedActivation, found str"):
        moe_expert_outputs_cpu(x, ids, w, activation="situ")
    # the op's own checks (the Python wrapper never sends these)
    ops, out = cpu_kernel.load(), torch.empty(3, 1, 64)
    for act, beta, lin, msg in (
        (2, 4.0, 25.0, "activation: expected 0"),
        (1, 0.0, 25.0, "beta must be > 0"),
        (1, 4.0, -1.0, "linear_beta must be >= 0"),
    ):
        with pytest.raises(RuntimeError, match=msg):
            ops.moe_expert_outputs(x, ids, *w, out, 0, act, beta, lin)  # the C++ op takes the four tensors


@pytest.mark.parametrize(
    "tokens,slots,width,experts,groups", [(1, 4, 1024, 64, 8), (37, 8, 96, 64, 8), (5, 6, 33, 16, 4)]
)
def test_group_partials_in_cpp_are_the_definitions_bits(tokens, slots, width, experts, groups):
    """The C++ group partial sums against combine.group_partials_torch, bitwise, with slots computed elsewhere
    (−1) anywhere in a row, as the exchange sends them."""
    from expertmesh.kernels.moe.combine import group_partials, group_partials_torch

    gen = torch.Generator().manual_seed(tokens * 100 + slots)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:slots].sort().values for _ in range(tokens)])
    ids[torch.rand(tokens, slots, generator=gen) < 0.3] = -1
    weights = torch.rand(tokens, slots, generator=gen)
    outputs = torch.randn(tokens, slots, width, generator=gen)
    got = group_partials(outputs, ids, weights, experts // groups, groups)
    want = group_partials_torch(outputs, ids, weights, experts // groups, groups)
    assert got.shape == want.shape and torch.equal(got, want)


def test_group_partials_refuse_unordered_ids():
    from expertmesh.kernels.moe import cpu_kernel

    with pytest.raises(RuntimeError, match="ids: expected each row's valid ids distinct and ascending"):
        cpu_kernel.group_partials(torch.randn(1, 2, 8), torch.tensor([[5, 3]]), torch.rand(1, 2), 4)


def test_bf16_activations_give_the_bits_of_their_fp32_widening():
    """bf16 x read as it is (the AVX512-BF16 tiles where the CPU has them) gives bitwise the fp32 result of x widened
    to fp32, on every ISA path, over activations of very different magnitudes."""
    E, K, H, I, T = 6, 3, 96, 64, 23
    gen = torch.Generator().manual_seed(41)
    w = _weights(E, H, I, seed=40)
    x = (torch.randn(T, H, generator=gen) * torch.exp(torch.randn(T, 1, generator=gen) * 4)).to(torch.bfloat16)
    ids = torch.randint(-1, E, (T, K), generator=gen)
    want = moe_expert_outputs_cpu(x.float(), ids, w, isa="portable")
    for isa in _isas():
        got = moe_expert_outputs_cpu(x, ids, w, isa=isa, fp32_output=True)
        assert got.dtype == torch.float32 and torch.equal(got, want), isa


def _gated_act_f64(gate: torch.Tensor, up: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """The activation in float64 from its definition (kernels/activation.py), not from any fp32 path."""
    g, u = gate.double(), up.double()
    if act.kind == "swiglu":
        return g * torch.sigmoid(g) * u
    a = act.beta * torch.tanh(g / act.beta) * torch.sigmoid(g)
    return a * (act.linear_beta * torch.tanh(u / act.linear_beta) if act.linear_beta > 0 else u)


@pytest.mark.parametrize("act", list(ACTS))
def test_vector_activation_has_the_same_bits_on_every_path_and_a_few_ulp_error(act):
    """The vector paths' exp / tanh (no libm): AVX-512, AVX2 and the scalar loop bit for bit, on gates from tiny to
    saturated (|g| up to 300: exp's overflow and underflow ends), within 4e-7 of the float64 function wherever the
    result is not itself subnormal-small; strided rows (views of one gate | up buffer) as contiguous ones."""
    activation = ACTS[act]
    gen = torch.Generator().manual_seed(41)
    I = 200  # not a multiple of 16: the vector loops' scalar tail runs too
    gate_up = torch.cat([torch.randn(16, 2 * I, generator=gen) * s for s in (1e-3, 1.0, 8.0, 40.0, 300.0)])
    gate, up = gate_up[:, :I], gate_up[:, I:]
    outs = [cpu_kernel.gated_activation(gate, up, activation, isa=isa) for isa in _isas() if isa != "avx512bf16"]
    for got in outs[1:]:
        assert torch.equal(got, outs[0])
    assert torch.equal(cpu_kernel.gated_activation(gate.contiguous(), up.contiguous(), activation), outs[0])
    want = _gated_act_f64(gate, up, activation)
    big = want.abs() > 1e-30
    rel = (outs[0].double() - want).abs()[big] / want.abs()[big]
    assert rel.max() < 4e-7, rel.max()
    assert ((outs[0].double() - want).abs()[~big] <= 1e-30).all()
    with pytest.raises(ValueError, match="up: expected the shape of gate"):
        cpu_kernel.gated_activation(gate, up[:, :-1], activation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_mlp_on_cpu_runs_the_vector_activation_row_by_row(dtype):
    """A dense MLP / shared experts on CPU (model/layers.GatedMLP): the kernel's activation, a row's bits the same
    alone or in a batch, and within fp32 rounding of the PyTorch activation (the backend forced to torch)."""
    from expertmesh.model.config import ActivationConfig
    from expertmesh.model.layers import GatedMLP

    gen = torch.Generator().manual_seed(43)
    mlp = GatedMLP(64, 96, ActivationConfig(kind="situ", beta=4.0, linear_beta=25.0)).to(dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        x = (torch.randn(9, 64, generator=gen) * 2).to(dtype)
        gate = mlp.gate(x)
        assert cpu_activation_runs(gate)
        got = mlp(x)
        for i in (0, 4, 8):
            assert torch.equal(mlp(x[i : i + 1])[0], got[i])
        with use_backend("torch"):
            assert not cpu_activation_runs(gate)
            ref = mlp(x)
    if dtype == torch.float32:
        assert not torch.equal(got, ref)  # two functions, a few ulp apart: the kernel's was taken
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(got.float(), ref.float()) < tol
