"""One scheduler step's calls on the attention workers (the Engine's part that talks to them during a step): one
`run_step` per worker, concurrently; the results gathered with failover (a worker unreachable, past the step's
deadline or hung is marked down and its sequences replayed elsewhere, the step going on for the others); each
result applied to the KV index and the requests (scheduler.update_from_output).

A mixin of router/engine.py's Engine: it reads the engine's workers, KV manager, health, counters and requests, and
ends requests through the engine's own `_fail` / `_recover` / `_finish` / `_evict`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait

from expertmesh.router.health import serving
from expertmesh.router.request import EngineClosed, ExpertsUnavailable, Request, RequestError, TokenLogprob
from expertmesh.router.scheduler import Planned, update_from_output
from expertmesh.router.tracing import StepTrace, record_image_encodes
from expertmesh.router.work_deadline import step_work
from expertmesh.wire.worker_api import NotConnected, StepDone, StepSegment

log = logging.getLogger("expertmesh.router")


def public_error(error: Exception) -> Exception:
    """What a client may see of a failed step: no worker addresses or internals (those go to the log)."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return ConnectionError("attention workers unavailable for this step; retry")
    if isinstance(error, (RequestError, ExpertsUnavailable, EngineClosed)):
        return error
    return RuntimeError(f"the step failed on a worker ({type(error).__name__}); see the router log")


class StepCalls:
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
                        [StepSegment(p.req.seq_id, p.tokens, p.sample, p.max_new, p.hold_at) for p in batches[w]],
                        {
                            p.req.seq_id: p.snapshot if p.snapshot_at is None else (p.snapshot, p.snapshot_at)
                            for p in batches[w]
                            if p.snapshot
                        }
                        or None,
                    )
                    for w in workers
                }
                results = self._gather(futures, {w: step_work(batches[w]) for w in workers})
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
            error = public_error(e)
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

    def _gather(self, futures: dict, work: dict[int, int] | None = None, probe_every: float = 2.0) -> dict:
        """Results of one call per attention worker; a worker that is unreachable, past its deadline, has lost
        its expert table (restarted), or stops answering its health check while its step runs (hung, e.g.
        SIGSTOP: noticed within ~2 probes, not at the step deadline) is marked down and left out — the step goes
        on for the others, its sequences are rebuilt elsewhere. Each worker's deadline is its step's `work` at the
        rate its recent steps took (router/work_deadline.py; `call_timeout` at least), and the time its step took
        teaches that rate."""
        results, pending = {}, dict(futures)
        work = work or {}
        start = time.monotonic()
        deadline = {w: start + self.step_rates.deadline(w, work.get(w, 0)) for w in futures}
        while pending:
            wait(
                list(pending.values()),
                timeout=min(probe_every, max(0.0, min(deadline[w] for w in pending) - time.monotonic())),
                return_when=FIRST_COMPLETED,
            )
            for w, f in list(pending.items()):
                if f.done():
                    del pending[w]
                    try:
                        results[w] = f.result()
                    except (ConnectionError, NotConnected, TimeoutError) as e:
                        self.health.mark_down(w, e)
                    else:
                        self.step_rates.observe(w, work.get(w, 0), time.monotonic() - start)
                elif time.monotonic() >= deadline[w]:
                    del pending[w]
                    self.step_rates.past_deadline(w, work.get(w, 0), deadline[w] - start)  # it took that, at least
                    self.health.mark_down(w, TimeoutError(f"no step result within {deadline[w] - start:.3g} s"))
                elif not serving(self.attention[w], timeout=probe_every):
                    del pending[w]
                    self.health.mark_down(w, TimeoutError("its health check does not answer during the step"))
        if not results:
            raise ConnectionError("every attention worker in this step failed")
        return results

    def _apply(self, w: int, done: StepDone, batch: list[Planned]) -> None:
        """One attention worker's step result → the KV index and the requests (scheduler.update_from_output)."""
        update = update_from_output(batch, done, max_context=self.cfg.max_context)
        self.kv.report(w, update.free_blocks)
        self.health.experts_down_by[w] = update.experts_down
        self.stats.exchange_bytes += update.exchange_bytes
        for p in batch:
            if p.chain_key is None or p.req.seq_id in done.failed:
                continue
            prompt_end = p.prefix_end == (len(p.req.prompt) - 1) // self.kv.chunk * self.kv.chunk  # a resend's hit
            if p.snapshot is not None:  # it extends the last prefix its request reached: one conversation
                saved = self.kv.record_prefix(
                    w, p.snapshot, p.prefix_end, parent=p.req.last_key, user=p.req, prompt_end=prompt_end
                )
                for victim in saved:
                    if self.kv.has(victim) and not self.kv.is_lower(victim):
                        self._evict(w, victim)
            elif prompt_end:
                self.kv.mark_prompt_end(p.chain_key)
            p.req.last_key = p.chain_key
        for p in batch:  # speculation: the boundary state the worker now holds (saved by the request's next step)
            if p.req.seq_id not in done.failed:
                kept = len(done.emitted(p.req.seq_id))
                if p.saves_held:
                    p.req.held_mark = 0
                if p.hold_at and p.start + max(kept, 1) >= p.hold_at:
                    p.req.held_mark = p.hold_at
        if done.image_encodes:
            record_image_encodes(self.metrics, done.image_encodes, {p.req.seq_id: p.req for p in batch}, w)
        for u in update.seqs:
            req = u.req
            if u.error is not None:
                self._fail(req, u.error)
                continue
            req.prompt_logprobs.update(u.prompt_logprobs)
            req.computed = u.computed
            if u.prefilled:
                self.stats.prefilled(self.pools.name(w), u.prefilled)
            if u.diverged is not None:
                log.warning("request %s: replay diverged at %d", req.request_id, u.diverged[0])
            if u.token is not None:
                self._accept(req, u.token, u.logprob)
                for token, logprob in u.more:  # speculation: the run's accepted drafts and the target's token
                    self._accept(req, token, logprob)
                if u.drafted:
                    self._speculated(req, u.drafted, len(u.more))
            if u.finish is not None:
                self._finish(req, u.finish)

    def _speculated(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify step's figures: `drafted` drafts verified, `accepted` tokens emitted beyond the first (the
        accepted drafts, the target's own token after them — cut where the request ended)."""
        self.stats.speculated(drafted, min(accepted, drafted))
        req.drafted += drafted
        req.accepted += min(accepted, drafted)
        req.verify_steps += 1

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
        req._emit("token", token)
