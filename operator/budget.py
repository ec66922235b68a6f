"""What the operator agrees to compute and send for one MoEDeployment. Pure: a spec and its model in, a verdict out.

Before planning, `check_plan_budget` estimates the planner's work, memory and the smallest plan.json the shape can
have, and refuses a shape past them naming its fields — nothing is computed for it. After the children are built,
`check_children` refuses any the Kubernetes API would not take (an object over 1 MiB, a ConfigMap's data over
1 MiB, a container argument over Linux's 128 KiB), naming the spec fields it grows with — nothing is sent. Planning
itself runs in planning.PlanRunner, under a deadline and a memory limit.

The estimates follow expertmesh.placement.planner.plan_placement (L MoE layers, E experts, P pods, G devices per pod,
N = P·G devices, r redundant slots per layer after its caps, K = min(P-1, r)):
  - replica_counts: an [L, E, K] float64 quotient table and its argsort (16·L·E·K bytes);
  - _pack: pod_has [L, E, P] bools, loads / rotations / candidate masks over [L, N] (~64·L·N bytes), and one
    pass over N devices per shard placed (work L·(E + r)·N);
  - the plan: ~400 bytes per shard (index arrays, Python tuples, the pydantic objects, its JSON).
Measured (tracemalloc peak) they over-estimate by 1.3-3x: full-2.8t on 16 pods x 8 GPUs with 32 redundant experts is
estimated at 56 MiB and peaks at 30 MiB in about 2 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from expertmesh.operator.spec import MoEDeploymentSpec, SpecError

MIB = 2**20
PLAN_MEMORY_BUDGET = 256 * MIB  # the planner's estimated working set
PLAN_WORK_BUDGET = 150_000_000  # the planner's estimated device passes (shards placed x devices)
CONFIGMAP_DATA_MAX = 1 * MIB  # the API server's limit on a ConfigMap's data
OBJECT_MAX = 1 * MIB  # what the operator sends in one object (etcd takes 1.5 MiB with its envelope)
ARG_MAX = 128 * 1024  # Linux's MAX_ARG_STRLEN: one command-line argument of a container

_GPU_SKELETON = len('{"gpu":0,"shards":[],"bytes":0},')
_WORKER_SKELETON = len('{"ordinal":0,"gpus":[]},')


class BudgetError(SpecError):
    """A spec the operator will not plan or send: past its budget or the API's limits; the message names the
    fields."""


@dataclass(frozen=True)
class PlanEstimate:
    layers: int
    experts: int
    pods: int
    devices: int
    redundant: int  # per layer, after the planner's cap of one replica per pod
    shards: int  # physical experts at most
    work: int  # device passes
    memory: int  # bytes
    plan_json_min: int  # bytes: plan.json is at least this long (every expert once, every device listed)


def _digits(n: int) -> int:
    return len(str(n))


def estimate(cfg, pods: int, gpus_per_pod: int, redundant: int) -> PlanEstimate:
    """The planner's cost for `cfg` on `pods` x `gpus_per_pod` devices with `redundant` slots per layer."""
    layers, E = list(cfg.moe_layers), cfg.moe.n_routed_experts
    L, N = len(layers), pods * gpus_per_pod
    r = min(redundant, E * (pods - 1))
    K = min(pods - 1, r)
    shards = L * (E + r)
    memory = 16 * L * E * K + L * E * pods + 64 * L * N + 400 * shards
    expert_digits = sum(_digits(e) for e in range(E))
    first_copies = L * E * 4 + E * sum(_digits(layer) for layer in layers) + L * expert_digits
    json_min = first_copies + N * _GPU_SKELETON + pods * _WORKER_SKELETON
    return PlanEstimate(
        layers=L,
        experts=E,
        pods=pods,
        devices=N,
        redundant=r,
        shards=shards,
        work=shards * N,
        memory=memory,
        plan_json_min=json_min,
    )


def _shape(spec: MoEDeploymentSpec) -> str:
    ew = spec.expert_workers
    return (
        f"spec.expertWorkers.replicas={ew.replicas} x gpusPerPod={ew.gpus_per_pod}, "
        f"spec.expertWorkers.redundantExperts={ew.redundant_experts}"
    )


def check_plan_budget(
    spec: MoEDeploymentSpec, cfg, *, memory: int = PLAN_MEMORY_BUDGET, work: int = PLAN_WORK_BUDGET
) -> PlanEstimate:
    """The estimate for a spec, or BudgetError naming the fields when planning it would take more than the
    operator's budget or its plan could not fit the plan ConfigMap."""
    ew = spec.expert_workers
    est = estimate(cfg, ew.replicas, ew.devices_per_pod, ew.redundant_experts)
    what = (
        f"{est.layers} MoE layers x {est.experts} experts (+{est.redundant} redundant) over {est.pods} pods x "
        f"{ew.devices_per_pod} devices"
    )
    config_json = len(cfg.model_dump_json(indent=1))
    if est.plan_json_min + config_json > CONFIGMAP_DATA_MAX:
        raise BudgetError(
            f"{_shape(spec)}: the plan of {what} needs at least {est.plan_json_min / MIB:.2f} MiB of "
            f"plan.json, over the API's {CONFIGMAP_DATA_MAX // MIB} MiB limit for the plan ConfigMap: "
            f"fewer expert pods or devices per pod"
        )
    if est.memory > memory or est.work > work:
        raise BudgetError(
            f"{_shape(spec)}: planning {what} would take about {est.memory / MIB:,.0f} MiB and "
            f"{est.work:.2g} device passes, over the operator's budget ({memory / MIB:,.0f} MiB, "
            f"{work:.2g}): fewer redundantExperts, expert pods or devices per pod"
        )
    return est


# ------------------------------------------------------------------------------------------------ children
def _fields(child: dict) -> str:
    """The spec fields a child's size grows with."""
    kind, name = child.get("kind"), (child.get("metadata") or {}).get("name", "")
    if kind == "ConfigMap" and name.endswith("-plan"):
        return "spec.expertWorkers (replicas x gpusPerPod, redundantExperts) and spec.model (MoE layers x experts)"
    if kind == "ConfigMap":
        return "spec.model (MoE layers x experts)"
    if kind == "Deployment":
        return (
            "spec.attentionWorkers.replicas, spec.prefillWorkers.replicas and spec.expertWorkers.replicas (the "
            "router is given every address)"
        )
    return "spec.scheduling, spec.*.resources and spec.model.checkpoint"


def _args(child: dict) -> Iterable[tuple[str, str]]:
    pod = ((child.get("spec") or {}).get("template") or {}).get("spec") or {}
    for c in (pod.get("initContainers") or []) + (pod.get("containers") or []):
        for arg in (c.get("command") or []) + (c.get("args") or []):
            yield c.get("name", "?"), arg


def child_size_error(child: dict) -> str | None:
    kind, name = child.get("kind"), (child.get("metadata") or {}).get("name", "")
    size = len(json.dumps(child, separators=(",", ":")).encode())
    if kind == "ConfigMap":
        data = sum(len(k.encode()) + len(str(v).encode()) for k, v in (child.get("data") or {}).items())
        if data > CONFIGMAP_DATA_MAX:
            return (
                f"{_fields(child)}: the ConfigMap {name} would hold {data / MIB:.2f} MiB of data, over the "
                f"API's {CONFIGMAP_DATA_MAX // MIB} MiB limit"
            )
    if size > OBJECT_MAX:
        return (
            f"{_fields(child)}: the {kind} {name} would be {size / MIB:.2f} MiB, over the "
            f"{OBJECT_MAX // MIB} MiB the API takes in one object"
        )
    for container, arg in _args(child):
        if len(arg.encode()) > ARG_MAX:
            return (
                f"{_fields(child)}: an argument of the {kind} {name}'s container {container} would be "
                f"{len(arg.encode()) // 1024} KiB, over Linux's {ARG_MAX // 1024} KiB for one argument"
            )
    return None


def check_children(children: list[dict]) -> None:
    """BudgetError naming the fields when a child could not be sent to the API (or run) as built."""
    for child in children:
        err = child_size_error(child)
        if err:
            raise BudgetError(err)
