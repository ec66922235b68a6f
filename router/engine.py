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
router/request.py, the KV / prefix index in router/kv.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from expertmesh.model.config import ModelConfig
from expertmesh.router.disagg import Pools, choose_decode
from expertmesh.router.health import AttentionHealth, serving
from expertmesh.router.instrument import InstrumentedClient
from expertmesh.router.kv import KVManager, WorkerKV
from expertmesh.router.metrics import EngineStats, RouterMetrics
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
from expertmesh.router.scheduler import (
    Admission,
    Growth,
    Limits,
    Planned,
    StepPlan,
    check_request,
    schedule,
    update_from_output,
)
from expertmesh.router.tracing import StepTrace, record_image_encodes
from expertmesh.runtime import telemetry
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import (
    HandOffFailed,
    ImageSpan,
    NotConnected,
    OutOfBlocks,
    StepDone,
    StepSegment,
    WorkerError,
)

log = logging.getLogger("expertmesh.router")


def _public(error: Exception) -> Exception:
    """What a client may see of a failed step: no worker addresses or internals (those go to the log)."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return ConnectionError("attention workers unavailable for this step; retry")
    if isinstance(error, (RequestError, ExpertsUnavailable, EngineClosed)):
        return error
    return RuntimeError(f"the step failed on a worker ({type(error).__name__}); see the router log")


@dataclass
class _InTransit:
    """A hand-off in flight: its call, from / to which attention worker, the sequence id there, the blocks promised."""

    future: Future
    src: int
    to: int
    to_seq: str
    blocks: int


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


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        attention: list,
        experts: list,
        placement,
        *,
        prefill_chunk: int = 16,
        prefill_tokens: int = 0,
        max_batch_tokens: int | None = None,
        max_running: int = 64,
        max_waiting: int = 256,
        call_timeout: float = 60.0,
        model_name: str | None = None,
        metrics=None,
        health_interval: float = 1.0,
        startup_timeout: float = 120.0,
        max_queue_wait: float = 300.0,
        kv_growth: int = 256,
        transport: str = "grpc",
        image_limits=None,
        prefix_salt: bytes | None = None,
        prefix_index_refresh: float = 5.0,
        prefill: list | None = None,
        prefill_min_tokens: int = 0,
    ):
        """`prefill_chunk`: the prefix cache's granularity (prompt chunks end at its multiples); `prefill_tokens`:
        prompt chunks end at its multiples (0: at prefill_chunk's); `max_batch_tokens`: tokens per step (None: 256,
        or prefill_tokens + max_running if more, so a chunk always fits beside every decoding sequence); `max_queue_wait`:
        seconds a request may wait for KV room before it is refused (429, retry later);
        `kv_growth`: tokens of KV a sequence reserves ahead (at placement and each time it runs out);
        `transport`: how attention workers exchange each MoE layer with the expert workers (grpc | collective:
        worker/collective.py); `prefix_salt`: the secret prefix keys are salted with (None: a random one of this
        instance; router replicas given the same one compute the same keys, so each hits the prefixes the others
        saved); `prefix_index_refresh`: seconds between two reads of every live worker's cached prefixes into the
        index (what other replicas saved or dropped there; 0: only when a worker is taken back); `prefill`: the
        prefill pool's attention workers (`attention` is then the decode pool; none: one colocated pool), prompts
        shorter than `prefill_min_tokens` skipping it (router/disagg.py)."""
        if transport not in ("grpc", "collective"):
            raise ValueError(f"transport: expected grpc or collective, found {transport!r}")
        self.transport = transport
        self.image_limits = image_limits or ImageLimits()  # what the APIs accept as image input
        self.kv_growth = max(1, kv_growth)
        self.cfg = cfg
        self.model_name = model_name or cfg.name
        self.metrics = metrics or RouterMetrics()
        self.metrics.bind(self)
        self.pools = Pools.of(len(attention), len(prefill or ()), prefill_min_tokens)
        self.attention = [
            InstrumentedClient(a, self.metrics, "attention") for a in list(attention) + list(prefill or ())
        ]
        self.transit: dict[Request, _InTransit] = {}  # requests being handed off (prefill → decode)
        self.experts = [InstrumentedClient(e, self.metrics, "expert") for e in experts]
        if prefill_tokens and prefill_tokens % prefill_chunk:
            raise ValueError(f"prefill_tokens: {prefill_tokens} is not a multiple of prefill_chunk {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.prefill_tokens = max(prefill_tokens, prefill_chunk)
        self.max_batch_tokens = max(
            max_batch_tokens or max(256, self.prefill_tokens + max_running), self.prefill_tokens
        )
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_queue_wait = max_queue_wait
        self.call_timeout = call_timeout
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
            transport=transport,
            probe_interval=health_interval,
        )
        infos = [_first_info(a, startup_timeout) for a in self.attention]
        for i, info in enumerate(infos):
            if info.get("pool", "mixed") != self.pools.name(i):
                log.warning(
                    "attention worker %d (%s) says it serves pool %r; this router uses it in %r",
                    i,
                    info.get("name"),
                    info.get("pool"),
                    self.pools.name(i),
                )
        # sequence ids are this router instance's own, prefix keys its own or its replicas' (a shared salt): a
        # client's request id never reaches a worker, and no other party can compute (to replace or drop) the
        # prefix keys saved there
        if prefix_salt is not None and not prefix_salt:
            raise ValueError("prefix_salt: empty; expected the router replicas' shared secret")
        self.instance = os.urandom(6).hex()
        self.seq_ids = itertools.count()
        self.kv = KVManager(
            [
                WorkerKV(i, info["block_size"], info["total_blocks"], info["free_blocks"])
                for i, info in enumerate(infos)
            ],
            chunk=prefill_chunk,
            salt=prefix_salt if prefix_salt is not None else os.urandom(16),
        )
        self.prefix_index_refresh = prefix_index_refresh
        self._listings: dict[int, tuple[set[str], list]] = {}  # worker → (keys known, its ListPrefixes) to merge
        self.health = AttentionHealth(
            self.attention, self.kv, owner=self.instance, interval=health_interval, connect=self.plan.connect
        )
        self._last_refresh = 0.0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = EngineStats()
        self.step_ids = itertools.count(int.from_bytes(os.urandom(6), "little") << 8)  # unique per router
        self.closed = False
        for i in range(len(self.attention)):
            self.plan.connect(i)
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()
        threading.Thread(target=self.health.watch, args=(lambda: self.closed,), name="health", daemon=True).start()
        if prefix_index_refresh > 0:
            threading.Thread(target=self._watch_prefixes, name="prefix-index", daemon=True).start()

    # ------------------------------------------------------------------ public
    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        check_request(prompt, params, vocab_size=self.cfg.vocab_size, kv=self.kv, limits=self.limits)

    @property
    def limits(self) -> Limits:
        """The scheduling settings (the context read from `cfg` each time)."""
        return Limits(
            prefill_chunk=self.prefill_chunk,
            prefill_tokens=self.prefill_tokens,
            max_batch_tokens=self.max_batch_tokens,
            max_running=self.max_running,
            kv_growth=self.kv_growth,
            max_context=self.cfg.max_context,
            max_queue_wait=self.max_queue_wait,
            snapshot_within_step=not self.cfg.n_kda_layers,
        )

    def submit(self, prompt: list[int], params: SamplingParams, images: list | None = None, **kw) -> Request:
        """`images` (router.images.PreparedImage, in prompt order): each fills the next image placeholder run."""
        self.validate(prompt, params)
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
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"waiting queue full ({self.max_waiting} requests); retry later")
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
        self.thread.join(timeout=30)
        for req in self.waiting + self.running:
            self._fail(req, EngineClosed("the router is shutting down"))
        self.pool.shutdown(wait=False, cancel_futures=True)

    def load_stats(self) -> dict[int, list[int]]:
        """Tokens routed per (MoE layer, expert), summed over the live attention workers (each counts its own)."""
        total: dict[int, list[int]] = {l: [0] * self.cfg.moe.n_routed_experts for l in self.cfg.moe_layers}
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
            time.sleep(self.prefix_index_refresh)
            self.read_prefix_index()

    def read_prefix_index(self) -> None:
        """Read every live worker's cached prefixes (ListPrefixes: keys only, a cheap call) for the scheduler to
        merge into the index before its next plan (KVManager.learn): the prefixes router replicas sharing this
        one's salt saved there become hits here, those they dropped are forgotten. The calls run here (the
        prefix-index thread), the merge on the scheduler thread, which alone changes the index while it plans."""
        for i, client in enumerate(self.attention):
            if i in self.attention_down:
                continue
            known = {k for k, w in list(self.kv.prefixes.items()) if w == i}  # list(): one atomic copy
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
            self.kv.workers[worker].free_blocks = self.attention[worker].info(owner=self.instance)["free_blocks"]
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
                    f"(prompt + max_tokens) within {self.max_queue_wait:g} s; retry later"
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
                tier = "lower" if lower else "device"
                self.kv.restored(key)
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
        self.kv.workers[worker].sequences += 1
        self._refresh(worker)
        self.stats.prompt_tokens += len(req.prompt)
        self.stats.cached_tokens += cached
        self.metrics.prompt_tokens.inc(len(req.prompt))
        self.metrics.cached_tokens.inc(cached)
        if not req.done:
            self.running.append(req)

    def _drop_prefix(self, worker: int, key: str) -> None:
        self.kv.forget(key)
        self.kv.workers[worker].free_blocks = self.attention[worker].drop_prefix(key)

    def _evict(self, worker: int, key: str) -> None:
        """Take a prefix off `worker`'s device pool: dropped when superseded (a longer prefix of its conversation
        holds all of it), else demoted to the worker's lower tiers (router/eviction.py); the keys the worker
        reports dropped for good leave the index."""
        if self.kv.superseded(key):
            self._drop_prefix(worker, key)
            self.metrics.prefix_evictions.labels("dropped_superseded").inc()
            return
        free, dropped = self.attention[worker].demote_prefix(key)
        self.kv.workers[worker].free_blocks = free
        self.kv.demoted(key)
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
                    self.kv.workers[w].free_blocks = self.attention[w].extend_sequence(req.seq_id, g.target)
                    req.reserved = g.target
                    break
                except OutOfBlocks:
                    self._refresh(w)
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
        self.kv.workers[req.worker].sequences -= 1
        req.worker, req.seq_id, req.computed, req.reserved = -1, "", 0, 0
        req.last_key = None
        req.queued_at = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        with self.cv:
            self.waiting.insert(0, req)

    # ------------------------------------------------------------------ one step's calls
    def _run(self, batches: dict[int, list[Planned]]) -> None:
        step_id = next(self.step_ids)
        workers = sorted(batches)
        for items in batches.values():
            for p in items:
                if p.hasher is not None:
                    p.req.hasher = p.hasher
        tracing = StepTrace(
            step_id, {w: [(p.req, p.tokens, p.sample) for p in items] for w, items in batches.items()}, self.attention
        )
        try:
            with tracing.layer("step", 0):
                futures = {
                    w: self.pool.submit(
                        self.attention[w].run_step,
                        step_id,
                        [StepSegment(p.req.seq_id, p.tokens, p.sample) for p in batches[w]],
                        {
                            p.req.seq_id: p.snapshot if p.snapshot_at is None else (p.snapshot, p.snapshot_at)
                            for p in batches[w]
                            if p.snapshot
                        }
                        or None,
                    )
                    for w in workers
                }
                results = self._gather(futures)
        except ConnectionError as e:
            # every attention worker of the step is unreachable (a blip, a restart): the requests wait for one
            # to come back (replaying what they had) instead of failing — bounded by max_queue_wait
            tracing.end(e)
            log.error("step %d: %s; requeueing its requests", step_id, e)
            for w in workers:
                for p in batches[w]:
                    self._recover(p.req)
            return
        except Exception as e:
            tracing.end(e)
            log.error("step %d failed: %s", step_id, e)
            error = _public(e)
            for w in workers:
                for p in batches[w]:
                    self._fail(p.req, error)
            return
        tracing.end()
        self.stats.steps += 1
        self.stats.attention_calls += len(workers)
        for w in workers:
            if w not in results:
                for p in batches[w]:
                    self._recover(p.req)
                continue
            self._apply(w, results[w], batches[w])

    def _gather(self, futures: dict, probe_every: float = 2.0) -> dict:
        """Results of one call per attention worker; a worker that is unreachable, past its deadline, has lost
        its expert table (restarted), or stops answering its health check while its step runs (hung, e.g.
        SIGSTOP: noticed within ~2 probes, not at the step deadline) is marked down and left out — the step goes
        on for the others, its sequences are rebuilt elsewhere."""
        results, pending = {}, dict(futures)
        deadline = time.monotonic() + self.call_timeout
        while pending:
            wait(
                list(pending.values()),
                timeout=min(probe_every, max(0.0, deadline - time.monotonic())),
                return_when=FIRST_COMPLETED,
            )
            for w, f in list(pending.items()):
                if f.done():
                    del pending[w]
                    try:
                        results[w] = f.result()
                    except (ConnectionError, NotConnected, TimeoutError) as e:
                        self.health.mark_down(w, e)
                elif time.monotonic() >= deadline:
                    del pending[w]
                    self.health.mark_down(w, TimeoutError(f"no step result within {self.call_timeout:g} s"))
                elif not serving(self.attention[w], timeout=probe_every):
                    del pending[w]
                    self.health.mark_down(w, TimeoutError("its health check does not answer during the step"))
        if not results:
            raise ConnectionError("every attention worker in this step failed")
        return results

    def _apply(self, w: int, done: StepDone, batch: list[Planned]) -> None:
        """One attention worker's step result → the KV index and the requests (scheduler.update_from_output)."""
        update = update_from_output(batch, done, max_context=self.cfg.max_context)
        self.kv.workers[w].free_blocks = update.free_blocks
        self.health.experts_down_by[w] = update.experts_down
        self.stats.exchange_bytes += update.exchange_bytes
        for p in batch:
            if p.chain_key is None or p.req.seq_id in done.failed:
                continue
            if p.snapshot is not None:  # it extends the last prefix its request reached: one conversation
                for victim in self.kv.record_prefix(w, p.snapshot, p.prefix_end, parent=p.req.last_key, user=p.req):
                    if self.kv.has(victim) and not self.kv.is_lower(victim):
                        self._evict(w, victim)
            p.req.last_key = p.chain_key
        if done.image_encodes:
            record_image_encodes(self.metrics, done.image_encodes, {p.req.seq_id: p.req for p in batch}, w)
        for u in update.seqs:
            req = u.req
            if u.error is not None:
                self._fail(req, u.error)
                continue
            req.prompt_logprobs.update(u.prompt_logprobs)
            req.computed = u.computed
            self.stats.prefilled_tokens += u.prefilled
            if u.prefilled:
                self.metrics.prefill_tokens.labels(self.pools.name(w)).inc(u.prefilled)
            if u.diverged is not None:
                log.warning("request %s: replay diverged at %d", req.request_id, u.diverged[0])
            if u.token is not None:
                self._accept(req, u.token, u.logprob)
            if u.finish is not None:
                self._finish(req, u.finish)

    def _accept(self, req: Request, token: int, logprob: TokenLogprob | None) -> None:
        if logprob is not None:
            req.logprobs.append(logprob)
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.arrived)
        else:
            self.metrics.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        req.output.append(token)
        self.stats.generated_tokens += 1
        self.metrics.generation_tokens.inc()
        req._emit("token", token)

    # ------------------------------------------------------------------ prefill → decode hand-offs
    def _start_handoffs(self) -> None:
        """Move every sequence whose prompt a prefill worker finished to a decode worker with room
        (disagg.choose_decode), each call in the pool beside the next steps; one with no room yet waits (it decodes
        where it is meanwhile) and is tried again after the next step."""
        down = frozenset(self.attention_down)
        for req in self.running:
            if (
                req in self.transit
                or req.done
                or req.worker in down
                or self.pools.name(req.worker) != "prefill"
                or req.computed < len(req.prompt)
            ):
                continue
            to = choose_decode(self.kv, self.pools, down, req.reserved)
            if to is None:
                continue
            # promised (later choices see it taken); what the receiver reserves exactly: blocks_for(reserved)
            blocks = self.kv.blocks_for(to, req.reserved)
            self.kv.workers[to].free_blocks -= blocks
            self.kv.workers[to].sequences += 1
            to_seq = f"{self.instance}-{next(self.seq_ids)}"
            future = self.pool.submit(self._hand_off, req, req.worker, to, to_seq)
            self.transit[req] = _InTransit(future, req.worker, to, to_seq, blocks)
            future.add_done_callback(lambda _f: self._wake())

    def _wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def _hand_off(self, req: Request, src: int, to: int, to_seq: str):
        """The call (a pool thread): the prefill worker sends the sequence to the decode worker itself; traced as
        `kv.handoff` under the request's trace (the workers' spans join it)."""

        def call():
            return self.attention[src].hand_off(
                req.seq_id,
                self.attention[to]._client,
                to_seq,
                reserve_tokens=req.reserved,
                owner=self.instance,
                transport=self.transport,
            )

        if req.trace_ctx is None:
            return call()
        span = telemetry.tracer().start_span(
            "kv.handoff",
            context=req.trace_ctx,
            attributes={
                "expertmesh.handoff.from": self.attention[src].name,
                "expertmesh.handoff.to": self.attention[to].name,
                "expertmesh.kv.tokens": req.computed,
            },
        )
        with trace.use_span(span, end_on_exit=True, record_exception=True):
            done = call()
            span.set_attribute("expertmesh.kv.bytes", done.bytes)
            return done

    def _land_handoffs(self) -> None:
        """Apply the hand-offs that finished (the scheduler thread): the request now runs on its decode worker;
        or, when it failed, stays on its prefill worker (the receiver refused or had no room) or — the prefill
        worker gone — goes back to the queue to replay, its copy on the decode worker (if it got there) closed."""
        for req, t in list(self.transit.items()):
            if not t.future.done():
                continue
            del self.transit[req]
            src, to, to_seq = t.src, t.to, t.to_seq
            e = t.future.exception()
            if e is not None:  # not there: the promise is taken back
                self.kv.workers[to].sequences -= 1
                self.kv.workers[to].free_blocks += t.blocks
            if isinstance(e, (OutOfBlocks, HandOffFailed)):
                log.info("hand-off of %s to attention worker %d: %s; it stays on %d", req.request_id, to, e, src)
                self.metrics.handoffs.labels("refused").inc()
                self.health.close(to, to_seq)  # in case it got there and only the answer was lost
                self._refresh(to)
                continue
            if e is not None:
                log.warning("hand-off of %s from attention worker %d failed: %s; replaying it", req.request_id, src, e)
                self.metrics.handoffs.labels("failed").inc()
                if isinstance(e, ConnectionError):
                    self.health.mark_down(src, e)
                self.health.close(to, to_seq)
                if req in self.running:
                    self._recover(req)
                continue
            done = t.future.result()
            self.metrics.handoffs.labels("moved").inc()
            self.metrics.kv_transfer_bytes.inc(done.bytes)
            self.metrics.handoff_seconds.observe(done.seconds)
            self.kv.workers[src].free_blocks = done.free_blocks
            self.kv.workers[src].sequences -= 1
            req.worker, req.seq_id = to, to_seq
            if req not in self.running:  # ended meanwhile (close() failed it): not left open there
                self.health.close(to, to_seq)

    # ------------------------------------------------------------------ ending requests
    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.worker >= 0 and req.seq_id:
            self.health.close(req.worker, req.seq_id)
            self.kv.workers[req.worker].sequences -= 1
            req.seq_id = ""

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        req.finish_reason = reason
        self.stats.requests_finished += 1
        self.metrics.requests.labels(reason).inc()
        req._emit("done", None)

    def _fail(self, req: Request, error: Exception) -> None:
        if req.done:
            return
        if req.queue_span is not None:
            req.queue_span.end()
            req.queue_span = None
        self._release(req)
        req.error = error
        self.stats.requests_failed += 1
        self.metrics.requests.labels("error").inc()
        req._emit("error", error)
