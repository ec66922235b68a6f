"""Spans of one scheduler step: per request a `prefill_chunk` / `decode_step` span under its root span, and —
on one step in EXPERTMESH_TRACE_LAYER_EVERY — per-layer `attention` / `expert_dispatch` spans with the worker
calls (and, through gRPC metadata, the workers' server spans) under them; an `image_encode` span per image the
vision encoder ran; and the root span of an API request."""

from __future__ import annotations

import contextlib
import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from expertmesh.runtime import telemetry


class StepTrace:
    def __init__(self, step_id: int, batches: dict, clients: list):
        self.spans = []
        self.detail_ctx = None
        self.clients = clients
        items = [(r, toks) for entries in batches.values() for r, toks, _ in entries if r.trace_ctx is not None]
        if not items or not telemetry.tracing_enabled():
            return
        tracer = telemetry.tracer()
        for req, toks in items:
            kind = "decode_step" if req.computed >= len(req.prompt) else "prefill_chunk"
            span = tracer.start_span(
                kind,
                context=req.trace_ctx,
                attributes={
                    "expertmesh.step": step_id,
                    "expertmesh.step.tokens": len(toks),
                    "expertmesh.position": req.computed,
                    "expertmesh.attention_worker": req.worker,
                },
            )
            self.spans.append(span)
        recording = [s for s in self.spans if s.is_recording()]
        if recording and step_id % telemetry.layer_span_every() in (0, 1 % telemetry.layer_span_every()):
            self.detail_ctx = trace.set_span_in_context(recording[0])

    @contextlib.contextmanager
    def layer(self, name: str, layer: int):
        """A per-layer span on detailed steps, the parent of the worker calls made inside it."""
        if self.detail_ctx is None:
            yield
            return
        span = telemetry.tracer().start_span(name, context=self.detail_ctx, attributes={"expertmesh.layer": layer})
        ctx = trace.set_span_in_context(span)
        for c in self.clients:
            c.trace_parent = ctx
        try:
            yield
        finally:
            for c in self.clients:
                c.trace_parent = None
            span.end()

    def end(self, error: Exception | None = None) -> None:
        for span in self.spans:
            if error is not None:
                span.record_exception(error)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
            span.end()


def record_image_encodes(metrics, encodes: list, by_seq: dict, worker: int) -> None:
    """The vision encoder's runs of a step → the encoder metrics and an `image_encode` span per image under its
    request (timed by the worker's measurement, ending when the step's answer arrived)."""
    end = time.time_ns()
    for e in encodes:
        metrics.image_encode_seconds.observe(e.seconds)
        metrics.image_tokens.inc(e.tokens)
        req = by_seq.get(e.seq_id)
        if req is not None and req.trace_ctx is not None and telemetry.tracing_enabled():
            span = telemetry.tracer().start_span(
                "image_encode",
                context=req.trace_ctx,
                start_time=end - int(e.seconds * 1e9),
                attributes={"expertmesh.image.tokens": e.tokens, "expertmesh.attention_worker": worker},
            )
            span.end(end_time=end)


class RequestSpan:
    """The root span of one API request, named and attributed per the OpenTelemetry GenAI conventions
    ("{operation} {model}", gen_ai.*), ended when the request is over (streams included)."""

    def __init__(
        self,
        operation: str,
        model: str,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        api: str = "openai",
        tier: str | None = None,
        auto_tier: str | None = None,
    ):
        """`auto_tier`: why reasoning_effort auto chose `tier` (expertmesh.chat.thinking.auto_tier)."""
        self.span = None
        if not telemetry.tracing_enabled():
            return
        attrs = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "gen_ai.provider.name": "expertmesh",
            "gen_ai.system": "expertmesh",
            "expertmesh.api": api,
        }
        if max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = max_tokens
        if temperature is not None:
            attrs["gen_ai.request.temperature"] = temperature
        if tier is not None:
            attrs["expertmesh.chat.thinking.tier"] = tier
        if auto_tier is not None:
            attrs["expertmesh.chat.thinking.auto"] = auto_tier
        self.span = telemetry.tracer().start_span(f"{operation} {model}", kind=SpanKind.SERVER, attributes=attrs)

    @contextlib.contextmanager
    def current(self):
        if self.span is None:
            yield
            return
        with trace.use_span(self.span, end_on_exit=False):
            yield

    def finish(
        self,
        *,
        input_tokens: int,
        output_tokens: int,
        finish_reason: str | None,
        reasoning_tokens: int | None = None,
        cached_tokens: int | None = None,
        error: Exception | None = None,
        req=None,
    ) -> None:
        """`req`: the engine's Request, whose speculation figures become attributes (when it verified drafts)."""
        if self.span is None:
            return
        s, self.span = self.span, None
        if req is not None and req.verify_steps:
            s.set_attribute("expertmesh.spec.draft_tokens", req.drafted)
            s.set_attribute("expertmesh.spec.accepted_tokens", req.accepted)
            s.set_attribute("expertmesh.spec.verify_steps", req.verify_steps)
            s.set_attribute("expertmesh.spec.mean_accepted_length", 1 + req.accepted / req.verify_steps)
        s.set_attribute("gen_ai.usage.input_tokens", input_tokens)
        s.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        if reasoning_tokens is not None:
            s.set_attribute("gen_ai.usage.reasoning_tokens", reasoning_tokens)
        if cached_tokens is not None:
            s.set_attribute("gen_ai.usage.cached_tokens", cached_tokens)
        if finish_reason:
            s.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        if error is not None:
            s.record_exception(error)
            s.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
        s.end()
