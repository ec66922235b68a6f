"""The child objects of a MoEDeployment (named in naming.py), built from the spec, the model config and the plan: the
plan and load ConfigMaps, the worker StatefulSets with their headless Services (one per attention pool: pools.py),
the autoscaled pools' HorizontalPodAutoscalers, the expert PodDisruptionBudget, the router Deployment and Service, the
workers' NetworkPolicies, and the pods' containers (the checkpoint fetch init container among them). Pure: plain dicts
in the shape of Kubernetes objects; owner references are left to the handlers (`kopf.adopt`).

A new plan changes the plan ConfigMap only, never a pod template (placement_policy.changed_ordinals).
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from typing import Any

import numpy as np

from expertmesh.operator.naming import (
    CACHE_MOUNT,
    CHECKPOINT_MOUNT,
    COLLECTIVE_PORT,
    COMPONENT_ATTENTION,
    COMPONENT_EXPERT,
    COMPONENT_PREFILL,
    COMPONENT_ROUTER,
    FETCH_CONTAINER,
    HEALTH_PORT,
    KV_DISK_MOUNT,
    LABEL_COMPONENT,
    PLAN_DIR,
    PLAN_HASH_ANNOTATION,
    PLAN_PATH,
    TEMPLATE_HASH_ANNOTATION,
    WORKER_PORT,
    WORKER_TLS_DIR,
    checkpoint_path,
    expert_name,
    labels,
    load_configmap_name,
    network_policy_name,
    object_meta,
    plan_configmap_name,
    prefill_name,
    router_name,
    selector_labels,
    statefulset_addresses,
    worker_tls_secret_name,
)
from expertmesh.operator.pools import DECODE, METRIC_SERIES, MIXED, PREFILL, Pool, PoolKV, attention_pools, spec_pool_kv
from expertmesh.operator.router_salt import router_salt_volume
from expertmesh.operator.spec import GIB, GPU_RESOURCE, KVDiskSpec, MoEDeploymentSpec
from expertmesh.operator.validation import parse_quantity
from expertmesh.operator.worker_tls import worker_tls_args

STARTUP_SECONDS = 1800  # loading a shard of a 1.5 TB checkpoint can take many minutes


def fetch_container(spec: MoEDeploymentSpec, mounts: list[dict]) -> dict:
    """The init container that fetches a remote checkpoint into the cache volume (`expertmesh fetch`: every
    file verified by size and sha256, resumable, retried with backoff; pods on one node share the cache)."""
    ck = spec.model.checkpoint
    env = []
    if ck.token_secret_ref is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": ck.token_secret_ref.name, "key": ck.token_secret_ref.key}},
            }
        )
    if ck.endpoint is not None:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": ck.endpoint})
    if ck.region is not None:
        env.append({"name": "AWS_REGION", "value": ck.region})
    out = {
        "name": FETCH_CONTAINER,
        "image": spec.image.ref,
        "imagePullPolicy": spec.image.pull_policy,
        "command": ["expertmesh"],
        "args": ["fetch", ck.uri, "--cache", checkpoint_path(spec)],
        "env": env,
        "volumeMounts": [mt for mt in mounts if mt["name"] == "checkpoint-cache"],
        # a failure's last log line (it names the file) becomes the container's termination message
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    }
    if ck.credentials_secret is not None:  # the keys as environment variables (never on the command line)
        out["envFrom"] = [{"secretRef": {"name": ck.credentials_secret}}]
    return out


def _env(spec: MoEDeploymentSpec, service: str, name: str) -> list[dict]:
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    t = spec.telemetry
    if t.otlp_endpoint:
        env += [
            {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": t.otlp_endpoint},
            {"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": t.protocol},
            {"name": "OTEL_SERVICE_NAME", "value": service},
            {
                "name": "OTEL_RESOURCE_ATTRIBUTES",
                "value": f"service.namespace=expertmesh,expertmesh.deployment={name},"
                "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)",
            },
        ]
    return env


def _resources(res, gpus: int) -> dict:
    out = {k: dict(v) for k, v in (("limits", res.limits), ("requests", res.requests)) if v}
    if gpus:  # GPUs are requested through limits (extended resources: requests default to limits)
        out.setdefault("limits", {})[GPU_RESOURCE] = gpus
    return out


def _volumes(name: str, spec: MoEDeploymentSpec) -> tuple[list[dict], list[dict]]:
    vols = [{"name": "plan", "configMap": {"name": plan_configmap_name(name)}}]
    mounts = [{"name": "plan", "mountPath": PLAN_DIR, "readOnly": True}]
    pvc = spec.model.checkpoint.pvc
    if pvc is not None:
        vols.append(
            {"name": "checkpoint", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": pvc.read_only}}
        )
        mounts.append({"name": "checkpoint", "mountPath": CHECKPOINT_MOUNT, "readOnly": pvc.read_only})
    ck = spec.model.checkpoint
    if ck.fetched:
        cache = ck.cache
        vols.append(
            {
                "name": "checkpoint-cache",
                **(
                    {"persistentVolumeClaim": {"claimName": cache.claim_name}}
                    if cache.claim_name is not None
                    else {"hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
                ),
            }
        )
        mounts.append({"name": "checkpoint-cache", "mountPath": CACHE_MOUNT})
    if spec.security.worker_tls:
        vols.append(
            {"name": "worker-tls", "secret": {"secretName": worker_tls_secret_name(name), "defaultMode": 0o400}}
        )
        mounts.append({"name": "worker-tls", "mountPath": WORKER_TLS_DIR, "readOnly": True})
    return vols, mounts


def _grpc_probes(port: int = HEALTH_PORT) -> dict:
    return {
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": STARTUP_SECONDS // 10},
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"grpc": {"port": port}, "periodSeconds": 20, "failureThreshold": 3, "timeoutSeconds": 5},
    }


def _pod_spec(name: str, component: str, spec: MoEDeploymentSpec, container: dict, spread: bool = False) -> dict:
    vols, mounts = _volumes(name, spec)
    container = {
        "image": spec.image.ref,
        "imagePullPolicy": spec.image.pull_policy,
        "volumeMounts": mounts,
        **container,
    }
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": vols,
        "terminationGracePeriodSeconds": 60,
        "enableServiceLinks": False,
    }
    if spec.model.checkpoint.fetched:
        pod["initContainers"] = [fetch_container(spec, mounts)]
    sch = spec.scheduling
    if sch.node_selector:
        pod["nodeSelector"] = dict(sch.node_selector)
    if sch.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in sch.tolerations]
    if spread and sch.topology_spread_key:
        pod["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": sch.topology_spread_key,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector_labels(name, component)},
            }
        ]
    return pod


def expert_worker_command(spec: MoEDeploymentSpec) -> list[str]:
    """The expert container's command: a shell that takes the ordinal from the StatefulSet hostname
    (`<name>-expert-<ordinal>`) and execs the worker (the worker is PID 1's only child; signals reach it)."""
    fixed = [
        "expertmesh",
        "worker",
        "--role",
        "expert",
        "--plan",
        PLAN_PATH,
        "--checkpoint",
        checkpoint_path(spec),
        "--host",
        "0.0.0.0",
        "--port",
        str(WORKER_PORT),
        "--health-port",
        str(HEALTH_PORT),
        *worker_tls_args(spec, "expert"),
    ]
    return ["/bin/sh", "-c", f'exec {shlex.join(fixed)} --ordinal "${{HOSTNAME##*-}}" --name "$HOSTNAME"']


def attention_worker_args(spec: MoEDeploymentSpec, cfg, role: str = MIXED) -> list[str]:
    """An attention worker of a pool (`role`: mixed, prefill or decode — pools.py): its KV sized for the role
    (pools.pool_kv), `--pool` unless mixed (the worker's default)."""
    kv = spec_pool_kv(spec, cfg, role)
    return [
        "worker",
        "--role",
        "attention",
        "--checkpoint",
        checkpoint_path(spec),
        "--host",
        "0.0.0.0",
        "--port",
        str(WORKER_PORT),
        "--health-port",
        str(HEALTH_PORT),
        "--name",
        "$(POD_NAME)",
        "--kv-blocks",
        str(kv.blocks),
        "--block-size",
        str(spec.kv.block_size),
        *(["--pool", role] if role != MIXED else []),
        *kv_tier_args(kv),
        *worker_tls_args(spec, "attention"),
    ]


KV_DISK_VOLUME = "kv-disk"
# an emptyDir's sizeLimit evicts the pod when passed: room above the tier's own bound (file system blocks)
KV_DISK_SLACK = 1.05


def kv_tier_args(kv: PoolKV) -> list[str]:
    """A pool's KV tiers (spec.kv.hostGiB / spec.kv.disk, where pools.pool_kv puts them) → the attention worker's
    tier flags (the disk tier on its volume)."""
    out = ["--kv-host-gib", f"{kv.host_gib:g}"] if kv.host_gib else []
    if kv.disk is not None:
        out += ["--kv-disk-dir", KV_DISK_MOUNT, "--kv-disk-gib", f"{kv.disk.size_gib:g}"]
    return out


def _mib(n_bytes) -> str:
    return f"{math.ceil(n_bytes / 2**20)}Mi"


def attention_resources(workers, host_gib: float) -> dict:
    """An attention pool's container resources: its spec's (`workers`: spec.attentionWorkers or
    spec.prefillWorkers), with its host tier's bytes added to the memory request (and to the limit when there is
    one)."""
    out = _resources(workers.resources, workers.gpus_per_pod)
    host = host_gib * GIB
    if host:
        for where in ("requests", "limits"):
            have = out.get(where, {}).get("memory")
            if have is not None or where == "requests":
                out.setdefault(where, {})["memory"] = _mib(host + (float(parse_quantity(have)) if have else 0))
    return out


def kv_disk_volume(disk: KVDiskSpec | None) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, mounts, volumeClaimTemplates) of an attention pool's disk tier: an emptyDir with a sizeLimit, a
    node directory, or a claim per pod."""
    if disk is None:
        return [], [], []
    mounts = [{"name": KV_DISK_VOLUME, "mountPath": KV_DISK_MOUNT}]
    if disk.pvc is not None:
        claim = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": _mib(disk.size_gib * GIB * KV_DISK_SLACK)}},
        }
        if disk.pvc.storage_class_name:
            claim["storageClassName"] = disk.pvc.storage_class_name
        return [], mounts, [{"metadata": {"name": KV_DISK_VOLUME}, "spec": claim}]
    if disk.host_path is not None:  # a folder per pod: two attention pods on one node never share files
        mounts[0]["subPathExpr"] = "$(POD_NAME)"
        return [{"name": KV_DISK_VOLUME, "hostPath": {"path": disk.host_path, "type": "DirectoryOrCreate"}}], mounts, []
    return [{"name": KV_DISK_VOLUME, "emptyDir": {"sizeLimit": _mib(disk.size_gib * GIB * KV_DISK_SLACK)}}], mounts, []


def router_serving_args(spec: MoEDeploymentSpec) -> list[str]:
    """The spec's serving limits as router flags: `kv.maxContext` → `--max-context` (prompt + output per
    sequence), `thinking` → `--thinking-budgets LOW,HIGH,MAX` (the reasoning-token limits the router enforces).
    Unset fields add nothing: the router serves the checkpoint's own limits."""
    out: list[str] = []
    if spec.kv.max_context is not None:
        out += ["--max-context", str(spec.kv.max_context)]
    if spec.thinking is not None:
        t = spec.thinking
        out += ["--thinking-budgets", f"{t.low},{t.high},{t.max}"]
    return out


def router_pool_args(name: str, namespace: str, spec: MoEDeploymentSpec, pools: list[Pool]) -> list[str]:
    """The router's worker lists: `--attention` the attention StatefulSet's pods (the decode pool beside a prefill
    pool), `--experts` the expert pods, and with a prefill pool `--prefill` its pods (and `--prefill-min-tokens`
    when set) — each pool's pods as many as it has now (an autoscaled pool's change re-renders them: the router
    rolls)."""

    def addresses(pool: Pool) -> str:
        return ",".join(statefulset_addresses(name, namespace, pool.statefulset, pool.replicas))

    exp = statefulset_addresses(name, namespace, expert_name(name), spec.expert_workers.replicas)
    out = ["--attention", addresses(pools[0]), "--experts", ",".join(exp)]
    for pool in pools[1:]:
        out += ["--prefill", addresses(pool)]
        if pool.workers.min_prompt_tokens:
            out += ["--prefill-min-tokens", str(pool.workers.min_prompt_tokens)]
    return out


def router_args(name: str, namespace: str, spec: MoEDeploymentSpec, pools: list[Pool] | None = None) -> list[str]:
    pools = pools or attention_pools(name, spec)
    return [
        "router",
        "--checkpoint",
        checkpoint_path(spec),
        "--plan",
        PLAN_PATH,
        *router_pool_args(name, namespace, spec, pools),
        "--host",
        "0.0.0.0",
        "--http-port",
        str(spec.router.http_port),
        "--grpc-port",
        str(spec.router.grpc_port),
        *(["--transport", spec.transport] if spec.transport != "grpc" else []),
        *router_serving_args(spec),
        *worker_tls_args(spec, "router"),
        *router_salt_volume(name, spec)[2],
    ]


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
        c["metadata"]["labels"][LABEL_COMPONENT]: c["spec"]["template"]["metadata"]["annotations"][
            TEMPLATE_HASH_ANNOTATION
        ]
        for c in children
        if c["kind"] in ("StatefulSet", "Deployment")
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
    env = _env(spec, "expertmesh-prefill" if pool.role == PREFILL else "expertmesh-attention", name)
    if spec.transport == "collective" and pool.role == DECODE:
        ports, env = _collective_store(ports, env)  # the hand-offs sent to it (the prefill pods learn it over gRPC)
    container = {
        "name": "prefill" if pool.role == PREFILL else "attention",
        "command": ["expertmesh"],
        "args": attention_worker_args(spec, cfg, pool.role),
        "ports": ports,
        "env": env,
        "resources": attention_resources(pool.workers, kv.host_gib),
        **_grpc_probes(),
    }
    pod = _pod_spec(name, pool.component, spec, container, spread=True)
    volumes, mounts, claims = kv_disk_volume(kv.disk)
    pod["volumes"] += volumes
    pod["containers"][0]["volumeMounts"] = pod["containers"][0]["volumeMounts"] + mounts
    sts = {
        "serviceName": pool.statefulset,
        "replicas": pool.replicas,
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector_labels(name, pool.component)},
        "template": {"metadata": {"labels": labels(name, pool.component, spec)}, "spec": pod},
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
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": pool.statefulset},
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


def _collective_store(ports: list[dict], env: list[dict]) -> tuple[list[dict], list[dict]]:
    """A worker container's ports and env with its collective rendezvous store (worker --collective-port)."""
    return (
        ports + [{"name": "collective", "containerPort": COLLECTIVE_PORT}],
        env + [{"name": "EXPERTMESH_COLLECTIVE_PORT", "value": str(COLLECTIVE_PORT)}],
    )


def expert_statefulset(name: str, namespace: str, spec: MoEDeploymentSpec, plan) -> dict:
    ew = spec.expert_workers
    ports = [{"name": "grpc", "containerPort": WORKER_PORT}, {"name": "health", "containerPort": HEALTH_PORT}]
    env = _env(spec, "expertmesh-expert", name)
    if spec.transport == "collective":  # the pod's rendezvous store; the attention pods learn it over gRPC
        ports, env = _collective_store(ports, env)
    container = {
        "name": "expert",
        "command": expert_worker_command(spec),
        "ports": ports,
        "env": env,
        "resources": _resources(ew.resources, ew.gpus_per_pod),
        **_grpc_probes(),
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
                    "spec": _pod_spec(name, COMPONENT_EXPERT, spec, container, spread=True),
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
    env = _env(spec, "expertmesh-router", name)
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
        "ports": [{"name": "http", "containerPort": r.http_port}, {"name": "grpc", "containerPort": r.grpc_port}],
        "env": env,
        "resources": _resources(r.resources, 0),
        "readinessProbe": {"httpGet": {"path": "/health", "port": r.http_port}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": r.http_port},
            "periodSeconds": 20,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
    }
    pod = _pod_spec(name, COMPONENT_ROUTER, spec, container)
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


def build_children(
    name: str, namespace: str, spec: MoEDeploymentSpec, cfg, plan, observed: dict[str, int] | None = None
) -> list[dict]:
    """Every child object, in apply order (the ConfigMap before the pods that mount it, a StatefulSet before its
    autoscaler). `observed`: component → the replicas of an autoscaled pool's StatefulSet now (pools.py: kept, not
    reset; the router lists that many)."""
    pools = attention_pools(name, spec, observed)
    return [
        plan_configmap(name, namespace, spec, cfg, plan),
        *(headless_service(name, namespace, spec, p.statefulset, p.component) for p in pools),
        headless_service(name, namespace, spec, expert_name(name), COMPONENT_EXPERT),
        *(attention_statefulset(name, namespace, spec, cfg, p) for p in pools),
        expert_statefulset(name, namespace, spec, plan),
        *(pool_hpa(name, namespace, spec, p) for p in pools if p.autoscale is not None),
        expert_pdb(name, namespace, spec),
        router_deployment(name, namespace, spec, plan, pools),
        router_service(name, namespace, spec),
        *(worker_network_policy(name, namespace, spec, p.component, pools) for p in pools),
        worker_network_policy(name, namespace, spec, COMPONENT_EXPERT, pools),
    ]


def absent_children(name: str, spec: MoEDeploymentSpec) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the children this spec does not have but an earlier one may have made: the
    prefill pool's objects once it is gone (replicas 0, no autoscale), a pool's HorizontalPodAutoscaler once the pool
    is no longer autoscaled (left alone it would keep resizing the StatefulSet the operator now sizes). The handler
    deletes those the MoEDeployment owns."""
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
    return out
