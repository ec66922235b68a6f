"""A speculative verify's KDA rows in one call (kernels/kda fused_recurrent_kda_states, the PyTorch path) against
the plain path — one one-token `fused_recurrent_kda` call per row, what decode steps compute — on fresh random
inputs: outputs and every kept state equal bit for bit (greedy speculation's identical texts rest on it)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.kernels.kda import cpu_kernel as kda_cpu
from expertmesh.kernels.kda import fused_recurrent_kda_torch, verify_recurrent_kda, verify_recurrent_kda_rows
from expertmesh.kernels.kda.fused_recurrent import fused_recurrent_kda_states


@pytest.fixture(autouse=True)
def _pytorch_recurrence(monkeypatch):
    monkeypatch.setenv("EXPERTMESH_CPU_KDA_KERNEL", "0")
    kda_cpu.refresh()
    yield
    monkeypatch.delenv("EXPERTMESH_CPU_KDA_KERNEL")
    kda_cpu.refresh()


def inputs(T: int, H: int, K: int, V: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=g).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g), dim=-1).to(dtype)
    v = torch.randn(1, T, H, V, generator=g).to(dtype)
    gate = -5 * torch.sigmoid(torch.randn(1, T, H, K, generator=g))  # K3's lower-bounded gate, fp32
    beta = torch.sigmoid(torch.randn(1, T, H, generator=g)).to(dtype)
    state = torch.randn(H, K, V, generator=g)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize(("T", "H", "K", "V"), [(1, 2, 16, 16), (4, 4, 32, 32), (9, 3, 24, 8)])
def test_one_call_equals_one_token_calls(T, H, K, V):
    args = inputs(T, H, K, V, seed=T * 100 + H)
    o, states = fused_recurrent_kda_states(*args)
    o_ref, states_ref = verify_recurrent_kda_rows(*args)
    assert o.dtype == o_ref.dtype and o.shape == (1, T, H, V)
    assert torch.equal(o, o_ref)
    assert len(states) == len(states_ref) == T
    for j, (a, b) in enumerate(zip(states, states_ref)):
        assert torch.equal(a, b), f"state after row {j}"
    # and the dispatcher (PyTorch here) takes the one-call path with the same result
    o2, states2 = verify_recurrent_kda(*args)
    assert torch.equal(o2, o) and all(torch.equal(a, b) for a, b in zip(states2, states))


def test_the_rows_path_is_the_decode_call():
    """The reference itself: row j equals a one-token decode from the state after row j-1 (and the states are not
    all one tensor: a rollback picks a distinct one per position)."""
    q, k, v, g, beta, state = inputs(3, 2, 16, 16, seed=7)
    o, states = verify_recurrent_kda_rows(q, k, v, g, beta, state)
    out1, s1 = fused_recurrent_kda_torch(
        q[:, 1:2], k[:, 1:2], v[:, 1:2], g[:, 1:2], beta[:, 1:2], initial_state=states[0][None], output_final_state=True
    )
    assert torch.equal(o[:, 1:2], out1) and torch.equal(states[1], s1[0])
    assert not torch.equal(states[0], states[2])


def test_more_than_one_sequence_is_refused():
    q, k, v, g, beta, state = inputs(2, 2, 16, 16, seed=1)
    two = [torch.cat([x, x]) for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="one sequence"):
        fused_recurrent_kda_states(*two, state)
