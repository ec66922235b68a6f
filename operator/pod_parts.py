"""The parts a MoEDeployment's pods are made of (operator/children.py assembles them): the checkpoint fetch init
container, environment, resources, volumes (checkpoint, cache, KV disk, /tmp), gRPC probes, the collective store's
port, and the pod spec with its scheduling and its security contexts (pod_security.py: the restricted profile)."""

from __future__ import annotations

import math
from typing import Any

from expertmesh.operator.devices import with_devices
from expertmesh.operator.naming import (
    CACHE_MOUNT,
    CHECKPOINT_MOUNT,
    COLLECTIVE_PORT,
    FETCH_CONTAINER,
    HEALTH_PORT,
    KV_DISK_MOUNT,
    PLAN_DIR,
    WORKER_TLS_DIR,
    checkpoint_path,
    plan_configmap_name,
    selector_labels,
    worker_tls_secret_name,
)
from expertmesh.operator.pod_security import (
    TMP_VOLUME,
    container_security_context,
    pod_security_context,
    tmp_volume,
)
from expertmesh.operator.spec import GIB, KVDiskSpec, MoEDeploymentSpec
from expertmesh.operator.spec_fields import GPU_RESOURCE
from expertmesh.operator.validation import parse_quantity

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
        "volumeMounts": [mt for mt in mounts if mt["name"] in ("checkpoint-cache", TMP_VOLUME)],
        # a failure's last log line (it names the file) becomes the container's termination message
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": container_security_context(),
    }
    if ck.credentials_secret is not None:  # the keys as environment variables (never on the command line)
        out["envFrom"] = [{"secretRef": {"name": ck.credentials_secret}}]
    return out


def pod_env(spec: MoEDeploymentSpec, service: str, name: str) -> list[dict]:
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


def container_resources(res, gpus: int) -> dict:
    out = {k: dict(v) for k, v in (("limits", res.limits), ("requests", res.requests)) if v}
    if gpus:  # GPUs are requested through limits (extended resources: requests default to limits)
        out.setdefault("limits", {})[GPU_RESOURCE] = gpus
    return out


def pod_volumes(name: str, spec: MoEDeploymentSpec) -> tuple[list[dict], list[dict]]:
    tmp, tmp_mount = tmp_volume()
    vols = [{"name": "plan", "configMap": {"name": plan_configmap_name(name)}}, tmp]
    mounts = [{"name": "plan", "mountPath": PLAN_DIR, "readOnly": True}, tmp_mount]
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


def grpc_probes(port: int = HEALTH_PORT) -> dict:
    return {
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": STARTUP_SECONDS // 10},
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"grpc": {"port": port}, "periodSeconds": 20, "failureThreshold": 3, "timeoutSeconds": 5},
    }


def pod_spec(name: str, component: str, spec: MoEDeploymentSpec, container: dict, spread: bool = False) -> dict:
    vols, mounts = pod_volumes(name, spec)
    container = {
        "image": spec.image.ref,
        "imagePullPolicy": spec.image.pull_policy,
        "volumeMounts": mounts,
        **container,
        "securityContext": container_security_context(),
    }
    pod: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": vols,
        "automountServiceAccountToken": False,  # no pod of a deployment talks to the Kubernetes API
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
    return with_devices(pod, spec)  # spec.devices: GPUs through DRA claims (devices.py)


KV_DISK_VOLUME = "kv-disk"
# an emptyDir's sizeLimit evicts the pod when passed: room above the tier's own bound (file system blocks)
KV_DISK_SLACK = 1.05


def mib(n_bytes) -> str:
    return f"{math.ceil(n_bytes / 2**20)}Mi"


def attention_resources(workers, host_gib: float) -> dict:
    """An attention pool's container resources: its spec's (`workers`: spec.attentionWorkers or
    spec.prefillWorkers), with its host tier's bytes added to the memory request (and to the limit when there is
    one)."""
    out = container_resources(workers.resources, workers.gpus_per_pod)
    host = host_gib * GIB
    if host:
        for where in ("requests", "limits"):
            have = out.get(where, {}).get("memory")
            if have is not None or where == "requests":
                out.setdefault(where, {})["memory"] = mib(host + (float(parse_quantity(have)) if have else 0))
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
            "resources": {"requests": {"storage": mib(disk.size_gib * GIB * KV_DISK_SLACK)}},
        }
        if disk.pvc.storage_class_name:
            claim["storageClassName"] = disk.pvc.storage_class_name
        return [], mounts, [{"metadata": {"name": KV_DISK_VOLUME}, "spec": claim}]
    if disk.host_path is not None:  # a folder per pod: two attention pods on one node never share files
        mounts[0]["subPathExpr"] = "$(POD_NAME)"
        return [{"name": KV_DISK_VOLUME, "hostPath": {"path": disk.host_path, "type": "DirectoryOrCreate"}}], mounts, []
    return [{"name": KV_DISK_VOLUME, "emptyDir": {"sizeLimit": mib(disk.size_gib * GIB * KV_DISK_SLACK)}}], mounts, []


def collective_store(ports: list[dict], env: list[dict]) -> tuple[list[dict], list[dict]]:
    """A worker container's ports and env with its collective rendezvous store (worker --collective-port)."""
    return (
        ports + [{"name": "collective", "containerPort": COLLECTIVE_PORT}],
        env + [{"name": "EXPERTMESH_COLLECTIVE_PORT", "value": str(COLLECTIVE_PORT)}],
    )
