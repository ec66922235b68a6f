"""Planning off Kopf's event loop: the pure planning functions (placement_policy.plan_for, replan_around,
rebalance) run in one child process, one plan at a time, each under a deadline and the child under a memory limit.

Why a process and not a thread: a thread cannot be stopped at its deadline, and its memory is the operator's — a
plan past every estimate would still take the operator down with it (the chart gives it 1 GiB), and every
MoEDeployment with it. (It is no longer there to keep torch out of the operator: the planner and its sizing,
expertmesh.placement.sizing, import no torch.) The child is started on the first plan, killed at a deadline (and
started again for the next plan), and exits after `idle` seconds without a plan. Its data segment is limited
(RLIMIT_DATA) to what its imports took plus `memory_limit`: an allocation past it raises MemoryError there, which
comes back as PlanningFailed.

    runner = PlanRunner()
    plan = await runner.run(plan_for, spec, cfg, previous=previous)   # PlanningFailed past the budget
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from expertmesh.runtime.process_limits import limit_data_segment

MIB = 2**20
PLAN_DEADLINE = 60.0  # seconds one plan may take
PLAN_MEMORY_LIMIT = 512 * MIB  # the planning process's data beyond its imports
START_DEADLINE = 120.0  # starting the process and importing the planner
IDLE_SECONDS = 300.0  # the process exits after this long without a plan
# imported by the child before its memory is limited, so the limit counts a plan's data, not the imports
WARM_MODULES = ("expertmesh.operator.placement_policy",)


class PlanningFailed(Exception):
    """A plan that did not finish within the deadline or the memory limit, or whose process died."""


def _start(memory_limit: int | None) -> None:
    """The child's initializer: import the planner, then cap the data segment at what that took + the limit."""
    for name in WARM_MODULES:
        importlib.import_module(name)  # before the limit: it counts a plan's data, not the imports
    if memory_limit:
        limit_data_segment(memory_limit)


def _ready() -> bool:
    return True


def _call(fn: Callable, args: tuple, kwargs: dict) -> tuple[str, Any]:
    """Run one plan in the child. MemoryError is answered, not raised (numpy's carries arrays' shapes, which do not
    always survive the trip back)."""
    try:
        return "ok", fn(*args, **kwargs)
    except MemoryError as e:
        return "memory", f"{type(e).__name__}: {e}"


class PlanRunner:
    """One planning process, one plan at a time (later callers wait their turn; the deadline counts from the
    start of their own plan)."""

    def __init__(
        self,
        deadline: float = PLAN_DEADLINE,
        memory_limit: int | None = PLAN_MEMORY_LIMIT,
        idle: float = IDLE_SECONDS,
        start_deadline: float = START_DEADLINE,
    ):
        self.deadline, self.memory_limit, self.idle, self.start_deadline = deadline, memory_limit, idle, start_deadline
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._locks: dict[int, asyncio.Lock] = {}
        self._last = 0.0
        self.started = 0  # planning processes started (tests read it)

    def _lock(self) -> asyncio.Lock:
        return self._locks.setdefault(id(asyncio.get_running_loop()), asyncio.Lock())

    async def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start,
                initargs=(self.memory_limit,),
            )
            self.started += 1
            try:  # the start (a new interpreter importing the planner) is not counted against a plan's deadline
                await asyncio.wait_for(asyncio.wrap_future(self._pool.submit(_ready)), self.start_deadline)
            except (TimeoutError, BrokenProcessPool, OSError) as e:
                self._kill()
                raise PlanningFailed(
                    f"the planning process did not start within {self.start_deadline:g} s: {type(e).__name__} {e}"
                ) from None
        return self._pool

    async def run(self, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)` in the planning process (fn and its arguments picklable); PlanningFailed when it
        takes longer than the deadline or more memory than the limit, or its process dies; fn's own exceptions
        (e.g. PlanError) as they are."""
        async with self._lock():
            pool = await self._executor()
            future = pool.submit(_call, fn, args, kwargs)
            try:
                status, value = await asyncio.wait_for(asyncio.wrap_future(future), self.deadline)
            except TimeoutError:
                self._kill()
                raise PlanningFailed(f"planning did not finish within {self.deadline:g} s") from None
            except BrokenProcessPool:
                self._kill()
                raise PlanningFailed("the planning process died (killed for its memory?)") from None
            finally:
                self._touch()
        if status == "memory":
            raise PlanningFailed(
                f"planning needed more than the planning process's {(self.memory_limit or 0) / MIB:,.0f} MiB ({value})"
            )
        return value

    def _touch(self) -> None:
        self._last = time.monotonic()
        if self.idle and self._pool is not None:
            asyncio.get_running_loop().call_later(self.idle, self._close_if_idle)

    def _close_if_idle(self) -> None:
        if (
            self._pool is not None
            and time.monotonic() - self._last >= self.idle
            and not any(lock.locked() for lock in self._locks.values())
        ):
            self.close()

    def _kill(self) -> None:
        """Stop the process at once (a plan past its deadline keeps computing otherwise); the next plan starts a
        new one."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Let the process go (the operator stops, or it has been idle)."""
        self._kill()
