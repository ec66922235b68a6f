"""The router's engine: continuous batching over attention workers, which exchange tokens with the expert workers
themselves. It executes router/scheduler.py's pure decisions.

Each scheduler step (the scheduler thread):
  1. take a re-plan's replica table if one waits (router/replan.py), end cancelled requests;
  2. plan the step (scheduler.schedule: admissions, KV growth, the batches and the prefixes to save);
  3. apply it: open the admitted requests' sequences, extend the reservations that ran out (dropping prefixes and
     preempting the youngest while a worker is out of blocks) — when a worker answers otherwise than the plan
     expected, the rest of the step is planned again from the state as it now is;
  4. one `run_step` call per attention worker, concurrently: the worker runs every layer, dispatching its tokens to
     the expert workers directly at each MoE layer, and returns sampled tokens;
  5. apply each result (scheduler.update_from_output): tokens and log-probs to the requests, finished ones closed,
     saved prefixes recorded. A worker that fails is marked down (router/health.py) and its requests go back to
     the queue to replay what they had elsewhere — the same tokens;
  6. with a prefill pool (router/disagg.py): hand each sequence whose prompt a prefill worker finished to a decode
     worker — the call runs beside the next steps (the sequence sits them out), the prefill worker sends the KV
     itself, and a hand-off that fails leaves the sequence where it was (or, its prefill worker gone, replays it).
The router's traffic is token ids and plan entries — independent of hidden size and layer count. Workers are
reached through clients with the same methods whether in process or over gRPC. The request and its errors live in
router/request.py, the KV / prefix index in router/kv.py. The settings are one frozen EngineConfig
(router/engine_config.py); the constructor does no I/O and `start()` waits for the workers and starts the
scheduler, health and prefix-index threads. Step 4-5's calls are router/step_calls.py, step 6's hand-offs
router/handoffs.py (both mixins of Engine).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import context as otel_context

from expertmesh.model.config import ModelConfig
from expertmesh.router.disagg import Pools
from expertmesh.router.engine_config import EngineConfig
from expertmesh.router.handoffs import HandOffs, InTransit
from expertmesh.router.health import AttentionHealth
from expertmesh.router.instrument import InstrumentedClient
from expertmesh.router.kv import KVManager, WorkerKV
from expertmesh.router.metrics import EngineStats, RouterMetrics
from expertmesh.router.prefix_scope import PrefixScope
from expertmesh.router.prepared_image import ImageLimits, image_positions
from expertmesh.router.replan import LivePlan
from expertmesh.router.request import (  # noqa: F401  (the API layers import the errors from here too)
    ContextLengthExceeded,
    EngineClosed,
    ExpertsUnavailable,
    QueueFull,
    Request,
    RequestError,
    TokenLogprob,
)
from expertmesh.router.scheduler import Admission, Growth, Limits, StepPlan, check_request, schedule
from expertmesh.router.step_calls import StepCalls
from expertmesh.router.work_deadline import WorkRates
from expertmesh.runtime import telemetry
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import ImageSpan, OutOfBlocks, WorkerError

log = logging.getLogger("expertmesh.router")


def _first_info(client, timeout: float) -> dict:
    """A worker that is still starting (pods start in any order) is waited for, up to `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.info()
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Engine(StepCalls, HandOffs):
    def __init__(
        self,
        cfg: ModelConfig,
        attention: list,
        experts: list,
        placement,
        config: EngineConfig | None = None,
        *,
        prefill: list | None = None,
        metrics: RouterMetrics | None = None,
    ):
        """The engine over `attention` (with `prefill`: the decode pool, `prefill` the prefill pool's workers; none:
        one colocated pool, router/disagg.py) and `experts` (clients, in process or remote), following `placement`,
        as `config` says (router/engine_config.py). No I/O here — no call to a worker, no thread: `start()` waits
        for the workers and starts serving."""
        self.config = config = config or EngineConfig()
        self.cfg = cfg
        self.metrics = metrics or RouterMetrics()
        self.metrics.bind(self)
        self.pools = Pools.of(len(attention), len(prefill or ()), config.prefill_min_tokens)
        self.attention = [
            InstrumentedClient(a, self.metrics, "attention") for a in list(attention) + list(prefill or ())
        ]
        self.transit: dict[Request, InTransit] = {}  # requests being handed off (prefill → decode)
        self.experts = [InstrumentedClient(e, self.metrics, "expert") for e in experts]
        # threads start with the first call submitted (Engine.start's), not here
        self.pool = ThreadPoolExecutor(
            max_workers=max(8, 2 * (len(self.attention) + len(self.experts))), thread_name_prefix="router-call"
        )
        self.expert_clients = [e._client for e in self.experts]  # what attention workers dispatch to
        self.cv = threading.Condition()
        self.plan = LivePlan(
            cfg,
            placement,
            self.attention,
            self.experts,
            self.expert_clients,
            pool=self.pool,
            wake=self.cv,
            transport=config.transport,
            probe_interval=config.health_interval,
            mtp=config.speculative_method == "mtp" and config.speculative_tokens > 0,
        )
        # sequence ids are this router instance's own, prefix keys its own or its replicas' (a shared salt): a
        # client's request id never reaches a worker, and no other party can compute (to replace or drop) the
        # prefix keys saved there; within the salt, each request's keys are its scope's (router/prefix_scope.py)
        self.instance = os.urandom(6).hex()
        self.seq_ids = itertools.count()
        salt = config.prefix_salt if config.prefix_salt is not None else os.urandom(16)
        # the workers join at start(); with a cluster store every saved prefix is in it (written through)
        self.kv = KVManager(None, chunk=config.prefill_chunk, salt=salt, store=config.kv_store)
        self._listings: dict[int, tuple[set[str], list]] = {}  # worker → (keys known, its ListPrefixes) to merge
        self.health = AttentionHealth(
            self.attention, self.kv, owner=self.instance, interval=config.health_interval, connect=self.plan.connect
        )
        self._last_refresh = 0.0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = EngineStats()
        self.step_rates = WorkRates(config.call_timeout)  # seconds per unit of step work, per attention worker
        self.metrics.registry.register(self.step_rates)
        self.step_ids = itertools.count(int.from_bytes(os.urandom(6), "little") << 8)  # unique per router
        self.closed = False
        self.thread: threading.Thread | None = None  # the scheduler, once started

    def start(self) -> Engine:
        """Wait for every attention worker's first answer (a worker still starting is waited for up to
        `startup_timeout`; ConnectionError past it), learn its KV pool, connect it to the expert workers, and start
        the scheduler, health and prefix-index threads. Returns the engine, serving."""
        if self.thread is not None:
            raise RuntimeError("the engine is started already")
        infos = [_first_info(a, self.config.startup_timeout) for a in self.attention]
        for i, info in enumerate(infos):
            if info.get("pool", "mixed") != self.pools.name(i):
                log.warning(
                    "attention worker %d (%s) says it serves pool %r; this router uses it in %r",
                    i,
                    info.get("name"),
                    info.get("pool"),
                    self.pools.name(i),
                )
            self._check_speculation(i, info)
            self.kv.add_worker(WorkerKV(i, info["block_size"], info["total_blocks"], info["free_blocks"]))
        for i in range(len(self.attention)):
            self.plan.connect(i)
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()
        threading.Thread(target=self.health.watch, args=(lambda: self.closed,), name="health", daemon=True).start()
        if self.config.prefix_index_refresh > 0:
            threading.Thread(target=self._watch_prefixes, name="prefix-index", daemon=True).start()
        return self

    def _check_speculation(self, i: int, info: dict) -> None:
        """Refuse to start when attention worker `i` drafts otherwise than this router plans (it grants K + 1
        tokens a step per sequence and reserves KV for them)."""
        k, method = self.config.speculative_tokens, self.config.speculative_method
        theirs = (info.get("speculative_tokens", 0), info.get("speculative_method", "") or "")
        if theirs != ((k, method) if k else (0, "")):
            raise ValueError(
                f"--speculative-tokens: attention worker {i} ({info.get('name')}) speculates with "
                f"{theirs[0]} tokens{f' ({theirs[1]})' if theirs[0] else ''}, this router with {k}"
                f"{f' ({method})' if k else ''}; start both with the same --speculative-tokens and "
                f"--speculative-method"
            )

    @property
    def started(self) -> bool:
        return self.thread is not None

    @property
    def model_name(self) -> str:
        return self.config.model_name or self.cfg.name

    @property
    def image_limits(self) -> ImageLimits:
        """What the APIs accept as image input."""
        return self.config.image_limits

    # ------------------------------------------------------------------ public
    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        check_request(prompt, params, vocab_size=self.cfg.vocab_size, kv=self.kv, limits=self.limits)

    @property
    def limits(self) -> Limits:
        """The scheduling settings (the context read from `cfg` each time)."""
        return self.config.limits(max_context=self.cfg.max_context, snapshot_within_step=not self.cfg.n_kda_layers)

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        images: list | None = None,
        scope: PrefixScope | None = None,
        **kw,
    ) -> Request:
        """`images` (router.images.PreparedImage, in prompt order): each fills the next image placeholder run.
        `scope`: whom the request's cached prefixes are shared with, under `--prefix-cache-scope`
        (router/prefix_scope.py; None: the shared scope of requests that set nothing)."""
        if not self.started:
            raise EngineClosed("the engine is not started")
        self.validate(prompt, params)
        if scope is not None:
            kw["cache_scope"] = scope.digest(self.config.prefix_cache_scope)
        if images:
            if self.cfg.vision is None:
                raise RequestError(f"images: model {self.model_name!r} takes text only")
            try:
                kw["images"] = list(zip(image_positions(prompt, images, self.cfg.vision), images))
            except ValueError as e:
                raise RequestError(f"prompt: {e}") from None
        req = Request(prompt=list(prompt), params=params, **kw)
        if telemetry.tracing_enabled():
            req.trace_ctx = otel_context.get_current()
            req.queue_span = telemetry.tracer().start_span("queue", context=req.trace_ctx)
        with self.cv:
            if self.closed:
                raise EngineClosed("the engine is shutting down")
            if len(self.waiting) >= self.config.max_waiting:
                raise QueueFull(f"waiting queue full ({self.config.max_waiting} requests); retry later")
            self.waiting.append(req)
            self.cv.notify_all()
        return req

    def generate(self, prompt: list[int], params: SamplingParams, timeout: float | None = 300) -> Request:
        return self.submit(prompt, params).wait(timeout)

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        with self.cv:
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=30)
        for req in self.waiting + self.running:
            self._fail(req, EngineClosed("the router is shutting down"))
        self.pool.shutdown(wait=False, cancel_futures=True)

    def load_stats(self) -> dict[int, list[int]]:
        """Tokens routed per (MoE layer, expert), summed over the live attention workers (each counts its own)."""
        total: dict[int, list[int]] = {l: [0] * self.cfg.moe.n_routed_experts for l in self.plan.layers}
        for i, a in enumerate(self.attention):
            if i in self.attention_down:
                continue
            try:
                load = a.expert_load()
            except Exception as e:
                log.debug("expert_load from attention worker %d failed: %s", i, e)
                continue
            for l, row in load.items():
                total[l] = [x + y for x, y in zip(total[l], row)]
        return total

    @property
    def attention_down(self) -> set[int]:
        """Attention workers marked down (taken back once they answer again)."""
        return self.health.down

    @property
    def experts_down(self) -> list[int]:
        """Expert workers some live attention worker saw down after its last step."""
        return self.health.experts_down

    @property
    def pending_closes(self) -> dict[int, list[str]]:
        """Attention worker → sequences to close there once it answers again."""
        return self.health.pending_closes

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    @property
    def placement(self):
        return self.plan.placement

    @property
    def replicas(self):
        return self.plan.table

    @property
    def plan_hash(self) -> str | None:
        """The hash of the placement plan the replica table now follows (None for a plan-less placement)."""
        return self.plan.plan_hash

    def replan(self, placement, timeout: float = 600.0, drain_delay: float = 0.0) -> dict:
        """Adopt a new placement plan live, without failing or changing a request (router/replan.py)."""
        return self.plan.replan(placement, timeout=timeout, drain_delay=drain_delay)

    # ------------------------------------------------------------------ scheduler loop
    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.closed and not self.waiting and not self.running and not self.plan.switch_pending:
                    self.cv.wait(timeout=1.0)
                if self.closed:
                    return
            try:
                self.plan.take_switch(self.attention_down, self.health.mark_down)
                self._drop_cancelled()
                self._step()
            except Exception as e:  # a failed step fails its requests, never the loop
                log.exception("scheduler step failed")
                for req in list(self.running):
                    self._fail(req, e)

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.running if r.cancelled and r not in self.transit]:
            self._finish(req, "cancelled")
        with self.cv:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                self._fail(req, RequestError("cancelled"))

    def _schedule(self, admit: bool = True) -> StepPlan:
        with self.cv:
            waiting = list(self.waiting)
        running = [r for r in self.running if r not in self.transit]
        return schedule(
            waiting,
            running,
            self.kv,
            limits=self.limits,
            down=frozenset(self.attention_down),
            now=time.monotonic(),
            admit=admit,
            pools=self.pools,
        )

    def _step(self) -> None:
        self._land_handoffs()
        self._merge_listings()
        plan = self._schedule()
        if plan.blocked and self._refresh_all():  # the counts may be stale: plan on the workers' own
            plan = self._schedule()
        self._expire(plan.expire)
        if not self._admit(plan.admissions):
            plan = self._schedule(admit=False)
        if not self.running:
            time.sleep(0.002)
            return
        if not self._grow(plan.growth):
            plan = self._schedule(admit=False)
        if plan.batches:
            self._run(plan.batches)
        if self.pools.split:
            self._start_handoffs()
        if not plan.batches and self.transit:
            with self.cv:  # only hand-offs in flight: wait for one to land (or new work)
                self.cv.wait(timeout=0.01)

    # ------------------------------------------------------------------ the prefix index across router replicas
    def _watch_prefixes(self) -> None:
        while not self.closed:
            time.sleep(self.config.prefix_index_refresh)
            self.read_prefix_index()

    def read_prefix_index(self) -> None:
        """Read every live worker's cached prefixes (ListPrefixes: keys only, a cheap call) for the scheduler to
        merge into the index before its next plan (KVManager.learn): the prefixes router replicas sharing this
        one's salt saved there become hits here, those they dropped are forgotten. The calls run here (the
        prefix-index thread), the merge on the scheduler thread, which alone changes the index while it plans."""
        for i, client in enumerate(self.attention):
            if i in self.attention_down:
                continue
            known = self.kv.prefixes_of(i)
            try:
                listing = client.list_prefixes()
            except Exception as e:  # a worker that does not answer is the heartbeat's business
                log.debug("list_prefixes on attention worker %d failed: %s", i, e)
                continue
            with self.cv:
                self._listings[i] = (known, listing)

    def _merge_listings(self) -> None:
        with self.cv:
            listings, self._listings = self._listings, {}
        for i, (known, listing) in listings.items():
            if i not in self.attention_down:
                self.kv.learn(i, listing, known)
            else:  # gone since it listed them: what it put in the cluster store another worker still restores
                self.kv.learn(i, [entry for entry in listing if entry[2] == "store"])

    def _refresh_all(self, interval: float = 0.5) -> bool:
        """Re-read every live worker's free blocks (at most every `interval` s): the router's counts go stale when
        blocks are freed behind its back (another router, a close that failed); True when it re-read them."""
        now = time.monotonic()
        if now - self._last_refresh < interval:
            return False
        self._last_refresh = now
        for i in range(len(self.attention)):
            if i not in self.attention_down:
                self._refresh(i)
        return True

    def _refresh(self, worker: int) -> None:
        try:
            self.kv.report(worker, self.attention[worker].info(owner=self.instance)["free_blocks"])
        except ConnectionError as e:
            self.health.mark_down(worker, e)

    def _unqueue(self, req: Request) -> bool:
        with self.cv:
            if req not in self.waiting:
                return False
            self.waiting.remove(req)
            return True

    def _expire(self, expired: list[Request]) -> None:
        """Refuse requests that waited longer than `max_queue_wait` for KV room (429: retry later)."""
        for req in [r for r in expired if self._unqueue(r)]:
            self._fail(
                req,
                QueueFull(
                    f"no KV room for {len(req.prompt) + req.params.max_tokens} tokens "
                    f"(prompt + max_tokens) within {self.config.max_queue_wait:g} s; retry later"
                ),
            )

    # ------------------------------------------------------------------ applying a plan
    def _admit(self, admissions: list[Admission]) -> bool:
        """Open the admitted requests' sequences, in order; False at the first that did not go as planned (placed
        otherwise, refused, or placed nowhere: it stays first in the queue), leaving the rest waiting."""
        return all(self._open(adm) for adm in admissions)

    def _open(self, adm: Admission) -> bool:
        """Open one request's sequence on the first candidate that takes it; True when that was the first."""
        req = adm.req
        if adm.hit is not None:
            self.kv.touch(adm.hit, req)
        candidates = adm.candidates
        if adm.evict:
            worker = candidates[0][0]
            for key in adm.evict:
                if self.kv.has(key) and not self.kv.is_lower(key):
                    self._evict(worker, key)
                if self.kv.workers[worker].free_blocks >= adm.need:
                    break
            else:  # the evictions did not make room (its sequences hold it):
                candidates = candidates[1:]  # the next candidate, a worker that fits it now, if there is one
                if not candidates:
                    return False
        for n, (worker, key, length) in enumerate(candidates):
            seq_id = f"{self.instance}-{next(self.seq_ids)}"
            lower = key is not None and self.kv.is_lower(key)
            try:
                # images wholly inside the cached prefix are not sent: their rows are in the cache already
                images = [ImageSpan(pos, img.pixels) for pos, img in req.images if pos + img.tokens > length]
                cached = self.attention[worker].open_sequence(
                    seq_id,
                    req.params,
                    reserve_tokens=adm.reserve,
                    prefix_key=key,
                    owner=self.instance,
                    **({"images": images} if images else {}),
                )
            except WorkerError as e:  # the worker refuses the request itself: it must not block the queue
                self._unqueue(req)
                self._fail(req, RequestError(str(e)))
                return False
            except ConnectionError as e:  # unreachable or hung: down (no request waits on it again) until it
                self.health.mark_down(worker, e)  # answers its health check; the next candidate is tried
                continue
            except OutOfBlocks as e:  # no room there now (a restore needs the prefix's blocks too): the next one
                log.debug("open_sequence on %d: %s", worker, e)
                self._refresh(worker)
                continue
            except Exception as e:  # prefix gone (or a lower tier's copy refused): try the next candidate
                log.debug("open_sequence on %d failed: %s", worker, e)
                if key is not None:  # forgotten here, so dropped there too: never pinned unknown
                    self.kv.forget(key)
                    try:
                        self.attention[worker].drop_prefix(key)
                    except Exception:
                        pass
                self._refresh(worker)
                continue
            if key is not None:
                req.last_key = key
                tier = "lower" if lower or self.kv.prefixes.get(key) != worker else "device"
                self.kv.restored(key, worker)
                self.metrics.prefix_hits.labels(tier).inc()
                self.metrics.prefix_hit_tokens.labels(tier).inc(cached)
            self._unqueue(req)
            self._placed(req, worker, seq_id, cached, adm.reserve)
            return candidates is adm.candidates and n == 0 and cached == length  # as planned
        return False

    def _placed(self, req: Request, worker: int, seq_id: str, cached: int, reserve: int) -> None:
        req.worker, req.seq_id, req.computed, req.cached_tokens = worker, seq_id, cached, cached
        req.reserved = reserve
        if req.queue_span is not None:
            req.queue_span.set_attribute("expertmesh.attention_worker", worker)
            req.queue_span.set_attribute("expertmesh.cached_tokens", cached)
            req.queue_span.end()
            req.queue_span = None
        self.kv.opened(worker)
        self._refresh(worker)
        self.stats.prompt_tokens += len(req.prompt)
        self.stats.cached_tokens += cached
        if not req.done:
            self.running.append(req)

    def _drop_prefix(self, worker: int, key: str) -> None:
        self.kv.forget(key)
        self.kv.report(worker, self.attention[worker].drop_prefix(key))

    def _evict(self, worker: int, key: str) -> None:
        """Take a prefix off `worker`'s device pool: dropped when superseded (a longer prefix of its conversation
        holds all of it), else demoted to the worker's lower tiers (router/eviction.py); the keys the worker
        reports dropped for good leave the index."""
        if self.kv.superseded(key):
            self._drop_prefix(worker, key)
            self.metrics.prefix_evictions.labels("dropped_superseded").inc()
            return
        free, dropped = self.attention[worker].demote_prefix(key)
        self.kv.report(worker, free)
        self.kv.demoted(key)
        if self.config.kv_store and key not in dropped:  # the workers put what they demote in the cluster store
            self.kv.stored(key)
        if key not in dropped:
            self.metrics.prefix_evictions.labels("demoted").inc()
        for k in dropped:
            self.kv.forget(k)
        self.metrics.prefix_evictions.labels("dropped").inc(len(dropped))

    def _grow(self, growth: list[Growth]) -> bool:
        """Extend the reservations that ran out; while a worker is out of blocks, make room as each growth says.
        False when anything but a plain extension happened (the running set or the prefixes changed)."""
        plain = True
        for g in growth:
            req = g.req
            evict, victims = list(g.evict), list(g.preempt)
            while req in self.running:
                w = req.worker
                try:
                    self.kv.report(w, self.attention[w].extend_sequence(req.seq_id, g.target))
                    req.reserved = g.target
                    break
                except OutOfBlocks:
                    self._refresh(w)
                    if g.optional:  # speculation's room only: the step emits fewer tokens
                        break
                except ConnectionError as e:
                    self.health.mark_down(w, e)
                    self._recover(req)
                    plain = False
                    break
                plain = False
                while evict and (not self.kv.has(evict[0]) or self.kv.is_lower(evict[0])):
                    evict.pop(0)  # evicted meanwhile
                if evict:
                    self._evict(w, evict.pop(0))
                    continue
                while victims and not (victims[0] in self.running and victims[0].worker == w):
                    victims.pop(0)  # preempted, recovered or finished meanwhile
                if not victims:
                    self._finish(req, "length")  # the worker's whole KV cannot hold more of it
                    break
                self._preempt(victims.pop(0))
        return plain

    def _preempt(self, req: Request) -> None:
        """Free a running request's KV for others: closed now, requeued at the head keeping its output."""
        self.health.close(req.worker, req.seq_id)
        self._requeue(req)
        self.stats.preempted += 1

    def _recover(self, req: Request) -> None:
        """A request whose attention worker died goes back to the head of the queue keeping its output; its
        sequence there is closed once the worker is back."""
        self.health.close_later(req.worker, req.seq_id)
        self._requeue(req)
        self.stats.recovered += 1

    def _requeue(self, req: Request) -> None:
        """Back at the head of the queue: placed again (on a live worker), it replays prompt + output on the same
        schedule, so the same tokens."""
        self.kv.released(req.worker)
        req.worker, req.seq_id, req.computed, req.reserved, req.held_mark = -1, "", 0, 0, 0
        req.last_key = None
        req.queued_at = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        with self.cv:
            self.waiting.insert(0, req)

    # ------------------------------------------------------------------ ending requests
    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.worker >= 0 and req.seq_id:
            self.health.close(req.worker, req.seq_id)
            self.kv.released(req.worker)
            req.seq_id = ""

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        req.finish_reason = reason
        self.stats.ended(reason)
        req._emit("done", None)

    def _fail(self, req: Request, error: Exception) -> None:
        if req.done:
            return
        if req.queue_span is not None:
            req.queue_span.end()
            req.queue_span = None
        self._release(req)
        req.error = error
        self.stats.ended("error")
        req._emit("error", error)
