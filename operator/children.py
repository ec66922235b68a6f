"""The child objects of a MoEDeployment (named in naming.py), built from the spec, the model config and the plan: the
plan and load ConfigMaps, the worker StatefulSets with their headless Services (one per attention pool: pools.py),
the autoscaled pools' HorizontalPodAutoscalers, the expert PodDisruptionBudget, the router Deployment and Service, the
gateway's InferencePool and picker Service (gateway.py), the workers' NetworkPolicies, and the pods (their parts in pod_parts.py, their command lines in pod_commands.py). Pure: plain dicts
in the shape of Kubernetes objects; owner references are left to the handlers (`kopf.adopt`).

A new plan changes the plan ConfigMap only, never a pod template (placement_policy.changed_ordinals).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection

import numpy as np

from expertmesh.operator.devices import compute_domain, queued
from expertmesh.operator.gateway import absent_gateway_children, gateway_children, router_epp_ports
from expertmesh.operator.kv_store import (
    absent_kv_store,
    kv_store_children,
    kv_store_key_volume,
    kv_store_worker_args,
)
from expertmesh.operator.lws import (
    LWS_API,
    LWS_KIND,
    as_leader_worker_set,
    pod_template,
    role_labels,
    uses_lws,
    workload_kind,
)
from expertmesh.operator.naming import (
    COMPONENT_ATTENTION,
    COMPONENT_EXPERT,
    COMPONENT_PREFILL,
    COMPONENT_ROUTER,
    HEALTH_PORT,
    LABEL_COMPONENT,
    PLAN_HASH_ANNOTATION,
    TEMPLATE_HASH_ANNOTATION,
    WORKER_PORT,
    expert_name,
    labels,
    load_configmap_name,
    network_policy_name,
    object_meta,
    plan_configmap_name,
    prefill_name,
    router_name,
    selector_labels,
)
from expertmesh.operator.pod_commands import attention_worker_args, expert_worker_command, router_args
from expertmesh.operator.pod_parts import (
    attention_resources,
    collective_store,
    container_resources,
    grpc_probes,
    kv_disk_volume,
    pod_env,
    pod_spec,
)
from expertmesh.operator.pools import DECODE, METRIC_SERIES, PREFILL, Pool, attention_pools, spec_pool_kv
from expertmesh.operator.router_salt import kv_disk_key_volume, router_salt_volume
from expertmesh.operator.spec import MoEDeploymentSpec


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _stamped(workload: dict) -> dict:
    """Annotate a workload's pod template with the hash of the template itself: a pod carrying the current
    hash runs the current spec (pods of an older template are still rolling). The plan is not part of any
    template: running pods adopt a new plan live (see placement_policy, "plan rollout")."""
    tmpl = workload["spec"]["template"]
    tmpl["metadata"]["annotations"] = {**tmpl["metadata"].get("annotations", {}), TEMPLATE_HASH_ANNOTATION: _hash(tmpl)}
    return workload


def template_hashes(children: list[dict]) -> dict[str, str]:
    """component → the pod-template hash of its workload among `children`."""
    return {
        c["metadata"]["labels"][LABEL_COMPONENT]: pod_template(c)["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]
        for c in children
        if c["kind"] in ("StatefulSet", "Deployment", LWS_KIND)
    }


def revision(children: list[dict]) -> str:
    """A hash of every child's desired state (`status.revision`): it changes whenever reconciling changes
    anything, so a rollout can be told from a loss."""
    return _hash(children)


def plan_configmap(name: str, namespace: str, spec: MoEDeploymentSpec, cfg, plan) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            **object_meta(plan_configmap_name(name), namespace, "plan", spec, instance=name),
            "annotations": {PLAN_HASH_ANNOTATION: plan.plan_hash()},
        },
        "data": {"plan.json": plan.to_json(), "config.json": cfg.model_dump_json(indent=1)},
    }


def load_configmap(
    name: str, namespace: str, spec: MoEDeploymentSpec, cfg, loads: np.ndarray, observed_at: str
) -> dict:
    """The router's last observed expert load (the body `/v1/load` gave, as `placement_policy.parse_load` reads it
    back): kept in the cluster so a restarted operator or a new leader re-plans around a lost pod with it."""
    payload = {
        "moe_layers": list(cfg.moe_layers),
        "observedAt": observed_at,
        "tokens": {str(layer): [int(x) for x in loads[i]] for i, layer in enumerate(cfg.moe_layers)},
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(load_configmap_name(name), namespace, "load", spec, instance=name),
        "data": {"load.json": json.dumps(payload, separators=(",", ":"))},
    }


def headless_service(name: str, namespace: str, spec: MoEDeploymentSpec, svc: str, component: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(svc, namespace, component, spec, instance=name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # router resolves pods while they load
            "selector": selector_labels(name, component),
            "ports": [{"name": "grpc", "port": WORKER_PORT, "targetPort": WORKER_PORT, "protocol": "TCP"}],
        },
    }


def attention_statefulset(name: str, namespace: str, spec: MoEDeploymentSpec, cfg, pool: Pool | None = None) -> dict:
    """An attention pool's StatefulSet (`pool`: default the attention workers' — pools.attention_pools): its pods run
    the attention worker for the pool's role, with its KV (pools.pool_kv), resources, tiers and replicas."""
    pool = pool or attention_pools(name, spec)[0]
    kv = spec_pool_kv(spec, cfg, pool.role)
    ports = [{"name": "grpc", "containerPort": WORKER_PORT}, {"name": "health", "containerPort": HEALTH_PORT}]
    env = pod_env(spec, "expertmesh-prefill" if pool.role == PREFILL else "expertmesh-attention", name)
    if spec.transport == "collective" and pool.role == DECODE:
        ports, env = collective_store(ports, env)  # the hand-offs sent to it (the prefill pods learn it over gRPC)
    container = {
        "name": "prefill" if pool.role == PREFILL else "attention",
        "command": ["expertmesh"],
        "args": attention_worker_args(spec, cfg, pool.role) + kv_store_worker_args(name, namespace, spec),
        "ports": ports,
        "env": env,
        "resources": attention_resources(pool.workers, kv.host_gib),
        **grpc_probes(),
    }
    pod = pod_spec(name, pool.component, spec, container, spread=True)
    volumes, mounts, claims = kv_disk_volume(kv.disk)
    key_volumes, key_mounts = kv_disk_key_volume(name, kv.disk)  # what the disk tier's files are keyed with
    store_volumes, store_mounts = kv_store_key_volume(name, spec)  # what the cluster store's objects are keyed with
    key_volumes, key_mounts = key_volumes + store_volumes, key_mounts + store_mounts
    pod["volumes"] += volumes + key_volumes
    pod["containers"][0]["volumeMounts"] = pod["containers"][0]["volumeMounts"] + mounts + key_mounts
    sts = {
        "serviceName": pool.statefulset,
        "replicas": pool.replicas,
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector_labels(name, pool.component)},
        "template": {
            "metadata": {"labels": {**labels(name, pool.component, spec), **role_labels(pool.role)}},
            "spec": pod,
        },
    }
    if claims:
        sts["volumeClaimTemplates"] = claims
    return _stamped(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": object_meta(pool.statefulset, namespace, pool.component, spec, instance=name),
            "spec": sts,
        }
    )


def _quantity(x: float) -> str:
    """A positive number as a Kubernetes quantity: an integer as it is, else in thousandths (0.8 → 800m)."""
    return str(int(x)) if float(x).is_integer() else f"{max(1, round(x * 1000))}m"


# the Prometheus label that carries the router pod's app.kubernetes.io/instance (the MoEDeployment's name), as a
# PodMonitor's podTargetLabels writes it: the HPAs select their deployment's series by it (docs/operator.md)
METRIC_INSTANCE_LABEL = "app_kubernetes_io_instance"


def pool_hpa(name: str, namespace: str, spec: MoEDeploymentSpec, pool: Pool) -> dict:
    """An autoscaled pool's HorizontalPodAutoscaler (autoscaling/v2) on its StatefulSet: minReplicas..maxReplicas,
    one External metric — the router's series of the pool (`pool` label: prefill or decode) for this deployment,
    through the Prometheus adapter — at the spec's target (AverageValue per pod for the waiting counts, Value for
    kv_utilization: pools.METRIC_SERIES)."""
    a = pool.autoscale
    series, kind = METRIC_SERIES[a.metric]
    target = {"type": kind, "averageValue" if kind == "AverageValue" else "value": _quantity(a.target)}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_meta(pool.statefulset, namespace, pool.component, spec, instance=name),
        "spec": {
            "scaleTargetRef": dict(zip(("apiVersion", "kind"), workload_kind(spec)), name=pool.statefulset),
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": series,
                            "selector": {"matchLabels": {"pool": pool.metric_pool, METRIC_INSTANCE_LABEL: name}},
                        },
                        "target": target,
                    },
                }
            ],
        },
    }


def expert_statefulset(name: str, namespace: str, spec: MoEDeploymentSpec, plan) -> dict:
    ew = spec.expert_workers
    ports = [{"name": "grpc", "containerPort": WORKER_PORT}, {"name": "health", "containerPort": HEALTH_PORT}]
    env = pod_env(spec, "expertmesh-expert", name)
    if spec.transport == "collective":  # the pod's rendezvous store; the attention pods learn it over gRPC
        ports, env = collective_store(ports, env)
    container = {
        "name": "expert",
        "command": expert_worker_command(spec),
        "ports": ports,
        "env": env,
        "resources": container_resources(ew.resources, ew.gpus_per_pod),
        **grpc_probes(),
    }
    return _stamped(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": object_meta(
                expert_name(name),
                namespace,
                COMPONENT_EXPERT,
                spec,
                instance=name,
                annotations={PLAN_HASH_ANNOTATION: plan.plan_hash()},
            ),
            "spec": {
                "serviceName": expert_name(name),
                "replicas": ew.replicas,
                "podManagementPolicy": "Parallel",
                "updateStrategy": {"type": "RollingUpdate"},
                "selector": {"matchLabels": selector_labels(name, COMPONENT_EXPERT)},
                # nothing in the pod template changes with the plan: a new plan is published in the ConfigMap
                # (mounted at PLAN_DIR), it never rolls the StatefulSet
                "template": {
                    "metadata": {"labels": labels(name, COMPONENT_EXPERT, spec)},
                    "spec": pod_spec(name, COMPONENT_EXPERT, spec, container, spread=True),
                },
            },
        }
    )


def expert_pdb(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(expert_name(name), namespace, COMPONENT_EXPERT, spec, instance=name),
        # one at a time: a drained expert pod is re-planned around before the next may go
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, COMPONENT_EXPERT)}},
    }


def router_deployment(
    name: str, namespace: str, spec: MoEDeploymentSpec, plan, pools: list[Pool] | None = None
) -> dict:
    r = spec.router
    env = pod_env(spec, "expertmesh-router", name)
    if r.api_key_secret_ref is not None:
        env.append(
            {
                "name": "EXPERTMESH_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": r.api_key_secret_ref.name, "key": r.api_key_secret_ref.key}},
            }
        )
    container = {
        "name": "router",
        "command": ["expertmesh"],
        "args": router_args(name, namespace, spec, pools),
        "ports": [
            {"name": "http", "containerPort": r.http_port},
            {"name": "grpc", "containerPort": r.grpc_port},
            *router_epp_ports(spec),  # the InferencePool's endpoint picker (gateway.py)
        ],
        "env": env,
        "resources": container_resources(r.resources, 0),
        "readinessProbe": {"httpGet": {"path": "/health", "port": r.http_port}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": r.http_port},
            "periodSeconds": 20,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
    }
    pod = pod_spec(name, COMPONENT_ROUTER, spec, container)
    volumes, mounts, _ = router_salt_volume(name, spec)  # replicas > 1: their shared prefix-key salt
    pod["volumes"] += volumes
    pod["containers"][0]["volumeMounts"] = pod["containers"][0]["volumeMounts"] + mounts
    return _stamped(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": object_meta(
                router_name(name),
                namespace,
                COMPONENT_ROUTER,
                spec,
                instance=name,
                annotations={PLAN_HASH_ANNOTATION: plan.plan_hash()},
            ),
            "spec": {
                "replicas": r.replicas,
                "selector": {"matchLabels": selector_labels(name, COMPONENT_ROUTER)},
                "template": {
                    "metadata": {"labels": labels(name, COMPONENT_ROUTER, spec)},  # nothing of the plan
                    "spec": pod,
                },
            },
        }
    )


def router_service(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict:
    r = spec.router
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(router_name(name), namespace, COMPONENT_ROUTER, spec, instance=name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, COMPONENT_ROUTER),
            "ports": [
                {"name": "http", "port": r.http_port, "targetPort": r.http_port, "protocol": "TCP"},
                {"name": "grpc", "port": r.grpc_port, "targetPort": r.grpc_port, "protocol": "TCP"},
            ],
        },
    }


def worker_network_policy(
    name: str, namespace: str, spec: MoEDeploymentSpec, component: str, pools: list[Pool] | None = None
) -> dict:
    """Only this deployment's pods reach its workers (probes come from the kubelet, which NetworkPolicies do not
    filter): the router the workers' gRPC port, every attention pool the expert workers' (the per-layer
    exchange and its control), the prefill pool the decode pool's (the hand-off of a prefilled sequence). With
    `transport: collective` the attention pools and the expert pods, and the prefill and decode pools, also reach
    each other on any TCP port: the rendezvous store is on COLLECTIVE_PORT, but gloo's and NCCL's pair connections
    listen on ephemeral ports, in either direction."""
    pools = pools or attention_pools(name, spec)

    def peers(*components: str) -> list[dict]:
        return [{"podSelector": {"matchLabels": selector_labels(name, c)}} for c in components]

    grpc_port = [{"protocol": "TCP", "port": WORKER_PORT}]
    attention = [p.component for p in pools]
    ingress = [{"from": peers(COMPONENT_ROUTER), "ports": grpc_port}]
    if component == COMPONENT_EXPERT:
        ingress.append({"from": peers(*attention), **({} if spec.transport == "collective" else {"ports": grpc_port})})
    elif spec.transport == "collective":
        ingress.append({"from": peers(COMPONENT_EXPERT)})
    collective = {} if spec.transport == "collective" else {"ports": grpc_port}
    if component == COMPONENT_ATTENTION and COMPONENT_PREFILL in attention:
        ingress.append({"from": peers(COMPONENT_PREFILL), **collective})
    if component == COMPONENT_PREFILL and spec.transport == "collective":
        ingress.append({"from": peers(COMPONENT_ATTENTION)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(network_policy_name(name, component), namespace, component, spec, instance=name),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def workloads(
    spec: MoEDeploymentSpec, statefulsets: list[dict], group_size: int, restart_bounded: Collection[str] = ()
) -> list[dict]:
    """The StatefulSets as they are, or (spec.workload leaderworkerset) as LeaderWorkerSets (lws.py), those named in
    `restart_bounded` with restartPolicy None (lws_restarts.py)."""
    if uses_lws(spec):
        statefulsets = [
            as_leader_worker_set(
                s, spec, group_size=group_size, restart_bounded=s["metadata"]["name"] in restart_bounded
            )
            for s in statefulsets
        ]
    return [queued(s, spec) for s in statefulsets]  # spec.queueName: Kueue's label (devices.py)


def build_children(
    name: str,
    namespace: str,
    spec: MoEDeploymentSpec,
    cfg,
    plan,
    observed: dict[str, int] | None = None,
    restart_bounded: Collection[str] = (),
) -> list[dict]:
    """Every child object, in apply order (the ConfigMap before the pods that mount it, a StatefulSet before its
    autoscaler). `observed`: component → the replicas of an autoscaled pool's StatefulSet now (pools.py: kept, not
    reset; the router lists that many). `restart_bounded`: the LeaderWorkerSets whose group restarts reached the
    bound (lws_restarts.bounded_sets)."""
    pools = attention_pools(name, spec, observed)
    bounded = restart_bounded
    return [
        plan_configmap(name, namespace, spec, cfg, plan),
        *compute_domain(name, namespace, spec),  # before the pods that claim its channel
        *(headless_service(name, namespace, spec, p.statefulset, p.component) for p in pools),
        headless_service(name, namespace, spec, expert_name(name), COMPONENT_EXPERT),
        *kv_store_children(name, namespace, spec, [p.component for p in pools]),  # spec.kv.store
        *workloads(spec, [attention_statefulset(name, namespace, spec, cfg, p) for p in pools], 1, bounded),
        *workloads(spec, [expert_statefulset(name, namespace, spec, plan)], spec.expert_workers.replicas, bounded),
        *(pool_hpa(name, namespace, spec, p) for p in pools if p.autoscale is not None),
        expert_pdb(name, namespace, spec),
        queued(router_deployment(name, namespace, spec, plan, pools), spec),
        router_service(name, namespace, spec),
        *gateway_children(name, namespace, spec),
        *(worker_network_policy(name, namespace, spec, p.component, pools) for p in pools),
        worker_network_policy(name, namespace, spec, COMPONENT_EXPERT, pools),
    ]


def absent_children(name: str, spec: MoEDeploymentSpec, *, other_kinds: bool = False) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the children this spec does not have but an earlier one may have made: the
    prefill pool's objects once it is gone (replicas 0, no autoscale), a pool's HorizontalPodAutoscaler once the pool
    is no longer autoscaled (left alone it would keep resizing the StatefulSet the operator now sizes); with
    `other_kinds` also those of the kinds this spec does not use (absent_kinds). The handler deletes those the
    MoEDeployment owns."""
    pools = attention_pools(name, spec)
    out = []
    if not any(p.component == COMPONENT_PREFILL for p in pools):
        out += [
            ("apps/v1", "StatefulSet", prefill_name(name)),
            ("v1", "Service", prefill_name(name)),
            ("networking.k8s.io/v1", "NetworkPolicy", network_policy_name(name, COMPONENT_PREFILL)),
            ("autoscaling/v2", "HorizontalPodAutoscaler", prefill_name(name)),
        ]
    out += [("autoscaling/v2", "HorizontalPodAutoscaler", p.statefulset) for p in pools if p.autoscale is None]
    return out + (absent_kinds(name, spec) if other_kinds else [])


def absent_kinds(name: str, spec: MoEDeploymentSpec) -> list[tuple[str, str, str]]:
    """The children of the kinds this spec does not use, which an earlier one may have: the workers' other workload
    kind after spec.workload changed (the LWS controller's own StatefulSets are its LeaderWorkerSets', never the
    MoEDeployment's: the handler deletes only what the MoEDeployment owns), a prefill LeaderWorkerSet once the pool is
    gone, the gateway's InferencePool and picker Service once spec.gateway drops them, the KV store's Deployment,
    Service and NetworkPolicy once spec.kv.store does."""
    other = ("apps/v1", "StatefulSet") if uses_lws(spec) else (LWS_API, LWS_KIND)
    pools = attention_pools(name, spec)
    out = [(*other, n) for n in [p.statefulset for p in pools] + [expert_name(name)]]
    if uses_lws(spec) and not any(p.component == COMPONENT_PREFILL for p in pools):
        out.append((LWS_API, LWS_KIND, prefill_name(name)))
    return out + absent_gateway_children(name, spec) + absent_kv_store(name, spec)
