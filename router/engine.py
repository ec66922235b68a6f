"""The router's engine: continuous batching over attention workers, which exchange tokens with the expert
workers themselves.

Each scheduler step:
  1. admit waiting requests at the step boundary (KV must fit what the request has + kv_growth tokens; it grows
     as the request decodes, preempting the youngest sequence when a worker is full; a cached
     prefix pins the request to the worker holding it);
  2. plan each attention worker's batch (router/scheduler.py: pure decisions — decode tokens, prefill chunks
     ending at multiples of `prefill_chunk`, prefixes to save);
  3. one `run_step` call per attention worker, concurrently: the worker runs every layer, dispatching its
     tokens to the expert workers directly at each MoE layer (worker/exchange.py), and returns sampled tokens;
  4. hand sampled tokens to the requests, finish the ones that stop, record saved prefixes.
The router's traffic is token ids and plan entries — independent of hidden size and layer count.
Workers are reached through clients with the same methods whether in process or over gRPC. The request and its
errors live in router/request.py, the step planner in router/scheduler.py, the KV / prefix index in router/kv.py.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from opentelemetry import context as otel_context

from expertmesh import telemetry
from expertmesh.config import ModelConfig
from expertmesh.router.health import AttentionHealth, serving
from expertmesh.router.instrument import InstrumentedClient
from expertmesh.router.kv import KVManager, WorkerKV
from expertmesh.router.metrics import EngineStats, RouterMetrics
from expertmesh.router.prepared_image import ImageLimits, image_positions
from expertmesh.router.replan import LivePlan
from expertmesh.router.request import (  # noqa: F401
    ContextLengthExceeded,
    EngineClosed,
    ExpertsUnavailable,
    QueueFull,
    Request,
    RequestError,
    TokenLogprob,
)
from expertmesh.router.scheduler import plan_snapshots, plan_step
from expertmesh.router.tracing import StepTrace, record_image_encodes
from expertmesh.sampling_params import SamplingParams, check_sampling
from expertmesh.worker_api import (
    ImageSpan,
    NotConnected,
    OutOfBlocks,
    StepDone,
    StepSegment,
    TokenLogprobs,
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


class Engine:
    def __init__(self, cfg: ModelConfig, attention: list, experts: list, placement, *,
                 prefill_chunk: int = 16, max_batch_tokens: int = 256, max_running: int = 64,
                 max_waiting: int = 256, call_timeout: float = 60.0, model_name: str | None = None,
                 metrics=None, health_interval: float = 1.0, startup_timeout: float = 120.0,
                 max_queue_wait: float = 300.0, kv_growth: int = 256, transport: str = "grpc", image_limits=None):
        """`max_queue_wait`: seconds a request may wait for KV room before it is refused (429, retry later);
        `kv_growth`: tokens of KV a sequence reserves ahead (at placement and each time it runs out);
        `transport`: how attention workers exchange each MoE layer with the expert workers (grpc | collective:
        worker/collective.py)."""
        if transport not in ("grpc", "collective"):
            raise ValueError(f"transport: expected grpc or collective, found {transport!r}")
        self.transport = transport
        self.image_limits = image_limits or ImageLimits()     # what the APIs accept as image input
        self.kv_growth = max(1, kv_growth)
        self.cfg = cfg
        self.model_name = model_name or cfg.name
        self.metrics = metrics or RouterMetrics()
        self.metrics.bind(self)
        self.attention = [InstrumentedClient(a, self.metrics, "attention") for a in attention]
        self.experts = [InstrumentedClient(e, self.metrics, "expert") for e in experts]
        attention, experts = self.attention, self.experts
        self.prefill_chunk = prefill_chunk
        self.max_batch_tokens = max(max_batch_tokens, prefill_chunk)
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.call_timeout = call_timeout
        self.pool = ThreadPoolExecutor(max_workers=max(8, 2 * (len(attention) + len(experts))),
                                       thread_name_prefix="router-call")
        self.expert_clients = [e._client for e in experts]    # what attention workers dispatch to
        self.cv = threading.Condition()
        self.plan = LivePlan(cfg, placement, attention, experts, self.expert_clients, pool=self.pool, wake=self.cv,
                             transport=transport, probe_interval=health_interval)
        infos = [self._first_info(a, startup_timeout) for a in attention]
        # sequence ids and prefix keys are this router instance's own: a client's request id never reaches a
        # worker, and no other party can compute (to replace or drop) the prefix keys it saves there
        self.instance = os.urandom(6).hex()
        self.seq_ids = itertools.count()
        self.kv = KVManager([WorkerKV(i, info["block_size"], info["total_blocks"], info["free_blocks"])
                             for i, info in enumerate(infos)], chunk=prefill_chunk, salt=os.urandom(16))
        self.health = AttentionHealth(attention, self.kv, owner=self.instance, interval=health_interval,
                                      connect=self.plan.connect)
        self.max_queue_wait = max_queue_wait
        self._last_refresh = 0.0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = EngineStats()
        self.step_ids = itertools.count(int.from_bytes(os.urandom(6), 'little') << 8)  # unique per router
        self.closed = False
        for i in range(len(attention)):
            self.plan.connect(i)
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()
        threading.Thread(target=self.health.watch, args=(lambda: self.closed,), name="health", daemon=True).start()

    @staticmethod
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

    # ------------------------------------------------------------------ public
    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise RequestError("prompt: expected at least one token")
        if params.max_tokens < 0 or (params.max_tokens == 0 and params.prompt_logprobs is None):
            raise RequestError(f"max_tokens={params.max_tokens}: expected a positive integer (0 only when scoring "
                               f"the prompt with prompt_logprobs)")
        counts = {"prompt_tokens": len(prompt), "max_tokens": params.max_tokens, "context": self.cfg.max_context}
        if len(prompt) >= self.cfg.max_context and params.max_tokens > 0:
            raise ContextLengthExceeded(f"prompt: {len(prompt)} tokens, the model's context is {self.cfg.max_context} "
                                        f"tokens (at least one must remain to generate)", param="prompt", **counts)
        if len(prompt) + params.max_tokens > self.cfg.max_context:
            raise ContextLengthExceeded(f"max_tokens={params.max_tokens}: the prompt ({len(prompt)} tokens) plus "
                                        f"max_tokens exceeds the model's context of {self.cfg.max_context} tokens",
                                        param="max_tokens", **counts)
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]} outside [0, {self.cfg.vocab_size})")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"logit_bias: token id {bad[0]} outside [0, {self.cfg.vocab_size})")
        try:
            check_sampling(params)
        except ValueError as err:
            raise RequestError(str(err)) from None
        need = self._reserve(prompt, params)
        if all(self.kv.blocks_for(w.index, need) > w.total_blocks for w in self.kv.workers):
            raise RequestError(f"prompt: {len(prompt)} tokens (+ the first {need - len(prompt)} to generate) exceed "
                               f"the KV capacity of every attention worker")

    def _reserve(self, tokens: list[int], params: SamplingParams, prompt_len: int | None = None) -> int:
        """KV reserved when a request is placed: what it has (prompt, or prompt + output when replaying) plus up
        to `kv_growth` tokens; it grows by `kv_growth` as it decodes (`_grow`), so a large max_tokens holds no
        KV it does not use yet."""
        total = min((prompt_len if prompt_len is not None else len(tokens)) + params.max_tokens, self.cfg.max_context)
        return min(total, len(tokens) + self.kv_growth)

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
                self._admit()
                if self.running:
                    self._step()
                else:
                    time.sleep(0.002)
            except Exception as e:  # a failed step fails its requests, never the loop
                log.exception("scheduler step failed")
                for req in list(self.running):
                    self._fail(req, e)

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.running if r.cancelled]:
            self._finish(req, "cancelled")
        with self.cv:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                self._fail(req, RequestError("cancelled"))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self._place(req) and not (self._refresh_all() and self._place(req)):
                self._expire_waiting()
                break
            with self.cv:
                self.waiting.pop(0)
            if not req.done:                 # refused by the worker: already answered with its error
                self.running.append(req)

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

    def _expire_waiting(self) -> None:
        """Refuse requests that waited longer than `max_queue_wait` for KV room (429: retry later)."""
        now = time.monotonic()
        with self.cv:
            expired = [r for r in self.waiting if now - r.queued_at > self.max_queue_wait]
            for req in expired:
                self.waiting.remove(req)
        for req in expired:
            self._fail(req, QueueFull(f"no KV room for {len(req.prompt) + req.params.max_tokens} tokens "
                                      f"(prompt + max_tokens) within {self.max_queue_wait:g} s; retry later"))

    def _place(self, req: Request) -> bool:
        """Open the request's sequence on an attention worker; False when nothing fits right now."""
        reserve = self._reserve(req.tokens, req.params, len(req.prompt))
        # scoring the prompt needs every prompt position computed: no cached prefix
        hit = self.kv.lookup(req.hash_prompt) if req.params.prompt_logprobs is None else None
        candidates: list[tuple[int, str | None, int]] = []
        if hit is not None:
            candidates.append(hit)
        if hit is not None and hit[0] in self.attention_down:
            hit = None
            candidates = []
        w = self.kv.choose_worker(self.kv.blocks_for(0, reserve), exclude=self.attention_down)
        if w is not None:
            candidates.append((w, None, 0))
        elif hit is None and len(self.attention_down) < len(self.kv.workers):
            # evict cached prefixes on the live worker with the most free blocks, then retry once
            target = max((x for x in self.kv.workers if x.index not in self.attention_down),
                         key=lambda x: x.free_blocks).index
            for key in self.kv.eviction_candidates(target):
                self._drop_prefix(target, key)
                if self.kv.workers[target].free_blocks >= self.kv.blocks_for(target, reserve):
                    candidates.append((target, None, 0))
                    break
        for worker, key, length in candidates:
            seq_id = f"{self.instance}-{next(self.seq_ids)}"
            try:
                # images wholly inside the cached prefix are not sent: their rows are in the cache already
                images = [ImageSpan(pos, img.pixels) for pos, img in req.images if pos + img.tokens > length]
                cached = self.attention[worker].open_sequence(seq_id, req.params, reserve_tokens=reserve,
                                                              prefix_key=key, owner=self.instance,
                                                              **({"images": images} if images else {}))
            except WorkerError as e:   # the worker refuses the request itself: it must not block the queue
                self._fail(req, RequestError(str(e)))
                return True
            except Exception as e:  # out of blocks or prefix gone: try the next candidate
                log.debug("open_sequence on %d failed: %s", worker, e)
                if key is not None:              # forgotten here, so dropped there too: never pinned unknown
                    self.kv.forget(key)
                    try:
                        self.attention[worker].drop_prefix(key)
                    except Exception:
                        pass
                self._refresh(worker)
                continue
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
            return True
        return False

    def _refresh(self, worker: int) -> None:
        try:
            self.kv.workers[worker].free_blocks = self.attention[worker].info(owner=self.instance)["free_blocks"]
        except ConnectionError as e:
            self.health.mark_down(worker, e)

    # ------------------------------------------------------------------ live re-plan
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

    def _drop_prefix(self, worker: int, key: str) -> None:
        self.kv.forget(key)
        self.kv.workers[worker].free_blocks = self.attention[worker].drop_prefix(key)

    # ------------------------------------------------------------------ one step
    def _grow(self) -> None:
        """Before a step: every decoding sequence has room for the token it feeds. One that has not reserves
        `kv_growth` more; when its worker is out of blocks, cached prefixes there are dropped, then the youngest
        sequence there is preempted (closed and requeued: it replays what it had, the same tokens, later); a
        sequence alone on a worker that cannot hold it any longer ends with "length"."""
        for req in list(self.running):
            if req not in self.running or req.computed + 1 <= req.reserved:
                continue
            target = min(len(req.prompt) + req.params.max_tokens, self.cfg.max_context,
                         req.reserved + self.kv_growth)
            while req in self.running:
                w = req.worker
                try:
                    self.kv.workers[w].free_blocks = self.attention[w].extend_sequence(req.seq_id, target)
                    req.reserved = target
                    break
                except OutOfBlocks:
                    self._refresh(w)
                except ConnectionError as e:
                    self.health.mark_down(w, e)
                    self._recover(req)
                    break
                stale = self.kv.eviction_candidates(w)
                if stale:
                    self._drop_prefix(w, stale[0])
                    continue
                others = [r for r in self.running if r.worker == w and r is not req]
                if not others:
                    self._finish(req, "length")          # the worker's whole KV cannot hold more of it
                    break
                self._preempt(others[-1])                # the youngest (running keeps admission order)

    def _preempt(self, req: Request) -> None:
        """Free a running request's KV for others: closed now, requeued at the head keeping its output."""
        w, seq_id = req.worker, req.seq_id
        self.running.remove(req)
        self._close(w, seq_id)
        self.kv.workers[w].sequences -= 1
        req.worker, req.seq_id, req.computed, req.reserved = -1, "", 0, 0
        req.queued_at = time.monotonic()
        with self.cv:
            self.waiting.insert(0, req)
        self.stats.preempted += 1

    def _step(self) -> None:
        self._grow()
        batches = plan_step(self.running, max_batch_tokens=self.max_batch_tokens, prefill_chunk=self.prefill_chunk)
        if not batches:
            return
        step_id = next(self.step_ids)
        snapshots, snapshot_len = plan_snapshots(batches, prefill_chunk=self.prefill_chunk,
                                                 max_context=self.cfg.max_context, cached=self.kv.has,
                                                 salt=self.kv.salt)
        workers = sorted(batches)
        tracing = StepTrace(step_id, {w: [(p.req, p.tokens, p.sample) for p in items]
                                      for w, items in batches.items()}, self.attention)
        try:
            with tracing.layer("step", 0):
                futures = {w: self.pool.submit(self.attention[w].run_step, step_id,
                                               [StepSegment(p.req.seq_id, p.tokens, p.sample) for p in batches[w]],
                                               snapshots.get(w))
                           for w in workers}
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
            done: StepDone = results[w]
            self._apply(w, done, batches[w], snapshots.get(w) or {}, snapshot_len)

    def _apply(self, w: int, done: StepDone, batch: list, snapshots: dict[str, str],
               snapshot_len: dict[str, int]) -> None:
        """One attention worker's step result → the requests (tokens, log-probs, failures) and the KV index."""
        self.kv.workers[w].free_blocks = done.free_blocks
        self.health.experts_down_by[w] = set(done.experts_down)
        self.stats.exchange_bytes += done.exchange_bytes
        for seq_id, key in snapshots.items():
            if seq_id in done.failed:
                continue
            for stale in self.kv.record_prefix(w, key, snapshot_len[key]):
                self.kv.workers[w].free_blocks = self.attention[w].drop_prefix(stale)
        if done.image_encodes:
            record_image_encodes(self.metrics, done.image_encodes, {p.req.seq_id: p.req for p in batch}, w)
        logprobs: dict[str, list[TokenLogprobs]] = {}
        for run in done.logprobs:
            logprobs.setdefault(run.seq_id, []).append(run)
        for p in batch:
            req, toks, sample = p.req, p.tokens, p.sample
            reason = done.failed.get(req.seq_id)
            if reason is not None:
                self._fail(req, RuntimeError(reason) if reason.startswith("sampling failed")
                           else ExpertsUnavailable(reason))
                continue
            sampled = None
            for run in logprobs.get(req.seq_id, ()):
                for i, entry in enumerate(TokenLogprob.entries(run)):
                    if run.position + i < len(req.prompt):
                        req.prompt_logprobs.setdefault(run.position + i, entry)  # a replay scores it again
                    else:
                        sampled = entry
            req.computed += len(toks)
            if req.computed <= len(req.prompt):
                self.stats.prefilled_tokens += len(toks)
            if req.computed == len(req.prompt) and req.params.max_tokens == 0:
                self._finish(req, "length")                     # scored the prompt, nothing to generate
                continue
            if sample and req.computed < len(req.tokens):
                # replaying after a failover: this token was generated before; same schedule, same bits
                if req.params.temperature == 0 and done.tokens[req.seq_id] != req.tokens[req.computed]:
                    log.warning("request %s: replay diverged at %d", req.request_id, req.computed)
                continue
            if sample:
                self._accept(req, done.tokens[req.seq_id], sampled)

    def _gather(self, futures: dict, probe_every: float = 2.0) -> dict:
        """Results of one call per attention worker; a worker that is unreachable, past its deadline, has lost
        its expert table (restarted), or stops answering its health check while its step runs (hung, e.g.
        SIGSTOP: noticed within ~2 probes, not at the step deadline) is marked down and left out — the step goes
        on for the others, its sequences are rebuilt elsewhere."""
        results, pending = {}, dict(futures)
        deadline = time.monotonic() + self.call_timeout
        while pending:
            wait(list(pending.values()), timeout=min(probe_every, max(0.0, deadline - time.monotonic())),
                 return_when=FIRST_COMPLETED)
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

    def _recover(self, req: Request) -> None:
        """Put a request whose attention worker died back at the head of the queue, keeping its output: it
        is re-placed on a live worker and replays prompt + generated tokens on the same schedule."""
        self.kv.workers[req.worker].sequences -= 1
        self.health.close_later(req.worker, req.seq_id)   # closed there once it is back
        req.worker, req.seq_id, req.computed, req.reserved = -1, "", 0, 0
        req.queued_at = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        with self.cv:
            self.waiting.insert(0, req)
        self.stats.recovered += 1

    def _accept(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> None:
        if req.token_filter is not None:
            token = req.token_filter(req, token)
        if logprob is not None:
            req.logprobs.append(logprob if logprob.token == token else logprob.forced(token))
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
        if token in req.params.stop_token_ids:
            self._finish(req, "stop")
        elif len(req.output) >= req.params.max_tokens:
            self._finish(req, "length")
        elif len(req.tokens) >= self.cfg.max_context:
            self._finish(req, "length")

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.worker >= 0 and req.seq_id:
            self._close(req.worker, req.seq_id)
            self.kv.workers[req.worker].sequences -= 1
            req.seq_id = ""

    def _close(self, worker: int, seq_id: str) -> None:
        self.health.close(worker, seq_id)

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
