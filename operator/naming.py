"""What a MoEDeployment's children are called and where things are: names, labels, selectors, addresses, ports and
paths inside the pods. Pure: plain strings and dicts from the resource's name, namespace and spec.

Children of a `MoEDeployment` named N in namespace NS (built by children.py):
  ConfigMap    N-plan        plan.json (the placement plan) + config.json (the model config)
  ConfigMap    N-load        the router's last observed expert load (kept for a restarted operator or a new leader)
  StatefulSet  N-attention   attention workers (+ headless Service N-attention)
  StatefulSet  N-expert      expert workers, ordinal i holds plan.experts_of(i) (+ headless Service N-expert,
                             PodDisruptionBudget N-expert)
  Deployment   N-router      the router (+ Service N-router: http and grpc)
  Secret       N-worker-tls  the deployment's CA + worker server / client certificates (spec.security.workerTLS):
                             created once by the handler (worker_tls.py), never rebuilt from the spec
"""
from __future__ import annotations

import hashlib

from expertmesh.operator.spec import MoEDeploymentSpec

OPERATOR_NAME = "expertmesh-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_VERSION = "app.kubernetes.io/version"
PLAN_HASH_ANNOTATION = "expertmesh.dev/plan-hash"
TEMPLATE_HASH_ANNOTATION = "expertmesh.dev/template-hash"  # tells pods of the current template from old ones
POD_MANAGED_LABELS = {LABEL_NAME: "expertmesh", LABEL_MANAGED_BY: OPERATOR_NAME}  # what the pod watch selects

COMPONENT_ROUTER, COMPONENT_ATTENTION, COMPONENT_EXPERT = "router", "attention-worker", "expert-worker"
WORKER_PORT = 50061
HEALTH_PORT = 50062         # plaintext, grpc.health.v1 only: the kubelet's gRPC probes (no client certificate)
WORKER_TLS_DIR = "/etc/expertmesh-tls"   # the N-worker-tls Secret, mounted in every pod
COLLECTIVE_PORT = 29500     # spec.transport collective: each expert pod's rendezvous store (worker/collective.py)
PLAN_DIR = "/etc/expertmesh"
PLAN_PATH = f"{PLAN_DIR}/plan.json"
CHECKPOINT_MOUNT = "/mnt/checkpoint"
CACHE_MOUNT = "/var/cache/expertmesh"   # fetched checkpoints, one directory per source
FETCH_CONTAINER = "fetch"


def plan_configmap_name(name: str) -> str:
    return f"{name}-plan"


def load_configmap_name(name: str) -> str:
    return f"{name}-load"


def attention_name(name: str) -> str:
    return f"{name}-attention"


def expert_name(name: str) -> str:
    return f"{name}-expert"


def router_name(name: str) -> str:
    return f"{name}-router"


def worker_tls_secret_name(name: str) -> str:
    return f"{name}-worker-tls"


def selector_labels(name: str, component: str) -> dict[str, str]:
    """The immutable subset used in selectors (never the version: that changes on upgrades)."""
    return {LABEL_NAME: "expertmesh", LABEL_INSTANCE: name, LABEL_COMPONENT: component}


def labels(name: str, component: str, spec: MoEDeploymentSpec) -> dict[str, str]:
    return {**selector_labels(name, component), LABEL_PART_OF: "expertmesh", LABEL_MANAGED_BY: OPERATOR_NAME,
            LABEL_VERSION: spec.image.tag[:63]}


def selector_string(sel: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(sel.items()))


def object_meta(name: str, namespace: str, component: str, spec: MoEDeploymentSpec, *, instance: str,
                **extra) -> dict:
    """`metadata` of a child object `name` of the MoEDeployment `instance` (labels included; `extra`: e.g.
    annotations)."""
    return {"name": name, "namespace": namespace, "labels": labels(instance, component, spec), **extra}


def pod_dns(name: str, namespace: str, statefulset: str, ordinal: int, port: int = WORKER_PORT) -> str:
    """`<pod>.<headless svc>.<ns>.svc:port` — resolves through the pod's DNS search path on any cluster domain."""
    return f"{statefulset}-{ordinal}.{statefulset}.{namespace}.svc:{port}"


def worker_addresses(name: str, namespace: str, spec: MoEDeploymentSpec) -> tuple[list[str], list[str]]:
    """(attention, expert) worker addresses in ordinal order, as the router is given them."""
    att = [pod_dns(name, namespace, attention_name(name), i) for i in range(spec.attention_workers.replicas)]
    exp = [pod_dns(name, namespace, expert_name(name), i) for i in range(spec.expert_workers.replicas)]
    return att, exp


def endpoints(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict[str, str]:
    host = f"{router_name(name)}.{namespace}.svc"
    return {"http": f"{host}:{spec.router.http_port}", "grpc": f"{host}:{spec.router.grpc_port}"}


def load_url(name: str, namespace: str, spec: MoEDeploymentSpec) -> str:
    """The router's expert-load statistics (`GET /v1/load`), through its Service."""
    return f"http://{router_name(name)}.{namespace}.svc:{spec.router.http_port}/v1/load"


def cache_key(uri: str) -> str:
    """The cache directory name of a fetched source: readable, and unique per URI."""
    readable = "".join(ch if ch.isalnum() or ch in "-._" else "-" for ch in uri.split("://", 1)[-1])[-48:]
    return f"{readable.strip('-.')}-{hashlib.sha256(uri.encode()).hexdigest()[:10]}"


def checkpoint_path(spec: MoEDeploymentSpec) -> str:
    """Where the pods read the checkpoint: under the PVC's mount, in the fetch cache, or a path in the image."""
    ck = spec.model.checkpoint
    if ck.pvc is not None:
        sub = ck.pvc.path.strip("/")
        return f"{CHECKPOINT_MOUNT}/{sub}" if sub else CHECKPOINT_MOUNT
    if ck.fetched:
        return f"{CACHE_MOUNT}/{cache_key(ck.uri)}"
    return ck.uri  # a path inside the image
