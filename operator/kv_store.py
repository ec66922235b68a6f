"""The cluster KV tier on a cluster (`spec.kv.store: mooncake`, #53): Mooncake's master and the store process that
holds the objects' memory (`spec.kv.storeGiB`) as one Deployment of their own with a Service, every attention worker
its client, the router told (`--kv-store`: every prefix saved is in the store at once, docs/data-plane.md).

The pod runs the wrapper `expertmesh up` runs (expertmesh/entry/kv_store_service.py) twice — `master` (with its HTTP
metadata server) and `store` — on the pod's IP: the master binds it, the store process advertises it to the workers
(their gets and puts reach its memory directly). One replica, Recreate: the master keeps no snapshot (restarted, it
starts empty) and the workers fall back to their local tiers while it is away, so two would only split the keys.

Trust. Mooncake's store has no TLS; the store's objects are authenticated instead (HMAC-SHA256 under the deployment's
salt Secret, which every attention pod mounts as `--kv-store-key-file`: a forged or foreign object is refused,
counted, never served) and a NetworkPolicy admits only this deployment's attention pods — on any port, as Mooncake's
transfer engine listens on ephemeral ones. Keys hash the namespace/name, so two deployments sharing a store never
meet.
"""

from __future__ import annotations

from expertmesh.operator.naming import labels, object_meta, router_salt_secret_name, selector_labels
from expertmesh.operator.pod_parts import pod_env, pod_spec
from expertmesh.operator.spec import MoEDeploymentSpec

COMPONENT_KV_STORE = "kv-store"
RPC_PORT, METADATA_PORT, METRICS_PORT, STORE_PORT = 50051, 8080, 9003, 17812  # Mooncake's defaults
KV_STORE_KEY_DIR = "/etc/expertmesh-kv-store-key"  # the N-router-salt Secret (router_salt.py) in the attention pods
KV_STORE_KEY_VOLUME = "kv-store-key"
SALT_KEY = "salt"  # router_salt.SALT_KEY


def uses_kv_store(spec: MoEDeploymentSpec) -> bool:
    return spec.kv.store is not None


def kv_store_name(name: str) -> str:
    return f"{name}-kv-store"


def kv_store_host(name: str, namespace: str) -> str:
    return f"{kv_store_name(name)}.{namespace}.svc"


def kv_store_worker_args(name: str, namespace: str, spec: MoEDeploymentSpec) -> list[str]:
    """An attention worker's client flags (worker/cli.py --kv-store-*); none without spec.kv.store."""
    if not uses_kv_store(spec):
        return []
    host = kv_store_host(name, namespace)
    return [
        "--kv-store-master",
        f"{host}:{RPC_PORT}",
        "--kv-store-metadata",
        f"http://{host}:{METADATA_PORT}/metadata",
        "--kv-store-key-file",
        f"{KV_STORE_KEY_DIR}/{SALT_KEY}",
        "--kv-store-deployment",
        f"{namespace}/{name}",
        "--kv-store-gib",
        f"{spec.kv.store_gib:g}",
    ]


def kv_store_router_args(spec: MoEDeploymentSpec) -> list[str]:
    """The router's `--kv-store`: the prefixes it records as saved are in the store (written through)."""
    return ["--kv-store", spec.kv.store] if uses_kv_store(spec) else []


def kv_store_key_volume(name: str, spec: MoEDeploymentSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, volume mounts) of an attention pod with the store: the salt Secret, read-only, owner-readable."""
    if not uses_kv_store(spec):
        return [], []
    return (
        [{"name": KV_STORE_KEY_VOLUME, "secret": {"secretName": router_salt_secret_name(name), "defaultMode": 0o400}}],
        [{"name": KV_STORE_KEY_VOLUME, "mountPath": KV_STORE_KEY_DIR, "readOnly": True}],
    )


def _ports_flag() -> str:
    return f"{RPC_PORT},{METADATA_PORT},{METRICS_PORT},{STORE_PORT}"


def kv_store_deployment(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict:
    """The master and the store process, one pod (Recreate: never two masters)."""
    env = [*pod_env(spec, "expertmesh-kv-store", name)]
    env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    store_bytes = int(spec.kv.store_gib * 2**30)

    def process(role: str, extra: list[str], port: int) -> dict:
        return {
            "name": f"kv-store-{role}",
            "command": ["python", "-m", "expertmesh.entry.kv_store_service"],
            "args": [role, "--host", "$(POD_IP)", "--ports", _ports_flag(), *extra],
            "env": env,
            "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 5},
            "livenessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 20, "failureThreshold": 3},
        }

    master = process("master", [], RPC_PORT)
    master["ports"] = [
        {"name": "rpc", "containerPort": RPC_PORT},
        {"name": "metadata", "containerPort": METADATA_PORT},
        {"name": "metrics", "containerPort": METRICS_PORT},
    ]
    store = process("store", ["--store-bytes", str(store_bytes)], STORE_PORT)
    store["ports"] = [{"name": "store", "containerPort": STORE_PORT}]
    store["resources"] = {"requests": {"memory": str(store_bytes)}, "limits": {"memory": str(int(store_bytes * 1.25))}}
    pod = pod_spec(name, COMPONENT_KV_STORE, spec, master)
    pod["containers"].append({**{k: v for k, v in pod["containers"][0].items() if k not in master}, **store})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(kv_store_name(name), namespace, COMPONENT_KV_STORE, spec, instance=name),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector_labels(name, COMPONENT_KV_STORE)},
            "template": {"metadata": {"labels": labels(name, COMPONENT_KV_STORE, spec)}, "spec": pod},
        },
    }


def kv_store_service(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(kv_store_name(name), namespace, COMPONENT_KV_STORE, spec, instance=name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, COMPONENT_KV_STORE),
            "ports": [
                {"name": "rpc", "port": RPC_PORT, "targetPort": RPC_PORT, "protocol": "TCP"},
                {"name": "metadata", "port": METADATA_PORT, "targetPort": METADATA_PORT, "protocol": "TCP"},
            ],
        },
    }


def kv_store_network_policy(name: str, namespace: str, spec: MoEDeploymentSpec, attention: list[str]) -> dict:
    """Only this deployment's attention pods (`attention`: their components) reach the store's pod, on any port."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(f"{kv_store_name(name)}", namespace, COMPONENT_KV_STORE, spec, instance=name),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name, COMPONENT_KV_STORE)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": selector_labels(name, c)}} for c in attention]}],
        },
    }


def kv_store_children(name: str, namespace: str, spec: MoEDeploymentSpec, attention: list[str]) -> list[dict]:
    """The store's Deployment, Service and NetworkPolicy (none without spec.kv.store)."""
    if not uses_kv_store(spec):
        return []
    return [
        kv_store_deployment(name, namespace, spec),
        kv_store_service(name, namespace, spec),
        kv_store_network_policy(name, namespace, spec, attention),
    ]


def absent_kv_store(name: str, spec: MoEDeploymentSpec) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the store's objects once spec.kv.store is gone."""
    if uses_kv_store(spec):
        return []
    n = kv_store_name(name)
    return [("apps/v1", "Deployment", n), ("v1", "Service", n), ("networking.k8s.io/v1", "NetworkPolicy", n)]
