"""Prefill → decode hand-offs (router/disagg.py's pools): each sequence whose prompt a prefill worker finished moves
to a decode worker with room, the call running in the engine's pool beside the next steps; the blocks it needs are
promised on the receiver (KVManager.promise) until it lands or fails.

A mixin of router/engine.py's Engine: it reads the engine's workers, KV manager, pools, health and requests.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

from opentelemetry import trace

from expertmesh.router.disagg import choose_decode
from expertmesh.router.request import Request
from expertmesh.runtime import telemetry
from expertmesh.wire.worker_api import HandOffFailed, OutOfBlocks

log = logging.getLogger("expertmesh.router")


@dataclass
class InTransit:
    """A hand-off in flight: its call, from / to which attention worker, the sequence id there, the blocks promised."""

    future: Future
    src: int
    to: int
    to_seq: str
    blocks: int


class HandOffs:
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
            self.kv.promise(to, blocks)
            to_seq = f"{self.instance}-{next(self.seq_ids)}"
            future = self.pool.submit(self._hand_off, req, req.worker, to, to_seq)
            self.transit[req] = InTransit(future, req.worker, to, to_seq, blocks)
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
                transport=self.config.hand_off_over,
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
                self.kv.withdraw(to, t.blocks)
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
            self.kv.report(src, done.free_blocks)
            self.kv.released(src)
            req.worker, req.seq_id = to, to_seq
            if req not in self.running:  # ended meanwhile (close() failed it): not left open there
                self.health.close(to, to_seq)
