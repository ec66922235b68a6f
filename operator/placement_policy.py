"""Placement policy: which plan a MoEDeployment gets — for its spec, around lost expert pods, under observed load.

Pure functions over the planner (`expertmesh.placement.planner`): they decide between the minimal-movement plan (every
still-valid shard stays) and a fresh one, renumber a plan around lost pods, and judge the router's load statistics.
A new plan reaches the pods through the plan ConfigMap only (see `changed_ordinals`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from expertmesh.operator.spec import GIB, MoEDeploymentSpec
from expertmesh.placement.plan import ClusterShape, GpuPlacement, PlacementPlan, PlanFigures, WorkerPlacement
from expertmesh.placement.planner import PlanError, imbalance, moved_shards, placed_layers, plan_placement


def cluster_shape(spec: MoEDeploymentSpec) -> ClusterShape:
    """The expert workers of a spec as the planner sees them (a CPU pod counts as one device)."""
    ew = spec.expert_workers
    return ClusterShape(
        pods=ew.replicas,
        gpus_per_pod=ew.devices_per_pod,
        gpu_memory_bytes=int(ew.gpu_memory_gib * GIB),
        reserve_bytes=int(ew.reserve_gib * GIB),
    )


def mtp_of(spec: MoEDeploymentSpec) -> bool:
    """The spec drafts with the MTP layer: its plans place that layer's experts too (planner.placed_layers)."""
    return spec.speculative is not None and spec.speculative.method == "mtp"


def placed_loads(loads, cfg, mtp: bool):
    """Observed loads [n_moe_layers, E] (parse_load: the MoE layers) as the plan's layers: with `mtp`, the MTP
    layers' rows at the mean load (the router's counts for them are not kept)."""
    if loads is None or not mtp:
        return loads
    arr = np.asarray(loads, dtype=np.float64)
    extra = len(placed_layers(cfg, True)) - arr.shape[0]
    return np.vstack([arr, np.full((extra, arr.shape[1]), arr.mean() if arr.size else 1.0)]) if extra > 0 else arr


def compatible(previous: PlacementPlan | None, cfg, mtp: bool = False) -> PlacementPlan | None:
    """`previous` when it is a plan of this model and these layers (so its shards can stay put), else None."""
    if previous is None:
        return None
    same = (previous.model_name, list(previous.moe_layers), previous.n_experts, previous.expert_bytes) == (
        cfg.name,
        placed_layers(cfg, mtp),
        cfg.moe.n_routed_experts,
        cfg.expert_bytes_mxfp4,
    )
    return previous if same else None


def plan_for(
    spec: MoEDeploymentSpec, cfg, previous: PlacementPlan | None = None, loads=None, reuse: bool = True
) -> PlacementPlan:
    """The plan for a spec on all its expert pods. With a previous plan of this model, the minimal-movement
    plan (every still-valid shard stays) is preferred; when that is out of balance — expected imbalance above
    `placement.imbalanceThreshold`, e.g. pods were added and would stay empty — a fresh plan is taken if it
    balances better (see `choose`). Raises `PlanError` (a ValueError) when the pods cannot hold the model."""
    shape, r, mtp = cluster_shape(spec), spec.expert_workers.redundant_experts, mtp_of(spec)
    previous, loads = compatible(previous, cfg, mtp), placed_loads(loads, cfg, mtp)
    if previous is None:
        return plan_placement(cfg, shape, redundant_slots=r, loads=loads, mtp=mtp)
    if reuse and loads is None and previous.cluster == shape and previous.figures.redundant_requested == r:
        return previous  # nothing placement-relevant changed (restart, image bump): keep it, pods stay
    incremental = plan_placement(cfg, shape, redundant_slots=r, loads=loads, previous=previous, mtp=mtp)
    if incremental.figures.imbalance <= spec.placement.imbalance_threshold:
        return incremental
    fresh = plan_placement(cfg, shape, redundant_slots=r, loads=loads, mtp=mtp)
    return choose(incremental, fresh, spec.placement.imbalance_threshold)


def choose(incremental: PlacementPlan, fresh: PlacementPlan, threshold: float, loads=None) -> PlacementPlan:
    """The minimal-movement plan unless it is above `threshold` and the fresh one is better balanced
    (imbalance under `loads`, else under the loads each plan was made with)."""
    if loads is None:
        a, b = incremental.figures.imbalance, fresh.figures.imbalance
    else:
        a, b = imbalance(incremental, loads).mean, imbalance(fresh, loads).mean
    return fresh if a > threshold and b < a else incremental


def moved_from(previous: PlacementPlan | None, plan: PlacementPlan, cfg) -> int:
    """Shards `plan` places where `previous` (of the same model) did not have them; 0 without one."""
    previous = compatible(previous, cfg, mtp=len(plan.moe_layers) > cfg.n_moe_layers)
    return 0 if previous is None else moved_shards(previous, plan)


def _spread_figures(figures: PlanFigures, workers, expert_bytes: int) -> PlanFigures:
    """`figures` with the per-GPU shard/byte minimum and mean recomputed over `workers`."""
    per_gpu = [len(g.shards) for w in workers for g in w.gpus]
    mean = sum(per_gpu) / len(per_gpu)
    return figures.model_copy(
        update={
            "shards_per_gpu_min": min(per_gpu),
            "shards_per_gpu_mean": mean,
            "bytes_per_gpu_min": min(per_gpu) * expert_bytes,
            "bytes_per_gpu_mean": mean * expert_bytes,
        }
    )


def replan_around(spec: MoEDeploymentSpec, cfg, plan: PlacementPlan, lost: Iterable[int], loads=None) -> PlacementPlan:
    """Re-plan onto the expert pods that are not `lost`, moving as little as possible.

    The planner numbers pods 0..P-1 and drops shards of pods past the end, so the lost pods are renumbered to
    the end of a copy of `plan`, the survivors planned as P' = P - len(lost) pods (everything they hold stays),
    and the result numbered back: a plan for all P ordinals in which the lost ones hold nothing (the router
    sends them no tokens; a pod that comes back loads an empty shard until the next re-plan).
    Raises `PlanError` when the survivors cannot hold the model."""
    P, G = plan.cluster.pods, plan.cluster.gpus_per_pod
    lost = sorted({int(o) for o in lost if 0 <= int(o) < P})
    survivors = [o for o in range(P) if o not in lost]
    if not lost:  # everyone is back: the balanced choice of plan_for (a returning pod would otherwise stay empty)
        return plan_for(spec, cfg, previous=plan, loads=loads, reuse=False)
    if not survivors:
        raise PlanError(f"all {P} expert workers are lost: no pod left to plan onto")
    order = survivors + lost  # new index i ← old ordinal order[i]
    permuted = _with_workers(plan, [plan.workers[o].gpus for o in order], plan.figures)
    shape = ClusterShape(
        pods=len(survivors),
        gpus_per_pod=G,
        gpu_memory_bytes=plan.cluster.gpu_memory_bytes,
        reserve_bytes=plan.cluster.reserve_bytes,
    )
    mtp = mtp_of(spec)
    compact = plan_placement(
        cfg,
        shape,
        redundant_slots=spec.expert_workers.redundant_experts,
        loads=placed_loads(loads, cfg, mtp),
        previous=permuted,
        mtp=mtp,
    )
    empty = tuple(GpuPlacement(gpu=g, shards=(), bytes=0) for g in range(G))
    gpus = [empty] * P
    for i, o in enumerate(survivors):
        gpus[o] = compact.workers[i].gpus
    # the planner's note about shards "on pods that no longer exist" means the lost pods here: say so instead
    notes = tuple(n for n in compact.notes if "no longer exist" not in n) + (
        f"expert workers {lost} lost: planned onto the {len(survivors)} survivors {survivors}; the lost "
        f"ordinals hold no experts",
    )
    staged = _with_workers(plan, gpus, compact.figures, notes=notes)
    figures = _spread_figures(compact.figures, staged.workers, plan.expert_bytes).model_copy(
        update={"moved_shards": moved_shards(plan, staged), "previous_hash": plan.plan_hash()}
    )
    return _with_workers(plan, gpus, figures, notes=notes)


def _with_workers(plan: PlacementPlan, gpus_by_ordinal, figures: PlanFigures, notes=None) -> PlacementPlan:
    """A validated copy of `plan` with other per-ordinal GPU placements (and figures/notes)."""
    return PlacementPlan(
        model_name=plan.model_name,
        moe_layers=plan.moe_layers,
        n_experts=plan.n_experts,
        top_k=plan.top_k,
        expert_bytes=plan.expert_bytes,
        cluster=plan.cluster,
        workers=tuple(WorkerPlacement(ordinal=o, gpus=tuple(g)) for o, g in enumerate(gpus_by_ordinal)),
        figures=figures,
        notes=plan.notes if notes is None else tuple(notes),
    )


# ------------------------------------------------------------------------------------------------ plan rollout
# A new plan is published in the plan ConfigMap; no pod template changes and no pod restarts. The router follows
# the mounted plan and adopts it live (router/server.watch_plan → Engine.replan): the expert workers load their
# new shards, the router switches the attention workers' replica table between two steps, the expert workers
# drop the shards they gave up. A pod that starts reads the plan in force from the same ConfigMap.
def _shards(plan: PlacementPlan | None, ordinal: int) -> tuple:
    if plan is None or ordinal >= len(plan.workers):
        return ()
    return tuple((g.gpu, tuple(g.shards)) for g in plan.workers[ordinal].gpus if g.shards)


def changed_ordinals(previous: PlacementPlan | None, plan: PlacementPlan) -> list[int]:
    """Expert ordinals whose shards (per device) differ between `previous` and `plan`."""
    n = max(len(plan.workers), len(previous.workers) if previous is not None else 0)
    return [o for o in range(n) if _shards(previous, o) != _shards(plan, o)]


# ------------------------------------------------------------------------------------------------ load
def parse_load(payload: dict, cfg) -> np.ndarray:
    """The router's `/v1/load` body — {"moe_layers": [...], "tokens": {layer: [count per expert]}} — as
    float64 [n_moe_layers, E] in `cfg.moe_layers` order (layers it does not report count 0).
    Raises ValueError naming what is malformed."""
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not isinstance(tokens, dict):
        raise ValueError(f"load: expected an object with 'tokens' {{layer: [counts]}}, got {str(payload)[:80]!r}")
    E = cfg.moe.n_routed_experts
    out = np.zeros((cfg.n_moe_layers, E), dtype=np.float64)
    for i, layer in enumerate(cfg.moe_layers):
        row = tokens.get(str(layer), tokens.get(layer))
        if row is None:
            continue
        arr = np.asarray(row, dtype=np.float64)
        if arr.shape != (E,) or not np.isfinite(arr).all() or (arr < 0).any():
            raise ValueError(f"load: tokens[{layer}] must be {E} finite counts >= 0, got {str(row)[:80]}")
        out[i] = arr
    return out


@dataclass
class Rebalance:
    """The timer's verdict on observed load: `plan` is the new plan (None: keep the current one)."""

    observed: float  # imbalance of the current plan under the observed load
    plan: PlacementPlan | None = None
    expected: float | None = None  # imbalance of the new plan under the same load
    moved: int = 0
    reason: str = ""


def rebalance(spec: MoEDeploymentSpec, cfg, plan: PlacementPlan, loads: np.ndarray) -> Rebalance:
    """Re-plan when the observed imbalance (the planner's max/mean per-GPU load, averaged over layers) exceeds
    `placement.imbalanceThreshold`. Tries the minimal-movement plan first (previous shards stay); if that does
    not get under the threshold, a fresh plan, taken only when it is better still."""
    threshold = spec.placement.imbalance_threshold
    if not np.asarray(loads).sum() > 0:
        return Rebalance(observed=1.0, reason="no load observed yet")
    mtp = mtp_of(spec)
    if list(plan.moe_layers) != placed_layers(cfg, mtp):
        return Rebalance(observed=1.0, reason="the plan's layers differ from the spec's: left to reconcile")
    loads = placed_loads(loads, cfg, mtp)
    current = imbalance(plan, loads).mean
    if current <= threshold:
        return Rebalance(observed=current, reason=f"imbalance {current:.3f} <= threshold {threshold}")
    shape = plan.cluster
    if shape.pods != spec.expert_workers.replicas:
        return Rebalance(observed=current, reason="the plan's pod count differs from the spec: left to reconcile")
    r = spec.expert_workers.redundant_experts
    best = plan_placement(cfg, shape, redundant_slots=r, loads=loads, previous=plan, mtp=mtp)
    if imbalance(best, loads).mean > threshold:
        best = choose(best, plan_placement(cfg, shape, redundant_slots=r, loads=loads, mtp=mtp), threshold, loads)
    best_imb = imbalance(best, loads).mean
    if best_imb >= current or best.plan_hash() == plan.plan_hash():
        return Rebalance(
            observed=current, reason=f"imbalance {current:.3f} > threshold {threshold}, but no plan does better"
        )
    return Rebalance(
        observed=current,
        plan=best,
        expected=best_imb,
        moved=moved_shards(plan, best),
        reason=f"imbalance {current:.3f} > threshold {threshold}: re-planned to {best_imb:.3f}",
    )
