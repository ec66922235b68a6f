"""The router's engine: continuous batching over attention and expert workers.

Each scheduler step:
  1. admit waiting requests at the step boundary (KV must fit: prompt + max_tokens reserved up front; a cached
     prefix pins the request to the worker holding it);
  2. build each attention worker's batch: every decoding sequence feeds its last token, prefilling sequences
     feed their next chunk (chunks end at multiples of `prefill_chunk`, so a long prompt never stalls decoding
     for more than a chunk and cached prefixes line up with fresh runs);
  3. run the layers in lock step across attention workers: at each MoE layer gather their route requests,
     dispatch once per expert worker, combine, send each attention worker its delta;
  4. hand sampled tokens to the requests, finish the ones that stop, save prefixes at chunk multiples.
Workers are reached through clients with the same methods whether in process or over gRPC.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from expertmesh import telemetry
from expertmesh.config import ModelConfig
from expertmesh.kernels.moe import moe_combine
from expertmesh.model import SamplingParams
from expertmesh.sampling import check_sampling
from expertmesh.router.dispatch import Dispatcher, ExpertsUnavailable
from expertmesh.router.kv import KVManager, PrefixHasher, WorkerKV
from expertmesh.router.tracing import StepTrace
from expertmesh.worker.attention import RouteRequest, StepDone, StepSegment, TokenLogprobs, WorkerError

log = logging.getLogger("expertmesh.router")


def _serving(client) -> bool:
    """Whether a worker answers its health check (in-process workers have none and never go down)."""
    health = getattr(client, "health", None)
    if health is None:
        return True
    try:
        return health() == "SERVING"
    except Exception:
        return False


class RequestError(ValueError):
    """Bad request (→ 400 / INVALID_ARGUMENT), naming the field."""


class ContextLengthExceeded(RequestError):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context (OpenAI's
    `context_length_exceeded`); carries the counts."""

    def __init__(self, message: str, *, prompt_tokens: int, max_tokens: int, context: int, param: str):
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.context, self.param = prompt_tokens, max_tokens, context, param


class QueueFull(RuntimeError):
    """The waiting queue is at its bound (→ 429 / RESOURCE_EXHAUSTED)."""


class EngineClosed(RuntimeError):
    pass


@dataclass
class TokenLogprob:
    """One token's log-probability under the model (before temperature / top-k / top-p) and its position's top
    alternatives, most likely first."""
    token: int
    logprob: float | None          # None: a token forced by the server (thinking budget) outside `top`
    top: list[tuple[int, float]]

    @staticmethod
    def entries(run: TokenLogprobs) -> list["TokenLogprob"]:
        return [TokenLogprob(t, lp, list(zip(ids, lps))) for t, lp, ids, lps in
                zip(run.token_ids.tolist(), run.logprobs.tolist(), run.top_ids.tolist(), run.top_logprobs.tolist())]

    def forced(self, token: int) -> "TokenLogprob":
        """The entry for `token` fed instead of this sampled one (same position, same alternatives)."""
        return TokenLogprob(token, dict(self.top).get(token), self.top)


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    # called with each sampled token; may return a different token to force (thinking budgets)
    token_filter: Callable[["Request", int], int] | None = None
    # runtime state
    worker: int = -1
    seq_id: str = ""
    computed: int = 0                     # tokens of prompt + output already fed to the model
    cached_tokens: int = 0
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    events: "queue.Queue" = field(default_factory=queue.Queue)   # ("token", id) / ("done", None)
    cancelled: bool = False
    notify: Callable[[], None] | None = None    # called after each event (wakes an async consumer)
    trace_ctx: object | None = None             # OpenTelemetry context of the request's root span
    queue_span: object | None = None
    hasher: PrefixHasher | None = None          # hash chain of tokens fed so far (prefix-cache keys)
    # params.prompt_logprobs: position (1..len(prompt)-1) → entry; params.logprobs: one entry per output token,
    # set before the token's event
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def _emit(self, kind: str, value) -> None:
        self.events.put((kind, value))
        if self.notify is not None:
            self.notify()

    def drain(self) -> list[tuple[str, object]]:
        """Events so far, without blocking."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def stream(self, timeout: float | None = None):
        """Yield tokens as they come; raises the request's error if it failed."""
        while True:
            kind, value = self.events.get(timeout=timeout)
            if kind == "token":
                yield value
            elif kind == "error":
                raise value
            else:
                return

    def wait(self, timeout: float | None = None) -> "Request":
        for _ in self.stream(timeout):
            pass
        return self


@dataclass
class EngineStats:
    steps: int = 0
    attention_calls: int = 0
    expert_calls: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0            # prompt tokens actually computed (cache hits excluded)
    cached_tokens: int = 0
    generated_tokens: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    max_calls_in_a_step: int = 0
    recovered: int = 0                   # requests rebuilt on another attention worker


class Engine:
    def __init__(self, cfg: ModelConfig, attention: list, experts: list, placement, *,
                 prefill_chunk: int = 16, max_batch_tokens: int = 256, max_running: int = 64,
                 max_waiting: int = 256, call_timeout: float = 60.0, model_name: str | None = None,
                 metrics=None, health_interval: float = 1.0, startup_timeout: float = 120.0):
        from expertmesh.router.instrument import InstrumentedClient
        from expertmesh.router.metrics import RouterMetrics
        self.cfg = cfg
        self.model_name = model_name or cfg.name
        self.metrics = metrics or RouterMetrics()
        self.metrics.bind(self)
        self.attention = [InstrumentedClient(a, self.metrics, "attention") for a in attention]
        self.experts = [InstrumentedClient(e, self.metrics, "expert") for e in experts]
        attention, experts = self.attention, self.experts
        self.placement = placement
        self.prefill_chunk = prefill_chunk
        self.max_batch_tokens = max(max_batch_tokens, prefill_chunk)
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.call_timeout = call_timeout
        self.pool = ThreadPoolExecutor(max_workers=max(8, 2 * (len(attention) + len(experts))),
                                       thread_name_prefix="router-call")
        self.dispatcher = Dispatcher(experts, placement, cfg.moe.n_routed_experts, cfg.moe_layers, pool=self.pool)
        infos = [self._first_info(a, startup_timeout) for a in attention]
        self.kv = KVManager([WorkerKV(i, info["block_size"], info["total_blocks"], info["free_blocks"])
                             for i, info in enumerate(infos)], chunk=prefill_chunk)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.attention_down: set[int] = set()
        self.stats = EngineStats()
        self.step_ids = itertools.count(int.from_bytes(os.urandom(6), 'little') << 8)  # unique per router
        self.cv = threading.Condition()
        self.closed = False
        self.health_interval = health_interval
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()
        threading.Thread(target=self._watch_health, name="health", daemon=True).start()

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
            raise RequestError(f"prompt + max_tokens = {need} tokens exceed the KV capacity of every attention worker")

    def _reserve(self, prompt: list[int], params: SamplingParams) -> int:
        return min(len(prompt) + params.max_tokens, self.cfg.max_context)

    def submit(self, prompt: list[int], params: SamplingParams, **kw) -> Request:
        self.validate(prompt, params)
        req = Request(prompt=list(prompt), params=params, **kw)
        if telemetry.tracing_enabled():
            from opentelemetry import context as otel_context
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

    def load_stats(self) -> dict:
        return self.dispatcher.load_stats()

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ scheduler loop
    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.closed and not self.waiting and not self.running:
                    self.cv.wait(timeout=1.0)
                if self.closed:
                    return
            try:
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
            if not self._place(req):
                break
            with self.cv:
                self.waiting.pop(0)
            if not req.done:                 # refused by the worker: already answered with its error
                self.running.append(req)

    def _place(self, req: Request) -> bool:
        """Open the request's sequence on an attention worker; False when nothing fits right now."""
        reserve = self._reserve(req.prompt, req.params)
        # scoring the prompt needs every prompt position computed: no cached prefix
        hit = self.kv.lookup(req.prompt) if req.params.prompt_logprobs is None else None
        candidates: list[tuple[int, str | None, int]] = []
        if hit is not None:
            candidates.append(hit)
        if hit is not None and hit[0] in self.attention_down:
            hit = None
            candidates = []
        w = self.kv.choose_worker(self.kv.blocks_for(0, reserve), exclude=self.attention_down)
        if w is not None:
            candidates.append((w, None, 0))
        elif hit is None:
            # evict cached prefixes on the worker with the most free blocks, then retry once
            target = max(self.kv.workers, key=lambda x: x.free_blocks).index
            for key in self.kv.eviction_candidates(target):
                self._drop_prefix(target, key)
                if self.kv.workers[target].free_blocks >= self.kv.blocks_for(target, reserve):
                    candidates.append((target, None, 0))
                    break
        for worker, key, length in candidates:
            seq_id = f"{req.request_id}-{worker}"
            try:
                cached = self.attention[worker].open_sequence(seq_id, req.params, reserve_tokens=reserve,
                                                              prefix_key=key)
            except WorkerError as e:   # the worker refuses the request itself: it must not block the queue
                self._fail(req, RequestError(str(e)))
                return True
            except Exception as e:  # out of blocks or prefix gone: try the next candidate
                log.debug("open_sequence on %d failed: %s", worker, e)
                if key is not None:
                    self.kv.forget(key)
                self._refresh(worker)
                continue
            req.worker, req.seq_id, req.computed, req.cached_tokens = worker, seq_id, cached, cached
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
            self.kv.workers[worker].free_blocks = self.attention[worker].info()["free_blocks"]
        except ConnectionError as e:
            self._attention_down(worker, e)

    def _watch_health(self) -> None:
        """Probe workers marked down once a second; take them back when they answer SERVING again."""
        while not self.closed:
            time.sleep(self.health_interval)
            for i, client in enumerate(self.experts):
                if i in self.dispatcher.down and _serving(client):
                    log.info("expert worker %d is back", i)
                    self.dispatcher.mark_up(i)
            for i in list(self.attention_down):
                if _serving(self.attention[i]):
                    try:
                        self.kv.workers[i].free_blocks = self.attention[i].info()["free_blocks"]
                    except Exception:
                        continue
                    log.info("attention worker %d is back", i)
                    self.attention_down.discard(i)

    def _drop_prefix(self, worker: int, key: str) -> None:
        self.kv.forget(key)
        self.kv.workers[worker].free_blocks = self.attention[worker].drop_prefix(key)

    # ------------------------------------------------------------------ one step
    def _plan_batches(self) -> dict[int, list[tuple[Request, list[int], bool]]]:
        batches: dict[int, list] = {}
        budget = self.max_batch_tokens
        decoding = [r for r in self.running if r.computed >= len(r.prompt)]
        prefilling = [r for r in self.running if r.computed < len(r.prompt)]
        for req in decoding:                       # decode first: one token each (the next one not fed yet)
            batches.setdefault(req.worker, []).append((req, [req.tokens[req.computed]], True))
            budget -= 1
        for req in prefilling:
            if budget <= 0:
                break
            end = min(len(req.prompt), (req.computed // self.prefill_chunk + 1) * self.prefill_chunk)
            if end - req.computed > budget:
                break
            sample = end == len(req.prompt) and req.params.max_tokens > 0
            batches.setdefault(req.worker, []).append((req, req.prompt[req.computed:end], sample))
            budget -= end - req.computed
        return batches

    def _step(self) -> None:
        batches = self._plan_batches()
        if not batches:
            return
        step_id = next(self.step_ids)
        calls_before = self.stats.attention_calls + self.stats.expert_calls
        snapshots: dict[int, dict[str, str]] = {}
        snapshot_len: dict[str, int] = {}
        for w, items in batches.items():
            for req, toks, _ in items:
                new_len = req.computed + len(toks)
                if new_len % self.prefill_chunk == 0 and new_len < self.cfg.max_context:
                    if req.hasher is None or req.hasher.length > new_len:   # new, or replaying after a failover
                        req.hasher = PrefixHasher(self.prefill_chunk)
                    key = req.hasher.advance(req.tokens, new_len)
                    if not self.kv.has(key):
                        snapshots.setdefault(w, {})[req.seq_id] = key
                        snapshot_len[key] = new_len
        workers = sorted(batches)
        self._row_failures: dict[tuple[int, int], str] = {}
        tracing = StepTrace(step_id, batches, self.attention + self.experts)
        try:
            results = self._run_layers(step_id, batches, workers, snapshots, tracing)
        except Exception as e:
            tracing.end(e)
            for w in workers:
                try:
                    self.attention[w].abort_step(step_id)
                except Exception:
                    pass
            for w in workers:
                for req, _, _ in batches[w]:
                    self._fail(req, e)
            return
        tracing.end()
        self.stats.steps += 1
        self.stats.max_calls_in_a_step = max(self.stats.max_calls_in_a_step,
                                             self.stats.attention_calls + self.stats.expert_calls - calls_before)
        for w in workers:
            if w not in results:
                for req, _, _ in batches[w]:
                    self._recover(req)
                continue
            done: StepDone = results[w]
            self.kv.workers[w].free_blocks = done.free_blocks
            for key in (snapshots.get(w) or {}).values():
                for stale in self.kv.record_prefix(w, key, snapshot_len[key]):
                    self.kv.workers[w].free_blocks = self.attention[w].drop_prefix(stale)
            logprobs: dict[str, list[TokenLogprobs]] = {}
            for run in done.logprobs:
                logprobs.setdefault(run.seq_id, []).append(run)
            row = 0
            for req, toks, sample in batches[w]:
                rows = range(row, row + len(toks))
                row += len(toks)
                reason = next((self._row_failures[(w, r)] for r in rows if (w, r) in self._row_failures), None)
                if reason is not None:
                    self._fail(req, ExpertsUnavailable(reason))
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

    def _gather(self, futures: dict) -> dict:
        """Results of one call per attention worker; a worker that is unreachable (or past its deadline) is
        marked down and left out — the step goes on for the others, its sequences are rebuilt elsewhere."""
        results = {}
        for w, f in futures.items():
            try:
                results[w] = f.result(timeout=self.call_timeout)
            except ConnectionError as e:
                self._attention_down(w, e)
        if not results:
            raise ConnectionError("every attention worker in this step failed")
        return results

    def _attention_down(self, w: int, error: Exception) -> None:
        if w not in self.attention_down:
            log.warning("attention worker %d marked down: %s", w, error)
        self.attention_down.add(w)
        for key in self.kv.eviction_candidates(w):
            self.kv.forget(key)
        self.kv.workers[w].free_blocks = 0

    def _recover(self, req: Request) -> None:
        """Put a request whose attention worker died back at the head of the queue, keeping its output: it
        is re-placed on a live worker and replays prompt + generated tokens on the same schedule."""
        self.kv.workers[req.worker].sequences -= 1
        req.worker, req.seq_id, req.computed = -1, "", 0
        if req in self.running:
            self.running.remove(req)
        with self.cv:
            self.waiting.insert(0, req)
        self.stats.recovered += 1

    def _run_layers(self, step_id, batches, workers, snapshots, tracing) -> dict:
        """Run one step's layers in lock step across the attention workers; returns their StepDone results."""
        with tracing.layer("attention", 0):
            futures = {w: self.pool.submit(self.attention[w].begin_step, step_id,
                                           [StepSegment(r.seq_id, toks, sample) for r, toks, sample in batches[w]],
                                           snapshots.get(w))
                       for w in workers}
            results = self._gather(futures)
        self.stats.attention_calls += len(workers)
        while not all(isinstance(r, StepDone) for r in results.values()):
            routes: list[tuple[int, RouteRequest]] = [(w, r) for w, r in results.items()]
            layers = {r.layer for _, r in routes}
            if len(layers) != 1 or any(isinstance(r, StepDone) for _, r in routes):
                raise RuntimeError(f"attention workers out of lock step (layers {sorted(layers)})")
            layer = layers.pop()
            hidden = torch.cat([r.hidden for _, r in routes])
            ids = torch.cat([r.topk_ids for _, r in routes])
            weights = torch.cat([r.topk_weights for _, r in routes])
            expert_calls_before = sum(self.dispatcher.calls.values())
            with tracing.layer("expert_dispatch", layer):
                routed, failed_rows = self.dispatcher.run(layer, hidden, ids)
            if failed_rows:          # these rows' requests end with the reason; the others go on unaffected
                start = 0
                for w, r in routes:
                    n = r.hidden.shape[0]
                    for row in range(start, start + n):
                        if row in failed_rows:
                            self._row_failures.setdefault((w, row - start), failed_rows[row])
                    start += n
            self.stats.expert_calls += sum(self.dispatcher.calls.values()) - expert_calls_before
            delta = moe_combine(routed, weights.float())       # the one canonical combine order
            with tracing.layer("attention", layer + 1):
                futures, start = {}, 0
                for w, r in routes:
                    n = r.hidden.shape[0]
                    futures[w] = self.pool.submit(self.attention[w].continue_step, step_id,
                                                  delta[start:start + n])
                    start += n
                results = self._gather(futures)
            self.stats.attention_calls += len(futures)
        return results

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
            try:
                self.kv.workers[req.worker].free_blocks = self.attention[req.worker].close_sequence(req.seq_id)
            except Exception as e:
                log.warning("close_sequence %s failed: %s", req.seq_id, e)
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
