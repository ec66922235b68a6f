"""The router's Prometheus metrics (`/metrics`), names prefixed `expertmesh_` (and vLLM's four, router/vllm_metrics.py).

The engine's counts live in one store, its EngineStats, rendered here at scrape time (never counted twice);
histograms and the counters of the layers around the engine (worker calls, prefix hits, hand-offs, reasoning tokens)
are Prometheus objects updated as things happen; gauges that describe current state (queue lengths, KV blocks,
per-expert load and imbalance) are read from the engine at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from expertmesh.router.disagg import pool_load
from expertmesh.router.vllm_metrics import vllm_metrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class EngineStats:
    """The engine's running counts: the one store of what it counts. `engine.stats` reads them, /metrics renders
    them at scrape time (`expertmesh_prompt_tokens`, `_requests{outcome}`, ...: _StateCollector) — never counted a
    second time. Written by the scheduler thread (and by close(), once it stopped)."""

    steps: int = 0
    attention_calls: int = 0  # router → attention worker step calls
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    exchange_bytes: int = 0  # attention ↔ expert tensor bytes, as the attention workers report
    recovered: int = 0  # requests rebuilt on another attention worker
    preempted: int = 0  # requests whose KV was taken for others (replayed later)
    outcomes: dict[str, int] = field(default_factory=dict)  # ended requests by finish reason, or "error"
    prefilled_by_pool: dict[str, int] = field(default_factory=dict)  # prompt tokens computed (hits excluded), by pool
    # speculative decoding: drafts verified and accepted (in all, and by draft position "0" = a step's first draft),
    # verify steps (one per sequence and step that verified drafts)
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    drafted_by_position: dict[str, int] = field(default_factory=dict)
    accepted_by_position: dict[str, int] = field(default_factory=dict)

    def ended(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def speculated(self, drafted: int, accepted: int) -> None:
        """A sequence's verify step: `drafted` drafts, the first `accepted` of them accepted."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        for i in range(drafted):
            self.drafted_by_position[str(i)] = self.drafted_by_position.get(str(i), 0) + 1
            if i < accepted:
                self.accepted_by_position[str(i)] = self.accepted_by_position.get(str(i), 0) + 1

    def prefilled(self, pool: str, tokens: int) -> None:
        self.prefilled_by_pool[pool] = self.prefilled_by_pool.get(pool, 0) + tokens

    @property
    def requests_finished(self) -> int:
        return sum(n for outcome, n in list(self.outcomes.items()) if outcome != "error")

    @property
    def requests_failed(self) -> int:
        return self.outcomes.get("error", 0)

    @property
    def prefilled_tokens(self) -> int:
        return sum(list(self.prefilled_by_pool.values()))


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "expertmesh_time_to_first_token_seconds",
            "Time from arrival to the first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "expertmesh_inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_hits = Counter(
            "expertmesh_prefix_hits",
            "Admissions that reused a cached prefix, by the tier it was "
            "in on its worker (device, or lower: host / disk, restored)",
            ["tier"],
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "expertmesh_prefix_hit_tokens", "Prompt tokens served from a cached prefix, by tier", ["tier"], registry=r
        )
        self.prefix_evictions = Counter(
            "expertmesh_prefix_evictions",
            "Prefixes taken off a device pool: demoted "
            "(to host / disk), dropped_superseded (a longer one holds it), dropped (no "
            "tier kept it)",
            ["action"],
            registry=r,
        )
        self.reasoning_tokens = Counter("expertmesh_reasoning_tokens", "Generated reasoning tokens", registry=r)
        self.call_seconds = Histogram(
            "expertmesh_worker_call_duration_seconds",
            "Router→worker call latency",
            ["worker", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.call_errors = Counter(
            "expertmesh_worker_call_errors", "Failed router→worker calls", ["worker", "method"], registry=r
        )
        self.image_encode_seconds = Histogram(
            "expertmesh_image_encode_seconds",
            "Vision encoder time per image (on the attention worker)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.image_tokens = Counter(
            "expertmesh_image_tokens", "Image tokens produced by the vision encoder", registry=r
        )
        self.handoffs = Counter(
            "expertmesh_kv_handoffs",
            "Prefill → decode hand-offs: moved, refused (the decode "
            "worker had no room or refused; the sequence stayed), failed (the prefill worker "
            "failed; the request replayed)",
            ["outcome"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "expertmesh_kv_transfer_bytes",
            "KV, indexer-key and recurrent-state bytes moved by hand-offs (worker to worker)",
            registry=r,
        )
        self.handoff_seconds = Histogram(
            "expertmesh_kv_handoff_seconds",
            "Hand-off time (export, transfer, import)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine = None
        r.register(_StateCollector(self))

    def bind(self, engine) -> None:
        self.engine = engine

    def render(self) -> bytes:
        return generate_latest(self.registry)


def imbalance(counts: np.ndarray) -> float:
    """max/mean tokens per expert of one layer (1.0 = perfectly even; 0 when the layer saw no tokens)."""
    mean = counts.mean() if counts.size else 0.0
    return float(counts.max() / mean) if mean > 0 else 0.0


class _StateCollector:
    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def collect(self):
        eng = self.metrics.engine
        if eng is None:
            return
        running = GaugeMetricFamily("expertmesh_requests_running", "Requests in the running batch")
        running.add_metric([], eng.num_running())
        waiting = GaugeMetricFamily("expertmesh_requests_waiting", "Requests waiting for admission")
        waiting.add_metric([], eng.num_waiting())
        yield running
        yield waiting
        hit = GaugeMetricFamily("expertmesh_prefix_cache_hit_ratio", "Cached / total prompt tokens since start")
        s = eng.stats
        hit.add_metric([], s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0)
        yield hit
        yield from counted(s)
        if not eng.started:  # no worker known or asked yet (Engine.start): nothing more to read
            yield from vllm_metrics(eng)
            return
        blocks = GaugeMetricFamily("expertmesh_kv_blocks", "KV blocks per attention worker", labels=["worker", "state"])
        for w in eng.kv.workers:
            name = getattr(eng.attention[w.index], "name", str(w.index))
            blocks.add_metric([name, "free"], w.free_blocks)
            blocks.add_metric([name, "used"], w.total_blocks - w.free_blocks)
        yield blocks
        load = CounterMetricFamily(
            "expertmesh_expert_tokens", "Tokens routed per (layer, expert)", labels=["layer", "expert"]
        )
        imb = GaugeMetricFamily("expertmesh_expert_load_imbalance", "max/mean tokens per expert", labels=["layer"])
        worst = 0.0
        for layer, counts in eng.load_stats().items():
            arr = np.asarray(counts)
            for e, c in enumerate(counts):
                load.add_metric([str(layer), str(e)], c)
            value = imbalance(arr)
            worst = max(worst, value)
            imb.add_metric([str(layer)], value)
        yield load
        yield imb
        overall = GaugeMetricFamily("expertmesh_expert_load_imbalance_max", "Worst per-layer max/mean expert load")
        overall.add_metric([], worst)
        yield overall
        wire = CounterMetricFamily(
            "expertmesh_worker_message_bytes",
            "Serialized bytes of router↔worker messages",
            labels=["worker", "direction"],
        )
        for c in list(eng.attention) + list(eng.experts):
            sent = getattr(c, "bytes_sent", None)
            if isinstance(sent, int):
                wire.add_metric([c.name, "sent"], sent)
                wire.add_metric([c.name, "received"], c.bytes_received)
        yield wire
        exchange = CounterMetricFamily(
            "expertmesh_expert_exchange_bytes",
            "Tensor bytes between attention and expert workers (as the attention workers "
            "report them; the router does not carry them)",
        )
        exchange.add_metric([], s.exchange_bytes)
        yield exchange
        steps = CounterMetricFamily("expertmesh_scheduler_steps", "Scheduler steps run")
        steps.add_metric([], s.steps)
        yield steps
        yield from pool_metrics(eng)
        yield from vllm_metrics(eng)


def counted(s: EngineStats):
    """The counters the engine keeps in its EngineStats, as Prometheus counters (`<name>_total`)."""
    for name, doc, value in (
        ("expertmesh_prompt_tokens", "Prompt tokens of admitted requests", s.prompt_tokens),
        ("expertmesh_prompt_cached_tokens", "Prompt tokens served from the prefix cache", s.cached_tokens),
        ("expertmesh_generation_tokens", "Generated tokens", s.generated_tokens),
        ("expertmesh_spec_draft_tokens", "Speculative decoding: draft tokens verified", s.drafted),
        ("expertmesh_spec_accepted_tokens", "Speculative decoding: draft tokens accepted", s.accepted),
        ("expertmesh_spec_verify_steps", "Speculative decoding: sequence steps that verified drafts", s.verify_steps),
    ):
        family = CounterMetricFamily(name, doc)
        family.add_metric([], value)
        yield family
    for name, doc, label, counts in (
        ("expertmesh_requests", "Finished requests by outcome", "outcome", s.outcomes),
        (
            "expertmesh_prefill_tokens",
            "Prompt tokens computed, by the pool of the attention worker that computed them (prefill | decode | mixed)",
            "pool",
            s.prefilled_by_pool,
        ),
        (
            "expertmesh_spec_draft_tokens_by_position",
            "Speculative decoding: drafts verified, by draft position in the step (0: the first)",
            "position",
            s.drafted_by_position,
        ),
        (
            "expertmesh_spec_accepted_tokens_by_position",
            "Speculative decoding: drafts accepted, by draft position in the step (0: the first)",
            "position",
            s.accepted_by_position,
        ),
    ):
        family = CounterMetricFamily(name, doc, labels=[label])
        for key, value in list(counts.items()):
            family.add_metric([key], value)
        yield family


def pool_metrics(eng):
    """Per attention pool (router/disagg.py): what a HorizontalPodAutoscaler scales each pool on."""
    loads = pool_load(eng.pools, eng.kv, frozenset(eng.attention_down), list(eng.waiting), list(eng.running))
    families = {
        f: GaugeMetricFamily(f"expertmesh_pool_{f}", doc, labels=["pool"])
        for f, doc in (
            ("requests_waiting", "Requests waiting to enter the pool (decode: also sequences waiting for a hand-off)"),
            ("prefill_tokens_waiting", "Prompt tokens bound for the pool, not computed yet"),
            ("kv_utilization", "Used / total KV blocks over the pool's live attention workers"),
            ("live_workers", "Attention workers of the pool not marked down"),
        )
    }
    for pool, load in loads.items():
        for f, family in families.items():
            family.add_metric([pool], getattr(load, f))
    yield from families.values()
