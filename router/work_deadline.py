"""A step's deadline from the work it does. One fixed deadline (`call_timeout`) for every step misjudges long
prompts: a chunk's attention grows with the context it sees, so a step deep in an 8K prompt may take minutes on a
loaded CPU while a decode step takes milliseconds — a fixed deadline either waits minutes for a hung worker or
marks a busy one down, replaying its sequences into the same step again and again.

So each attention worker's recent steps teach the router how many seconds a unit of work takes there (`WorkRates`:
the largest seconds/work of its last steps that took long enough to measure work rather than a step's fixed
cost), and a step's deadline is that rate × its work × a safety factor, never below `call_timeout` (the floor)
and never above `DEADLINE_CAP` floors — a worker that hangs is still noticed (and sooner by the health probe the
router runs during a step, router/step_calls.py). Work is in the scheduler's units (scheduler.chunk_work: row ·
context of attention, plus one a row for its projections and experts). On /metrics per attention worker: the rate
(`expertmesh_step_seconds_per_work`), the steps given longer than the floor (`expertmesh_step_deadline_extended`)
and those past their deadline (`expertmesh_step_deadline_missed`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from expertmesh.router.scheduler import Planned, chunk_work

DEADLINE_FACTOR = 3.0  # a step may take this many times what its work took on that worker lately
DEADLINE_CAP = 10.0  # ... but never more than this many floors (call_timeout)
RATE_WINDOW = 8  # steps per worker the rate is learned from
SIGNIFICANT = 0.1  # a step shorter than this fraction of the floor measures its fixed cost, not its work


def entry_work(start: int, rows: int) -> int:
    """One batch entry's work: its rows' attention (chunk_work) plus one a row."""
    return chunk_work(start, rows) + rows


def step_work(batch: Iterable[Planned]) -> int:
    """One attention worker's step: the work of its entries (a speculating decode entry verifies up to max_new rows)."""
    return sum(entry_work(p.start, len(p.tokens) + p.max_new - 1) for p in batch)


def work_deadline(
    work: int, seconds_per_work: float, *, floor: float, factor: float = DEADLINE_FACTOR, cap: float = DEADLINE_CAP
) -> float:
    """The seconds a step of `work` may take on a worker whose steps took `seconds_per_work` (0: not known yet):
    `factor` times what the work took there, at least `floor`, at most `cap` floors."""
    return min(max(floor, factor * seconds_per_work * work), cap * floor)


class WorkRates:
    """Per attention worker, seconds per unit of work: the largest of its last `window` measured steps (a robust,
    pessimistic estimate: a step's fixed cost and a load spike only lengthen deadlines). Steps shorter than
    `significant` seconds are not measured: they time a step's fixed cost, and inflate the rate of big ones."""

    def __init__(self, floor: float, *, window: int = RATE_WINDOW, significant: float | None = None):
        self.floor = floor
        self.significant = SIGNIFICANT * floor if significant is None else significant
        self.window = window
        self._rates: dict[int, deque[float]] = {}
        self.extended: dict[int, int] = {}  # worker → steps given longer than the floor
        self.missed: dict[int, int] = {}  # worker → steps past their deadline
        self._lock = threading.Lock()  # read by the metrics, written by the scheduler thread

    def observe(self, worker: int, work: int, seconds: float) -> None:
        """A step of `work` took `seconds` on `worker` — or at least that long: a step past its deadline is
        observed at its deadline, so the same step replayed gets `factor` times longer (up to the cap) instead of
        missing the same deadline forever."""
        if work <= 0 or seconds < self.significant:
            return
        with self._lock:
            self._rates.setdefault(worker, deque(maxlen=self.window)).append(seconds / work)

    def rate(self, worker: int) -> float:
        """Seconds per unit of work on `worker` (0.0 until a step was measured there)."""
        with self._lock:
            return max(self._rates.get(worker, ()), default=0.0)

    def deadline(self, worker: int, work: int) -> float:
        """The seconds a step of `work` may take on `worker` (work_deadline)."""
        seconds = work_deadline(work, self.rate(worker), floor=self.floor)
        if seconds > self.floor:
            with self._lock:
                self.extended[worker] = self.extended.get(worker, 0) + 1
        return seconds

    def past_deadline(self, worker: int, work: int, deadline: float) -> None:
        """A step of `work` on `worker` had no result within its `deadline`: observed at it (see observe)."""
        self.observe(worker, work, deadline)
        with self._lock:
            self.missed[worker] = self.missed.get(worker, 0) + 1

    def collect(self):
        """/metrics (a prometheus_client collector): per attention worker (by index), the rate learned, the steps
        given longer than the floor and those past their deadline."""
        rate = GaugeMetricFamily(
            "expertmesh_step_seconds_per_work",
            "Seconds per unit of step work (rows x context) an attention worker's recent steps took: a step's "
            "deadline is 3x this x its work, at least --call-timeout",
            labels=["worker"],
        )
        extended = CounterMetricFamily(
            "expertmesh_step_deadline_extended",
            "Steps whose deadline, from their work, was longer than --call-timeout",
            labels=["worker"],
        )
        missed = CounterMetricFamily(
            "expertmesh_step_deadline_missed", "Steps with no result within their deadline", labels=["worker"]
        )
        with self._lock:
            rates = {w: max(r) for w, r in self._rates.items() if r}
            ext, miss = dict(self.extended), dict(self.missed)
        for w, r in sorted(rates.items()):
            rate.add_metric([str(w)], r)
        for w, n in sorted(ext.items()):
            extended.add_metric([str(w)], n)
        for w, n in sorted(miss.items()):
            missed.add_metric([str(w)], n)
        yield rate
        yield extended
        yield missed
