"""A MoEDeployment's `status`: conditions, the phase state machine over observed pods, the WeightsReady condition
of a fetched checkpoint, and `status.placement` from a plan. Pure: the current status and observations in, the
status to merge (Kopf's patch) out.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from expertmesh.operator.forecast import predicted_status
from expertmesh.operator.naming import (
    COMPONENT_ATTENTION,
    COMPONENT_EXPERT,
    COMPONENT_PREFILL,
    COMPONENT_ROUTER,
    selector_labels,
    selector_string,
)
from expertmesh.operator.pods import Assessment, PodInfo
from expertmesh.operator.spec import GIB, MESSAGE_MAX, MoEDeploymentSpec, resolve_model
from expertmesh.placement.plan import PlacementPlan


def now_rfc3339(now: _dt.datetime | None = None) -> str:
    now = now or _dt.datetime.now(_dt.UTC)
    return now.astimezone(_dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def clip(message: str, limit: int = MESSAGE_MAX) -> str:
    """A message within the CRD's bound for status messages (the API server refuses a longer one)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


_CONDITION_ORDER = {
    "LicenseAccepted": 0,
    "PlacementReady": 1,
    "WeightsReady": 2,
    "WorkersReady": 3,
    "RouterReady": 4,
    "Degraded": 5,
}


def set_condition(
    conditions: list[dict] | None,
    type_: str,
    status: str,
    reason: str,
    message: str = "",
    generation: int | None = None,
    now: str | None = None,
) -> list[dict]:
    """A new condition list with `type_` set; its `lastTransitionTime` is kept unless `status` flips."""
    now = now or now_rfc3339()
    message = clip(message or "")
    out, found = [], False
    for c in conditions or []:
        c = dict(c)
        if c.get("type") == type_:
            found = True
            keep = c.get("status") == status and c.get("lastTransitionTime")
            c = {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": c["lastTransitionTime"] if keep else now,
                "observedGeneration": generation,
            }
        out.append(c)
    if not found:
        out.append(
            {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": now,
                "observedGeneration": generation,
            }
        )
    return sorted(out, key=lambda c: _CONDITION_ORDER.get(c.get("type"), 99))


def without_condition(conditions: list[dict] | None, type_: str) -> list[dict]:
    """The condition list less `type_` (a condition that no longer applies, e.g. LicenseAccepted once no licence
    does)."""
    return [dict(c) for c in conditions or [] if c.get("type") != type_]


def condition(status: dict, type_: str) -> dict | None:
    return next((c for c in (status or {}).get("conditions", []) or [] if c.get("type") == type_), None)


def failed_status(
    status: dict | None, message: str, generation: int | None, reason: str, now: str | None = None
) -> dict:
    """Status for a spec that cannot be deployed as written (a bad field, a cluster too small for the model)."""
    conds = (status or {}).get("conditions", []) or []
    conds = set_condition(conds, "PlacementReady", "False", reason, message, generation, now)
    for t in ("WorkersReady", "RouterReady"):
        conds = set_condition(conds, t, "Unknown", reason, "not deployed: fix the spec", generation, now)
    conds = set_condition(conds, "Degraded", "False", reason, "", generation, now)
    return {"phase": "Failed", "message": clip(message), "conditions": conds, "observedGeneration": generation}


def with_license(conditions: list[dict] | None, verdict, generation: int | None) -> list[dict]:
    """The conditions with LicenseAccepted from `verdict` (model_license.license_verdict), or without it when no
    licence applies."""
    if verdict is None:
        return without_condition(conditions, "LicenseAccepted")
    status = "True" if verdict.accepted else "False"
    return set_condition(conditions, "LicenseAccepted", status, verdict.reason, verdict.message, generation)


def license_refused_status(status: dict | None, verdict, generation: int | None) -> dict:
    """Status for a deployment whose weights' licence is not accepted: nothing fetched or deployed (phase Failed:
    waiting for a spec fix), LicenseAccepted False saying which licence needs accepting."""
    out = failed_status(status, verdict.message, generation, reason=verdict.reason)
    return {**out, "conditions": with_license(out["conditions"], verdict, generation)}


def placement_status(
    plan: PlacementPlan,
    lost_workers: Iterable[int] = (),
    moved: int | None = None,
    observed_imbalance: float | None = None,
) -> dict[str, Any]:
    """`status.placement` (camelCase) from a plan's figures."""
    f = plan.figures
    out = {
        "logicalExperts": f.logical_experts,
        "physicalExperts": f.physical_experts,
        "imbalance": round(f.imbalance, 4),
        "bytesPerGpu": f.bytes_per_gpu_max,
        "planHash": plan.plan_hash(),
        "movedShards": int(moved if moved is not None else (f.moved_shards or 0)),
        "lostWorkers": sorted({int(w) for w in lost_workers}),
    }
    if observed_imbalance is not None:
        out["observedImbalance"] = round(float(observed_imbalance), 4)
    return out


def summarize_plan(plan: PlacementPlan) -> str:
    """One line for the PlacementReady condition's message."""
    f, c = plan.figures, plan.cluster
    text = (
        f"{f.physical_experts} physical experts for {f.logical_experts} logical over {c.pods} expert pods x "
        f"{c.gpus_per_pod} devices ({f.bytes_per_gpu_max / GIB:.3g} GiB max per device); expected imbalance "
        f"{f.imbalance:.3f}"
    )
    if f.moved_shards is not None:
        text += f"; {f.moved_shards} shards moved"
    if plan.notes:
        text += "; " + "; ".join(plan.notes)
    return text


def weights_condition(
    spec: MoEDeploymentSpec, pods: Iterable[PodInfo], progress: dict[str, float | None]
) -> tuple[str, str, str] | None:
    """(status, reason, message) of the WeightsReady condition for a fetched checkpoint (None otherwise):
    FetchFailed naming the pod and what its fetch said (a corrupted file by name); Downloading N% (`progress`:
    pod name → percent read from its fetch log; the pods of one node share its cache — one downloads, the others
    wait for it — so a node counts its most advanced pod, 100% once one of its pods has finished, and the deployment
    its slowest node); Verified once no pod fetches."""
    ck = spec.model.checkpoint
    if not ck.fetched:
        return None
    pods = [p for p in pods if not p.deleting]
    failed = sorted((p for p in pods if p.fetch == "failed"), key=lambda p: p.name)
    if failed:
        p = failed[0]
        what = p.fetch_error.splitlines()[-1] if p.fetch_error else "the fetch failed"
        return "False", "FetchFailed", f"pod {p.name}: {what.removeprefix('FETCH failed: ')}"
    fetching = sorted(p.name for p in pods if p.fetch == "running")
    if fetching:
        by_node: dict[str, float] = {}
        for p in pods:
            if p.fetch in ("running", "done"):
                done = 100.0 if p.fetch == "done" else progress.get(p.name) or 0.0
                by_node[p.node] = max(by_node.get(p.node, 0.0), done)
        pct = min(by_node.values())
        return "False", "Downloading", f"Downloading {int(pct)}% ({len(fetching)} pods fetching {ck.uri})"
    if not pods:
        return "Unknown", "PodsStarting", f"no pod has fetched {ck.uri} yet"
    return "True", "Verified", f"{ck.uri}: every file verified by size and sha256 in the cache"


def with_weights(
    update: dict,
    status: dict,
    spec: MoEDeploymentSpec,
    pods: Iterable[PodInfo],
    progress: dict[str, float | None],
    generation: int | None,
) -> dict:
    """`update` (a status patch) with the WeightsReady condition, and while pods fetch or a fetch failed, its
    message (`Downloading 37% …`) as the status message; with spec.slo, also status.predicted and SLOAttainable."""
    update = with_forecast(update, status, spec, generation)
    cond = weights_condition(spec, pods, progress)
    if cond is None:
        return update
    conds = update.get("conditions", status.get("conditions")) or []
    out = {**update, "conditions": set_condition(conds, "WeightsReady", *cond, generation)}
    if cond[0] == "False" and (update.get("phase") or status.get("phase")) in ("Deploying", "Degraded"):
        out["message"] = clip(cond[2])
    return out


def with_forecast(update: dict, status: dict, spec: MoEDeploymentSpec, generation: int | None) -> dict:
    """spec.slo's forecast (operator/forecast.py) as status.predicted and the SLOAttainable condition; both gone
    once the spec has no SLO."""
    conds = update.get("conditions", status.get("conditions")) or []
    if spec.slo is None:
        if status.get("predicted") is None and condition({"conditions": conds}, "SLOAttainable") is None:
            return update
        return {**update, "predicted": None, "conditions": without_condition(conds, "SLOAttainable")}
    predicted, cond = predicted_status(spec, resolve_model(spec))
    return {**update, "predicted": predicted, "conditions": set_condition(conds, "SLOAttainable", *cond, generation)}


@dataclass
class Decision:
    """What the observed pods call for: the status to merge in, and whether to re-plan.
    `replan_excluding` None: keep the plan; a list: re-plan around these expert ordinals ([] = onto all)."""

    status: dict
    replan_excluding: list[int] | None = None


def counts_status(a: Assessment, spec: MoEDeploymentSpec, name: str) -> dict:
    """The pod counts: every worker, each pool (`prefillWorkers` beside `attentionWorkers` — the decode pool — when
    there is a prefill pool; null removes it from the status when there is none) and the router."""
    return {
        "readyWorkers": a.ready_workers,
        "desiredWorkers": a.desired_workers,
        "expertWorkers": {
            "replicas": spec.expert_workers.replicas,
            "ready": a.ready[COMPONENT_EXPERT],
            "selector": selector_string(selector_labels(name, COMPONENT_EXPERT)),
        },
        "attentionWorkers": {"ready": a.ready[COMPONENT_ATTENTION], "desired": a.desired[COMPONENT_ATTENTION]},
        "prefillWorkers": {"ready": a.ready[COMPONENT_PREFILL], "desired": a.desired[COMPONENT_PREFILL]}
        if spec.prefill_workers.enabled
        else None,
        "router": {"ready": a.ready[COMPONENT_ROUTER], "desired": a.desired[COMPONENT_ROUTER]},
    }


def _workers_message(a: Assessment, spec: MoEDeploymentSpec) -> str:
    """`2/2 expert and 1/1 attention workers ready`; with a prefill pool `2/2 expert, 1/1 attention (decode) and 1/1
    prefill workers ready`."""

    def n(c: str) -> str:
        return f"{a.ready[c]}/{a.desired[c]}"

    if spec.prefill_workers.enabled:
        return (
            f"{n(COMPONENT_EXPERT)} expert, {n(COMPONENT_ATTENTION)} attention (decode) and "
            f"{n(COMPONENT_PREFILL)} prefill workers ready"
        )
    return f"{n(COMPONENT_EXPERT)} expert and {n(COMPONENT_ATTENTION)} attention workers ready"


def decide(
    name: str,
    spec: MoEDeploymentSpec,
    plan: PlacementPlan,
    status: dict,
    a: Assessment,
    generation: int | None,
    now: str | None = None,
) -> Decision:
    """The phase state machine over observed pods.

    Deploying — until every pod the plan needs is live on the current template (pods starting or rolling are
      expected, never a reason to re-plan);
    Ready — everything live; Degraded (ReplannedOntoSurvivors) when the plan routes around lost pods;
    after Ready/Degraded, a pod the plan needs that is not live → Degraded:
      its experts all have live replicas elsewhere → reason ReplicasServing (nothing moves);
      some expert has no live replica → reason ExpertsUnavailable and a re-plan onto the survivors;
      — but only once the pods have been lost for `placement.replanGraceSeconds` (`status.lostSince` records
      since when; a restarting pod usually comes back, and a re-plan moves shards);
    lost pods all live again → re-plan onto every pod (they rejoin).
    A Failed resource is left alone (only a spec change gets it out)."""
    phase = status.get("phase")
    if phase == "Failed":
        return Decision(status={})
    now = now or now_rfc3339()
    conds = status.get("conditions", []) or []
    since: dict[int, str] = {}
    lost_before = sorted((status.get("placement") or {}).get("lostWorkers", []) or [])
    r_ok = a.ready[COMPONENT_ROUTER] >= a.desired[COMPONENT_ROUTER]
    conds = set_condition(
        conds,
        "RouterReady",
        "True" if r_ok else "False",
        "RouterAvailable" if r_ok else "RouterUnavailable",
        f"{a.ready[COMPONENT_ROUTER]}/{a.desired[COMPONENT_ROUTER]} router pods ready",
        generation,
        now,
    )
    w_ok = not a.lost_experts and all(a.ready[c] >= a.desired[c] for c in (COMPONENT_ATTENTION, COMPONENT_PREFILL))
    w_msg = _workers_message(a, spec)
    replan: list[int] | None = None
    if a.rolled_out:
        conds = set_condition(conds, "WorkersReady", "True", "AllWorkersReady", w_msg, generation, now)
        if lost_before:
            new_phase = "Degraded"
            message = f"the plan routes around lost expert workers {lost_before}"
            conds = set_condition(conds, "Degraded", "True", "ReplannedOntoSurvivors", message, generation, now)
            if all(o in a.live_expert_ordinals for o in lost_before):
                replan, message = [], f"expert workers {lost_before} are back: re-planning onto every pod"
        else:
            new_phase, message = "Ready", ""
            conds = set_condition(conds, "Degraded", "False", "AllReplicasServing", "", generation, now)
    elif phase in ("Ready", "Degraded"):
        new_phase = "Degraded"
        conds = set_condition(
            conds,
            "WorkersReady",
            "True" if w_ok else "False",
            "AllWorkersReady" if w_ok else "WorkersLost",
            w_msg,
            generation,
            now,
        )
        before = {int(x["ordinal"]): x["since"] for x in status.get("lostSince") or []}
        since = {o: before.get(o, now) for o in a.lost_experts}
        if a.unserved:
            layer, e = a.unserved[0]
            reason = "ExpertsUnavailable"
            newest = max(_parse_time(t) for t in since.values())
            due = newest + _dt.timedelta(seconds=spec.placement.replan_grace_seconds)
            message = (
                f"expert workers {a.lost_experts} lost; {len(a.unserved)} experts have no live replica "
                f"(e.g. layer {layer} expert {e}): "
            )
            if _parse_time(now) >= due:
                message += "re-planning onto the surviving workers"
                replan = sorted(set(lost_before) | set(a.lost_experts))
            else:
                message += f"re-planning onto the surviving workers at {now_rfc3339(due)} unless they come back"
        elif a.lost_experts:
            reason = "ReplicasServing"
            message = (
                f"expert workers {a.lost_experts} lost; every expert they held is served by a replica on another worker"
            )
        elif not w_ok:
            reason, message = "AttentionWorkersUnavailable", w_msg
        else:
            reason, message = "RouterUnavailable", "router pods are not ready"
        conds = set_condition(conds, "Degraded", "True", reason, message, generation, now)
    else:
        new_phase = "Deploying"
        message = f"rolling out revision {status.get('revision') or '?'} (plan {plan.plan_hash()}): {w_msg}"
        conds = set_condition(conds, "WorkersReady", "False", "PodsStarting", w_msg, generation, now)
        if lost_before:
            conds = set_condition(
                conds,
                "Degraded",
                "True",
                "ReplannedOntoSurvivors",
                f"the plan routes around lost expert workers {lost_before}",
                generation,
                now,
            )
        else:
            conds = set_condition(conds, "Degraded", "False", "AllReplicasServing", "", generation, now)
    out = {
        "phase": new_phase,
        "conditions": conds,
        "message": message or None,
        "lostSince": [{"ordinal": o, "since": since[o]} for o in sorted(since)],
        **counts_status(a, spec, name),
    }
    return Decision(status=out, replan_excluding=replan)


def seconds_since(rfc3339: str | None, now: _dt.datetime | None = None) -> float:
    """Seconds from an RFC 3339 time (as the status keeps them) to now; +inf when absent or unreadable."""
    try:
        then = _parse_time(rfc3339)
    except (TypeError, ValueError, AttributeError):
        return float("inf")
    return ((now or _dt.datetime.now(_dt.UTC)) - then).total_seconds()


def _parse_time(text: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
