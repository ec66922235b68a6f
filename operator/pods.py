"""The operator's pods as observed, against the plan in force: what one pod is (`pod_info`, from its object) and how
the deployment's pods stand (`assess`: live pods per component, lost plan-holding expert pods, experts left without a
live replica). Pure: pod objects (dicts) in, plain data out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from expertmesh.operator.lws import lws_leader
from expertmesh.operator.naming import (
    COMPONENT_ATTENTION,
    COMPONENT_EXPERT,
    COMPONENT_PREFILL,
    COMPONENT_ROUTER,
    FETCH_CONTAINER,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    TEMPLATE_HASH_ANNOTATION,
)
from expertmesh.operator.spec import MoEDeploymentSpec
from expertmesh.placement.plan import PlacementPlan


@dataclass(frozen=True)
class PodInfo:
    """What the operator needs of one of its pods."""

    name: str
    component: str
    ordinal: int | None  # StatefulSet ordinal (None for router pods)
    ready: bool
    template_hash: str | None  # the pod template it was created from (see TEMPLATE_HASH_ANNOTATION)
    deleting: bool = False
    uid: str = ""
    fetch: str | None = None  # the checkpoint fetch (init container): None (none), running, done, failed
    fetch_error: str = ""  # a failed fetch's termination message (its last log line names the file)
    node: str = ""  # the node it runs on (pods of one node share the checkpoint cache)
    lws_leader: tuple[str, int, str] | None = None  # a LeaderWorkerSet group's leader: (set, group, revision)

    @property
    def live(self) -> bool:
        return self.ready and not self.deleting


def pod_info(body: dict) -> PodInfo | None:
    """A PodInfo from a pod object; None when the pod is not one of ours."""
    meta = body.get("metadata") or {}
    lab = meta.get("labels") or {}
    component = lab.get(LABEL_COMPONENT)
    if (
        component not in (COMPONENT_ROUTER, COMPONENT_ATTENTION, COMPONENT_PREFILL, COMPONENT_EXPERT)
        or LABEL_INSTANCE not in lab
    ):
        return None
    name = meta.get("name", "")
    ordinal = None
    if component != COMPONENT_ROUTER:
        tail = name.rsplit("-", 1)[-1]
        ordinal = int(tail) if tail.isdigit() else None
    st = body.get("status") or {}
    ready = st.get("phase", "Running") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []
    )
    fetch, fetch_error = _fetch_state(st)
    return PodInfo(
        name=name,
        component=component,
        ordinal=ordinal,
        ready=ready,
        template_hash=(meta.get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION),
        deleting=bool(meta.get("deletionTimestamp")),
        uid=meta.get("uid", ""),
        fetch=fetch,
        fetch_error=fetch_error,
        node=(body.get("spec") or {}).get("nodeName") or "",
        lws_leader=lws_leader(lab),
    )


def _fetch_state(pod_status: dict) -> tuple[str | None, str]:
    """(None | "running" | "done" | "failed", message) of the fetch init container in a pod's status."""
    cs = next((c for c in pod_status.get("initContainerStatuses") or [] if c.get("name") == FETCH_CONTAINER), None)
    if cs is None:
        return None, ""
    state, last = cs.get("state") or {}, (cs.get("lastState") or {}).get("terminated") or {}
    term = state.get("terminated")
    if term is not None:
        return ("done", "") if term.get("exitCode") == 0 else ("failed", (term.get("message") or "").strip())
    if last.get("exitCode") not in (None, 0):  # restarting after a failure (CrashLoopBackOff)
        return "failed", (last.get("message") or "").strip()
    return "running", ""


@dataclass
class Assessment:
    """The pods as observed against the plan in force."""

    ready: dict[str, int]  # component → live pods (experts: plan-holding ordinals)
    desired: dict[str, int]
    lost_experts: list[int]  # plan-holding expert ordinals without a live pod
    unserved: list[tuple[int, int]]  # (layer, expert) left without a live replica
    live_expert_ordinals: set[int]  # ordinals with a live expert pod, on any plan

    @property
    def rolled_out(self) -> bool:
        """Every pod the plan needs is live."""
        return not self.lost_experts and all(
            self.ready[c] >= self.desired[c] for c in (COMPONENT_ROUTER, COMPONENT_ATTENTION, COMPONENT_PREFILL)
        )

    @property
    def ready_workers(self) -> int:
        return self.ready[COMPONENT_ATTENTION] + self.ready[COMPONENT_PREFILL] + self.ready[COMPONENT_EXPERT]

    @property
    def desired_workers(self) -> int:
        return self.desired[COMPONENT_ATTENTION] + self.desired[COMPONENT_PREFILL] + self.desired[COMPONENT_EXPERT]


def plan_ordinals(plan: PlacementPlan) -> list[int]:
    """Expert ordinals that hold at least one shard."""
    return [w.ordinal for w in plan.workers if any(g.shards for g in w.gpus)]


def unserved_experts(plan: PlacementPlan, lost: Iterable[int], live: Iterable[int]) -> list[tuple[int, int]]:
    """(layer, expert) pairs, sorted, that a `lost` ordinal holds and no `live` ordinal does. Counted over the plan's
    shard array at once: a K3 plan has ~80k shards, and asking each expert for its replicas in Python took about a
    second of Kopf's event loop per reconcile while the pods were still starting."""
    shards = plan.shard_array()  # rows (worker, gpu, layer position, expert)
    key = shards[:, 2] * plan.n_experts + shards[:, 3]
    size = plan.n_moe_layers * plan.n_experts
    held_by_lost = np.bincount(key[np.isin(shards[:, 0], list(lost))], minlength=size)
    held_by_live = np.bincount(key[np.isin(shards[:, 0], list(live))], minlength=size)
    positions, experts = np.divmod(np.flatnonzero((held_by_lost > 0) & (held_by_live == 0)), plan.n_experts)
    return sorted(zip((plan.moe_layers[p] for p in positions.tolist()), experts.tolist()))


def assess(
    spec: MoEDeploymentSpec,
    plan: PlacementPlan,
    pods: Iterable[PodInfo],
    templates: dict[str, str],
    pools: Mapping[str, int] | None = None,
) -> Assessment:
    """Count live pods of the current templates (`templates`: component → template hash, see
    `children.template_hashes`); find the plan-holding expert pods that are not live on the current template, and the
    experts they leave without a live replica. `pools`: attention pool component → its pods now (pools.py: an
    autoscaled pool's are its StatefulSet's); default the spec's attention workers and no prefill pool."""
    pods = list(pods)
    pools = pools if pools is not None else {COMPONENT_ATTENTION: spec.attention_workers.replicas}
    desired = {
        COMPONENT_ROUTER: spec.router.replicas,
        COMPONENT_ATTENTION: pools.get(COMPONENT_ATTENTION, 0),
        COMPONENT_PREFILL: pools.get(COMPONENT_PREFILL, 0),
        COMPONENT_EXPERT: plan.cluster.pods,
    }

    def live(component: str, current: bool = True) -> set:
        return {
            p.ordinal if component != COMPONENT_ROUTER else p.name
            for p in pods
            if p.component == component
            and p.live
            and (not current or p.template_hash == templates.get(component))
            and (component == COMPONENT_ROUTER or (p.ordinal is not None and p.ordinal < desired[component]))
        }

    live_exp = live(COMPONENT_EXPERT)
    holding = plan_ordinals(plan)
    lost = [o for o in holding if o not in live_exp]
    unserved = unserved_experts(plan, lost, live_exp)
    ready = {
        COMPONENT_ROUTER: len(live(COMPONENT_ROUTER)),
        COMPONENT_ATTENTION: len(live(COMPONENT_ATTENTION)),
        COMPONENT_PREFILL: len(live(COMPONENT_PREFILL)),
        COMPONENT_EXPERT: len([o for o in holding if o in live_exp]),
    }
    desired[COMPONENT_EXPERT] = len(holding)
    return Assessment(
        ready=ready,
        desired=desired,
        lost_experts=lost,
        unserved=unserved,
        live_expert_ordinals=live(COMPONENT_EXPERT, current=False),
    )
