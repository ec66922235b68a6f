"""A worker's Prometheus metrics (`--metrics-port`): calls, latency and errors per method, KV blocks and
sequences (attention role), (token, expert) pairs computed (expert role)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter("expertmesh_worker_rpcs", "gRPC calls served, by method and status code",
                             ["method", "code"], registry=self.registry)
        self.call_seconds = Histogram("expertmesh_worker_rpc_duration_seconds", "Time to serve a call",
                                      ["method"], buckets=BUCKETS, registry=self.registry)
        self.server = None
        self.registry.register(_State(self))


class _State:
    def __init__(self, metrics: WorkerMetrics):
        self.metrics = metrics

    def collect(self):
        server = self.metrics.server
        if server is None:
            return
        att, exp = getattr(server, "attention", None), getattr(server, "expert", None)
        if att is not None:
            info = att.info()
            blocks = GaugeMetricFamily("expertmesh_kv_blocks", "KV blocks of this attention worker",
                                       labels=["worker", "state"])
            blocks.add_metric([info["name"], "free"], info["free_blocks"])
            blocks.add_metric([info["name"], "used"], info["total_blocks"] - info["free_blocks"])
            yield blocks
            seqs = GaugeMetricFamily("expertmesh_sequences", "Open sequences", labels=["worker"])
            seqs.add_metric([info["name"]], info["sequences"])
            yield seqs
        if exp is not None:
            done = CounterMetricFamily("expertmesh_expert_slots_computed", "(token, expert) pairs computed",
                                       labels=["worker"])
            done.add_metric([exp.name], exp.tokens_computed)
            yield done
            held = GaugeMetricFamily("expertmesh_experts_held", "(layer, expert) shards held", labels=["worker"])
            held.add_metric([exp.name], len(exp.assignment))
            yield held


METRICS = WorkerMetrics()


def serve_metrics(server, host: str, port: int):
    METRICS.server = server
    httpd, _thread = start_http_server(port, addr=host, registry=METRICS.registry)
    return httpd
