"""Telemetry: OpenTelemetry tracing configured by the standard OTEL_* variables, and Prometheus metrics.

Tracing is off (a no-op tracer, near-zero cost) unless an exporter is configured:
  OTEL_TRACES_EXPORTER=otlp|console|none, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL=grpc|http/protobuf,
  OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (read by the SDK), OTEL_RESOURCE_ATTRIBUTES.
Per-layer spans (attention call, expert dispatch, worker calls) are recorded on one step in
EXPERTMESH_TRACE_LAYER_EVERY (default 16) so that tracing never dominates a step; 1 records every step.
"""

from __future__ import annotations

import os
import threading

from opentelemetry import propagate, trace

_lock = threading.Lock()
_configured: str | None = None
_provider = None
_extra_processors: list = []  # tests add an in-memory exporter here before setup


def tracing_enabled() -> bool:
    return _provider is not None


def setup_tracing(service_name: str, attributes: dict | None = None, *, force: bool = False):
    """Install a TracerProvider for this process when an exporter is configured; returns it (or None)."""
    global _configured, _provider
    with _lock:
        if _configured is not None and not force:
            return _provider
        _configured = service_name
        exporter_names = os.environ.get("OTEL_TRACES_EXPORTER", "")
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if not exporter_names:
            exporter_names = "otlp" if endpoint else ""
        names = [n.strip() for n in exporter_names.split(",") if n.strip() and n.strip() != "none"]
        if not names and not _extra_processors:
            _provider = None
            return None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

        attrs = {"service.name": service_name, "service.namespace": "expertmesh"}
        attrs.update({k: v for k, v in (attributes or {}).items() if v is not None})
        provider = TracerProvider(resource=Resource.create(attrs))
        for name in names:
            if name == "console":
                provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
            elif name == "otlp":
                protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                    "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
                )
                if protocol.startswith("http"):
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                else:
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            else:
                raise ValueError(f"OTEL_TRACES_EXPORTER={exporter_names!r}: {name!r} is not one of otlp, console, none")
        for proc in _extra_processors:
            provider.add_span_processor(proc)
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def tracer(name: str = "expertmesh"):
    return trace.get_tracer(name)


def layer_span_every() -> int:
    try:
        return max(1, int(os.environ.get("EXPERTMESH_TRACE_LAYER_EVERY", "16")))
    except ValueError:
        return 16


def inject_metadata() -> list[tuple[str, str]]:
    """W3C tracecontext of the current span as gRPC metadata (empty when tracing is off)."""
    if _provider is None:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def extract_context(metadata) -> object | None:
    """A context from incoming gRPC metadata (None when there is no traceparent)."""
    if _provider is None or not metadata:
        return None
    carrier = {k: v for k, v in metadata if isinstance(v, str)}
    if "traceparent" not in carrier:
        return None
    return propagate.extract(carrier)


def shutdown() -> None:
    if _provider is not None:
        _provider.shutdown()
