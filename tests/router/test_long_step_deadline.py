"""Long steps in process (issue #54, item 4): an attention worker whose steps take longer the deeper into a prompt
they compute (a delay proportional to each step's work, injected around its run_step) is not marked down when a
long step passes `call_timeout` — its deadline grows with the work (router/work_deadline.py); and a step that did
miss its deadline is replayed from the longest prefix the worker saved, not from token 0."""

import queue
import time

import pytest

from expertmesh.entry.local import build_local_engine
from expertmesh.router import work_deadline
from expertmesh.router.work_deadline import entry_work
from expertmesh.wire.sampling_params import SamplingParams

CHUNK = 16
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(5 * CHUNK)]  # five chunks of CHUNK rows
FLOOR = 0.5  # call_timeout: the fixed deadline every step had
SECONDS_PER_WORK = 0.0007  # the injected delay: chunk k takes ~(256 k + 152) × this (0.11, 0.29, 0.46, 0.64, 0.82 s)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    e = build_local_engine(tiny_checkpoint, prefill_chunk=CHUNK)
    try:
        return e.generate(PROMPT, SamplingParams(max_tokens=4)).output
    finally:
        e.close()


def metric(text: str, name: str) -> float:
    """Attention worker 0's sample of `name` on /metrics (0 when absent)."""
    prefix = f'{name}{{worker="0"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def engine(ckpt, **kw):
    return build_local_engine(
        ckpt, prefill_chunk=CHUNK, prefill_tokens=CHUNK, prefill_work=0, call_timeout=FLOOR, health_interval=0.2, **kw
    )


def slowed(e, delay):
    """Wrap attention worker 0's run_step: `delay(seq_id, start, rows)` seconds per segment are slept first, under
    the worker's step lock as if computing (the position of each sequence followed from what the wrapper saw fed; a
    sequence opened on a prefix starts there)."""
    w = e.attention[0]._client
    orig, fed = w.run_step, {}

    def run_step(step_id, segments, *a, **kw):
        pause = 0.0
        for s in segments:
            start = fed.get(s.seq_id, w.sequences[s.seq_id].cache.length if s.seq_id in w.sequences else 0)
            pause += delay(s.seq_id, start, len(s.token_ids))
            fed[s.seq_id] = start + len(s.token_ids)
        with w.lock:  # computing, as far as the worker's other calls can tell
            time.sleep(pause)
            return orig(step_id, segments, *a, **kw)

    w.run_step = run_step
    return w


def test_a_long_step_past_call_timeout_completes_under_a_deadline_from_its_work(tiny_checkpoint, reference):
    e = engine(tiny_checkpoint)
    try:
        slowed(e, lambda seq, start, rows: SECONDS_PER_WORK * entry_work(start, rows))
        req = e.submit(PROMPT, SamplingParams(max_tokens=4))
        assert req.wait(30).output == reference
        assert e.stats.recovered == 0 and not e.attention_down  # never marked down: no replay
        assert e.step_rates.rate(0) >= SECONDS_PER_WORK  # learned from the steps that took long enough
        metrics = e.metrics.render().decode()
        assert metric(metrics, "expertmesh_step_deadline_extended_total") >= 1  # the long chunks got longer
        assert metric(metrics, "expertmesh_step_deadline_missed_total") == 0
        assert metric(metrics, "expertmesh_step_seconds_per_work") == pytest.approx(e.step_rates.rate(0))
    finally:
        e.close()


def test_a_fixed_deadline_would_have_missed_the_same_long_step(tiny_checkpoint, monkeypatch):
    """What the test above guards against: with every step's deadline the floor (the old code), the fourth chunk
    misses it, and each replay misses it again."""
    monkeypatch.setattr(work_deadline, "work_deadline", lambda work, rate, *, floor, **kw: floor)
    e = engine(tiny_checkpoint)
    try:
        slowed(e, lambda seq, start, rows: SECONDS_PER_WORK * entry_work(start, rows))
        req = e.submit(PROMPT, SamplingParams(max_tokens=4))
        with pytest.raises(queue.Empty):  # no token in 6 s
            req.wait(6)
        assert e.stats.recovered >= 2  # replayed, and missed again
        assert metric(e.metrics.render().decode(), "expertmesh_step_deadline_missed_total") >= 2
        e.cancel(req)
    finally:
        e.close()


def test_a_step_past_its_deadline_is_replayed_from_the_longest_saved_prefix(tiny_checkpoint, reference):
    """One attention worker; its step from 3 chunks in hangs once past the deadline: the worker is marked down
    (its prefixes forgotten), taken back at the next health check (its prefixes learned again from its listing),
    and the request is placed again on the prefix of 3 chunks its earlier steps saved — not replayed from 0."""
    e = engine(tiny_checkpoint)
    try:
        hung = []

        def delay(seq, start, rows):
            if start == 3 * CHUNK and not hung:
                hung.append(seq)
                return 3.0
            return 0.0

        slowed(e, delay)
        req = e.submit(PROMPT, SamplingParams(max_tokens=4))
        assert req.wait(30).output == reference
        assert hung and e.stats.recovered == 1
        # the replay started from a saved prefix: 3 chunks, or 4 when the abandoned step ended (and saved its
        # prefix) before the worker listed its prefixes to the router taking it back
        assert req.cached_tokens in (3 * CHUNK, 4 * CHUNK)
        assert e.step_rates.rate(0) > 0  # the missed step taught a rate: its replay gets a longer deadline
        assert metric(e.metrics.render().decode(), "expertmesh_step_deadline_missed_total") == 1
    finally:
        e.close()
