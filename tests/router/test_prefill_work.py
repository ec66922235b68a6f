"""Long prompts (issue #54, item 4), on plain data: prompt chunks bounded by their attention work
(scheduler.prefill_end with Limits.prefill_work), a step's deadline from its work (router/work_deadline.py), and
the --prefill-work flag through the router's and `expertmesh up`'s parsers."""

import argparse
import dataclasses
import random

import pytest

from expertmesh.entry.up import add_arguments as up_arguments
from expertmesh.entry.up import router_engine_config, router_options
from expertmesh.router.engine_config import EngineConfig
from expertmesh.router.kv import KVManager, WorkerKV
from expertmesh.router.request import Request
from expertmesh.router.scheduler import Limits, Planned, chunk_work, prefill_end, schedule, work_rows
from expertmesh.router.server import add_arguments as router_arguments
from expertmesh.router.work_deadline import DEADLINE_CAP, WorkRates, entry_work, step_work, work_deadline
from expertmesh.wire.sampling_params import SamplingParams

G, T = 16, 64  # prefill_chunk, prefill_tokens
BOUNDED = Limits(
    prefill_chunk=G,
    prefill_tokens=T,
    prefill_work=2 * T * T,
    max_batch_tokens=4096,
    max_running=16,
    kv_growth=16,
    max_context=8192,
)
UNBOUNDED = dataclasses.replace(BOUNDED, prefill_work=0)


def chunks(length: int, limits: Limits, computed: int = 0) -> list[tuple[int, int]]:
    """The (start, end) of every chunk of a `length`-token prompt from `computed`."""
    out = []
    while computed < length:
        end = prefill_end(computed, length, limits)
        out.append((computed, end))
        computed = end
    return out


# ------------------------------------------------------------------ prompt chunks bounded by their work
def test_chunk_work_counts_each_row_attending_to_the_context_before_it():
    assert [chunk_work(0, 1), chunk_work(0, 4), chunk_work(10, 4)] == [1, 1 + 2 + 3 + 4, 11 + 12 + 13 + 14]


def test_work_rows_is_the_most_whole_granules_within_the_work():
    rng = random.Random(0)
    for _ in range(2000):
        computed, work = rng.randrange(0, 50_000), rng.randrange(1, 10**8)
        rows = work_rows(computed, work, 1)
        assert chunk_work(computed, rows) <= work or rows == 1
        assert chunk_work(computed, rows + 1) > work
        assert work_rows(computed, work, G) == max(G, rows // G * G)


def test_chunks_are_unchanged_while_the_bound_is_not_reached():
    assert chunks(2 * T, BOUNDED) == chunks(2 * T, UNBOUNDED) == [(0, T), (T, 2 * T)]
    assert chunks(3 * T, BOUNDED)[:2] == [(0, T), (T, 2 * T)]


def test_deep_in_a_long_prompt_chunks_shrink_with_the_context_in_whole_granules_down_to_one():
    spans = chunks(4000, BOUNDED)
    rows = [end - start for start, end in spans]
    assert rows[:2] == [T, T] and min(rows[2:]) < T
    assert all(a >= b for a, b in zip(rows, rows[1:-1]))  # fewer rows the further in (the last: the prompt's end)
    assert all(end % G == 0 for _, end in spans[:-1])  # the prefix cache's granularity
    assert rows[-2] == G  # never below one granule, though one granule is past the work there
    for start, end in spans[2:-1]:
        assert chunk_work(start, end - start) <= BOUNDED.prefill_work or end - start == G
        assert end - start == G or chunk_work(start, end - start + G) > BOUNDED.prefill_work  # no whole granule
    assert chunks(4000, UNBOUNDED) == [(s, min(s + T, 4000)) for s in range(0, 4000, T)]  # 0: unbounded


def test_the_prompts_last_multiple_of_the_granule_still_ends_a_chunk():
    length = 3 * T + 40  # its last multiple of G is 3T + 32
    limits = dataclasses.replace(BOUNDED, snapshot_within_step=False)
    ends = [end for _, end in chunks(length, limits)]
    assert 3 * T + 32 in ends and ends[-1] == length
    assert [end for _, end in chunks(length, dataclasses.replace(limits, snapshot_within_step=True))][-1] == length


def test_a_replay_from_a_chunk_end_computes_the_same_chunks_as_the_first_run():
    first = chunks(4000, BOUNDED)
    for k in (2, 5, len(first) - 3):
        assert chunks(4000, BOUNDED, computed=first[k][0]) == first[k:]


def test_a_sequences_chunks_do_not_depend_on_what_runs_beside_it():
    """The same long prompt planned alone and beside decoding sequences and another prompt: the same chunk ends."""
    kv = KVManager([WorkerKV(0, 16, 4096, 4096)], chunk=G, salt=b"s")

    def seq(length: int, computed: int, seed: int) -> Request:
        req = Request(prompt=[(seed + j) % 200 + 1 for j in range(length)], params=SamplingParams(max_tokens=8))
        req.output = [7] * max(0, computed - length + 1)
        req.worker, req.seq_id, req.computed, req.reserved = 0, f"s{seed}", computed, length + 16
        return req

    for computed in (0, T, 2 * T, 3 * T + 16, 1024):
        long = seq(4000, computed, 0)
        ends = []
        for beside in ([], [seq(20, 25, s) for s in range(1, 9)] + [seq(3000, 2048, 9)]):
            long.computed = computed
            plan = schedule([], [*beside, long], kv, limits=BOUNDED, admit=False)
            ends.append(next(p.end for p in plan.batches[0] if p.req is long))
        assert ends == [prefill_end(computed, 4000, BOUNDED)] * 2


# ------------------------------------------------------------------ a step's deadline from its work
def test_the_deadline_is_the_floor_then_proportional_to_the_work_then_capped():
    assert work_deadline(1000, 0.0, floor=60) == 60  # nothing learned yet: the floor
    assert work_deadline(1000, 0.01, floor=60) == 60  # 3 × 10 s: below the floor
    assert work_deadline(1000, 0.1, floor=60) == pytest.approx(300)  # 3 × 100 s
    assert work_deadline(2000, 0.1, floor=60) == pytest.approx(600)
    assert work_deadline(10**6, 0.1, floor=60) == DEADLINE_CAP * 60  # a hung worker is still noticed


def test_the_rate_is_learned_from_steps_long_enough_to_measure_their_work():
    rates = WorkRates(floor=10.0)  # steps under 1 s time a step's fixed cost: not learned from
    rates.observe(0, 10, 0.5)
    assert rates.rate(0) == 0 and rates.deadline(0, 10**6) == 10.0
    rates.observe(0, 1000, 2.0)
    rates.observe(0, 1000, 4.0)
    rates.observe(1, 1000, 1.0)
    assert rates.rate(0) == pytest.approx(0.004) and rates.rate(1) == pytest.approx(0.001)  # the worst, per worker
    assert rates.deadline(0, 5000) == pytest.approx(60.0)
    for _ in range(8):  # the window moves on: the slow steps are forgotten
        rates.observe(0, 1000, 1.5)
    assert rates.rate(0) == pytest.approx(0.0015)


def test_a_step_past_its_deadline_gets_factor_times_longer_when_replayed():
    rates = WorkRates(floor=1.0)
    deadlines = []
    for _ in range(4):  # the same step misses each deadline: observed at it, as gather does
        deadlines.append(rates.deadline(0, 500))
        rates.observe(0, 500, deadlines[-1])
    assert deadlines == pytest.approx([1.0, 3.0, 9.0, 10.0])


def test_a_steps_work_sums_its_entries_rows_and_their_attention():
    req = Request(prompt=list(range(1, 200)), params=SamplingParams(max_tokens=4))
    batch = [Planned(req, 100, [5] * 32, False), Planned(req, 150, [5], True, max_new=3)]
    assert step_work(batch) == entry_work(100, 32) + entry_work(150, 3)
    assert entry_work(100, 32) == chunk_work(100, 32) + 32


# ------------------------------------------------------------------ the flag
def router_flags(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    router_arguments(p)
    return p.parse_args(["--checkpoint", "-", "--plan", "-", "--attention", "a:1", "--experts", "e:1", *flags])


def test_prefill_work_is_derived_from_prefill_tokens_unless_set():
    config = EngineConfig.from_args(router_flags("--prefill-chunk", "32", "--prefill-tokens", "128"))
    assert config.prefill_work is None and config.step_prefill_work == 2 * 128 * 128
    assert config.limits(max_context=4096, snapshot_within_step=True).prefill_work == 2 * 128 * 128
    config = EngineConfig.from_args(router_flags("--prefill-work", "0"))
    assert config.limits(max_context=4096, snapshot_within_step=True).prefill_work == 0  # unbounded
    assert EngineConfig.from_args(router_flags("--prefill-work", "5000")).step_prefill_work == 5000


@pytest.mark.parametrize("value", ["-1", "lots", "1.5"])
def test_a_bad_prefill_work_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        router_flags("--prefill-work", value)
    err = capsys.readouterr().err
    assert "--prefill-work" in err and "an integer >= 0" in err
    with pytest.raises(ValueError, match="prefill_work: expected an integer >= 0"):
        EngineConfig(prefill_work=-1)


def test_up_passes_prefill_work_to_the_router():
    p = argparse.ArgumentParser()
    up_arguments(p)
    args = p.parse_args(["--checkpoint", "/nonexistent", "--expert-workers", "1", "--", "--prefill-work", "4096"])
    config = router_engine_config(args, router_options(args.router_options))
    assert config.step_prefill_work == 4096


def test_a_remote_steps_call_deadline_is_the_longest_a_step_may_take():
    """The RunStep call's own deadline must not end a long step the router's work deadline still waits for; a
    hand-off keeps the floor (its work does not grow with a prompt's attention: a hung one is noticed as before)."""
    from expertmesh.entry.cluster import make_placement
    from expertmesh.model.config import preset
    from expertmesh.router.server import build_remote_engine

    cfg = preset("tiny")
    config = EngineConfig(call_timeout=120.0)
    engine = build_remote_engine(cfg, ["127.0.0.1:9"], ["127.0.0.1:9"], make_placement(cfg, 1), config)
    try:
        assert [a._client.step_timeout for a in engine.attention] == [DEADLINE_CAP * 120.0]
        assert [a._client.handoff_timeout for a in engine.attention] == [120.0]
    finally:
        engine.close()
