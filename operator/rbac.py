"""The Kubernetes permissions the operator uses: (apiGroup, resource, verbs), one rule per resource.

This list is the contract the Helm chart's (Cluster)Role is tested against: every API call in `handlers.py`
and everything Kopf itself needs (watching, patching its resource, posting events, CRD discovery) must be
covered here, and the chart must grant no less. Keep it minimal: no `*`; secrets only get/create (the
deployment's worker-TLS Secret and, with several router replicas, their prefix-salt Secret, each created once; the
router reads its API key from its Secret through the pod's env,
not through the operator).
"""

from __future__ import annotations

from typing import NamedTuple

from expertmesh.operator.spec import GROUP, PLURAL


class Rule(NamedTuple):
    api_group: str  # "" is the core group
    resource: str  # plural, with "/subresource" where it applies
    verbs: tuple[str, ...]


_CHILD = ("get", "create", "patch")  # read (previous plan), create, server-side apply; GC deletes them
# children a later spec may no longer have (the prefill pool's, a pool's autoscaler): deleted by the operator
_CHILD_DELETED = (*_CHILD, "delete")

RULES: tuple[Rule, ...] = (
    # the custom resource: watched by Kopf, finalizers/annotations patched, status written
    Rule(GROUP, PLURAL, ("get", "list", "watch", "patch")),
    Rule(GROUP, f"{PLURAL}/status", ("get", "patch")),
    # children's ownerReferences set blockOwnerDeletion, which clusters with the
    # OwnerReferencesPermissionEnforcement admission plugin only allow with this
    Rule(GROUP, f"{PLURAL}/finalizers", ("update",)),
    # children (owner references make the garbage collector delete them with the resource)
    Rule("", "configmaps", _CHILD),
    Rule("", "services", _CHILD_DELETED),
    # StatefulSets also watched: an autoscaled pool's replicas (the HorizontalPodAutoscaler's) re-render the router
    Rule("apps", "statefulsets", ("get", "list", "watch", "create", "patch", "delete")),
    Rule("apps", "deployments", _CHILD_DELETED),  # the router's; spec.kv.store's (deleted once the store is gone)
    Rule("policy", "poddisruptionbudgets", _CHILD),
    Rule("networking.k8s.io", "networkpolicies", _CHILD_DELETED),
    # an autoscaled pool's HorizontalPodAutoscaler (spec.*Workers.autoscale)
    Rule("autoscaling", "horizontalpodautoscalers", _CHILD_DELETED),
    # spec.gateway.inferencePool: the Gateway API Inference Extension's InferencePool naming the router's picker
    Rule("inference.networking.k8s.io", "inferencepools", _CHILD_DELETED),
    # spec.workload leaderworkerset: the pools' LeaderWorkerSets (watched: an autoscaled pool's size, as StatefulSets)
    Rule("leaderworkerset.x-k8s.io", "leaderworkersets", ("get", "list", "watch", "create", "patch", "delete")),
    # spec.devices.computeDomain: the NVIDIA DRA driver's ComputeDomain (multi-node NVLink)
    Rule("resource.nvidia.com", "computedomains", _CHILD_DELETED),
    # N-worker-tls (spec.security.workerTLS): read to keep it across re-plans and restarts, created when absent
    Rule("", "secrets", ("get", "create")),
    # worker pods: watched for readiness and loss (never deleted: a new plan is adopted live)
    Rule("", "pods", ("get", "list", "watch")),
    # the checkpoint fetch's progress: the last lines of the pods' fetch (init) container log
    Rule("", "pods/log", ("get",)),
    # Kopf posts Kubernetes events (core v1) for handler outcomes
    Rule("", "events", ("create",)),
    # leader election among operator replicas (--peering): Kopf's peering objects, keep-alives in their status
    Rule("kopf.dev", "kopfpeerings", ("get", "list", "watch", "patch")),
    Rule("kopf.dev", "clusterkopfpeerings", ("get", "list", "watch", "patch")),
    # Kopf watches CRDs to notice its resource appearing/changing (it degrades gracefully without)
    Rule("apiextensions.k8s.io", "customresourcedefinitions", ("get", "list", "watch")),
    # Not granted: namespaces. With `--namespace <exact name>` Kopf tries to list namespaces and, forbidden,
    # assumes the named ones exist (a warning at startup); only glob patterns (`--namespace 'team-*'`) need
    # ("", "namespaces", get/list/watch) cluster-wide.
)

# Cluster-scoped resources: need a ClusterRole even when the operator runs namespace-scoped.
CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("kopf.dev", "clusterkopfpeerings")}


def as_policy_rules(rules: tuple[Rule, ...] = RULES, *, cluster_scoped: bool | None = None) -> list[dict]:
    """Rules in Kubernetes' PolicyRule shape (`apiGroups`, `resources`, `verbs`), optionally only the
    cluster-scoped (`True`) or the namespaced (`False`) ones."""
    out = []
    for r in rules:
        if cluster_scoped is not None and ((r.api_group, r.resource) in CLUSTER_SCOPED) != cluster_scoped:
            continue
        out.append({"apiGroups": [r.api_group], "resources": [r.resource], "verbs": list(r.verbs)})
    return out


def allows(granted: list[dict], api_group: str, resource: str, verb: str) -> bool:
    """Whether a list of PolicyRules (as in a Role manifest) grants `verb` on `api_group/resource`."""
    for rule in granted:
        groups, resources, verbs = rule.get("apiGroups", []), rule.get("resources", []), rule.get("verbs", [])
        if (
            (api_group in groups or "*" in groups)
            and (resource in resources or "*" in resources)
            and (verb in verbs or "*" in verbs)
        ):
            return True
    return False


def missing(granted: list[dict], rules: tuple[Rule, ...] = RULES) -> list[str]:
    """`group/resource:verb` entries of `rules` that `granted` does not allow (empty when it covers them)."""
    return [
        f"{r.api_group or 'core'}/{r.resource}:{v}"
        for r in rules
        for v in r.verbs
        if not allows(granted, r.api_group, r.resource, v)
    ]
