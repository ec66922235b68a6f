"""A proxy around a worker client that times every call, counts failures and (on traced steps) records a
client span — the same for in-process and gRPC clients, so the engine never deals with it."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from expertmesh.runtime import telemetry

_TRACED_METHODS = {"run_step", "open_sequence", "close_sequence"}


class InstrumentedClient:
    def __init__(self, client, metrics=None, role: str = "worker"):
        self._client = client
        self._metrics = metrics
        self._role = role
        self.name = getattr(client, "name", role)
        self.trace_parent = None  # an OpenTelemetry context: set by the engine on the steps it traces

    def __getattr__(self, method: str):
        fn = getattr(self._client, method)
        if not callable(fn) or method.startswith("_"):
            return fn
        metrics = self._metrics

        def call(*args, **kwargs):
            start = time.perf_counter()
            span = None
            parent = self.trace_parent
            if parent is not None and method in _TRACED_METHODS:
                span = telemetry.tracer().start_span(
                    f"{self._role}.{method}",
                    context=parent,
                    kind=SpanKind.CLIENT,
                    attributes={"expertmesh.worker": self.name, "rpc.method": method, "rpc.system": "grpc"},
                )
            try:
                if span is not None:
                    with trace.use_span(span, end_on_exit=False):
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            except Exception as e:
                if metrics is not None:
                    metrics.call_errors.labels(self.name, method).inc()
                if span is not None:
                    span.record_exception(e)
                raise
            finally:
                if metrics is not None:
                    metrics.call_seconds.labels(self.name, method).observe(time.perf_counter() - start)
                if span is not None:
                    span.end()

        return call
