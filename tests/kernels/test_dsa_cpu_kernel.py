"""The CPU paged-attention kernel (kernels/dsa/cpu/paged_attention.cpp) against the PyTorch path on fresh random
inputs, and its batch invariance: a sequence's result is the same bits alone or among others."""

import pytest
import torch

from expertmesh.kernels.backend import use_backend
from expertmesh.kernels.dsa import cpu_kernel
from expertmesh.kernels.dsa.sparse import (
    paged_sparse_attention,
    paged_sparse_attention_torch,
    select_topk,
    visible_positions,
)

BS, NB, H, D, V = 16, 48, 4, 80, 64


@pytest.fixture(scope="module", autouse=True)
def built():
    if not cpu_kernel.available():
        pytest.skip(f"the CPU paged-attention kernel cannot be built here: {cpu_kernel.EXTENSION.build_error}")


def _case(gen, dtype, lens, topk=None):
    """Pages in a shuffled pool, ragged contexts; indices every visible position, or a top-k of random scores
    (unsorted, −1 past a short row)."""
    B = len(lens)
    kv = torch.randn(NB, BS, D, generator=gen).to(dtype)
    width = -(-max(lens) // BS)
    table = torch.stack([torch.randperm(NB, generator=gen)[:width] for _ in range(B)]).to(torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    if topk is None:
        idx = visible_positions(ctx, max(lens))
    else:
        scores = torch.randn(B, max(lens), generator=gen)
        scores.masked_fill_(torch.arange(max(lens))[None] >= ctx[:, None].long(), float("-inf"))
        idx = select_topk(scores, topk)
    q = torch.randn(B, H, D, generator=gen)
    return q, kv, table, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("topk", [None, 7])
def test_kernel_matches_the_pytorch_path(dtype, topk):
    gen = torch.Generator().manual_seed(11 if topk is None else 12)
    q, kv, table, idx = _case(gen, dtype, [37, 5, 130, 16], topk)
    got = cpu_kernel.paged_attention(q, kv, table, idx, 0.11, V)
    want = paged_sparse_attention_torch(q, kv, table, idx, 0.11, V)
    assert got.dtype == torch.float32 and got.shape == (4, H, V)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(paged_sparse_attention(q, kv, table, idx, 0.11, V), got)  # what CPU decode runs
    with use_backend("torch"):
        assert torch.equal(paged_sparse_attention(q, kv, table, idx, 0.11, V), want)  # a forced backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequences_result_does_not_depend_on_the_batch(dtype):
    gen = torch.Generator().manual_seed(13)
    q, kv, table, idx = _case(gen, dtype, [21, 140, 3, 77, 64])
    together = cpu_kernel.paged_attention(q, kv, table, idx, 0.2, V)
    for b, n in enumerate([21, 140, 3, 77, 64]):
        pages = -(-n // BS)
        alone = cpu_kernel.paged_attention(q[b : b + 1], kv, table[b : b + 1, :pages], idx[b : b + 1, :n], 0.2, V)
        assert torch.equal(alone[0], together[b]), b


def test_bad_indices_are_refused_naming_them():
    gen = torch.Generator().manual_seed(14)
    q, kv, table, idx = _case(gen, torch.float32, [20, 9])
    with pytest.raises(RuntimeError, match="indices: position 40 is past the block table's 32 entries"):
        cpu_kernel.paged_attention(q, kv, table, torch.tensor([[40], [0]]), 0.2, V)
    with pytest.raises(RuntimeError, match="indices: a row without any used position"):
        cpu_kernel.paged_attention(q, kv, table, torch.tensor([[0], [-1]]), 0.2, V)
    with pytest.raises(RuntimeError, match="block_table: block 99"):
        cpu_kernel.paged_attention(q, kv, torch.full_like(table, 99), idx, 0.2, V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_heads_result_does_not_depend_on_the_heads_beside_it(dtype):
    """Heads go through the kernel in groups sharing each row read; a head's bits are the same in any group, alone
    or in a partial group, with dimensions that leave vector tails (d 83, v 70)."""
    gen = torch.Generator().manual_seed(15)
    d, v, heads = 83, 70, 7
    kv = torch.randn(NB, BS, d, generator=gen).to(dtype)
    table = torch.stack([torch.randperm(NB, generator=gen)[:9] for _ in range(2)]).to(torch.int32)
    idx = visible_positions(torch.tensor([130, 57], dtype=torch.int32), 130)
    q = torch.randn(2, heads, d, generator=gen)
    together = cpu_kernel.paged_attention(q, kv, table, idx, 0.3, v)
    torch.testing.assert_close(together, paged_sparse_attention_torch(q, kv, table, idx, 0.3, v), rtol=1e-5, atol=1e-5)
    for h in range(heads):
        alone = cpu_kernel.paged_attention(q[:, h : h + 1].contiguous(), kv, table, idx, 0.3, v)
        assert torch.equal(alone[:, 0], together[:, h]), h
    shifted = cpu_kernel.paged_attention(q[:, 1:].contiguous(), kv, table, idx, 0.3, v)  # other groupings
    assert torch.equal(shifted, together[:, 1:])
