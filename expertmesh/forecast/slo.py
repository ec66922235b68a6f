"""Searches over the forecast: the largest decode batch within a TPOT, and the smallest layout that meets an SLO
(`expertmesh plan --slo`, the operator's status.predicted)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from expertmesh.forecast.gpus import gpu as gpu_named
from expertmesh.forecast.predict import Layout, Prediction, Workload, predict


def largest_batch_within_tpot(at: Callable[[float], Prediction], tpot_ms: float, *, hi: float = 4096) -> Prediction:
    """The prediction at the largest batch per GPU (whole sequences) whose TPOT is within `tpot_ms` and whose KV
    fits; at batch 1 if even that misses it."""
    best = at(1)
    lo_b, hi_b = 1, int(hi)
    while lo_b < hi_b:  # TPOT grows with the batch: bisect on whole sequences
        mid = (lo_b + hi_b + 1) // 2
        try:
            p = at(mid)
        except ValueError:  # past the KV capacity
            hi_b = mid - 1
            continue
        if p.tpot_ms <= tpot_ms:
            lo_b, best = mid, p
        else:
            hi_b = mid - 1
    return best


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_ms: float


@dataclass(frozen=True)
class Proposal:
    layout: Layout
    prediction: Prediction
    batch_per_gpu: float

    @property
    def nodes(self) -> int:
        g = gpu_named(self.prediction.gpu)
        return -(-self.layout.gpus // g.gpus_per_node)


def meets(p: Prediction, slo: SLO) -> bool:
    return p.ttft_s <= slo.ttft_s and p.tpot_ms <= slo.tpot_ms


def smallest_layout(
    model,
    gpu: str,
    slo: SLO,
    workload: Workload,
    *,
    weights: str,
    attention: str = "bf16",
    max_nodes: int = 64,
) -> Proposal:
    """The fewest whole nodes whose best layout meets the SLO: attention TP over each node or DP attention, experts
    wide over the pool, prefill on the same GPUs or its own pool (a quarter of the nodes), the batch per decode
    GPU the largest within the TPOT; among layouts with equal nodes, the most decode throughput per GPU. Raises
    ValueError when nothing up to `max_nodes` does."""
    g = gpu_named(gpu)
    last_reason = "no layout fits the weights"
    for nodes in range(1, max_nodes + 1):
        gpus = nodes * g.gpus_per_node
        candidates = [Layout(gpus=gpus, tp=g.gpus_per_node)]  # TP attention per node, experts wide over all
        if nodes > 1:
            prefill = max(1, nodes // 4) * g.gpus_per_node
            for tp, dp in ((g.gpus_per_node, False), (1, True)):
                candidates.append(
                    Layout(gpus=gpus, tp=tp, dp_attention=dp, prefill_gpus=prefill, decode_gpus=gpus - prefill)
                )
            candidates.append(Layout(gpus=gpus, dp_attention=True))
        best: Proposal | None = None
        for layout in candidates:

            def at(batch: float, layout=layout) -> Prediction:
                w = Workload(
                    workload.input_len,
                    workload.output_len,
                    batch_per_gpu=batch,
                    cache_hit=workload.cache_hit,
                    accepted_tokens=workload.accepted_tokens,
                    context_len=workload.context_len,
                )
                return predict(model, g, layout, w, weights=weights, attention=attention)

            try:
                p = largest_batch_within_tpot(at, slo.tpot_ms)
            except ValueError as e:
                last_reason = str(e)
                continue
            if not meets(p, slo):
                last_reason = f"{nodes} node(s): TTFT {p.ttft_s:.2f} s, TPOT {p.tpot_ms:.1f} ms"
                continue
            proposal = Proposal(layout, p, p.assumed["batch_per_gpu"])
            if best is None or p.decode_tokens_per_s_per_gpu > best.prediction.decode_tokens_per_s_per_gpu:
                best = proposal
        if best is not None:
            return best
    raise ValueError(
        f"--slo ttft={slo.ttft_s:g}s,tpot={slo.tpot_ms:g}ms: no layout of up to {max_nodes} {g.name} nodes meets it "
        f"(last tried: {last_reason})"
    )
