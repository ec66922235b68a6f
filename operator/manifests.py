"""Pure reconciliation logic: spec + placement plan (+ observed pods / load) → child objects and status.

Nothing here talks to Kubernetes: every function takes plain data and returns plain data (dicts in the
shape of Kubernetes objects), so the handlers stay thin and all of this is unit-testable. Owner
references are left to the handlers (`kopf.adopt`).

Children of a `MoEDeployment` named N in namespace NS:
  ConfigMap    N-plan        plan.json (the placement plan) + config.json (the model config)
  StatefulSet  N-attention   attention workers (+ headless Service N-attention)
  StatefulSet  N-expert      expert workers, ordinal i holds plan.experts_of(i) (+ headless Service N-expert,
                             PodDisruptionBudget N-expert)
  Deployment   N-router      the router (+ Service N-router: http and grpc)
  Secret       N-worker-tls  the deployment's CA + worker server / client certificates (spec.security.workerTLS):
                             created once by the handler (worker_tls_secret), never rebuilt from the spec
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import shlex
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

from expertmesh.planner import PlanError, imbalance, moved_shards, plan_placement
from expertmesh.operator.spec import GIB, MoEDeploymentSpec
from expertmesh.plan import ClusterShape, GpuPlacement, PlacementPlan, PlanFigures, WorkerPlacement

# ------------------------------------------------------------------------------------------------ constants
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
GPU_RESOURCE = "nvidia.com/gpu"
STARTUP_SECONDS = 1800  # loading a shard of a 1.5 TB checkpoint can take many minutes


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


def selector_labels(name: str, component: str) -> dict[str, str]:
    """The immutable subset used in selectors (never the version: that changes on upgrades)."""
    return {LABEL_NAME: "expertmesh", LABEL_INSTANCE: name, LABEL_COMPONENT: component}


def labels(name: str, component: str, spec: MoEDeploymentSpec) -> dict[str, str]:
    return {**selector_labels(name, component), LABEL_PART_OF: "expertmesh", LABEL_MANAGED_BY: OPERATOR_NAME,
            LABEL_VERSION: spec.image.tag[:63]}


def selector_string(sel: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(sel.items()))


def pod_dns(name: str, namespace: str, statefulset: str, ordinal: int, port: int = WORKER_PORT) -> str:
    """`<pod>.<headless svc>.<ns>.svc:port` — resolves through the pod's DNS search path on any cluster domain."""
    return f"{statefulset}-{ordinal}.{statefulset}.{namespace}.svc:{port}"


def worker_tls_secret_name(name: str) -> str:
    return f"{name}-worker-tls"


def worker_tls_hosts(name: str, namespace: str) -> tuple[str, ...]:
    """The names the workers are reached by (pod_dns): any pod of either headless Service."""
    return tuple(f"*.{sts}.{namespace}.svc" for sts in (attention_name(name), expert_name(name)))


def worker_tls_secret(name: str, namespace: str, spec: MoEDeploymentSpec, pems: dict[str, bytes]) -> dict:
    """The Secret holding `pems` (expertmesh.tls.pki_pems(worker_tls_hosts(...))). Everything but the CA key, which
    only signs and is not needed once the certificates exist."""
    import base64
    data = {k: base64.b64encode(v).decode() for k, v in sorted(pems.items()) if k != "ca.key"}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(worker_tls_secret_name(name), namespace, "worker-tls", spec, instance=name),
            "data": data}


def worker_tls_args(spec: MoEDeploymentSpec, role: str) -> list[str]:
    """Flags for mutual TLS on every worker RPC: workers serve with the server certificate and require a client
    certificate of the deployment's CA; the router and the attention workers (callers of the expert workers) present
    the client certificate. Empty with spec.security.workerTLS false."""
    if not spec.security.worker_tls:
        return []
    d = WORKER_TLS_DIR
    serve = ["--tls-cert", f"{d}/server.crt", "--tls-key", f"{d}/server.key", "--tls-client-ca", f"{d}/ca.crt"]
    call = {"router": "--worker-tls", "attention": "--expert-tls"}.get(role)
    client = [f"{call}-ca", f"{d}/ca.crt", f"{call}-cert", f"{d}/client.crt", f"{call}-key", f"{d}/client.key"] \
        if call else []
    return client if role == "router" else serve + client


def worker_addresses(name: str, namespace: str, spec: MoEDeploymentSpec) -> tuple[list[str], list[str]]:
    """(attention, expert) worker addresses in ordinal order, as the router is given them."""
    att = [pod_dns(name, namespace, attention_name(name), i) for i in range(spec.attention_workers.replicas)]
    exp = [pod_dns(name, namespace, expert_name(name), i) for i in range(spec.expert_workers.replicas)]
    return att, exp


def endpoints(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict[str, str]:
    host = f"{router_name(name)}.{namespace}.svc"
    return {"http": f"{host}:{spec.router.http_port}", "grpc": f"{host}:{spec.router.grpc_port}"}


def cache_key(uri: str) -> str:
    """The cache directory name of a fetched source: readable, and unique per URI."""
    readable = "".join(ch if ch.isalnum() or ch in "-._" else "-" for ch in uri.split("://", 1)[-1])[-48:]
    return f"{readable.strip('-.')}-{hashlib.sha256(uri.encode()).hexdigest()[:10]}"


def checkpoint_path(spec: MoEDeploymentSpec) -> str:
    ck = spec.model.checkpoint
    if ck.pvc is not None:
        sub = ck.pvc.path.strip("/")
        return f"{CHECKPOINT_MOUNT}/{sub}" if sub else CHECKPOINT_MOUNT
    if ck.fetched:
        return f"{CACHE_MOUNT}/{cache_key(ck.uri)}"
    return ck.uri  # a path inside the image


def fetch_container(spec: MoEDeploymentSpec, mounts: list[dict]) -> dict:
    """The init container that fetches a remote checkpoint into the cache volume (`expertmesh fetch`: every
    file verified by size and sha256, resumable, retried with backoff; pods on one node share the cache)."""
    ck = spec.model.checkpoint
    env = []
    if ck.token_secret_ref is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": ck.token_secret_ref.name, "key": ck.token_secret_ref.key}}})
    if ck.endpoint is not None:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": ck.endpoint})
    if ck.region is not None:
        env.append({"name": "AWS_REGION", "value": ck.region})
    out = {"name": FETCH_CONTAINER, "image": spec.image.ref, "imagePullPolicy": spec.image.pull_policy,
           "command": ["expertmesh"], "args": ["fetch", ck.uri, "--cache", checkpoint_path(spec)],
           "env": env, "volumeMounts": [mt for mt in mounts if mt["name"] == "checkpoint-cache"],
           # a failure's last log line (it names the file) becomes the container's termination message
           "terminationMessagePolicy": "FallbackToLogsOnError",
           "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}}
    if ck.credentials_secret is not None:  # the keys as environment variables (never on the command line)
        out["envFrom"] = [{"secretRef": {"name": ck.credentials_secret}}]
    return out


# ------------------------------------------------------------------------------------------------ planning
def cluster_shape(spec: MoEDeploymentSpec) -> ClusterShape:
    """The expert workers of a spec as the planner sees them (a CPU pod counts as one device)."""
    ew = spec.expert_workers
    return ClusterShape(pods=ew.replicas, gpus_per_pod=ew.devices_per_pod,
                        gpu_memory_bytes=int(ew.gpu_memory_gib * GIB), reserve_bytes=int(ew.reserve_gib * GIB))


def compatible(previous: Optional[PlacementPlan], cfg) -> Optional[PlacementPlan]:
    """`previous` when it is a plan of this model (so its shards can stay put), else None."""
    if previous is None:
        return None
    same = (previous.model_name, list(previous.moe_layers), previous.n_experts, previous.expert_bytes) == \
        (cfg.name, cfg.moe_layers, cfg.moe.n_routed_experts, cfg.expert_bytes_mxfp4)
    return previous if same else None


def plan_for(spec: MoEDeploymentSpec, cfg, previous: Optional[PlacementPlan] = None, loads=None,
             reuse: bool = True) -> PlacementPlan:
    """The plan for a spec on all its expert pods. With a previous plan of this model, the minimal-movement
    plan (every still-valid shard stays) is preferred; when that is out of balance — expected imbalance above
    `placement.imbalanceThreshold`, e.g. pods were added and would stay empty — a fresh plan is taken if it
    balances better (see `choose`). Raises `PlanError` (a ValueError) when the pods cannot hold the model."""
    shape, r = cluster_shape(spec), spec.expert_workers.redundant_experts
    previous = compatible(previous, cfg)
    if previous is None:
        return plan_placement(cfg, shape, redundant_slots=r, loads=loads)
    if reuse and loads is None and previous.cluster == shape and previous.figures.redundant_requested == r:
        return previous  # nothing placement-relevant changed (restart, image bump): keep it, pods stay
    incremental = plan_placement(cfg, shape, redundant_slots=r, loads=loads, previous=previous)
    if incremental.figures.imbalance <= spec.placement.imbalance_threshold:
        return incremental
    fresh = plan_placement(cfg, shape, redundant_slots=r, loads=loads)
    return choose(incremental, fresh, spec.placement.imbalance_threshold)


def choose(incremental: PlacementPlan, fresh: PlacementPlan, threshold: float, loads=None) -> PlacementPlan:
    """The minimal-movement plan unless it is above `threshold` and the fresh one is better balanced
    (imbalance under `loads`, else under the loads each plan was made with)."""
    if loads is None:
        a, b = incremental.figures.imbalance, fresh.figures.imbalance
    else:
        a, b = imbalance(incremental, loads).mean, imbalance(fresh, loads).mean
    return fresh if a > threshold and b < a else incremental


def moved_from(previous: Optional[PlacementPlan], plan: PlacementPlan, cfg) -> int:
    """Shards `plan` places where `previous` (of the same model) did not have them; 0 without one."""
    previous = compatible(previous, cfg)
    return 0 if previous is None else moved_shards(previous, plan)


def _spread_figures(figures: PlanFigures, workers, expert_bytes: int) -> PlanFigures:
    """`figures` with the per-GPU shard/byte minimum and mean recomputed over `workers`."""
    per_gpu = [len(g.shards) for w in workers for g in w.gpus]
    mean = sum(per_gpu) / len(per_gpu)
    return figures.model_copy(update={"shards_per_gpu_min": min(per_gpu), "shards_per_gpu_mean": mean,
                                      "bytes_per_gpu_min": min(per_gpu) * expert_bytes,
                                      "bytes_per_gpu_mean": mean * expert_bytes})


def replan_around(spec: MoEDeploymentSpec, cfg, plan: PlacementPlan, lost: Iterable[int],
                  loads=None) -> PlacementPlan:
    """Re-plan onto the expert pods that are not `lost`, moving as little as possible.

    The planner numbers pods 0..P-1 and drops shards of pods past the end, so the lost pods are renumbered to
    the end of a copy of `plan`, the survivors planned as P' = P - len(lost) pods (everything they hold stays),
    and the result numbered back: a plan for all P ordinals in which the lost ones hold nothing (the router
    sends them no tokens; a pod that comes back loads an empty shard until the next re-plan).
    Raises `PlanError` when the survivors cannot hold the model."""
    P, G = plan.cluster.pods, plan.cluster.gpus_per_pod
    lost = sorted({int(o) for o in lost if 0 <= int(o) < P})
    survivors = [o for o in range(P) if o not in lost]
    if not lost:  # everyone is back: the balanced choice of plan_for (a returning pod would otherwise stay empty)
        return plan_for(spec, cfg, previous=plan, loads=loads, reuse=False)
    if not survivors:
        raise PlanError(f"all {P} expert workers are lost: no pod left to plan onto")
    order = survivors + lost  # new index i ← old ordinal order[i]
    permuted = _with_workers(plan, [plan.workers[o].gpus for o in order], plan.figures)
    shape = ClusterShape(pods=len(survivors), gpus_per_pod=G, gpu_memory_bytes=plan.cluster.gpu_memory_bytes,
                         reserve_bytes=plan.cluster.reserve_bytes)
    compact = plan_placement(cfg, shape, redundant_slots=spec.expert_workers.redundant_experts, loads=loads,
                             previous=permuted)
    empty = tuple(GpuPlacement(gpu=g, shards=(), bytes=0) for g in range(G))
    gpus = [empty] * P
    for i, o in enumerate(survivors):
        gpus[o] = compact.workers[i].gpus
    # the planner's note about shards "on pods that no longer exist" means the lost pods here: say so instead
    notes = tuple(n for n in compact.notes if "no longer exist" not in n) + (
        f"expert workers {lost} lost: planned onto the {len(survivors)} survivors {survivors}; the lost "
        f"ordinals hold no experts",)
    staged = _with_workers(plan, gpus, compact.figures, notes=notes)
    figures = _spread_figures(compact.figures, staged.workers, plan.expert_bytes).model_copy(
        update={"moved_shards": moved_shards(plan, staged), "previous_hash": plan.plan_hash()})
    return _with_workers(plan, gpus, figures, notes=notes)


def _with_workers(plan: PlacementPlan, gpus_by_ordinal, figures: PlanFigures, notes=None) -> PlacementPlan:
    """A validated copy of `plan` with other per-ordinal GPU placements (and figures/notes)."""
    return PlacementPlan(
        model_name=plan.model_name, moe_layers=plan.moe_layers, n_experts=plan.n_experts, top_k=plan.top_k,
        expert_bytes=plan.expert_bytes, cluster=plan.cluster,
        workers=tuple(WorkerPlacement(ordinal=o, gpus=tuple(g)) for o, g in enumerate(gpus_by_ordinal)),
        figures=figures, notes=plan.notes if notes is None else tuple(notes))


def placement_status(plan: PlacementPlan, lost_workers: Iterable[int] = (), moved: Optional[int] = None,
                     observed_imbalance: Optional[float] = None) -> dict[str, Any]:
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


# ------------------------------------------------------------------------------------------------ plan rollout
# A new plan is published in the plan ConfigMap; no pod template changes and no pod restarts. The router follows
# the mounted plan and adopts it live (router/server.watch_plan → Engine.replan): the expert workers load their
# new shards, the router switches the attention workers' replica table between two steps, the expert workers
# drop the shards they gave up. A pod that starts reads the plan in force from the same ConfigMap.
def _shards(plan: Optional[PlacementPlan], ordinal: int) -> tuple:
    if plan is None or ordinal >= len(plan.workers):
        return ()
    return tuple((g.gpu, tuple(g.shards)) for g in plan.workers[ordinal].gpus if g.shards)


def changed_ordinals(previous: Optional[PlacementPlan], plan: PlacementPlan) -> list[int]:
    """Expert ordinals whose shards (per device) differ between `previous` and `plan`."""
    n = max(len(plan.workers), len(previous.workers) if previous is not None else 0)
    return [o for o in range(n) if _shards(previous, o) != _shards(plan, o)]


def summarize_plan(plan: PlacementPlan) -> str:
    """One line for the PlacementReady condition's message."""
    f, c = plan.figures, plan.cluster
    text = (f"{f.physical_experts} physical experts for {f.logical_experts} logical over {c.pods} expert pods x "
            f"{c.gpus_per_pod} devices ({f.bytes_per_gpu_max / GIB:.3g} GiB max per device); expected imbalance "
            f"{f.imbalance:.3f}")
    if f.moved_shards is not None:
        text += f"; {f.moved_shards} shards moved"
    if plan.notes:
        text += "; " + "; ".join(plan.notes)
    return text


# ------------------------------------------------------------------------------------------------ children
def _env(spec: MoEDeploymentSpec, service: str, name: str) -> list[dict]:
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    t = spec.telemetry
    if t.otlp_endpoint:
        env += [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": t.otlp_endpoint},
                {"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": t.protocol},
                {"name": "OTEL_SERVICE_NAME", "value": service},
                {"name": "OTEL_RESOURCE_ATTRIBUTES",
                 "value": f"service.namespace=expertmesh,expertmesh.deployment={name},"
                          "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"}]
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
        vols.append({"name": "checkpoint",
                     "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": pvc.read_only}})
        mounts.append({"name": "checkpoint", "mountPath": CHECKPOINT_MOUNT, "readOnly": pvc.read_only})
    ck = spec.model.checkpoint
    if ck.fetched:
        cache = ck.cache
        vols.append({"name": "checkpoint-cache", **(
            {"persistentVolumeClaim": {"claimName": cache.claim_name}} if cache.claim_name is not None else
            {"hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}})})
        mounts.append({"name": "checkpoint-cache", "mountPath": CACHE_MOUNT})
    if spec.security.worker_tls:
        vols.append({"name": "worker-tls", "secret": {"secretName": worker_tls_secret_name(name),
                                                      "defaultMode": 0o400}})
        mounts.append({"name": "worker-tls", "mountPath": WORKER_TLS_DIR, "readOnly": True})
    return vols, mounts


def _grpc_probes(port: int = HEALTH_PORT) -> dict:
    return {
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": 10,
                         "failureThreshold": STARTUP_SECONDS // 10},
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"grpc": {"port": port}, "periodSeconds": 20, "failureThreshold": 3,
                          "timeoutSeconds": 5},
    }


def _pod_spec(name: str, component: str, spec: MoEDeploymentSpec, container: dict,
              spread: bool = False) -> dict:
    vols, mounts = _volumes(name, spec)
    container = {"image": spec.image.ref, "imagePullPolicy": spec.image.pull_policy, "volumeMounts": mounts,
                 **container}
    pod: dict[str, Any] = {"containers": [container], "volumes": vols,
                           "terminationGracePeriodSeconds": 60, "enableServiceLinks": False}
    if spec.model.checkpoint.fetched:
        pod["initContainers"] = [fetch_container(spec, mounts)]
    sch = spec.scheduling
    if sch.node_selector:
        pod["nodeSelector"] = dict(sch.node_selector)
    if sch.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in sch.tolerations]
    if spread and sch.topology_spread_key:
        pod["topologySpreadConstraints"] = [{
            "maxSkew": 1, "topologyKey": sch.topology_spread_key, "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(name, component)}}]
    return pod


def expert_worker_command(spec: MoEDeploymentSpec) -> list[str]:
    """The expert container's command: a shell that takes the ordinal from the StatefulSet hostname
    (`<name>-expert-<ordinal>`) and execs the worker (the worker is PID 1's only child; signals reach it)."""
    fixed = ["expertmesh", "worker", "--role", "expert", "--plan", PLAN_PATH,
             "--checkpoint", checkpoint_path(spec), "--host", "0.0.0.0", "--port", str(WORKER_PORT),
             "--health-port", str(HEALTH_PORT), *worker_tls_args(spec, "expert")]
    return ["/bin/sh", "-c", f'exec {shlex.join(fixed)} --ordinal "${{HOSTNAME##*-}}" --name "$HOSTNAME"']


def attention_worker_args(spec: MoEDeploymentSpec, cfg) -> list[str]:
    max_context = spec.kv.max_context or cfg.max_context
    kv_blocks = math.ceil(max_context / spec.kv.block_size)
    return ["worker", "--role", "attention", "--checkpoint", checkpoint_path(spec), "--host", "0.0.0.0",
            "--port", str(WORKER_PORT), "--health-port", str(HEALTH_PORT), "--name", "$(POD_NAME)",
            "--kv-blocks", str(kv_blocks), "--block-size", str(spec.kv.block_size),
            *worker_tls_args(spec, "attention")]


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


def router_args(name: str, namespace: str, spec: MoEDeploymentSpec) -> list[str]:
    att, exp = worker_addresses(name, namespace, spec)
    return ["router", "--checkpoint", checkpoint_path(spec), "--plan", PLAN_PATH,
            "--attention", ",".join(att), "--experts", ",".join(exp), "--host", "0.0.0.0",
            "--http-port", str(spec.router.http_port), "--grpc-port", str(spec.router.grpc_port),
            *(["--transport", spec.transport] if spec.transport != "grpc" else []), *router_serving_args(spec),
            *worker_tls_args(spec, "router")]


def _meta(name: str, namespace: str, component: str, spec: MoEDeploymentSpec, **extra) -> dict:
    return {"name": name, "namespace": namespace, "labels": labels(extra.pop("instance"), component, spec), **extra}


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _stamped(workload: dict) -> dict:
    """Annotate a workload's pod template with the hash of the template itself: a pod carrying the current
    hash runs the current spec (pods of an older template are still rolling). The plan is not part of any
    template: running pods adopt a new plan live (see "plan rollout")."""
    tmpl = workload["spec"]["template"]
    tmpl["metadata"]["annotations"] = {**tmpl["metadata"].get("annotations", {}), TEMPLATE_HASH_ANNOTATION: _hash(tmpl)}
    return workload


def template_hashes(children: list[dict]) -> dict[str, str]:
    """component → the pod-template hash of its workload among `children`."""
    return {c["metadata"]["labels"][LABEL_COMPONENT]: c["spec"]["template"]["metadata"]["annotations"][
        TEMPLATE_HASH_ANNOTATION] for c in children if c["kind"] in ("StatefulSet", "Deployment")}


def revision(children: list[dict]) -> str:
    """A hash of every child's desired state (`status.revision`): it changes whenever reconciling changes
    anything, so a rollout can be told from a loss."""
    return _hash(children)


def plan_configmap(name: str, namespace: str, spec: MoEDeploymentSpec, cfg, plan) -> dict:
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {**_meta(plan_configmap_name(name), namespace, "plan", spec, instance=name),
                     "annotations": {PLAN_HASH_ANNOTATION: plan.plan_hash()}},
        "data": {"plan.json": plan.to_json(), "config.json": cfg.model_dump_json(indent=1)},
    }


def load_configmap(name: str, namespace: str, spec: MoEDeploymentSpec, cfg, loads: np.ndarray,
                   observed_at: str) -> dict:
    """The router's last observed expert load (the body `/v1/load` gave, as `parse_load` reads it back): kept in
    the cluster so a restarted operator or a new leader re-plans around a lost pod with it."""
    payload = {"moe_layers": list(cfg.moe_layers), "observedAt": observed_at,
               "tokens": {str(layer): [int(x) for x in loads[i]] for i, layer in enumerate(cfg.moe_layers)}}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(load_configmap_name(name), namespace, "load", spec, instance=name),
            "data": {"load.json": json.dumps(payload, separators=(",", ":"))}}


def headless_service(name: str, namespace: str, spec: MoEDeploymentSpec, svc: str, component: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(svc, namespace, component, spec, instance=name),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,  # router resolves pods while they load
                 "selector": selector_labels(name, component),
                 "ports": [{"name": "grpc", "port": WORKER_PORT, "targetPort": WORKER_PORT, "protocol": "TCP"}]},
    }


def attention_statefulset(name: str, namespace: str, spec: MoEDeploymentSpec, cfg) -> dict:
    aw = spec.attention_workers
    container = {"name": "attention", "command": ["expertmesh"], "args": attention_worker_args(spec, cfg),
                 "ports": [{"name": "grpc", "containerPort": WORKER_PORT},
                           {"name": "health", "containerPort": HEALTH_PORT}],
                 "env": _env(spec, "expertmesh-attention", name),
                 "resources": _resources(aw.resources, aw.gpus_per_pod), **_grpc_probes()}
    return _stamped({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(attention_name(name), namespace, COMPONENT_ATTENTION, spec, instance=name),
        "spec": {
            "serviceName": attention_name(name), "replicas": aw.replicas, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(name, COMPONENT_ATTENTION)},
            "template": {"metadata": {"labels": labels(name, COMPONENT_ATTENTION, spec)},
                         "spec": _pod_spec(name, COMPONENT_ATTENTION, spec, container, spread=True)},
        },
    })


def expert_statefulset(name: str, namespace: str, spec: MoEDeploymentSpec, plan) -> dict:
    ew = spec.expert_workers
    ports = [{"name": "grpc", "containerPort": WORKER_PORT}, {"name": "health", "containerPort": HEALTH_PORT}]
    env = _env(spec, "expertmesh-expert", name)
    if spec.transport == "collective":     # the pod's rendezvous store; the attention pods learn it over gRPC
        ports.append({"name": "collective", "containerPort": COLLECTIVE_PORT})
        env.append({"name": "EXPERTMESH_COLLECTIVE_PORT", "value": str(COLLECTIVE_PORT)})
    container = {"name": "expert", "command": expert_worker_command(spec), "ports": ports, "env": env,
                 "resources": _resources(ew.resources, ew.gpus_per_pod), **_grpc_probes()}
    return _stamped({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(expert_name(name), namespace, COMPONENT_EXPERT, spec, instance=name,
                          annotations={PLAN_HASH_ANNOTATION: plan.plan_hash()}),
        "spec": {
            "serviceName": expert_name(name), "replicas": ew.replicas, "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(name, COMPONENT_EXPERT)},
            # nothing in the pod template changes with the plan: a new plan is published in the ConfigMap
            # (mounted at PLAN_DIR), it never rolls the StatefulSet
            "template": {"metadata": {"labels": labels(name, COMPONENT_EXPERT, spec)},
                         "spec": _pod_spec(name, COMPONENT_EXPERT, spec, container, spread=True)},
        },
    })


def expert_pdb(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict:
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(expert_name(name), namespace, COMPONENT_EXPERT, spec, instance=name),
        # one at a time: a drained expert pod is re-planned around before the next may go
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, COMPONENT_EXPERT)}},
    }


def router_deployment(name: str, namespace: str, spec: MoEDeploymentSpec, plan) -> dict:
    r = spec.router
    env = _env(spec, "expertmesh-router", name)
    if r.api_key_secret_ref is not None:
        env.append({"name": "EXPERTMESH_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": r.api_key_secret_ref.name, "key": r.api_key_secret_ref.key}}})
    container = {
        "name": "router", "command": ["expertmesh"], "args": router_args(name, namespace, spec),
        "ports": [{"name": "http", "containerPort": r.http_port}, {"name": "grpc", "containerPort": r.grpc_port}],
        "env": env, "resources": _resources(r.resources, 0),
        "readinessProbe": {"httpGet": {"path": "/health", "port": r.http_port}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": r.http_port}, "periodSeconds": 20,
                          "failureThreshold": 3, "timeoutSeconds": 5},
    }
    return _stamped({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(router_name(name), namespace, COMPONENT_ROUTER, spec, instance=name,
                          annotations={PLAN_HASH_ANNOTATION: plan.plan_hash()}),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": selector_labels(name, COMPONENT_ROUTER)},
            "template": {"metadata": {"labels": labels(name, COMPONENT_ROUTER, spec)},  # nothing of the plan
                         "spec": _pod_spec(name, COMPONENT_ROUTER, spec, container)},
        },
    })


def router_service(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict:
    r = spec.router
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(router_name(name), namespace, COMPONENT_ROUTER, spec, instance=name),
        "spec": {"type": "ClusterIP", "selector": selector_labels(name, COMPONENT_ROUTER),
                 "ports": [{"name": "http", "port": r.http_port, "targetPort": r.http_port, "protocol": "TCP"},
                           {"name": "grpc", "port": r.grpc_port, "targetPort": r.grpc_port, "protocol": "TCP"}]},
    }


def worker_network_policy(name: str, namespace: str, spec: MoEDeploymentSpec, component: str) -> dict:
    """Only this deployment's pods reach its workers (probes come from the kubelet, which NetworkPolicies do not
    filter): the router the workers' gRPC port, the attention workers the expert workers' (the per-layer
    exchange and its control). With `transport: collective` the attention and expert pods also reach each other on
    any TCP port: the rendezvous store is on COLLECTIVE_PORT, but gloo's and NCCL's pair connections listen on
    ephemeral ports, in either direction."""
    def peers(component_: str) -> list[dict]:
        return [{"podSelector": {"matchLabels": selector_labels(name, component_)}}]
    grpc_port = [{"protocol": "TCP", "port": WORKER_PORT}]
    ingress = [{"from": peers(COMPONENT_ROUTER), "ports": grpc_port}]
    other = {COMPONENT_ATTENTION: COMPONENT_EXPERT, COMPONENT_EXPERT: COMPONENT_ATTENTION}[component]
    if spec.transport == "collective":
        ingress.append({"from": peers(other)})
    elif component == COMPONENT_EXPERT:
        ingress.append({"from": peers(COMPONENT_ATTENTION), "ports": grpc_port})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(f"{name}-{component}-ingress", namespace, component, spec, instance=name),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_children(name: str, namespace: str, spec: MoEDeploymentSpec, cfg, plan) -> list[dict]:
    """Every child object, in apply order (the ConfigMap before the pods that mount it)."""
    return [
        plan_configmap(name, namespace, spec, cfg, plan),
        headless_service(name, namespace, spec, attention_name(name), COMPONENT_ATTENTION),
        headless_service(name, namespace, spec, expert_name(name), COMPONENT_EXPERT),
        attention_statefulset(name, namespace, spec, cfg),
        expert_statefulset(name, namespace, spec, plan),
        expert_pdb(name, namespace, spec),
        router_deployment(name, namespace, spec, plan),
        router_service(name, namespace, spec),
        worker_network_policy(name, namespace, spec, COMPONENT_ATTENTION),
        worker_network_policy(name, namespace, spec, COMPONENT_EXPERT),
    ]


# ------------------------------------------------------------------------------------------------ conditions
def now_rfc3339(now: Optional[_dt.datetime] = None) -> str:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return now.astimezone(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


_CONDITION_ORDER = {"PlacementReady": 0, "WeightsReady": 1, "WorkersReady": 2, "RouterReady": 3, "Degraded": 4}


def set_condition(conditions: Optional[list[dict]], type_: str, status: str, reason: str, message: str = "",
                  generation: Optional[int] = None, now: Optional[str] = None) -> list[dict]:
    """A new condition list with `type_` set; its `lastTransitionTime` is kept unless `status` flips."""
    now = now or now_rfc3339()
    out, found = [], False
    for c in conditions or []:
        c = dict(c)
        if c.get("type") == type_:
            found = True
            keep = c.get("status") == status and c.get("lastTransitionTime")
            c = {"type": type_, "status": status, "reason": reason, "message": message,
                 "lastTransitionTime": c["lastTransitionTime"] if keep else now, "observedGeneration": generation}
        out.append(c)
    if not found:
        out.append({"type": type_, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": now, "observedGeneration": generation})
    return sorted(out, key=lambda c: _CONDITION_ORDER.get(c.get("type"), 99))


def condition(status: dict, type_: str) -> Optional[dict]:
    return next((c for c in (status or {}).get("conditions", []) or [] if c.get("type") == type_), None)


def failed_status(status: Optional[dict], message: str, generation: Optional[int], reason: str,
                  now: Optional[str] = None) -> dict:
    """Status for a spec that cannot be deployed as written (a bad field, a cluster too small for the model)."""
    conds = (status or {}).get("conditions", []) or []
    conds = set_condition(conds, "PlacementReady", "False", reason, message, generation, now)
    for t in ("WorkersReady", "RouterReady"):
        conds = set_condition(conds, t, "Unknown", reason, "not deployed: fix the spec", generation, now)
    conds = set_condition(conds, "Degraded", "False", reason, "", generation, now)
    return {"phase": "Failed", "message": message, "conditions": conds, "observedGeneration": generation}


# ------------------------------------------------------------------------------------------------ pods
@dataclass(frozen=True)
class PodInfo:
    """What the operator needs of one of its pods."""
    name: str
    component: str
    ordinal: Optional[int]  # StatefulSet ordinal (None for router pods)
    ready: bool
    template_hash: Optional[str]  # the pod template it was created from (see TEMPLATE_HASH_ANNOTATION)
    deleting: bool = False
    uid: str = ""
    fetch: Optional[str] = None   # the checkpoint fetch (init container): None (none), running, done, failed
    fetch_error: str = ""         # a failed fetch's termination message (its last log line names the file)
    node: str = ""                # the node it runs on (pods of one node share the checkpoint cache)

    @property
    def live(self) -> bool:
        return self.ready and not self.deleting


def pod_info(body: dict) -> Optional[PodInfo]:
    """A PodInfo from a pod object; None when the pod is not one of ours."""
    meta = body.get("metadata") or {}
    lab = meta.get("labels") or {}
    component = lab.get(LABEL_COMPONENT)
    if component not in (COMPONENT_ROUTER, COMPONENT_ATTENTION, COMPONENT_EXPERT) or LABEL_INSTANCE not in lab:
        return None
    name = meta.get("name", "")
    ordinal = None
    if component != COMPONENT_ROUTER:
        tail = name.rsplit("-", 1)[-1]
        ordinal = int(tail) if tail.isdigit() else None
    st = body.get("status") or {}
    ready = st.get("phase", "Running") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
    fetch, fetch_error = _fetch_state(st)
    return PodInfo(name=name, component=component, ordinal=ordinal, ready=ready,
                   template_hash=(meta.get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION),
                   deleting=bool(meta.get("deletionTimestamp")), uid=meta.get("uid", ""),
                   fetch=fetch, fetch_error=fetch_error, node=(body.get("spec") or {}).get("nodeName") or "")


def _fetch_state(pod_status: dict) -> tuple[Optional[str], str]:
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


def weights_condition(spec: MoEDeploymentSpec, pods: Iterable[PodInfo],
                      progress: dict[str, Optional[float]]) -> Optional[tuple[str, str, str]]:
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


def with_weights(update: dict, status: dict, spec: MoEDeploymentSpec, pods: Iterable[PodInfo],
                 progress: dict[str, Optional[float]], generation: Optional[int]) -> dict:
    """`update` (a status patch) with the WeightsReady condition, and while pods fetch or a fetch failed, its
    message (`Downloading 37% …`) as the status message."""
    cond = weights_condition(spec, pods, progress)
    if cond is None:
        return update
    conds = update.get("conditions", status.get("conditions")) or []
    out = {**update, "conditions": set_condition(conds, "WeightsReady", *cond, generation)}
    if cond[0] == "False" and (update.get("phase") or status.get("phase")) in ("Deploying", "Degraded"):
        out["message"] = cond[2]
    return out



@dataclass
class Assessment:
    """The pods as observed against the plan in force."""
    ready: dict[str, int]            # component → live pods (experts: plan-holding ordinals)
    desired: dict[str, int]
    lost_experts: list[int]          # plan-holding expert ordinals without a live pod
    unserved: list[tuple[int, int]]  # (layer, expert) left without a live replica
    live_expert_ordinals: set[int]   # ordinals with a live expert pod, on any plan

    @property
    def rolled_out(self) -> bool:
        """Every pod the plan needs is live."""
        return not self.lost_experts and all(self.ready[c] >= self.desired[c]
                                             for c in (COMPONENT_ROUTER, COMPONENT_ATTENTION))

    @property
    def ready_workers(self) -> int:
        return self.ready[COMPONENT_ATTENTION] + self.ready[COMPONENT_EXPERT]

    @property
    def desired_workers(self) -> int:
        return self.desired[COMPONENT_ATTENTION] + self.desired[COMPONENT_EXPERT]


def plan_ordinals(plan: PlacementPlan) -> list[int]:
    """Expert ordinals that hold at least one shard."""
    return [w.ordinal for w in plan.workers if any(g.shards for g in w.gpus)]


def assess(spec: MoEDeploymentSpec, plan: PlacementPlan, pods: Iterable[PodInfo],
           templates: dict[str, str]) -> Assessment:
    """Count live pods of the current templates (`templates`: component → template hash, see
    `template_hashes`); find the plan-holding expert pods that are not live on the current template, and the
    experts they leave without a live replica."""
    pods = list(pods)
    desired = {COMPONENT_ROUTER: spec.router.replicas, COMPONENT_ATTENTION: spec.attention_workers.replicas,
               COMPONENT_EXPERT: plan.cluster.pods}

    def live(component: str, current: bool = True) -> set:
        return {p.ordinal if component != COMPONENT_ROUTER else p.name for p in pods
                if p.component == component and p.live
                and (not current or p.template_hash == templates.get(component))
                and (component == COMPONENT_ROUTER or (p.ordinal is not None and p.ordinal < desired[component]))}

    live_exp = live(COMPONENT_EXPERT)
    holding = plan_ordinals(plan)
    lost = [o for o in holding if o not in live_exp]
    unserved = sorted({(layer, e) for o in lost for layer, e in plan.experts_of(o)
                       if not any(r in live_exp for r in plan.replicas(layer, e))})
    ready = {COMPONENT_ROUTER: len(live(COMPONENT_ROUTER)), COMPONENT_ATTENTION: len(live(COMPONENT_ATTENTION)),
             COMPONENT_EXPERT: len([o for o in holding if o in live_exp])}
    desired[COMPONENT_EXPERT] = len(holding)
    return Assessment(ready=ready, desired=desired, lost_experts=lost, unserved=unserved,
                      live_expert_ordinals=live(COMPONENT_EXPERT, current=False))


@dataclass
class Decision:
    """What the observed pods call for: the status to merge in, and whether to re-plan.
    `replan_excluding` None: keep the plan; a list: re-plan around these expert ordinals ([] = onto all)."""
    status: dict
    replan_excluding: Optional[list[int]] = None


def counts_status(a: Assessment, spec: MoEDeploymentSpec, name: str) -> dict:
    return {
        "readyWorkers": a.ready_workers, "desiredWorkers": a.desired_workers,
        "expertWorkers": {"replicas": spec.expert_workers.replicas, "ready": a.ready[COMPONENT_EXPERT],
                          "selector": selector_string(selector_labels(name, COMPONENT_EXPERT))},
        "attentionWorkers": {"ready": a.ready[COMPONENT_ATTENTION], "desired": a.desired[COMPONENT_ATTENTION]},
        "router": {"ready": a.ready[COMPONENT_ROUTER], "desired": a.desired[COMPONENT_ROUTER]},
    }


def decide(name: str, spec: MoEDeploymentSpec, plan: PlacementPlan, status: dict, a: Assessment,
           generation: Optional[int], now: Optional[str] = None) -> Decision:
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
    conds = set_condition(conds, "RouterReady", "True" if r_ok else "False",
                          "RouterAvailable" if r_ok else "RouterUnavailable",
                          f"{a.ready[COMPONENT_ROUTER]}/{a.desired[COMPONENT_ROUTER]} router pods ready",
                          generation, now)
    w_ok = not a.lost_experts and a.ready[COMPONENT_ATTENTION] >= a.desired[COMPONENT_ATTENTION]
    w_msg = (f"{a.ready[COMPONENT_EXPERT]}/{a.desired[COMPONENT_EXPERT]} expert and "
             f"{a.ready[COMPONENT_ATTENTION]}/{a.desired[COMPONENT_ATTENTION]} attention workers ready")
    replan: Optional[list[int]] = None
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
        conds = set_condition(conds, "WorkersReady", "True" if w_ok else "False",
                              "AllWorkersReady" if w_ok else "WorkersLost", w_msg, generation, now)
        before = {int(x["ordinal"]): x["since"] for x in status.get("lostSince") or []}
        since = {o: before.get(o, now) for o in a.lost_experts}
        if a.unserved:
            layer, e = a.unserved[0]
            reason = "ExpertsUnavailable"
            newest = max(_parse_time(t) for t in since.values())
            due = newest + _dt.timedelta(seconds=spec.placement.replan_grace_seconds)
            message = (f"expert workers {a.lost_experts} lost; {len(a.unserved)} experts have no live replica "
                       f"(e.g. layer {layer} expert {e}): ")
            if _parse_time(now) >= due:
                message += "re-planning onto the surviving workers"
                replan = sorted(set(lost_before) | set(a.lost_experts))
            else:
                message += f"re-planning onto the surviving workers at {now_rfc3339(due)} unless they come back"
        elif a.lost_experts:
            reason = "ReplicasServing"
            message = (f"expert workers {a.lost_experts} lost; every expert they held is served by a replica on "
                       f"another worker")
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
            conds = set_condition(conds, "Degraded", "True", "ReplannedOntoSurvivors",
                                  f"the plan routes around lost expert workers {lost_before}", generation, now)
        else:
            conds = set_condition(conds, "Degraded", "False", "AllReplicasServing", "", generation, now)
    out = {"phase": new_phase, "conditions": conds, "message": message or None,
           "lostSince": [{"ordinal": o, "since": since[o]} for o in sorted(since)], **counts_status(a, spec, name)}
    return Decision(status=out, replan_excluding=replan)


def seconds_since(rfc3339: Optional[str], now: Optional[_dt.datetime] = None) -> float:
    """Seconds from an RFC 3339 time (as the status keeps them) to now; +inf when absent or unreadable."""
    try:
        then = _parse_time(rfc3339)
    except (TypeError, ValueError, AttributeError):
        return float("inf")
    return ((now or _dt.datetime.now(_dt.timezone.utc)) - then).total_seconds()


def _parse_time(text: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


# ------------------------------------------------------------------------------------------------ load
def parse_load(payload: dict, cfg) -> np.ndarray:
    """The router's `/v1/load` body — {"moe_layers": [...], "tokens": {layer: [count per expert]}} — as
    float64 [n_moe_layers, E] in `cfg.moe_layers` order (layers it does not report count 0).
    Raises ValueError naming what is malformed."""
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not isinstance(tokens, dict):
        raise ValueError(f"load: expected an object with 'tokens' {{layer: [counts]}}, got {str(payload)[:80]!r}")
    E = cfg.moe.n_routed_experts
    out = np.zeros((cfg.n_moe_layers, E), dtype=np.float64)
    for i, layer in enumerate(cfg.moe_layers):
        row = tokens.get(str(layer), tokens.get(layer))
        if row is None:
            continue
        arr = np.asarray(row, dtype=np.float64)
        if arr.shape != (E,) or not np.isfinite(arr).all() or (arr < 0).any():
            raise ValueError(f"load: tokens[{layer}] must be {E} finite counts >= 0, got {str(row)[:80]}")
        out[i] = arr
    return out


@dataclass
class Rebalance:
    """The timer's verdict on observed load: `plan` is the new plan (None: keep the current one)."""
    observed: float                    # imbalance of the current plan under the observed load
    plan: Optional[PlacementPlan] = None
    expected: Optional[float] = None   # imbalance of the new plan under the same load
    moved: int = 0
    reason: str = ""


def rebalance(spec: MoEDeploymentSpec, cfg, plan: PlacementPlan, loads: np.ndarray) -> Rebalance:
    """Re-plan when the observed imbalance (the planner's max/mean per-GPU load, averaged over layers) exceeds
    `placement.imbalanceThreshold`. Tries the minimal-movement plan first (previous shards stay); if that does
    not get under the threshold, a fresh plan, taken only when it is better still."""
    threshold = spec.placement.imbalance_threshold
    if not np.asarray(loads).sum() > 0:
        return Rebalance(observed=1.0, reason="no load observed yet")
    current = imbalance(plan, loads).mean
    if current <= threshold:
        return Rebalance(observed=current, reason=f"imbalance {current:.3f} <= threshold {threshold}")
    shape = plan.cluster
    if shape.pods != spec.expert_workers.replicas:
        return Rebalance(observed=current, reason="the plan's pod count differs from the spec: left to reconcile")
    r = spec.expert_workers.redundant_experts
    best = plan_placement(cfg, shape, redundant_slots=r, loads=loads, previous=plan)
    if imbalance(best, loads).mean > threshold:
        best = choose(best, plan_placement(cfg, shape, redundant_slots=r, loads=loads), threshold, loads)
    best_imb = imbalance(best, loads).mean
    if best_imb >= current or best.plan_hash() == plan.plan_hash():
        return Rebalance(observed=current, reason=f"imbalance {current:.3f} > threshold {threshold}, "
                                                  f"but no plan does better")
    return Rebalance(observed=current, plan=best, expected=best_imb, moved=moved_shards(plan, best),
                     reason=f"imbalance {current:.3f} > threshold {threshold}: re-planned to {best_imb:.3f}")
