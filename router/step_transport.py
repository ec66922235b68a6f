"""The router's step transport on /metrics: per attention worker, the transport its next step takes
(`expertmesh_step_transport{worker, transport}` = 1), the steps sent over each
(`expertmesh_step_transport_steps_total{worker, transport}`) and the step channels that could not form, gRPC
carrying the steps meanwhile (`expertmesh_step_transport_fallbacks_total{worker}`). Read from the workers' clients
at scrape time (expertmesh/wire/step_channel.py's StepChannelAttention; a plain gRPC client counts as "grpc")."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class StepTransportCollector:
    def __init__(self, clients: list):
        self.clients = list(clients)

    def collect(self):
        transport = GaugeMetricFamily(
            "expertmesh_step_transport",
            "The transport of the router's next step to each attention worker (1): tcp (the step channel) or grpc",
            labels=["worker", "transport"],
        )
        steps = CounterMetricFamily(
            "expertmesh_step_transport_steps",
            "Steps the router sent each attention worker, by transport",
            labels=["worker", "transport"],
        )
        fallbacks = CounterMetricFamily(
            "expertmesh_step_transport_fallbacks",
            "Step channels that could not form (the steps went over gRPC meanwhile)",
            labels=["worker"],
        )
        for c in self.clients:
            counts = getattr(c, "steps", None)
            name = c.name
            transport.add_metric([name, getattr(c, "transport", "grpc")], 1)
            for t, n in (counts or {}).items():
                steps.add_metric([name, t], n)
            fallbacks.add_metric([name], getattr(c, "fallbacks", 0))
        yield transport
        yield steps
        yield fallbacks
