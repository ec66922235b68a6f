"""The placement plan in force and the live re-plan onto a new one.

The router holds the plan and the replica table built from it (which expert workers hold each routed expert) and
pushes the table to every attention worker (ConnectExperts), which dispatch their tokens by it. A re-plan never
fails or changes a request: (1) warm — every expert worker loads its new shards beside the old ones (the old table
still routes); (2) switch — between two scheduler steps the new table is pushed to every live attention worker, so a
step runs wholly on one table; (3) drain — every expert worker drops the shards the new plan took away. Any replica
computes an expert's output bit for bit, so the tokens are the ones the old plan would have given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

from expertmesh.model.config import ModelConfig
from expertmesh.placement.planner import placed_layers
from expertmesh.placement.replica_table import ReplicaTable

log = logging.getLogger("expertmesh.router")


class LivePlan:
    def __init__(
        self,
        cfg: ModelConfig,
        placement,
        attention: list,
        experts: list,
        expert_clients: list,
        *,
        pool: Executor,
        wake: threading.Condition,
        transport: str,
        probe_interval: float,
        mtp: bool = False,
    ):
        """`experts`: the clients the router calls (set_shards); `expert_clients`: what the attention workers are
        given to dispatch to; `wake`: the scheduler's condition, notified when a switch waits for it; `mtp`: the
        attention workers draft with the MTP layer, whose experts every plan must place too."""
        self.cfg = cfg
        self.layers = placed_layers(cfg, mtp)
        self.placement = placement
        self.table = self._table(placement)
        self.attention, self.experts, self.expert_clients = attention, experts, expert_clients
        self.pool = pool
        self.wake = wake
        self.transport = transport
        self.probe_interval = probe_interval
        self.lock = threading.Lock()  # one re-plan at a time
        self._switch: tuple | None = None  # (placement, table, done event): taken between steps

    def _table(self, placement) -> ReplicaTable:
        """The replica table of `placement` over the placed layers; ValueError naming what is missing."""
        theirs = getattr(placement, "moe_layers", None)
        if theirs is not None and list(theirs) != self.layers:
            mtp = [layer for layer in self.layers if layer >= self.cfg.n_layers]
            raise ValueError(
                f"plan: places the experts of layers {list(theirs)}, this deployment needs {self.layers}"
                + (
                    f" (--speculative-method mtp: the MTP layer {mtp[0]}'s experts too; make the plan with "
                    f"`expertmesh plan --mtp` or spec.speculative)"
                    if mtp and mtp[0] not in theirs
                    else ""
                )
            )
        return ReplicaTable.from_placement(placement, self.layers, self.cfg.moe.n_routed_experts)

    @property
    def plan_hash(self) -> str | None:
        """The hash of the placement plan the replica table now follows (None for a plan-less placement)."""
        return self.placement.plan_hash() if hasattr(self.placement, "plan_hash") else None

    @property
    def switch_pending(self) -> bool:
        return self._switch is not None

    def connect(self, worker: int) -> None:
        """Push the expert workers and the table in force to attention worker `worker`."""
        extra = {"transport": self.transport} if self.transport != "grpc" else {}  # in-process: no transport
        self.attention[worker].connect_experts(
            self.expert_clients, self.table, probe_interval=self.probe_interval, **extra
        )

    def replan(self, placement, timeout: float = 600.0, drain_delay: float = 0.0) -> dict:
        """Adopt `placement` (warm, switch, drain: see the module's docstring). `drain_delay`: seconds between the
        switch and the drain, for other router replicas following the same plan to switch first (a drained shard
        is gone for every router). An expert worker that cannot be reached is skipped (down: its replicas serve;
        restarted, it reads the plan). → {"loaded": shards loaded, "dropped": shards dropped, "unreachable":
        ordinals skipped}."""
        table = self._table(placement)
        if table.table.size and int(table.table.max()) >= len(self.experts):
            raise ValueError(
                f"plan: places experts on worker {int(table.table.max())}, this router has "
                f"{len(self.experts)} expert workers"
            )
        with self.lock:
            shards = [
                (
                    placement.experts_of(o) if o < len(placement.workers) else [],
                    {(l, e): g.gpu for g in placement.workers[o].gpus for l, e in g.shards}
                    if o < len(placement.workers)
                    else None,
                )
                for o in range(len(self.experts))
            ]
            before = [
                set(self.placement.experts_of(o)) if o < len(self.placement.workers) else set()
                for o in range(len(self.experts))
            ]
            unreachable: set[int] = set()

            def each_worker(drop_others: bool) -> None:
                futures = {
                    o: self.pool.submit(self.experts[o].set_shards, pairs, gpu_of, drop_others=drop_others)
                    for o, (pairs, gpu_of) in enumerate(shards)
                    if o not in unreachable
                }
                for o, f in futures.items():
                    try:
                        f.result(timeout=timeout)
                    except ConnectionError as e:
                        log.warning("re-plan: expert worker %d unreachable (%s); its replicas serve", o, e)
                        unreachable.add(o)

            each_worker(drop_others=False)  # warm
            if (
                table.moe_layers == self.table.moe_layers
                and table.table.shape == self.table.table.shape
                and (table.table == self.table.table).all()
            ):
                self.placement = placement  # the same routing (e.g. the plan it started with): nothing to push
            else:
                done = threading.Event()
                with self.wake:
                    self._switch = (placement, table, done)
                    self.wake.notify_all()
                if not done.wait(timeout):
                    raise TimeoutError(f"re-plan: the scheduler did not switch tables within {timeout} s")
                time.sleep(drain_delay)
            each_worker(drop_others=True)  # drain
            moved = {o for o, (pairs, _) in enumerate(shards) if set(pairs) != before[o]}
            loaded = sum(len(set(pairs) - before[o]) for o, (pairs, _) in enumerate(shards))
            dropped = sum(len(before[o] - set(pairs)) for o, (pairs, _) in enumerate(shards))
            log.info(
                "re-planned onto plan %s: %d shards loaded, %d dropped, on expert workers %s",
                self.plan_hash,
                loaded,
                dropped,
                sorted(moved),
            )
            return {"loaded": loaded, "dropped": dropped, "unreachable": sorted(unreachable)}

    def take_switch(self, down: set[int], mark_down: Callable[[int, Exception], None]) -> None:
        """Between steps (the scheduler thread): adopt a waiting re-plan's table and push it to every attention
        worker not in `down`; one that does not answer is marked down (reconnected with the new table when it is
        back)."""
        with self.wake:
            switch, self._switch = self._switch, None
        if switch is None:
            return
        placement, table, done = switch
        self.placement, self.table = placement, table
        for i in range(len(self.attention)):
            if i not in down:
                try:
                    self.connect(i)
                except ConnectionError as e:
                    mark_down(i, e)
        done.set()
