"""`spec.workload: leaderworkerset` (issue #56): the workers as LeaderWorkerSet groups (leaderworkerset.x-k8s.io/v1, the
LWS controller installed) instead of StatefulSets, and the `llm-d.ai/role` label of the attention pods in both modes.
Pure: a StatefulSet as children.py builds it in, its LeaderWorkerSet out.

    attention pool N-attention / N-prefill → LWS of `replicas` groups of one pod each: pods N-attention-<i>, as the
                                             StatefulSet's, so the router's addresses and the headless Service stay
    expert workers N-expert                → LWS of one group of expertWorkers.replicas pods, gang-scheduled and
                                             restarted together (an NVL72 rack's expert-parallel group): leader
                                             N-expert-0 (ordinal 0), workers N-expert-0-<k> (ordinal k)

Every LeaderWorkerSet has an explicit `leaderWorkerTemplate.restartPolicy` (spec.leaderWorkerSet.restartPolicy,
default RecreateGroupOnPodRestart) and `startupPolicy`; the headless Services the operator renders keep their names
(the LWS controller uses an existing Service of the set's name for the pods' subdomain). An autoscaled pool's
HorizontalPodAutoscaler targets the LWS's scale subresource.
"""

from __future__ import annotations

import copy

from expertmesh.operator.naming import WORKER_PORT
from expertmesh.operator.pools import DECODE, MIXED, PREFILL
from expertmesh.operator.spec import MoEDeploymentSpec
from expertmesh.operator.spec_platform import LeaderWorkerSetSpec

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_RESOURCE = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")  # (group, version, plural): Kopf's watch
ROLE_LABEL = "llm-d.ai/role"  # the llm-d convention gateways, pickers and dashboards select attention pods by
ROLES = {MIXED: "prefill-decode", PREFILL: "prefill", DECODE: "decode"}
# what the LWS controller labels its pods with (api/leaderworkerset/v1/leaderworkerset_types.go)
LWS_SET_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0": the group's leader
LWS_REVISION_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"


def uses_lws(spec: MoEDeploymentSpec) -> bool:
    return spec.workload == "leaderworkerset"


def workload_kind(spec: MoEDeploymentSpec) -> tuple[str, str]:
    """(apiVersion, kind) of the pools' workloads: what an autoscaler scales and the operator reads the size of."""
    return (LWS_API, LWS_KIND) if uses_lws(spec) else ("apps/v1", "StatefulSet")


def role_labels(role: str) -> dict[str, str]:
    """An attention pool's pod labels for its role (pools.py: mixed, prefill or decode)."""
    return {ROLE_LABEL: ROLES[role]}


def lws_settings(spec: MoEDeploymentSpec) -> LeaderWorkerSetSpec:
    return spec.leader_worker_set or LeaderWorkerSetSpec()


def as_leader_worker_set(
    statefulset: dict, spec: MoEDeploymentSpec, *, group_size: int = 1, restart_bounded: bool = False
) -> dict:
    """The LeaderWorkerSet serving what `statefulset` would: its name, labels, annotations, pod template and claim
    templates; `group_size` 1: `replicas` groups of one pod; else one group of `group_size` pods (the leader is the
    group's pod 0, the rest its workers: one template for all). `restart_bounded`: a group of it was recreated
    maxGroupRestarts times (lws_restarts.py): restartPolicy None, its pods restart alone."""
    sts = copy.deepcopy(statefulset)
    s, lw = sts["spec"], lws_settings(spec)
    template = {
        "size": group_size,
        "restartPolicy": "None" if restart_bounded else lw.restart_policy,
        "workerTemplate": s["template"],
    }
    if s.get("volumeClaimTemplates"):
        template["volumeClaimTemplates"] = s["volumeClaimTemplates"]
    return {
        "apiVersion": LWS_API,
        "kind": LWS_KIND,
        "metadata": sts["metadata"],
        "spec": {
            "replicas": s["replicas"] if group_size == 1 else 1,
            "startupPolicy": lw.startup_policy,
            "leaderWorkerTemplate": template,
            # one group at a time, none extra: a group holds GPUs (and the experts' group all of them)
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},  # pods resolve as <pod>.<set name>: the router's lists
        },
    }


def lws_leader(labels: dict) -> tuple[str, int, str] | None:
    """(LeaderWorkerSet, group index, template revision) of a group's leader pod from its labels; None for any other
    pod."""
    group = labels.get(LWS_GROUP_LABEL, "")
    if labels.get(LWS_WORKER_LABEL) != "0" or not labels.get(LWS_SET_LABEL) or not group.isdigit():
        return None
    return labels[LWS_SET_LABEL], int(group), labels.get(LWS_REVISION_LABEL, "")


def pod_template(workload: dict) -> dict:
    """A workload's pod template: a StatefulSet's or Deployment's `template`, a LeaderWorkerSet's worker template."""
    s = workload["spec"]
    return s["leaderWorkerTemplate"]["workerTemplate"] if workload["kind"] == LWS_KIND else s["template"]


def expert_addresses(name: str, namespace: str, statefulset: str, replicas: int) -> list[str]:
    """The expert pods' gRPC addresses in ordinal order when they are one LWS group (naming.statefulset_addresses'
    signature): the leader N-expert-0, then the workers N-expert-0-<k> (the ordinal is the name's last number)."""
    pods = [f"{statefulset}-0"] + [f"{statefulset}-0-{k}" for k in range(1, replicas)]
    return [f"{pod}.{statefulset}.{namespace}.svc:{WORKER_PORT}" for pod in pods]
