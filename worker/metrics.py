"""A worker's Prometheus metrics (`--metrics-port`): calls, latency and errors per method, KV blocks and
sequences, the KV tiers' bytes and traffic, prompt tokens computed and hand-offs (attention role), (token, expert)
pairs computed (expert role)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter(
            "expertmesh_worker_rpcs",
            "gRPC calls served, by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.call_seconds = Histogram(
            "expertmesh_worker_rpc_duration_seconds",
            "Time to serve a call",
            ["method"],
            buckets=BUCKETS,
            registry=self.registry,
        )
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
            blocks = GaugeMetricFamily(
                "expertmesh_kv_blocks", "KV blocks of this attention worker", labels=["worker", "state"]
            )
            blocks.add_metric([info["name"], "free"], info["free_blocks"])
            blocks.add_metric([info["name"], "used"], info["total_blocks"] - info["free_blocks"])
            yield blocks
            seqs = GaugeMetricFamily("expertmesh_sequences", "Open sequences", labels=["worker"])
            seqs.add_metric([info["name"]], info["sequences"])
            yield seqs
            yield from tier_metrics(att)
            yield from store_metrics(att)
            yield from handoff_metrics(att)
            yield from speculation_metrics(att)
        collective = getattr(server, "collective", None)
        if collective is not None:
            calls = CounterMetricFamily(
                "expertmesh_collective_calls",
                "Calls served over torch.distributed pairs: expert exchange (run), hand-offs taken (import)",
                labels=["op"],
            )
            calls.add_metric(["run"], collective.calls)
            calls.add_metric(["import"], collective.imports)
            yield calls
        if exp is not None:
            done = CounterMetricFamily(
                "expertmesh_expert_slots_computed", "(token, expert) pairs computed", labels=["worker"]
            )
            done.add_metric([exp.name], exp.tokens_computed)
            yield done
            held = GaugeMetricFamily("expertmesh_experts_held", "(layer, expert) shards held", labels=["worker"])
            held.add_metric([exp.name], len(exp.assignment))
            yield held


def speculation_metrics(att):
    """Speculative decoding on this attention worker (worker/speculation.py): drafts verified and accepted, in
    all and by draft position, verify steps and their seconds."""
    spec = getattr(att, "spec", None)
    if spec is None:
        return
    f, name = spec.figures(), att.name
    for metric, doc, key in (
        ("expertmesh_worker_spec_draft_tokens", "Draft tokens verified", "drafted"),
        ("expertmesh_worker_spec_accepted_tokens", "Draft tokens accepted", "accepted"),
        ("expertmesh_worker_spec_verify_steps", "Steps that verified drafts", "verify_steps"),
        ("expertmesh_worker_spec_verify_seconds", "Seconds spent in steps that verified drafts", "verify_seconds"),
    ):
        family = CounterMetricFamily(metric, doc, labels=["worker", "method"])
        family.add_metric([name, f["method"]], f[key])
        yield family
    for metric, doc, key in (
        ("expertmesh_worker_spec_draft_tokens_by_position", "Drafts verified by position", "drafted_by_position"),
        ("expertmesh_worker_spec_accepted_tokens_by_position", "Drafts accepted by position", "accepted_by_position"),
    ):
        family = CounterMetricFamily(metric, doc + " (0: a step's first draft)", labels=["worker", "position"])
        for i, n in enumerate(f[key]):
            family.add_metric([name, str(i)], n)
        yield family


def handoff_metrics(att):
    """Prompt tokens this worker computed, under its pool (prefill | decode | mixed), and the sequences / KV bytes it
    handed to or took from another attention worker (prefill → decode disaggregation)."""
    prefill = CounterMetricFamily(
        "expertmesh_prefill_tokens", "Prompt tokens computed, by pool", labels=["worker", "pool"]
    )
    prefill.add_metric([att.name, att.pool_role], att.prompt_tokens_computed)
    yield prefill
    moved = CounterMetricFamily(
        "expertmesh_kv_transfer_bytes",
        "KV, indexer-key and recurrent-state bytes handed to (sent) or taken from (received) another attention worker",
        labels=["worker", "direction"],
    )
    count = CounterMetricFamily(
        "expertmesh_kv_handoffs", "Sequences handed off, by direction", labels=["worker", "direction"]
    )
    for direction in ("sent", "received"):
        moved.add_metric([att.name, direction], att.handoff_bytes[direction])
        count.add_metric([att.name, direction], att.handoffs[direction])
    yield moved
    yield count
    seconds = CounterMetricFamily(
        "expertmesh_kv_handoff_seconds",
        "Time spent handing sequences off (export, transfer, import; sender side)",
        labels=["worker"],
    )
    seconds.add_metric([att.name], att.handoff_seconds)
    yield seconds
    link = getattr(att, "_transfer_link", None)  # hand-offs on Mooncake's transfer engine (worker/transfer_engine.py)
    engine = CounterMetricFamily(
        "expertmesh_kv_handoff_engine_bytes",
        "Hand-off cache bytes moved by the transfer engine: read by a peer from here (sent) or from a peer (received)",
        labels=["worker", "direction"],
    )
    fallbacks = CounterMetricFamily(
        "expertmesh_kv_handoff_engine_fallbacks",
        "Hand-offs asked of the transfer engine that went over gRPC instead (an engine unavailable, a read failed)",
        labels=["worker"],
    )
    engine.add_metric([att.name, "sent"], link.sent_bytes if link else 0)
    engine.add_metric([att.name, "received"], link.received_bytes if link else 0)
    fallbacks.add_metric([att.name], link.fallbacks if link else 0)
    yield engine
    yield fallbacks


def tier_metrics(att):
    """Per KV tier (device, host, disk; worker/kv_tiers.py): bytes used and capacity, prefixes held, demotions in,
    restores (hits served by copying back), restore bytes and seconds, prefixes dropped, disk files rejected."""
    name, tiers = att.name, att.tiers.snapshot_stats()
    pool = att.pool
    block_bytes = sum(t[0].numel() * t.element_size() for t in list(pool.latent.values()) + list(pool.index_k.values()))
    gauges = {
        f: GaugeMetricFamily(f"expertmesh_kv_tier_{f}", doc, labels=["worker", "tier"])
        for f, doc in (
            ("used_bytes", "Bytes held by cached KV in the tier"),
            ("capacity_bytes", "The tier's byte bound"),
            ("prefixes", "Cached prefixes held in the tier"),
        )
    }
    gauges["used_bytes"].add_metric([name, "device"], (pool.num_blocks - pool.free_blocks) * block_bytes)
    gauges["capacity_bytes"].add_metric([name, "device"], pool.num_blocks * block_bytes)
    gauges["prefixes"].add_metric([name, "device"], len(att.prefixes))
    counters = {
        f: CounterMetricFamily(f"expertmesh_kv_tier_{f}", doc, labels=["worker", "tier"])
        for f, doc in (
            ("hits", "Prefixes served from the tier (device: used in place; host / disk: restored)"),
            ("demotions", "Prefixes that entered the tier from the one above"),
            ("restore_bytes", "Bytes copied back to the device from the tier"),
            ("restore_seconds", "Time spent restoring from the tier"),
            ("dropped", "Prefixes that left the tier for no lower one"),
            (
                "rejected",
                "Disk entries refused unserved: torn, corrupted, forged (MAC), of another model / layout, or not regular files",
            ),
        )
    }
    counters["hits"].add_metric([name, "device"], att.device_prefix_hits)
    for tier, st in tiers.items():
        gauges["used_bytes"].add_metric([name, tier], st.used_bytes)
        gauges["capacity_bytes"].add_metric([name, tier], st.capacity_bytes)
        gauges["prefixes"].add_metric([name, tier], st.entries)
        for field, value in (
            ("hits", st.restores),
            ("demotions", st.demotions),
            ("restore_bytes", st.restore_bytes),
            ("restore_seconds", st.restore_seconds),
            ("dropped", st.dropped),
            ("rejected", st.rejected),
        ):
            counters[field].add_metric([name, tier], value)
    yield from gauges.values()
    yield from counters.values()


def store_metrics(att):
    """The cluster KV tier's own calls (worker/kv_store.py), when the worker has one: puts made, their bytes and
    seconds, gets, bytes and seconds, misses, calls that failed or passed their deadline, write-through puts left
    out; its hits are expertmesh_kv_tier_hits{tier="store"}."""
    store = att.tiers.store
    if store is None:
        return
    s = store.stats
    for metric, doc, value in (
        ("puts", "Prefixes put in the cluster store", s.demotions),
        ("put_bytes", "Bytes put in the cluster store", s.put_bytes),
        ("put_seconds", "Time spent in the store's puts (on its own thread, never a step's)", s.put_seconds),
        ("gets", "Objects read from the cluster store", s.gets),
        ("get_bytes", "Bytes read from the cluster store", s.get_bytes),
        ("get_seconds", "Time spent reading objects from the cluster store", s.get_seconds),
        ("misses", "Lookups the cluster store did not answer with an object (absent, down, or late)", s.misses),
        ("failures", "Cluster store calls that failed or passed their deadline", s.failures),
        ("puts_not_made", "Write-through puts left out (queue full, store unavailable or refusing)", s.puts_not_made),
    ):
        family = CounterMetricFamily(f"expertmesh_kv_store_{metric}", doc, labels=["worker"])
        family.add_metric([att.name], value)
        yield family


METRICS = WorkerMetrics()


def serve_metrics(server, host: str, port: int):
    METRICS.server = server
    httpd, _thread = start_http_server(port, addr=host, registry=METRICS.registry)
    return httpd
