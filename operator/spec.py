"""The `MoEDeployment` custom resource (group `expertmesh.dev`, version `v1alpha1`) as pydantic models.

These models (with operator/spec_fields.py and operator/spec_model.py) are the single source of truth: the CRD's OpenAPI schema is generated from them
(`expertmesh.operator.crd`), the operator validates every spec with them, and the status it writes is
built from them. Field names are camelCase in YAML (aliases) and snake_case in Python.

    apiVersion: expertmesh.dev/v1alpha1
    kind: MoEDeployment
    metadata: {name: kimi}
    spec:
      model:
        preset: full-2.8t                      # or `config: {...}` (an inline ModelConfig)
        checkpoint: {pvc: {claimName: weights, path: /full}, format: expertmesh-mxfp4}
      expertWorkers: {replicas: 16, gpusPerPod: 8, gpuMemoryGiB: 141, reserveGiB: 24, redundantExperts: 32}
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from expertmesh.checkpoint.hf_config import HFCheckpointError, config_from_hf
from expertmesh.model.config import ModelConfig, preset
from expertmesh.operator.forecast import fill_autoscale_targets
from expertmesh.operator.spec_fields import (
    DEFAULT_EMPTY,
    AbsolutePath,
    DNSName,
    Endpoint,
    LabelValue,
    QualifiedName,
    QualifiedNameKey,
    Resources,
    SpecModel,
)
from expertmesh.operator.spec_model import (
    HF_MODEL_TYPES,
    MAX_EXPERTS,
    MAX_MODEL_LAYERS,
    ModelSpec,
    SecretKeyRef,
    config_size_error,
)
from expertmesh.operator.spec_platform import (
    DevicesSpec,
    DNSLabel,
    GatewaySpec,
    GroupRestarts,
    LeaderWorkerSetSpec,
    platform_errors,
)
from expertmesh.operator.spec_slo import PredictedStatus, SLOSpec
from expertmesh.operator.validation import (
    IMAGE_REPOSITORY,
    IMAGE_REPOSITORY_MAX,
    IMAGE_TAG,
)

GROUP = "expertmesh.dev"
VERSION = "v1alpha1"
KIND = "MoEDeployment"
PLURAL = "moedeployments"
SINGULAR = "moedeployment"
SHORT_NAMES = ("moe",)
API_VERSION = f"{GROUP}/{VERSION}"

GIB = 2**30
PRESETS = ("tiny", "small", "full-2.8t")
PHASES = ("Pending", "Planning", "Deploying", "Ready", "Degraded", "Failed")
CONDITION_TYPES = ("LicenseAccepted", "PlacementReady", "WeightsReady", "WorkersReady", "RouterReady", "Degraded")
CONDITION_TYPES += ("SLOAttainable",)  # issue #55: spec.slo against the forecast (operator/forecast.py)
CONDITION_TYPES += ("GroupRestartsBounded",)  # issue #56: a LeaderWorkerSet's restart loop bounded (lws_restarts.py)

# ---- bounds: every number, string, list and map of the spec has one (the CRD's schema carries them, so the API
# server refuses a spec past them; the operator checks them again for resources created before)
MAX_ROUTER_REPLICAS = 64
MAX_ATTENTION_REPLICAS = 512  # the router is given every worker's address in one argument (Linux: 128 KiB each)
MAX_PREFILL_REPLICAS = 512  # likewise (--prefill)
MAX_EXPERT_REPLICAS = 512
MAX_GPUS_PER_POD = 16
MAX_GPU_MEMORY_GIB = 4096
MAX_REDUNDANT_EXPERTS = 16384  # per MoE layer; the planner caps it further to E x (pods - 1) and to memory
MAX_CONTEXT = 2**24  # tokens
MAX_BLOCK_SIZE = 1024  # tokens per KV page
MAX_KV_TIER_GIB = 2**20  # a KV tier's bound (host memory or disk), GiB
MAX_THINKING = 2**24  # reasoning tokens
MAX_SECONDS = 7 * 24 * 3600  # intervals and grace periods
MAX_IMBALANCE = 1000.0
MAX_TOLERATION_SECONDS = 365 * 24 * 3600
MAX_NODE_SELECTOR = 32
MAX_TOLERATIONS = 32
MESSAGE_MAX = 32768  # a condition's message (metav1.Condition's bound)
MAX_INT64 = 2**63 - 1
MAX_AUTOSCALE_TARGET = 2**24  # an autoscaling target: tokens or requests waiting per pod (kv_utilization: at most 1)
MAX_SPECULATIVE_TOKENS = 8  # draft tokens a step (published K3 setups draft up to 7); a step verifies K+1 positions


# ------------------------------------------------------------------------------------------------ workloads
class RouterSpec(SpecModel):
    replicas: int = Field(1, ge=1, le=MAX_ROUTER_REPLICAS)
    resources: Resources = Field(default_factory=Resources, json_schema_extra=DEFAULT_EMPTY)
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(50051, ge=1, le=65535)
    api_key_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding the API key clients must present"
    )

    @model_validator(mode="after")
    def _ports(self) -> RouterSpec:
        if self.http_port == self.grpc_port:
            raise ValueError(f"router.httpPort and router.grpcPort must differ (both {self.http_port})")
        self.resources.check_gpus(0)
        return self


# the router's per-pool series (label pool="prefill"|"decode") an attention pool may be autoscaled on
POOL_METRICS = ("prefill_tokens_waiting", "requests_waiting", "kv_utilization")


class AutoscaleSpec(SpecModel):
    """A HorizontalPodAutoscaler (autoscaling/v2) on the pool's StatefulSet, driven by one of the router's per-pool
    metrics (an External metric served through the Prometheus adapter: docs/operator.md). `target`: for
    prefill_tokens_waiting and requests_waiting the pool's total per pod (the HPA's AverageValue: it keeps about
    `target` waiting per pod); for kv_utilization the pool's fraction of KV in use, 0..1 (the HPA's Value). While a
    pool is autoscaled the operator keeps the StatefulSet's replicas as the HPA sets them (minReplicas at first)."""

    min_replicas: int = Field(1, ge=1, le=MAX_ATTENTION_REPLICAS, description="the fewest pods (at least 1)")
    max_replicas: int = Field(ge=1, le=MAX_ATTENTION_REPLICAS, description="the most pods")
    metric: Literal["prefill_tokens_waiting", "requests_waiting", "kv_utilization"] = Field(
        "requests_waiting", description="the router's per-pool series: expertmesh_pool_<metric>{pool=...}"
    )
    target: float | None = Field(
        None,
        gt=0,
        le=MAX_AUTOSCALE_TARGET,
        description="per pod for prefill_tokens_waiting / requests_waiting; the pool's fraction "
        "(0..1] for kv_utilization; absent: derived from spec.slo's forecast (operator/forecast.py)",
    )

    @field_validator("max_replicas")
    @classmethod
    def _max_at_least_min(cls, v: int, info) -> int:
        low = info.data.get("min_replicas")
        if low is not None and v < low:
            raise ValueError(f"maxReplicas={v} must be at least minReplicas={low}")
        return v

    @field_validator("target")
    @classmethod
    def _fraction(cls, v: float | None, info) -> float | None:
        if v is not None and info.data.get("metric") == "kv_utilization" and v > 1:
            raise ValueError(f"target={v:g}: kv_utilization is a fraction, at most 1")
        return v


class AttentionWorkersSpec(SpecModel):
    """The attention workers: with no prefill pool they run prompts and decode alike (pool `mixed`); beside a prefill
    pool (spec.prefillWorkers) they are the decode pool (`--pool decode`)."""

    replicas: int = Field(1, ge=1, le=MAX_ATTENTION_REPLICAS, description="pods (with autoscale: the HPA's)")
    gpus_per_pod: int = Field(1, ge=0, le=MAX_GPUS_PER_POD, description="0 runs on CPU (tiny/small presets)")
    resources: Resources = Field(default_factory=Resources, json_schema_extra=DEFAULT_EMPTY)
    autoscale: AutoscaleSpec | None = Field(None, description="a HorizontalPodAutoscaler on this pool")

    @model_validator(mode="after")
    def _gpus(self) -> AttentionWorkersSpec:
        self.resources.check_gpus(self.gpus_per_pod)
        return self


class PrefillWorkersSpec(SpecModel):
    """The prefill pool (prefill/decode disaggregation): attention workers run with `--pool prefill`; they run the
    prompts and hand each sequence (KV and recurrent state) to a decode worker (the attention workers). The prefill
    pool holds the prefix cache and spec.kv's host and disk tiers. replicas 0 and no autoscale: no prefill pool."""

    replicas: int = Field(
        0, ge=0, le=MAX_PREFILL_REPLICAS, description="pods; 0: no prefill pool, the attention workers run prompts too"
    )
    gpus_per_pod: int = Field(1, ge=0, le=MAX_GPUS_PER_POD, description="0 runs on CPU (tiny/small presets)")
    resources: Resources = Field(default_factory=Resources, json_schema_extra=DEFAULT_EMPTY)
    autoscale: AutoscaleSpec | None = Field(
        None, description="a HorizontalPodAutoscaler on this pool (a prefill pool of minReplicas..maxReplicas pods)"
    )
    min_prompt_tokens: int = Field(
        0,
        ge=0,
        le=MAX_CONTEXT,
        description="prompts shorter than this skip the prefill pool (a decode worker runs "
        "them; the router's --prefill-min-tokens); 0: every prompt goes there",
    )

    @model_validator(mode="after")
    def _gpus(self) -> PrefillWorkersSpec:
        self.resources.check_gpus(self.gpus_per_pod)
        return self

    @property
    def enabled(self) -> bool:
        """A prefill pool exists (replicas >= 1, or autoscaled: at least minReplicas >= 1)."""
        return self.replicas >= 1 or self.autoscale is not None


class ExpertWorkersSpec(SpecModel):
    replicas: int = Field(
        2, ge=1, le=MAX_EXPERT_REPLICAS, description="expert worker pods (StatefulSet ordinals 0..replicas-1)"
    )
    gpus_per_pod: int = Field(1, ge=0, le=MAX_GPUS_PER_POD, description="0 runs on CPU; planned as one device per pod")
    gpu_memory_gib: float = Field(
        80.0, gt=0, le=MAX_GPU_MEMORY_GIB, alias="gpuMemoryGiB", description="memory of one device, GiB"
    )
    reserve_gib: float = Field(
        8.0,
        ge=0,
        le=MAX_GPU_MEMORY_GIB,
        alias="reserveGiB",
        description="per-device memory kept free for activations and buffers, GiB",
    )
    redundant_experts: int = Field(
        0, ge=0, le=MAX_REDUNDANT_EXPERTS, description="extra physical replicas of hot experts, per MoE layer"
    )
    resources: Resources = Field(default_factory=Resources, json_schema_extra=DEFAULT_EMPTY)

    @model_validator(mode="after")
    def _reserve(self) -> ExpertWorkersSpec:
        if self.reserve_gib >= self.gpu_memory_gib:
            raise ValueError(
                f"expertWorkers.reserveGiB={self.reserve_gib} must be below "
                f"expertWorkers.gpuMemoryGiB={self.gpu_memory_gib}"
            )
        self.resources.check_gpus(self.gpus_per_pod)
        return self

    @property
    def devices_per_pod(self) -> int:
        return max(1, self.gpus_per_pod)


class PlacementSpec(SpecModel):
    strategy: Literal["eplb"] = "eplb"
    rebalance_interval_seconds: int = Field(
        300, ge=1, le=MAX_SECONDS, description="how often the router's expert load is read"
    )
    imbalance_threshold: float = Field(
        1.25, ge=1.0, le=MAX_IMBALANCE, description="re-plan when max/mean GPU load under observed traffic exceeds this"
    )
    replan_grace_seconds: int = Field(
        120,
        ge=0,
        le=MAX_SECONDS,
        description="how long expert pods may be lost before their experts are re-planned onto the survivors",
    )


class KVDiskPVC(SpecModel):
    storage_class_name: DNSName | None = Field(None, description="the claims' storage class (default: the cluster's)")


class KVDiskSpec(SpecModel):
    """Each attention worker's disk tier (below its host tier): a volume of its own, `sizeGiB` the tier's bound.
    On an emptyDir (default) it survives a worker's restart inside its pod; on a PVC (one claim per pod) or a node
    directory (hostPath, e.g. local NVMe) it survives the pod too — files are checked before reuse."""

    size_gib: float = Field(gt=0, le=MAX_KV_TIER_GIB, alias="sizeGiB", description="the tier's bound, GiB")
    pvc: KVDiskPVC | None = Field(
        None, description="a PersistentVolumeClaim per attention pod (volumeClaimTemplates) of sizeGiB"
    )
    host_path: AbsolutePath | None = Field(None, description="a node directory (hostPath) instead of a volume")

    @model_validator(mode="after")
    def _one_volume(self) -> KVDiskSpec:
        if self.pvc is not None and self.host_path is not None:
            raise ValueError("kv.disk: give pvc or hostPath, not both (neither: an emptyDir)")
        return self


class KVSpec(SpecModel):
    max_context: int | None = Field(None, ge=1, le=MAX_CONTEXT, description="tokens; default: the model's max_context")
    block_size: int = Field(16, ge=1, le=MAX_BLOCK_SIZE, description="tokens per KV page")
    host_gib: float = Field(
        0.0,
        ge=0,
        le=MAX_KV_TIER_GIB,
        alias="hostGiB",
        description="each attention worker's host-memory tier for prefixes demoted off the "
        "device, GiB (added to its memory request and limit); 0: none",
    )
    disk: KVDiskSpec | None = Field(None, description="each attention worker's disk tier below the host tier")
    store: Literal["mooncake"] | None = Field(
        None,
        description="a cluster KV tier below disk that every attention worker shares: Mooncake's store (its master "
        "and store process as a Deployment + Service of their own, operator/kv_store.py); any worker restores a "
        "prefix another saved; absent: none",
    )
    store_gib: float = Field(
        4.0, gt=0, le=MAX_KV_TIER_GIB, alias="storeGiB", description="the cluster store's memory, GiB (with store)"
    )


class ThinkingSpec(SpecModel):
    """Reasoning-token limits per thinking tier; overrides the model's defaults."""

    low: int = Field(gt=0, le=MAX_THINKING)
    high: int = Field(gt=0, le=MAX_THINKING)
    max: int = Field(gt=0, le=MAX_THINKING)

    @model_validator(mode="after")
    def _order(self) -> ThinkingSpec:
        if not self.low <= self.high <= self.max:
            raise ValueError(
                f"thinking limits must satisfy low <= high <= max, got low={self.low} high={self.high} max={self.max}"
            )
        return self


class TelemetrySpec(SpecModel):
    otlp_endpoint: Endpoint | None = Field(None, description="e.g. http://otel-collector:4317")
    protocol: Literal["grpc", "http/protobuf"] = "grpc"


class ImageSpec(SpecModel):
    repository: str = Field(
        "ghcr.io/expertmesh/expertmesh", min_length=1, max_length=IMAGE_REPOSITORY_MAX, pattern=IMAGE_REPOSITORY
    )
    tag: str = Field("0.1.0", min_length=1, max_length=128, pattern=IMAGE_TAG)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


class Toleration(SpecModel):
    """A pod toleration, with the API server's rules: `Exists` takes no value, an empty key needs `Exists`,
    `tolerationSeconds` only with the NoExecute effect."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
                    "message": "tolerationSeconds needs effect NoExecute",
                },
                {
                    "rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
                    "message": "operator Exists takes no value",
                },
                {
                    "rule": "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
                    "message": "an empty key needs operator Exists",
                },
            ]
        }
    )
    key: QualifiedName | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0, le=MAX_TOLERATION_SECONDS)

    @model_validator(mode="after")
    def _rules(self) -> Toleration:
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(f"tolerationSeconds needs effect NoExecute (effect is {self.effect!r})")
        if self.operator == "Exists" and self.value:
            raise ValueError(f"operator Exists takes no value (value is {self.value[:80]!r})")
        if not self.key and self.operator != "Exists":
            raise ValueError("an empty key needs operator Exists (it tolerates every taint)")
        return self


class SchedulingSpec(SpecModel):
    node_selector: dict[QualifiedNameKey, LabelValue] = Field(default_factory=dict, max_length=MAX_NODE_SELECTOR)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_TOLERATIONS)
    topology_spread_key: QualifiedName | None = Field(
        None, description="spread worker pods over this node label, e.g. kubernetes.io/hostname"
    )


class SecuritySpec(SpecModel):
    worker_tls: bool = Field(
        True,
        description="mutual TLS on every worker RPC with per-deployment certificates the operator issues "
        "(Secret <name>-worker-tls); false for clusters whose service mesh already does mTLS",
    )


class SpeculativeSpec(SpecModel):
    """Speculative decoding: a drafter proposes `tokens` tokens a step and the model verifies them (and the newest
    token) in one step; greedy texts are the same as without it. Rendered as `--speculative-method M
    --speculative-tokens K` on the router and every attention worker (pod_commands.py)."""

    method: Literal["mtp", "ngram"] = Field(
        description="mtp: the model's own multi-token-prediction layers draft (the model must have one: "
        "num_nextn_predict_layers / n_mtp_layers); ngram: prompt lookup in the sequence's own tokens, no weights"
    )
    tokens: int = Field(
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        strict=True,  # an integer, as the CRD's schema says: not true, not "3"
        description="K, draft tokens a step (each running sequence's KV holds K more positions)",
    )


class MoEDeploymentSpec(SpecModel):
    model: ModelSpec
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra=DEFAULT_EMPTY)
    attention_workers: AttentionWorkersSpec = Field(
        default_factory=AttentionWorkersSpec, json_schema_extra=DEFAULT_EMPTY
    )
    prefill_workers: PrefillWorkersSpec = Field(default_factory=PrefillWorkersSpec, json_schema_extra=DEFAULT_EMPTY)
    expert_workers: ExpertWorkersSpec = Field(default_factory=ExpertWorkersSpec, json_schema_extra=DEFAULT_EMPTY)
    placement: PlacementSpec = Field(default_factory=PlacementSpec, json_schema_extra=DEFAULT_EMPTY)
    kv: KVSpec = Field(default_factory=KVSpec, json_schema_extra=DEFAULT_EMPTY)
    thinking: ThinkingSpec | None = None
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec, json_schema_extra=DEFAULT_EMPTY)
    image: ImageSpec = Field(default_factory=ImageSpec, json_schema_extra=DEFAULT_EMPTY)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, json_schema_extra=DEFAULT_EMPTY)
    security: SecuritySpec = Field(default_factory=SecuritySpec, json_schema_extra=DEFAULT_EMPTY)
    speculative: SpeculativeSpec | None = Field(
        None, description="speculative decoding on the router and every attention worker; absent: off"
    )
    transport: Literal["grpc", "collective"] = Field(
        "grpc",
        description="how attention workers exchange each MoE layer with the expert workers: grpc, or "
        "collective (point-to-point pairs: NCCL on GPUs, TCP on CPU; gRPC stays for "
        "control, health and fallback)",
    )
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, json_schema_extra=DEFAULT_EMPTY)
    workload: Literal["statefulset", "leaderworkerset"] = Field(
        "statefulset",
        description="the workers' workload kind: statefulset, or leaderworkerset (LeaderWorkerSet groups, "
        "leaderworkerset.x-k8s.io/v1: the LWS controller must be installed)",
    )
    leader_worker_set: LeaderWorkerSetSpec | None = Field(
        None, alias="leaderWorkerSet", description="the LeaderWorkerSets' startup and restart policies"
    )
    queue_name: DNSLabel | None = Field(
        None, description="a Kueue LocalQueue: label kueue.x-k8s.io/queue-name on every workload"
    )
    devices: DevicesSpec | None = Field(
        None, description="GPUs through DRA ResourceClaimTemplates (and a ComputeDomain) instead of nvidia.com/gpu"
    )

    slo: SLOSpec | None = Field(
        None, description="latency to meet on a GPU type: status.predicted, condition SLOAttainable, HPA targets"
    )

    @model_validator(mode="after")
    def _platform(self) -> MoEDeploymentSpec:
        problems = platform_errors(self) + slo_target_errors(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def to_yaml_dict(self) -> dict:
        """The spec as it reads in YAML: camelCase, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True)


# ------------------------------------------------------------------------------------------------ status
class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


Time = Annotated[str, Field(max_length=64, description="RFC 3339")]
Count = Annotated[int, Field(ge=0, le=1_000_000)]
Ratio = Annotated[float, Field(le=MAX_IMBALANCE * 1000)]
Hash = Annotated[str, Field(max_length=64)]


class Condition(_Status):
    type: Literal[CONDITION_TYPES]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(
        max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", description="CamelCase, machine-readable"
    )
    message: str = Field("", max_length=MESSAGE_MAX)
    last_transition_time: Time = Field(description="RFC 3339; changes only when status flips")
    observed_generation: int | None = Field(None, ge=0, le=MAX_INT64)


class PlacementStatus(_Status):
    logical_experts: Count
    physical_experts: Count
    imbalance: Ratio = Field(description="expected max/mean per-GPU load under the loads the plan was made with")
    bytes_per_gpu: int = Field(ge=0, le=MAX_INT64, description="the largest per-GPU expert bytes of the plan")
    plan_hash: Hash
    moved_shards: Count = 0
    lost_workers: list[Annotated[int, Field(ge=0, le=MAX_EXPERT_REPLICAS)]] = Field(
        default_factory=list, max_length=MAX_EXPERT_REPLICAS, description="expert ordinals the plan routes around"
    )
    observed_imbalance: Ratio | None = Field(
        None, description="imbalance of the plan under the router's last observed load"
    )


class ScaleStatus(_Status):
    """The expert StatefulSet as the scale subresource reports it."""

    replicas: int = Field(ge=0, le=MAX_EXPERT_REPLICAS, description="desired expert worker pods")
    ready: Count
    selector: str = Field(max_length=1024, description="label selector of the expert pods (for autoscalers)")


class WorkerCounts(_Status):
    ready: Count
    desired: Count


class LostWorker(_Status):
    ordinal: int = Field(ge=0, le=MAX_EXPERT_REPLICAS)
    since: Time = Field(description="RFC 3339: when the operator first saw this expert pod lost")


class Endpoints(_Status):
    http: str = Field(max_length=512)
    grpc: str = Field(max_length=512)


class MoEDeploymentStatus(_Status):
    phase: Literal["Pending", "Planning", "Deploying", "Ready", "Degraded", "Failed"] | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    observed_generation: int | None = Field(None, ge=0, le=MAX_INT64)
    revision: Hash | None = Field(None, description="hash of the children last applied (changes roll pods)")
    placement: PlacementStatus | None = None
    ready_workers: Count | None = None
    desired_workers: Count | None = None
    expert_workers: ScaleStatus | None = None
    attention_workers: WorkerCounts | None = None
    prefill_workers: WorkerCounts | None = Field(None, description="the prefill pool's pods (absent without one)")
    router: WorkerCounts | None = None
    endpoints: Endpoints | None = None
    lost_since: list[LostWorker] = Field(default_factory=list, max_length=MAX_EXPERT_REPLICAS)
    last_rebalance_time: Time | None = None
    message: str | None = Field(None, max_length=MESSAGE_MAX, description="why the phase is what it is, when not Ready")
    predicted: PredictedStatus | None = Field(None, description="the forecast of spec.slo's layout (absent without)")
    group_restarts: list[GroupRestarts] = Field(
        default_factory=list, max_length=1024, description="LeaderWorkerSet groups' recreations (lws_restarts.py)"
    )


# ------------------------------------------------------------------------------------------------ helpers
class SpecError(ValueError):
    """A spec that cannot be deployed as written; the message names the field(s), `reason` is the condition's."""

    reason = "InvalidSpec"


class NoMTPLayers(SpecError):
    """`speculative.method: mtp` for a model without a multi-token-prediction layer to draft with."""

    reason = "NoMTPLayers"


def format_validation_error(err: ValidationError, root: str = "spec", limit: int = 20) -> str:
    """One line per problem (the first `limit`), each naming the camelCase field path:
    `spec.expertWorkers.replicas: ...`; the offending value quoted, cut to 80 characters."""
    lines = []
    errors = err.errors()
    for e in errors[:limit]:
        loc = ".".join([root, *(str(p) for p in e["loc"])])
        msg = e["msg"].removeprefix("Value error, ")
        got = (
            f" (got {_short(e['input'])})"
            if e["type"] not in ("missing", "value_error") and not isinstance(e.get("input"), dict)
            else ""
        )
        lines.append(msg if not e["loc"] and msg.startswith(f"{root}.") else f"{loc}: {msg}{got}")
    if len(errors) > limit:
        lines.append(f"and {len(errors) - limit} more")
    return "; ".join(lines)


def _short(value, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width] + "..."


def parse_spec(spec: dict) -> MoEDeploymentSpec:
    """Validate a resource's `.spec` (a plain dict, camelCase). Raises SpecError naming the bad fields."""
    try:
        return MoEDeploymentSpec.model_validate(dict(spec or {}))
    except ValidationError as e:
        raise SpecError(format_validation_error(e)) from None


def resolve_model(spec: MoEDeploymentSpec):
    """The `ModelConfig` a spec names (preset or inline), with its thinking/context overrides checked; an inline
    config is bounded (layers, experts, context) before and after it is built. Raises SpecError naming the field."""
    if spec.model.preset is not None:
        cfg = preset(spec.model.preset)
    else:
        too_big = config_size_error(spec.model.config)
        if too_big:
            raise SpecError(too_big)
        try:
            if spec.model.config.get("model_type") in HF_MODEL_TYPES:
                cfg = config_from_hf(spec.model.config, set(), name=str(spec.model.config.get("name", "model")))
            else:
                cfg = ModelConfig.model_validate(spec.model.config)
        except HFCheckpointError as e:
            raise SpecError(f"spec.model.config: {str(e).removeprefix('config.json: ')}") from None
        except ValidationError as e:
            raise SpecError(format_validation_error(e, root="spec.model.config")) from None
        except Exception as e:  # a value of the wrong kind deep in a user's config: still the config's fault
            raise SpecError(f"spec.model.config: {type(e).__name__}: {str(e)[:200]}") from None
        if len(cfg.layer_types) > MAX_MODEL_LAYERS or cfg.moe.n_routed_experts > MAX_EXPERTS:
            raise SpecError(
                f"spec.model.config: {len(cfg.layer_types)} layers x {cfg.moe.n_routed_experts} experts; "
                f"at most {MAX_MODEL_LAYERS} layers and {MAX_EXPERTS} experts per layer"
            )
    if spec.kv.max_context is not None and spec.kv.max_context > cfg.max_context:
        raise SpecError(f"spec.kv.maxContext={spec.kv.max_context} exceeds the model's max_context={cfg.max_context}")
    if spec.kv.max_context is None and cfg.max_context > MAX_CONTEXT:
        raise SpecError(
            f"spec.model.config.max_context={cfg.max_context} exceeds {MAX_CONTEXT}: set spec.kv.maxContext"
        )
    check_speculation(spec, cfg)
    return cfg  # spec.thinking is serving policy: the router's --thinking-budgets (children.py)


def slo_target_errors(spec: MoEDeploymentSpec) -> list[str]:
    """Autoscaled pools without a target get spec.slo's forecast's (operator/forecast.py); without an SLO (or when
    the forecast refuses the layout) each is named as missing. A model that does not resolve is left to
    resolve_model's error."""
    pools = (spec.attention_workers.autoscale, spec.prefill_workers.autoscale)
    if all(a is None or a.target is not None for a in pools):
        return []
    try:
        cfg = resolve_model(spec)
    except SpecError:
        return []
    return fill_autoscale_targets(spec, cfg)


def check_speculation(spec: MoEDeploymentSpec, cfg) -> None:
    """`speculative.method: mtp` needs an MTP layer in the model the spec names (its preset, or its inline config's
    n_mtp_layers / num_nextn_predict_layers): NoMTPLayers naming the field, the model and the checkpoint. The
    operator never reads the checkpoint itself (it is on a volume or fetched by the pods): a config that claims an
    MTP layer the checkpoint lacks is refused by the worker at start, naming --speculative-method."""
    s = spec.speculative
    if s is None or s.method != "mtp" or cfg.n_mtp_layers > 0:
        return
    m = spec.model
    model = f"preset {m.preset!r}" if m.preset is not None else f"spec.model.config ({cfg.name!r})"
    ckpt = (
        m.checkpoint.uri if m.checkpoint.pvc is None else f"pvc {m.checkpoint.pvc.claim_name}:{m.checkpoint.pvc.path}"
    )
    raise NoMTPLayers(
        f"spec.speculative.method=mtp: the model ({model}, checkpoint {ckpt}) has no MTP layer "
        f"(n_mtp_layers / num_nextn_predict_layers is 0): use method ngram, which needs no weights, or a model "
        f"whose config has MTP layers"
    )
