"""What a MoEDeployment's children are called and where things are: names, labels, selectors, addresses, ports and
paths inside the pods. Pure: plain strings and dicts from the resource's name, namespace and spec.

Children of a `MoEDeployment` named N in namespace NS (built by children.py):
  ConfigMap    N-plan        plan.json (the placement plan) + config.json (the model config)
  ConfigMap    N-load        the router's last observed expert load (kept for a restarted operator or a new leader)
  StatefulSet  N-attention   attention workers (+ headless Service N-attention): the decode pool beside a prefill pool
  StatefulSet  N-prefill     prefill workers, when spec.prefillWorkers asks for a pool (+ headless Service N-prefill)
  HPA          N-attention / N-prefill   a pool's HorizontalPodAutoscaler, when its spec has `autoscale`
  StatefulSet  N-expert      expert workers, ordinal i holds plan.experts_of(i) (+ headless Service N-expert,
                             PodDisruptionBudget N-expert)
  Deployment   N-router      the router (+ Service N-router: http and grpc)
  InferencePool N            spec.gateway.inferencePool: the router pods, their picker Service N-epp (gateway.py)
  Secret       N-worker-tls  the deployment's CA + worker server / client certificates (spec.security.workerTLS):
                             created once by the handler (worker_tls.py), never rebuilt from the spec
"""

from __future__ import annotations

import hashlib
import re

from expertmesh.operator.spec import (
    MAX_ATTENTION_REPLICAS,
    MAX_EXPERT_REPLICAS,
    MAX_PREFILL_REPLICAS,
    MoEDeploymentSpec,
)
from expertmesh.operator.validation import DNS1035_LABEL, LABEL_VALUE

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
COMPONENT_PREFILL = "prefill-worker"  # the prefill pool's attention workers (spec.prefillWorkers)
WORKER_COMPONENTS = (COMPONENT_ATTENTION, COMPONENT_PREFILL, COMPONENT_EXPERT)
WORKER_PORT = 50061
HEALTH_PORT = 50062  # plaintext, grpc.health.v1 only: the kubelet's gRPC probes (no client certificate)
WORKER_TLS_DIR = "/etc/expertmesh-tls"  # the N-worker-tls Secret, mounted in every pod
ROUTER_SALT_DIR = "/etc/expertmesh-router-salt"  # the N-router-salt Secret, in the router pods (replicas > 1)
COLLECTIVE_PORT = 29500  # spec.transport collective: each expert pod's rendezvous store (worker/collective.py)
PLAN_DIR = "/etc/expertmesh"
PLAN_PATH = f"{PLAN_DIR}/plan.json"
CHECKPOINT_MOUNT = "/mnt/checkpoint"
CACHE_MOUNT = "/var/cache/expertmesh"  # fetched checkpoints, one directory per source
KV_DISK_MOUNT = "/var/cache/expertmesh-kv"  # the attention workers' disk tier (spec.kv.disk)
FETCH_CONTAINER = "fetch"


def plan_configmap_name(name: str) -> str:
    return f"{name}-plan"


def load_configmap_name(name: str) -> str:
    return f"{name}-load"


def attention_name(name: str) -> str:
    return f"{name}-attention"


def prefill_name(name: str) -> str:
    return f"{name}-prefill"


def expert_name(name: str) -> str:
    return f"{name}-expert"


def router_name(name: str) -> str:
    return f"{name}-router"


def network_policy_name(name: str, component: str) -> str:
    """The NetworkPolicy admitting a worker component's peers (`<name>-<component>-ingress`)."""
    return f"{name}-{component}-ingress"


def worker_tls_secret_name(name: str) -> str:
    return f"{name}-worker-tls"


def router_salt_secret_name(name: str) -> str:
    return f"{name}-router-salt"


# ------------------------------------------------------------------------------------------------ name bounds
STATEFULSET_NAME_MAX = 52  # a StatefulSet's pods carry controller-revision-hash=<name>-<10-char hash>: a label value
DNS_LABEL_MAX = 63  # a Service name (DNS-1035 label), a pod's hostname (<statefulset>-<ordinal>)


def _suffix(fn) -> int:
    return len(fn(""))


def max_name_length() -> int:
    """The longest MoEDeployment name whose every child name is valid: the StatefulSets' names (with the longest
    suffix the operator appends) within 52 characters, Services' within a 63-character DNS label, and pod hostnames
    (<statefulset>-<highest ordinal>) within 63."""
    statefulsets = (attention_name, prefill_name, expert_name)
    services = (attention_name, prefill_name, expert_name, router_name)
    ordinal = len(str(max(MAX_ATTENTION_REPLICAS, MAX_PREFILL_REPLICAS, MAX_EXPERT_REPLICAS) - 1))
    return min(
        STATEFULSET_NAME_MAX - max(map(_suffix, statefulsets)),
        DNS_LABEL_MAX - max(map(_suffix, services)),
        DNS_LABEL_MAX - max(_suffix(f) + 1 + ordinal for f in statefulsets),
    )


MAX_NAME_LENGTH = max_name_length()
NAME_PATTERN = DNS1035_LABEL  # Service names: a letter first, no dots


def name_error(name: str) -> str | None:
    """What is wrong with a MoEDeployment's `metadata.name` for its children (None: nothing). The CRD's schema and
    CEL rule refuse such names at the API server; the operator says the same for a resource created before them."""
    if len(name) > MAX_NAME_LENGTH:
        return (
            f"metadata.name {name[:80]!r}: at most {MAX_NAME_LENGTH} characters (the operator names children "
            f"<name>-attention, <name>-expert, ...: a StatefulSet's name stays within {STATEFULSET_NAME_MAX})"
        )
    if not re.fullmatch(NAME_PATTERN, name):
        return (
            f"metadata.name {name!r}: must be a DNS-1035 label (lowercase letters, digits and '-', starting with "
            f"a letter, no '.'): it names the deployment's Services"
        )
    return None


def version_label(tag: str) -> str | None:
    """The `app.kubernetes.io/version` label value of an image tag: a tag may be 128 characters and start with '_',
    a label value neither; cut to 63 and trimmed to alphanumerics at both ends (None when nothing is left)."""
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", tag[:63])
    return value if value and re.fullmatch(LABEL_VALUE, value) else None


def selector_labels(name: str, component: str) -> dict[str, str]:
    """The immutable subset used in selectors (never the version: that changes on upgrades)."""
    return {LABEL_NAME: "expertmesh", LABEL_INSTANCE: name, LABEL_COMPONENT: component}


def labels(name: str, component: str, spec: MoEDeploymentSpec) -> dict[str, str]:
    out = {**selector_labels(name, component), LABEL_PART_OF: "expertmesh", LABEL_MANAGED_BY: OPERATOR_NAME}
    version = version_label(spec.image.tag)
    if version is not None:
        out[LABEL_VERSION] = version
    return out


def selector_string(sel: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(sel.items()))


def object_meta(name: str, namespace: str, component: str, spec: MoEDeploymentSpec, *, instance: str, **extra) -> dict:
    """`metadata` of a child object `name` of the MoEDeployment `instance` (labels included; `extra`: e.g.
    annotations)."""
    return {"name": name, "namespace": namespace, "labels": labels(instance, component, spec), **extra}


def pod_dns(name: str, namespace: str, statefulset: str, ordinal: int, port: int = WORKER_PORT) -> str:
    """`<pod>.<headless svc>.<ns>.svc:port` — resolves through the pod's DNS search path on any cluster domain."""
    return f"{statefulset}-{ordinal}.{statefulset}.{namespace}.svc:{port}"


def statefulset_addresses(name: str, namespace: str, statefulset: str, replicas: int) -> list[str]:
    """The gRPC addresses of a StatefulSet's pods 0..replicas-1, in ordinal order."""
    return [pod_dns(name, namespace, statefulset, i) for i in range(replicas)]


def worker_addresses(
    name: str, namespace: str, spec: MoEDeploymentSpec, attention_replicas: int | None = None
) -> tuple[list[str], list[str]]:
    """(attention, expert) worker addresses in ordinal order, as the router is given them (`attention_replicas`: the
    attention StatefulSet's replicas when they are not the spec's — an autoscaled pool)."""
    att = statefulset_addresses(
        name,
        namespace,
        attention_name(name),
        spec.attention_workers.replicas if attention_replicas is None else attention_replicas,
    )
    exp = statefulset_addresses(name, namespace, expert_name(name), spec.expert_workers.replicas)
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
