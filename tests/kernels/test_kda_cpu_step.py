"""KDA's one-token recurrence as one C++ op (kernels/kda/cpu_kernel.py) against the reference recurrence
(naive.kda_recurrent_reference) and the PyTorch recurrent form on fresh random inputs, bitwise row invariance
(a sequence alone vs inside a batch, 1 vs 2 threads), a speculative verify's rows equal to its decode calls,
the dispatcher's choice, and bad inputs."""

from __future__ import annotations

import pytest
import torch

from expertmesh.kernels.kda import cpu_kernel as kda_cpu
from expertmesh.kernels.kda import (
    fused_recurrent_kda,
    fused_recurrent_kda_torch,
    kda_recurrent_reference,
    verify_recurrent_kda,
)

pytestmark = pytest.mark.skipif(not kda_cpu.built(), reason=f"kernel not built ({kda_cpu.EXTENSION.build_error})")


def inputs(B: int, H: int, K: int, V: int, seed: int, dtype=torch.float32, T: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, generator=g).to(dtype)
    gate = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=g))  # K3's lower-bounded gate, fp32
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g)).to(dtype)
    state = torch.randn(B, H, K, V, generator=g)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize(
    ("B", "H", "K", "V", "dtype"), [(1, 16, 128, 128, torch.bfloat16), (3, 2, 24, 8, torch.float32)]
)
def test_matches_the_reference_and_the_pytorch_form(B, H, K, V, dtype):
    q, k, v, g, beta, state = inputs(B, H, K, V, seed=B * 10 + H, dtype=dtype)
    o, final = kda_cpu.fused_recurrent_step(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_ref, final_ref = kda_recurrent_reference(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_pt, final_pt = fused_recurrent_kda_torch(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert o.dtype == dtype and o.shape == (B, 1, H, V) and final.shape == (B, H, K, V)
    for ref_o, ref_s in ((o_ref, final_ref), (o_pt, final_pt)):
        torch.testing.assert_close(final, ref_s.float(), rtol=1e-5, atol=1e-5)
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(o.float(), ref_o.float(), rtol=tol, atol=tol)
    assert not torch.equal(final, state)  # the state moved
    _, none = kda_cpu.fused_recurrent_step(q, k, v, g, beta, initial_state=state)
    assert none is None
    zero_o, _ = kda_cpu.fused_recurrent_step(q, k, v, g, beta)  # no initial state: zeros
    ref0, _ = kda_recurrent_reference(q, k, v, g, beta)
    torch.testing.assert_close(zero_o.float(), ref0.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_sequence_has_the_same_bits_alone_and_inside_a_batch(threads):
    q, k, v, g, beta, state = inputs(5, 4, 32, 32, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o, final = kda_cpu.fused_recurrent_step(q, k, v, g, beta, initial_state=state, output_final_state=True)
        for b in (0, 2, 4):
            one = [x[b : b + 1] for x in (q, k, v, g, beta, state)]
            o1, f1 = kda_cpu.fused_recurrent_step(*one[:5], initial_state=one[5], output_final_state=True)
            assert torch.equal(o1[0], o[b]) and torch.equal(f1[0], final[b]), b
    finally:
        torch.set_num_threads(before)


def test_the_dispatcher_takes_it_for_one_token_and_verify_rows_are_its_calls(monkeypatch):
    q, k, v, g, beta, state = inputs(1, 2, 16, 16, seed=5, dtype=torch.bfloat16)
    got = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    want = kda_cpu.fused_recurrent_step(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a verify of 3 rows: each row what a decode call gives from the state after the row before, bit for bit
    q3, k3, v3, g3, b3, _ = inputs(1, 2, 16, 16, seed=6, dtype=torch.bfloat16, T=3)
    o, states = verify_recurrent_kda(q3, k3, v3, g3, b3, state[0])
    s = state
    for j in range(3):
        t = slice(j, j + 1)
        oj, s = kda_cpu.fused_recurrent_step(
            q3[:, t], k3[:, t], v3[:, t], g3[:, t], b3[:, t], initial_state=s, output_final_state=True
        )
        assert torch.equal(o[:, t], oj) and torch.equal(states[j], s[0]), j
    monkeypatch.setenv("EXPERTMESH_CPU_KDA_KERNEL", "0")
    kda_cpu.refresh()
    try:
        off = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
        pt = fused_recurrent_kda_torch(q, k, v, g, beta, initial_state=state, output_final_state=True)
        assert torch.equal(off[0], pt[0]) and torch.equal(off[1], pt[1])
    finally:
        monkeypatch.delenv("EXPERTMESH_CPU_KDA_KERNEL")
        kda_cpu.refresh()


def test_bad_inputs_are_named():
    q, k, v, g, beta, state = inputs(1, 2, 16, 16, seed=8)
    with pytest.raises(ValueError, match="q: expected one token"):
        kda_cpu.fused_recurrent_step(*inputs(1, 2, 16, 16, seed=8, T=2)[:5])
    with pytest.raises(ValueError, match="beta"):
        kda_cpu.fused_recurrent_step(q, k, v, g, beta[..., :1], initial_state=state)
    with pytest.raises(ValueError, match="initial_state"):
        kda_cpu.fused_recurrent_step(q, k, v, g, beta, initial_state=state[:, :1])
    assert torch.isfinite(kda_cpu.fused_recurrent_step(q, k, v, g, beta, initial_state=state)[0]).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prompt_is_its_decode_steps_bit_for_bit_and_matches_the_reference(threads):
    """recurrent_steps_ (the CPU prefill): T tokens in one call give the bits of T one-token calls, whatever the
    thread count, and agree with the reference recurrence."""
    T, H, K, V = 37, 3, 32, 24
    q, k, v, g, beta, state = inputs(1, H, K, V, seed=11, dtype=torch.bfloat16, T=T)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        s_all = state[0].clone()
        o_all = kda_cpu.recurrent_steps_(q[0], k[0], v[0], g[0], beta[0], s_all)
        s_one, outs = state[0].clone(), []
        for t in range(T):
            outs.append(kda_cpu.recurrent_step_(q[0, t], k[0, t], v[0, t], g[0, t], beta[0, t], s_one))
    finally:
        torch.set_num_threads(before)
    assert o_all.dtype == torch.bfloat16 and o_all.shape == (T, H, V)
    assert torch.equal(o_all, torch.stack(outs)) and torch.equal(s_all, s_one)
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, initial_state=state, output_final_state=True)
    torch.testing.assert_close(s_all, s_ref[0].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o_all.float(), o_ref[0].float(), rtol=2**-7, atol=2**-7)
    assert not torch.equal(s_all, state[0])


def test_the_model_prefill_of_a_prompt_is_its_decode_steps_bit_for_bit():
    """A KDA layer fed a prompt in one step, in two uneven steps, or token by token: the same output rows and
    final state, bit for bit (the CPU prefill runs the decode step's recurrence)."""
    from expertmesh.model.attention import KDAttention
    from expertmesh.model.cache import Segment, SequenceCache
    from expertmesh.model.config import preset

    if not kda_cpu.available():
        pytest.skip("EXPERTMESH_CPU_KDA_KERNEL turns the kernel off: prompts take the chunked form")
    cfg = preset("tiny")
    torch.manual_seed(0)
    attn = KDAttention(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(13, cfg.hidden_size)

    @torch.no_grad()
    def run(cuts):
        cache = SequenceCache(layers=[attn.new_cache()])
        outs, start = [], 0
        for n in cuts:
            outs.append(attn(x[start : start + n], [Segment(0, n, cache)], 0))
            cache.length += n
            start += n
        return torch.cat(outs), cache.layers[0].state

    o1, s1 = run([13])
    for cuts in ([5, 8], [1] * 13):
        o2, s2 = run(cuts)
        assert torch.equal(o1, o2) and torch.equal(s1, s2), cuts


def test_bad_prompt_inputs_are_named():
    q, k, v, g, beta, state = inputs(1, 2, 16, 16, seed=9, T=4)
    with pytest.raises(ValueError, match="q: expected"):
        kda_cpu.recurrent_steps_(q[0, 0], k[0], v[0], g[0], beta[0], state[0].clone())
    with pytest.raises(ValueError, match="beta"):
        kda_cpu.recurrent_steps_(q[0], k[0], v[0], g[0], beta[0, :2], state[0].clone())
    with pytest.raises(ValueError, match="state"):
        kda_cpu.recurrent_steps_(q[0], k[0], v[0], g[0], beta[0], state[0].double())
