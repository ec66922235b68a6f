"""The scheduler's side of speculative decoding (router/scheduler.py, pure): how many tokens a decoding sequence may
emit a step (`max_new`: K + 1 within max_tokens, the context, the KV it reserved and one chunk; one while it
replays or has a token filter), the chunk boundary a verified run may cross held by the worker (`hold_at`) and
saved by the request's next step, the optional growth for K + 1, and a step result of several tokens cut at a stop
token or max_tokens with each token's own log-prob entry."""

from __future__ import annotations

import dataclasses

import numpy as np

from expertmesh.router.kv import KVManager, WorkerKV
from expertmesh.router.request import Request
from expertmesh.router.scheduler import Limits, Planned, Seq, max_new, schedule, update_from_output
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import StepDone, TokenLogprobs

LIMITS = Limits(
    prefill_chunk=16,
    max_batch_tokens=64,
    max_running=8,
    kv_growth=16,
    max_context=512,
    session_affinity=False,
    speculative_tokens=3,
)


def decoding(computed: int, reserved: int, output: int, max_tokens: int = 64, **params) -> Request:
    req = Request(prompt=list(range(1, 21)), params=SamplingParams(max_tokens=max_tokens, **params))
    req.output = [7] * output
    req.worker, req.seq_id, req.computed, req.reserved = 0, "s1", computed, reserved
    return req


def seq(req: Request) -> Seq:
    return Seq(req, req.worker, req.computed, req.reserved)


def test_max_new_is_k_plus_one_within_what_is_left():
    assert max_new(seq(decoding(20, 40, 1)), LIMITS) == 4  # 20 in cache, the boundary at 32
    assert max_new(seq(decoding(20, 40, 1)), dataclasses.replace(LIMITS, speculative_tokens=0)) == 1
    assert max_new(seq(decoding(20, 40, 1, max_tokens=3)), LIMITS) == 2  # 2 of max_tokens left
    assert max_new(seq(decoding(20, 22, 1)), LIMITS) == 2  # KV reserved for 2 more
    # a verified run may cross the chunk boundary at 32 (the worker holds the state there, Planned.hold_at)
    assert max_new(seq(decoding(29, 60, 10)), LIMITS) == 4
    assert max_new(seq(decoding(31, 60, 12)), LIMITS) == 4
    wide = dataclasses.replace(LIMITS, speculative_tokens=40)
    assert max_new(seq(decoding(20, 100, 1, max_tokens=90)), wide) == 16  # at most one chunk: one boundary a step
    replay = decoding(21, 60, 5)  # fed 21, has 25 tokens: it replays its own output one token a step
    assert max_new(seq(replay), LIMITS) == 1
    filtered = decoding(20, 40, 1)
    filtered.token_filter = lambda r, t: t
    assert max_new(seq(filtered), LIMITS) == 1


def test_growth_for_k_plus_one_is_optional_and_batches_plan_with_it():
    kv = KVManager([WorkerKV(0, 16, 64, 10)], chunk=16, salt=b"s")
    req = decoding(20, 22, 1)  # room for the fed token, not for K + 1
    plan = schedule([], [req], kv, limits=LIMITS)
    (g,) = plan.growth
    assert g.optional and g.target == 38 and g.evict == [] and g.preempt == []
    assert plan.batches[0][0].max_new == 4


def logprob_run(seq_id: str, position: int, tokens: list[int]) -> TokenLogprobs:
    n = len(tokens)
    return TokenLogprobs(
        seq_id,
        position,
        np.array(tokens),
        -np.arange(1, n + 1, dtype=np.float32) / 10,
        np.array([[t] for t in tokens]),
        -np.ones((n, 1), dtype=np.float32),
    )


def test_several_tokens_a_step_each_with_its_entry_cut_at_a_stop_token_or_max_tokens():
    req = decoding(20, 40, 1, logprobs=1, stop_token_ids=(99,))
    batch = [Planned(req, 20, [7], True, max_new=4)]
    done = StepDone(1, {"s1": 5}, 3, [logprob_run("s1", 21, [5, 6, 99, 8])], more_tokens={"s1": [6, 99, 8]})
    u = update_from_output(batch, done, max_context=512).seqs[0]
    assert (u.token, [t for t, _ in u.more], u.finish) == (5, [6, 99], "stop")
    assert [e.token for e in [u.logprob] + [e for _, e in u.more]] == [5, 6, 99]
    assert u.more[1][1].logprob == np.float32(-0.3)
    short = decoding(20, 40, 1, max_tokens=3)
    done = StepDone(1, {"s1": 5}, 3, more_tokens={"s1": [6, 8]}, drafted={"s1": 2})
    u = update_from_output([Planned(short, 20, [7], True, max_new=3)], done, max_context=512).seqs[0]
    assert (u.token, [t for t, _ in u.more], u.finish, u.drafted, u.computed) == (5, [6], "length", 2, 23)


def test_a_batch_larger_than_speculative_max_batch_verifies_no_drafts():
    """vLLM's speculative_disable_by_batch_size: a worker decoding more than N sequences a step gets max_new 1 for
    all of them (a compute-bound batch, where drafts cost more than they save); N or fewer speculate."""
    kv = KVManager([WorkerKV(0, 16, 64, 40)], chunk=16, salt=b"s")

    def batch(n: int, limit: int) -> list[int]:
        reqs = []
        for i in range(n):
            r = decoding(20, 40, 1)
            r.seq_id = f"s{i}"
            reqs.append(r)
        limits = dataclasses.replace(LIMITS, speculative_max_batch=limit, max_running=16, max_batch_tokens=128)
        return [p.max_new for p in schedule([], reqs, kv, limits=limits).batches[0]]

    assert batch(4, 4) == [4] * 4
    assert batch(5, 4) == [1] * 5
    assert batch(16, 8) == [1] * 16


def test_speculative_max_batch_is_checked_and_has_a_router_flag():
    import argparse

    import pytest

    from expertmesh.router.engine_config import EngineConfig
    from expertmesh.router.server import add_arguments

    with pytest.raises(ValueError, match="speculative_max_batch: expected an integer >= 1, found 0"):
        EngineConfig(speculative_max_batch=0)
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--checkpoint", "-", "--plan", "-", "--attention", "-", "--experts", "-"]
    assert EngineConfig.from_args(p.parse_args(base)).speculative_max_batch == 16
    assert EngineConfig.from_args(p.parse_args([*base, "--speculative-max-batch", "3"])).speculative_max_batch == 3


def test_a_boundary_a_verified_run_may_cross_is_held_then_saved_next_step():
    """hold_at names the next chunk boundary when the step's K + 1 tokens may reach it; a speculating step saves no
    prefix at its own end (where it ends is acceptance's); the request's next step saves the held boundary's
    prefix — (key, length) below the step's start, keyed by the tokens up to it."""
    kv = KVManager([WorkerKV(0, 16, 64, 40)], chunk=16, salt=b"s")
    far, near = decoding(20, 40, 1), decoding(29, 60, 10)
    near.seq_id = "s2"
    plan = schedule([], [far, near], kv, limits=LIMITS)
    by_id = {p.req.seq_id: p for p in plan.batches[0]}
    assert by_id["s1"].hold_at == 0 and by_id["s2"].hold_at == 32  # 20 + 4 < 32 <= 29 + 4
    assert by_id["s2"].snapshot is None and by_id["s1"].snapshot is None
    near.held_mark, near.computed = 32, 33  # the step kept 4: the worker holds the state at 32
    near.output += [7] * 4
    (p,) = [q for q in schedule([], [near], kv, limits=LIMITS).batches[0]]
    assert p.saves_held and p.snapshot_at == 32 and p.prefix_end == 32 and p.snapshot is not None
    assert p.snapshot == kv.hasher(near.cache_scope).advance(near.hash_tokens, 32)
    plain = dataclasses.replace(LIMITS, speculative_tokens=0)  # without speculation: the step ending at 32 saves
    (q,) = schedule([], [decoding(31, 60, 12)], kv, limits=plain).batches[0]
    assert q.hold_at == 0 and q.snapshot is not None and q.snapshot_at is None


def test_a_worker_over_the_batch_limit_counts_its_prompts_and_feeds_no_drafter():
    """Sequences still prefilling count toward --speculative-max-batch (they join the decode batch next): 4 decoding
    + 5 prefilling on one worker with a limit of 8 → every segment max_new 1 (the worker drafts and feeds its
    drafter nothing); 4 + 4 → the decodes speculate and the prompt chunks carry K + 1 (their rows feed the MTP)."""
    kv = KVManager([WorkerKV(0, 16, 64, 60)], chunk=16, salt=b"s")

    def plan(prefilling: int) -> tuple[list[int], list[int]]:
        reqs = []
        for i in range(4):
            r = decoding(20, 40, 1)
            r.seq_id = f"d{i}"
            reqs.append(r)
        for i in range(prefilling):
            r = Request(prompt=list(range(1, 21)), params=SamplingParams(max_tokens=8))
            r.worker, r.seq_id, r.computed, r.reserved = 0, f"p{i}", 0, 32
            reqs.append(r)
        limits = dataclasses.replace(LIMITS, speculative_max_batch=8, max_running=16, max_batch_tokens=256)
        batch = schedule([], reqs, kv, limits=limits).batches[0]
        return [p.max_new for p in batch if p.req.seq_id[0] == "d"], [
            p.max_new for p in batch if p.req.seq_id[0] == "p"
        ]

    assert plan(5) == ([1] * 4, [1] * 5)
    assert plan(4) == ([4] * 4, [4] * 4)
    assert plan(0)[0] == [4] * 4
