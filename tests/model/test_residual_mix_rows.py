"""Kimi K3's attention-residual mix gives a row the same bits wherever it sits in a step's batch.

Seen as one request of eight (200-token prompts, K3-shaped model, bf16) answering differently by the step it was
prefilled in: ATen's softmax over the sources (dim 0) and its sum over them round a row by its place in the batch
and by the thread count: with 2 threads each thread's share of the rows has a vectorized body and a scalar tail), so a prompt chunk at row 392 of a 968-row step left the first MLA layer's input a bit
off the one it gets alone."""

import torch

from expertmesh.model.transformer import ResidualMix

H = 1024  # the peer K3 model's hidden size, where the mismatch showed


def _mix() -> ResidualMix:
    gen = torch.Generator().manual_seed(0)
    mix = ResidualMix(H, 1e-6)
    with torch.no_grad():
        mix.norm.weight.copy_(torch.randn(H, generator=gen))
        mix.proj.weight.copy_(torch.randn(1, H, generator=gen))
    return mix


def test_a_row_mixes_to_the_same_bits_alone_and_inside_a_larger_batch():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the engine runs on 2 cores: ATen splits the rows between threads
    try:
        _check_rows()
    finally:
        torch.set_num_threads(threads)


def _check_rows():
    gen = torch.Generator().manual_seed(1)
    mix = _mix()

    def rows(n):
        return torch.randn(n, H, generator=gen)  # fp32: a bf16 stream rounds most one-ulp slips away

    for n_blocks in (1, 2, 3):
        blocks, current = [rows(192) for _ in range(n_blocks)], rows(192)
        alone = mix(blocks, current)

        def inside(t):  # the rows at 392..583 of a 968-row step, as a prefill chunk beside others
            return torch.cat([rows(392), t, rows(384)])

        batched = mix([inside(b) for b in blocks], inside(current))[392:584]
        assert torch.equal(alone, batched), f"{n_blocks} banked block(s): rows differ inside a 968-row batch"
        one_by_one = torch.cat([mix([b[i : i + 1] for b in blocks], current[i : i + 1]) for i in range(0, 192, 37)])
        assert torch.equal(alone[0:192:37], one_by_one)


def test_the_mix_is_the_softmax_weighted_sum_of_its_sources():
    gen = torch.Generator().manual_seed(2)
    mix = _mix()
    blocks = [torch.randn(5, H, generator=gen) for _ in range(2)]
    current = torch.randn(5, H, generator=gen)
    sources = torch.stack([*blocks, current])
    w = mix.norm.weight * mix.proj.weight[0]
    score = (sources * w).sum(-1) * torch.rsqrt(sources.pow(2).mean(-1) + 1e-6)
    expected = (torch.softmax(score, 0)[..., None] * sources).sum(0)
    torch.testing.assert_close(mix(blocks, current), expected, rtol=1e-5, atol=1e-5)
    assert mix([], current) is current
