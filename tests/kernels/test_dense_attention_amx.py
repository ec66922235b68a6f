"""The AMX dense-attention kernel (kernels/dsa/cpu/dense_attention_amx.cpp) against fp32 attention on fresh random
inputs; a query's bits alone, in a larger call, and across prefill chunks; its use by dsa_prefill / mla_prefill
(bf16 on CPU); bad inputs."""

import pytest
import torch

from expertmesh.kernels.dsa import cpu_kernel, naive
from expertmesh.kernels.dsa.sparse import dsa_prefill, mla_prefill

pytestmark = pytest.mark.skipif(
    not cpu_kernel.dense_runs_for(torch.empty(0, dtype=torch.bfloat16)),
    reason="this CPU (or its operating system) has no AMX-BF16, or the kernel is off",
)


def _fp32_attention(q, kv, q_pos, scale, v_dim):
    """The plain math: fp32 logits, causal mask, softmax, weighted values."""
    qf, kf = q.float(), kv.float()
    logits = torch.einsum("bthd,bnd->bthn", qf, kf) * scale
    if q_pos is not None:
        future = torch.arange(kv.shape[1])[None, :] > q_pos[:, None]
        logits = logits.masked_fill(future[None, :, None, :], float("-inf"))
    return torch.einsum("bthn,bnv->bthv", logits.softmax(-1), kf[..., :v_dim])


def _inputs(gen, B, T, H, D, n):
    return torch.randn(B, T, H, D, generator=gen).bfloat16(), torch.randn(B, n, D, generator=gen).bfloat16()


@pytest.mark.parametrize(
    "B,T,H,D,V,n",
    [
        (1, 40, 16, 576, 512, 100),  # MLA's absorbed shape, a continued prefill
        (2, 9, 5, 40, 33, 9),  # rows straddle tokens; V not 64-aligned
        (1, 3, 3, 70, 64, 37),  # odd pairs of D; a short query block
        (1, 33, 1, 32, 32, 33),
    ],
)  # one head
def test_matches_fp32_attention(B, T, H, D, V, n):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + H)
    q, kv = _inputs(gen, B, T, H, D, n)
    scale = D**-0.5
    for q_pos in (torch.arange(n - T, n), None):
        got = cpu_kernel.dense_attention(q, kv, q_pos, scale, V)
        want = _fp32_attention(q, kv, q_pos, scale, V)
        assert got.dtype == torch.float32 and got.shape == want.shape
        # bf16 products are exact and summed in fp32; the softmax weights keep ~16 bits (hi + lo bf16 parts)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_querys_bits_do_not_depend_on_the_call(two_threads):
    """Alone, inside a larger call at any position, and with the prompt prefilled in chunks: the same bits."""
    gen = torch.Generator().manual_seed(7)
    T, H, D, V = 70, 16, 576, 512
    q, kv = _inputs(gen, 1, T, H, D, T)
    pos = torch.arange(T)
    whole = cpu_kernel.dense_attention(q, kv, pos, 0.05, V)
    for t in (0, 31, 69):
        alone = cpu_kernel.dense_attention(q[:, t : t + 1], kv[:, : t + 1], pos[t : t + 1], 0.05, V)
        assert torch.equal(alone[0, 0], whole[0, t]), t
    chunks = torch.cat(
        [cpu_kernel.dense_attention(q[:, a:b], kv[:, :b], pos[a:b], 0.05, V) for a, b in ((0, 16), (16, 50), (50, 70))],
        dim=1,
    )
    assert torch.equal(chunks, whole)
    torch.set_num_threads(1)
    one_thread = cpu_kernel.dense_attention(q, kv, pos, 0.05, V)
    torch.set_num_threads(2)
    assert torch.equal(one_thread, whole)


def test_dsa_and_mla_prefill_use_it_for_bf16():
    """dsa_prefill (top-k covering some queries' contexts, not others') and mla_prefill on bf16 CPU inputs agree
    with the fp32 reference, and the indices of the densely attended queries are their visible positions."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, D, V, Hi, Di, n, topk = 1, 24, 4, 96, 64, 2, 32, 40, 25
    q, kv = _inputs(gen, B, T, H, D, n)
    iq = torch.randn(B, T, Hi, Di, generator=gen).bfloat16()
    ik = torch.randn(B, n, Di, generator=gen).bfloat16()
    iw = torch.randn(B, T, Hi, generator=gen)
    o, idx = dsa_prefill(q, kv, iq, ik, iw, topk, causal=True, scale=0.1, v_dim=V, return_indices=True)
    ref_o, ref_idx = naive.dsa_attention_reference(
        q.float(), kv.float(), iq.float(), ik.float(), iw, topk, causal=True, scale=0.1, v_dim=V, return_indices=True
    )
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(o.float(), ref_o, rtol=1 / 64, atol=1e-2)
    dense_rows = topk - (n - T)  # queries 0 .. 8 see <= 25 positions
    want = _fp32_attention(q, kv, torch.arange(n - T, n), 0.1, V)
    assert torch.equal(
        o[:, :dense_rows],
        cpu_kernel.dense_attention(
            q[:, :dense_rows], kv[:, : n - T + dense_rows], torch.arange(n - T, n - T + dense_rows), 0.1, V
        ).bfloat16(),
    )
    torch.testing.assert_close(mla_prefill(q, kv, scale=0.1, v_dim=V).float(), want, rtol=1 / 64, atol=1e-2)


def test_bad_inputs_are_refused_naming_them():
    gen = torch.Generator().manual_seed(1)
    q, kv = _inputs(gen, 1, 4, 2, 32, 4)
    ops = cpu_kernel.DENSE_EXTENSION.load()
    out = torch.empty(1, 4, 2, 32)
    with pytest.raises(RuntimeError, match="kv: expected"):
        ops.dense_attention(q, kv[:, :, :16].contiguous(), torch.arange(4), 0.1, out)
    with pytest.raises(RuntimeError, match="q_pos"):
        ops.dense_attention(q, kv, torch.arange(3), 0.1, out)
    with pytest.raises(RuntimeError, match="q: expected"):
        ops.dense_attention(q.float(), kv, torch.arange(4), 0.1, out)
    with pytest.raises(RuntimeError, match="q_pos: position -1"):
        ops.dense_attention(q, kv, torch.arange(4) - 1, 0.1, out)
