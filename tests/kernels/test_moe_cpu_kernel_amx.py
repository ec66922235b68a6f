"""The CPU MXFP4 kernel's tile-unit path (isa amx, kernels/moe/cpu/mxfp4_moe.cpp): the weights decoded to bf16 with
their scale folded in, sums in AMX-BF16's order. Held bit for bit to the PyTorch spelling of that order
(`kernels.linear.naive.matmul_in_tile_order_fp32`, `kernels.moe.naive.moe_expert_outputs_tile_order`) on both of
its routes — the tile unit for experts with 9 or more rows, the vector units emulating it for 1-8 — on inputs
whose products cancel, where the vector paths' order gives other bits (so the checks can fail); a token's rows
are the same alone and in any batch, at any thread count; `isa="auto"` runs it for bf16 activations where the CPU
and Linux offer AMX, EXPERTMESH_CPU_MOE_ISA overrides. Skipped where the extension cannot be built or the CPU has
no AMX-BF16."""

from __future__ import annotations

import pytest
import torch

from expertmesh.kernels.activation import SWIGLU, GatedActivation
from expertmesh.kernels.linear.naive import matmul_in_tile_order_fp32
from expertmesh.kernels.moe import MXFP4Experts, cpu_kernel
from expertmesh.kernels.moe.naive import moe_expert_outputs_tile_order
from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

ACTS = {"swiglu": SWIGLU, "situ": GatedActivation(kind="situ", beta=4.0, linear_beta=25.0)}


@pytest.fixture(scope="module", autouse=True)
def amx():
    if not cpu_kernel.enabled() or cpu_kernel.load() is None:
        pytest.skip(f"the fused CPU kernel is off or cannot be built here: {cpu_kernel.build_error}")
    if not cpu_kernel.amx_runs():
        pytest.skip("this CPU (or its operating system) offers no AMX-BF16")


def _cancelling(M: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 rows whose magnitudes span 2^±8 and whose sums cancel: the order of the adds shows in the bits."""
    x = torch.randn(M, K, generator=gen) * torch.exp2(torch.randint(-8, 9, (M, K), generator=gen).float())
    return x.bfloat16()


def _weights(E: int, H: int, I: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = quantize_mxfp4(torch.randn(E, 2 * I, H, generator=gen) * torch.exp(torch.randn(E, 2 * I, 1, generator=gen)))
    w2 = quantize_mxfp4(torch.randn(E, H, I, generator=gen) * I**-0.5)
    return MXFP4Experts(*w13, *w2)


@pytest.mark.parametrize(
    "M,N,K", [(1, 48, 64), (2, 33, 96), (5, 70, 256), (8, 16, 32), (9, 40, 128), (17, 21, 512), (70, 35, 64)]
)
def test_dense_gemm_is_the_tile_order_bit_for_bit(M, N, K):
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    blocks = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)  # every code, -0 included
    scales = torch.randint(118, 136, (N, K // 32), dtype=torch.uint8, generator=gen)
    x = _cancelling(M, K, gen)
    got = cpu_kernel.mxfp4_linear(x.float(), blocks, scales, isa="amx")
    want = matmul_in_tile_order_fp32(x, dequantize_mxfp4(blocks, scales, torch.bfloat16))
    assert torch.equal(got, want)
    vector_order = cpu_kernel.mxfp4_linear(x.float(), blocks, scales, isa=cpu_kernel.best_isa())
    assert not torch.equal(vector_order, want), "inputs too easy: the vector paths' order gives the same bits"


@pytest.mark.parametrize("act", list(ACTS))
def test_moe_is_its_tile_order_reference_bit_for_bit(act):
    """Experts with 1, 2 and 8 rows (vector route), 9+ and 17+ rows (tile route, one and two groups of 16) in one
    call; slots off the shard are 0."""
    T, Kt, E, H, I = 60, 4, 14, 128, 64
    gen = torch.Generator().manual_seed(7)
    w = _weights(E, H, I, seed=3)
    x = _cancelling(T, H, gen)
    ids = torch.stack([torch.randperm(E - 7, generator=gen)[:Kt] + 5 for _ in range(T)])  # experts 5-11 at random
    ids[torch.rand(T, Kt, generator=gen) < 0.3] = -1
    ids[:54, 0] = torch.arange(54) % 3  # experts 0-2: 18 rows each
    ids[55, 1], ids[56, 1], ids[57, 1] = 3, 4, 4  # expert 3: one row, expert 4: two
    ids[:8, 2], ids[8:17, 2] = 12, 13  # expert 12: 8 rows, expert 13: 9
    rows = torch.bincount(ids[ids >= 0], minlength=E)
    assert rows[0] > 16 and rows[3] == 1 and rows[4] == 2 and rows[12] == 8 and rows[13] == 9, rows
    activation = ACTS[act]
    got = cpu_kernel.moe_expert_outputs(x, ids, w, isa="amx", activation=activation, fp32_output=True)
    want = moe_expert_outputs_tile_order(x, ids, w, activation=activation)
    assert torch.equal(got, want)
    assert torch.equal(got[ids < 0], torch.zeros_like(got[ids < 0]))
    other = cpu_kernel.moe_expert_outputs(x, ids, w, isa=cpu_kernel.best_isa(), activation=activation, fp32_output=True)
    assert not torch.equal(other, want)


def test_a_tokens_rows_are_the_same_alone_in_any_batch_and_thread_count():
    E, Kt, H, I = 6, 4, 256, 128
    w = _weights(E, H, I, seed=5)
    gen = torch.Generator().manual_seed(13)
    probes = _cancelling(3, H, gen)
    probe_ids = torch.randint(-1, E, (3, Kt), generator=gen)
    alone = [
        cpu_kernel.moe_expert_outputs(probes[i : i + 1], probe_ids[i : i + 1], w, isa="amx", fp32_output=True)[0]
        for i in range(3)
    ]
    threads = torch.get_num_threads()
    try:
        for n_threads, n_other in ((threads, 1), (threads, 7), (1, 40), (3, 90), (threads, 90)):
            torch.set_num_threads(n_threads)
            others = _cancelling(n_other, H, gen)
            other_ids = torch.randint(-1, E, (n_other, Kt), generator=gen)
            for i in range(3):
                pos = int(torch.randint(0, n_other + 1, (1,), generator=gen))
                x = torch.cat([others[:pos], probes[i : i + 1], others[pos:]])
                ids = torch.cat([other_ids[:pos], probe_ids[i : i + 1], other_ids[pos:]])
                got = cpu_kernel.moe_expert_outputs(x, ids, w, isa="amx", fp32_output=True)[pos]
                assert torch.equal(got, alone[i]), (n_threads, n_other, i)
    finally:
        torch.set_num_threads(threads)


def test_auto_runs_amx_for_bf16_and_the_environment_chooses(monkeypatch):
    T, Kt, E, H, I = 5, 2, 4, 64, 32
    w = _weights(E, H, I, seed=9)
    gen = torch.Generator().manual_seed(2)
    x = _cancelling(T, H, gen)
    ids = torch.randint(0, E, (T, Kt), generator=gen)
    amx = cpu_kernel.moe_expert_outputs(x, ids, w, isa="amx", fp32_output=True)
    vector = cpu_kernel.moe_expert_outputs(x, ids, w, isa=cpu_kernel.best_isa(), fp32_output=True)
    assert not torch.equal(amx, vector)
    for env, want in ((None, amx), ("avx512bf16", vector), ("amx", amx)):
        monkeypatch.setattr(cpu_kernel, "_bf16_isa", None)
        if env is None:
            monkeypatch.delenv("EXPERTMESH_CPU_MOE_ISA", raising=False)
        else:
            monkeypatch.setenv("EXPERTMESH_CPU_MOE_ISA", env)
        assert torch.equal(cpu_kernel.moe_expert_outputs(x, ids, w, fp32_output=True), want), env
    # fp32 activations keep the vector paths' order whatever the setting
    assert torch.equal(cpu_kernel.moe_expert_outputs(x.float(), ids, w, fp32_output=True), vector)
    monkeypatch.setattr(cpu_kernel, "_bf16_isa", None)
    monkeypatch.setenv("EXPERTMESH_CPU_MOE_ISA", "sse")
    with pytest.raises(ValueError, match="EXPERTMESH_CPU_MOE_ISA: expected one of"):
        cpu_kernel.moe_expert_outputs(x, ids, w)
    monkeypatch.setattr(cpu_kernel, "_bf16_isa", None)
    with pytest.raises(ValueError, match="x: isa amx takes bfloat16"):
        cpu_kernel.moe_expert_outputs(x.float(), ids, w, isa="amx")
