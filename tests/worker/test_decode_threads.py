"""worker/threads.py: a worker built with `decode_threads` runs its decode-sized overlapping work (an expert
worker's calls, an attention worker's shared experts) on that many torch threads and the rest on all of them, with
the same tokens as a worker without it; the count is back to the process's after; `up` sets it when it shares the
cores out itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.worker.threads import DECODE_ROWS, DecodeThreads


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py)


def _pair(ckpt, dtype, decode_threads):
    from expertmesh.placement.replica_table import ReplicaTable
    from expertmesh.worker.attention import AttentionWorker
    from expertmesh.worker.expert import ExpertWorker
    from expertmesh.worker.server import all_experts

    cfg = ckpt.cfg
    attention = AttentionWorker(ckpt, kv_blocks=16, block_size=8, dtype=dtype, decode_threads=decode_threads)
    expert = ExpertWorker(ckpt, all_experts(cfg), decode_threads=decode_threads)
    table = np.zeros((len(cfg.moe_layers), cfg.moe.n_routed_experts, 1), dtype=np.int64)
    attention.connect_experts([expert], ReplicaTable(tuple(cfg.moe_layers), table))
    return attention


def _spy(monkeypatch) -> list[tuple[str, int, int]]:
    """(what, token rows, torch threads) of every shared-expert and routed-expert computation."""
    from expertmesh.model.moe import MoE, RoutedExperts

    seen = []
    shared, routed = MoE.shared_out, RoutedExperts.outputs_fp32

    def shared_out(self, h):
        seen.append(("shared", h.shape[0], torch.get_num_threads()))
        return shared(self, h)

    def outputs_fp32(self, h, ids):
        seen.append(("routed", h.shape[0], torch.get_num_threads()))
        return routed(self, h, ids)

    monkeypatch.setattr(MoE, "shared_out", shared_out)
    monkeypatch.setattr(RoutedExperts, "outputs_fp32", outputs_fp32)
    return seen


def _generate(worker, prompt: list[int]) -> list[int]:
    from expertmesh.wire.worker_api import StepSegment

    worker.open_sequence("s", SamplingParams(max_tokens=8), reserve_tokens=len(prompt) + 4)
    out = [worker.run_step(1, [StepSegment("s", prompt, True)]).tokens["s"]]
    for step in range(2, 5):
        out.append(worker.run_step(step, [StepSegment("s", [out[-1]], True)]).tokens["s"])
    worker.close_sequence("s")
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_sized_work_runs_on_the_decode_threads_with_the_same_tokens(ckpt, dtype, monkeypatch, two_threads):
    prompt = torch.randint(
        0, ckpt.cfg.vocab_size, (DECODE_ROWS + 4,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    seen = _spy(monkeypatch)
    want = _generate(_pair(ckpt, dtype, None), prompt)
    assert {t for _, _, t in seen} == {2}  # without it: every thread, always
    seen.clear()
    got = _generate(_pair(ckpt, dtype, 1), prompt)
    assert got == want
    assert {(what, rows > DECODE_ROWS, threads) for what, rows, threads in seen} == {
        ("shared", True, 2),
        ("routed", True, 2),  # the prompt's step: prefill-sized, all threads
        ("shared", False, 1),
        ("routed", False, 1),
    }  # decode steps: the decode threads
    assert torch.get_num_threads() == 2  # and back after


def test_decode_threads_count_and_restore(two_threads):
    t = DecodeThreads(1)
    assert (t.full, t.count(1), t.count(DECODE_ROWS), t.count(DECODE_ROWS + 1)) == (2, 1, 1, 2)
    with t.rows(3):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), t.rows(1):  # restored when the work raises too
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)  # a thread left on fewer: full again after
    with t.rows(DECODE_ROWS + 1):
        assert torch.get_num_threads() == 2
    off = DecodeThreads(None)
    with off.rows(1):
        assert torch.get_num_threads() == 2 and off.count(1) == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="decode_threads"):
            DecodeThreads(bad)


def test_worker_refuses_a_bad_decode_threads(ckpt):
    from expertmesh.wire.worker_api import WorkerError
    from expertmesh.worker.attention import AttentionWorker

    with pytest.raises(WorkerError, match="decode_threads"):
        AttentionWorker(ckpt, kv_blocks=4, block_size=8, decode_threads=0)
