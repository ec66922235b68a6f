"""Prefixes saved inside a step (a model without recurrent layers): a prompt runs in whole steps instead of
stopping at its last multiple of the prefix granularity, the worker saves that prefix from the step's pages, and a
later request that starts from it generates the tokens a cold run does. A model with KDA layers refuses a prefix
inside a step, naming the field (its recurrent state exists at a step's end alone)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import StepSegment, WorkerError

CHUNK = 16


def _checkpoint(path, layer_types):
    from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
    from expertmesh.model.config import preset

    create_checkpoint(preset("tiny").model_copy(update={"layer_types": layer_types}), path, seed=0)
    return Checkpoint(path)


@pytest.fixture(scope="module")
def dsa_only(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("dsa"), ("dsa",) * 4)


@pytest.fixture(scope="module")
def with_kda(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("kda"), ("kda", "dsa", "kda", "dsa"))


def _engine(ckpt, monkeypatch=None, steps: list | None = None):
    from expertmesh.entry.local import build_local_engine
    from expertmesh.worker.attention import AttentionWorker

    if steps is not None:
        run_step = AttentionWorker.run_step

        def counted(self, step_id, segments, snapshot_keys=None):
            steps.append(([len(s.token_ids) for s in segments], snapshot_keys))
            return run_step(self, step_id, segments, snapshot_keys)

        monkeypatch.setattr(AttentionWorker, "run_step", counted)
    return build_local_engine(ckpt, kv_blocks=64, block_size=8, prefill_chunk=CHUNK, prefill_tokens=4 * CHUNK)


def _generate(engine, prompt: list[int]):
    req = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))
    return list(req.output), req.cached_tokens


def test_a_prompt_runs_in_one_step_saves_its_last_granule_and_a_hit_generates_the_cold_tokens(dsa_only, monkeypatch):
    g = torch.Generator().manual_seed(5)
    first = torch.randint(3, dsa_only.cfg.vocab_size, (40,), generator=g).tolist()
    follow = first + torch.randint(3, dsa_only.cfg.vocab_size, (10,), generator=g).tolist()
    cold = _engine(dsa_only)
    try:
        want, cached = _generate(cold, follow)  # 50 tokens, no prefix to start from
        assert cached == 0
    finally:
        cold.close()
    steps = []
    engine = _engine(dsa_only, monkeypatch, steps)
    try:
        assert engine.limits.snapshot_within_step
        _generate(engine, first)
        fed, snapshots = steps[0]
        assert fed == [40] and list(snapshots.values())[0][1] == 32  # one step, the prefix of 32 saved inside it
        assert [f for f, _ in steps[1:]] == [[1]] * 5  # then decoding
        got, cached = _generate(engine, follow)
        assert cached == 32 and got == want  # the saved pages give the cold run's tokens
    finally:
        engine.close()


def test_a_model_with_kda_layers_keeps_stopping_at_the_granule_and_refuses_a_prefix_inside_a_step(
    with_kda, monkeypatch
):
    steps = []
    engine = _engine(with_kda, monkeypatch, steps)
    try:
        assert not engine.limits.snapshot_within_step
        prompt = torch.randint(3, with_kda.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
        _generate(engine, prompt)
        assert [f for f, _ in steps[:2]] == [[32], [8]]  # stops at 32 to save the prefix there
        worker = engine.attention[0]
        worker.open_sequence("s", SamplingParams(max_tokens=4), reserve_tokens=48)
        for snapshot, why in ((("p", 16), "inside the step"), (("p", 41), r"expected 1\.\.40")):
            with pytest.raises(WorkerError, match=rf"snapshot_keys\[s\]\.length: .*{why}"):
                worker.run_step(100, [StepSegment("s", prompt, True)], {"s": snapshot})
        assert worker.run_step(101, [StepSegment("s", prompt, True)], {"s": ("p", 40)}).tokens  # at its end: fine
        assert [k for k, _, _ in worker.list_prefixes()].count("p") == 1
    finally:
        engine.close()
