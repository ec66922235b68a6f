"""A MoEDeployment's attention pools (issue #36, prefill/decode disaggregation): which pools there are, how many pods
each has, how much KV each holds, and what its autoscaler watches. Pure: the spec (and the replicas observed on the
pools' StatefulSets) in, plain data out.

Without a prefill pool (spec.prefillWorkers.replicas 0, no autoscale) there is one pool, `mixed`: the attention
workers run prompts and decode, as before. With one there are two:
  - `prefill` (StatefulSet N-prefill, spec.prefillWorkers): runs the prompts, samples the first token and hands the
    sequence (KV + recurrent state) to a decode worker over gRPC; the router lists it in `--prefill`;
  - `decode` (StatefulSet N-attention, spec.attentionWorkers): runs the sequences it is handed; the router lists it in
    `--attention`.
An autoscaled pool (`autoscale`) has as many pods as its StatefulSet has now (the HorizontalPodAutoscaler sets them),
within [minReplicas, maxReplicas]; minReplicas before the StatefulSet exists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from expertmesh.operator.naming import COMPONENT_ATTENTION, COMPONENT_PREFILL, attention_name, prefill_name
from expertmesh.operator.spec import (
    AttentionWorkersSpec,
    AutoscaleSpec,
    KVDiskSpec,
    MoEDeploymentSpec,
    PrefillWorkersSpec,
)

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"

# spec autoscale.metric → (the router's series, the HPA target type): the waiting counts are the pool's totals, kept
# at `target` per pod (AverageValue: desired = ceil(total / target)); kv_utilization is already the pool's fraction
# (Value: desired = ceil(current × utilization / target))
METRIC_SERIES = {
    "prefill_tokens_waiting": ("expertmesh_pool_prefill_tokens_waiting", "AverageValue"),
    "requests_waiting": ("expertmesh_pool_requests_waiting", "AverageValue"),
    "kv_utilization": ("expertmesh_pool_kv_utilization", "Value"),
}


@dataclass(frozen=True)
class Pool:
    """One attention pool as the children are built from it."""

    role: str  # mixed | prefill | decode: the worker's --pool
    component: str  # its pods' app.kubernetes.io/component label
    statefulset: str  # its StatefulSet's (and headless Service's, and HPA's) name
    field: str  # its spec field, for messages: spec.attentionWorkers / spec.prefillWorkers
    workers: AttentionWorkersSpec | PrefillWorkersSpec
    replicas: int  # pods now: the spec's, or an autoscaled pool's StatefulSet's

    @property
    def autoscale(self) -> AutoscaleSpec | None:
        return self.workers.autoscale

    @property
    def metric_pool(self) -> str:
        """The router's `pool` label of this pool's series (a mixed pool is the decode pool: it decodes)."""
        return PREFILL if self.role == PREFILL else DECODE


def pool_replicas(spec_replicas: int, autoscale: AutoscaleSpec | None, observed: int | None) -> int:
    """A pool's pods: `spec_replicas` unless it is autoscaled; then the StatefulSet's current replicas (`observed`,
    what the HorizontalPodAutoscaler set — never overwritten) within [minReplicas, maxReplicas], or minReplicas
    when the StatefulSet does not exist yet."""
    if autoscale is None:
        return spec_replicas
    if observed is None:
        return autoscale.min_replicas
    return min(max(observed, autoscale.min_replicas), autoscale.max_replicas)


def attention_pools(name: str, spec: MoEDeploymentSpec, observed: Mapping[str, int] | None = None) -> list[Pool]:
    """The deployment's attention pools, the attention StatefulSet's first: [mixed] or [decode, prefill].
    `observed`: component → the replicas of that pool's StatefulSet now (read only for autoscaled pools)."""
    observed = observed or {}
    aw, pw = spec.attention_workers, spec.prefill_workers
    split = pw.enabled
    pools = [
        Pool(
            DECODE if split else MIXED,
            COMPONENT_ATTENTION,
            attention_name(name),
            "spec.attentionWorkers",
            aw,
            pool_replicas(aw.replicas, aw.autoscale, observed.get(COMPONENT_ATTENTION)),
        )
    ]
    if split:
        pools.append(
            Pool(
                PREFILL,
                COMPONENT_PREFILL,
                prefill_name(name),
                "spec.prefillWorkers",
                pw,
                pool_replicas(pw.replicas, pw.autoscale, observed.get(COMPONENT_PREFILL)),
            )
        )
    return pools


def autoscaled_components(spec: MoEDeploymentSpec) -> list[str]:
    """The components whose StatefulSet's replicas the operator reads (and keeps) rather than sets."""
    return [p.component for p in attention_pools("", spec) if p.autoscale is not None]


# ------------------------------------------------------------------------------------------------ KV sizing
@dataclass(frozen=True)
class PoolKV:
    """One attention worker's KV: its device pool and the tiers below it."""

    blocks: int  # --kv-blocks: device KV pages of block_size tokens
    host_gib: float = 0.0  # --kv-host-gib (0: no host tier)
    disk: KVDiskSpec | None = None  # --kv-disk-dir / --kv-disk-gib on its volume (None: no disk tier)


def pool_kv(
    role: str,
    *,
    max_context: int,
    block_size: int,
    host_gib: float = 0.0,
    disk: KVDiskSpec | None = None,
    speculative_tokens: int = 0,
) -> PoolKV:
    """How much KV one worker of a pool holds, for its role. A sequence of the deployment's context needs
    S = ceil((max_context + speculative_tokens) / block_size) pages: with speculation (spec.speculative.tokens = K)
    a verify step writes the newest token and K drafts, so a sequence at the full context holds K positions more
    until the rejected ones are rolled back.

    - mixed (no prefill pool): S pages — one sequence at full context in flight; what is free holds cached
      prefixes — plus spec.kv's host (`host_gib`) and disk (`disk`) tiers below, as before the pools existed;
    - prefill: 2·S pages — the prompt being prefilled chunk by chunk (up to the full context) and the previous one,
      finished, held until the decode worker it is handed to has taken it (so the next prompt starts meanwhile);
      handed-off sequences stay behind as cached prefixes (follow-up turns of a conversation are routed here, where
      their prefix is), demoted into spec.kv's host and disk tiers: the tiers go to the prefill pool;
    - decode: S pages — one running sequence at full context (it arrives whole from the prefill pool); no tiers:
      the decode pool keeps no prefixes for later turns (they start in the prefill pool).
    """
    if max_context < 1 or block_size < 1 or speculative_tokens < 0:
        raise ValueError(
            f"max_context={max_context} and block_size={block_size} must be positive, "
            f"speculative_tokens={speculative_tokens} not negative"
        )
    seq = math.ceil((max_context + speculative_tokens) / block_size)
    if role == MIXED:
        return PoolKV(seq, host_gib, disk)
    if role == PREFILL:
        return PoolKV(2 * seq, host_gib, disk)
    if role == DECODE:
        return PoolKV(seq)
    raise ValueError(f"unknown pool role {role!r}: expected {MIXED}, {PREFILL} or {DECODE}")


def spec_pool_kv(spec: MoEDeploymentSpec, cfg, role: str) -> PoolKV:
    """pool_kv for a spec: its context (spec.kv.maxContext, else the model's), page size, tiers and draft tokens."""
    kv = spec.kv
    return pool_kv(
        role,
        max_context=kv.max_context or cfg.max_context,
        block_size=kv.block_size,
        host_gib=kv.host_gib,
        disk=kv.disk,
        speculative_tokens=spec.speculative.tokens if spec.speculative is not None else 0,
    )
