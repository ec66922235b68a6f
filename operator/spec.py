"""The `MoEDeployment` custom resource (group `expertmesh.dev`, version `v1alpha1`) as pydantic models.

These models are the single source of truth: the CRD's OpenAPI schema is generated from them
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

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from expertmesh.config import ModelConfig, ThinkingBudgets, preset
from expertmesh.hf_config import HFCheckpointError, config_from_hf

GROUP = "expertmesh.dev"
VERSION = "v1alpha1"
KIND = "MoEDeployment"
PLURAL = "moedeployments"
SINGULAR = "moedeployment"
SHORT_NAMES = ("moe",)
API_VERSION = f"{GROUP}/{VERSION}"

GIB = 2 ** 30
PRESETS = ("tiny", "small", "full-2.8t")
PHASES = ("Pending", "Planning", "Deploying", "Ready", "Degraded", "Failed")
CONDITION_TYPES = ("PlacementReady", "WeightsReady", "WorkersReady", "RouterReady", "Degraded")

# Applied to nested objects with all-default fields so the API server fills their defaults in even when the
# user leaves the whole object out (Kubernetes only defaults fields whose parent object exists).
_DEFAULT_EMPTY = {"default": {}}


class _Spec(BaseModel):
    """camelCase in YAML, unknown fields rejected (a typo is an error, not silently ignored)."""
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


IntOrString = Union[int, str]  # a Kubernetes quantity ("500m", "16Gi", 2); becomes x-kubernetes-int-or-string


class Resources(_Spec):
    """Container resources (the `resources` of a Kubernetes container, without `claims`)."""
    limits: dict[str, IntOrString] = Field(default_factory=dict)
    requests: dict[str, IntOrString] = Field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ model
class PVCSource(_Spec):
    claim_name: str = Field(min_length=1, description="PersistentVolumeClaim holding the checkpoint")
    path: str = Field("/", description="checkpoint directory inside the volume")
    read_only: bool = True


class SecretKeyRef(_Spec):
    name: str = Field(min_length=1)
    key: str = Field(min_length=1)


class CheckpointCache(_Spec):
    """Where fetched checkpoints are kept: a directory on each node (pods on one node fetch once and share it),
    or a PersistentVolumeClaim (ReadWriteMany: one fetch for the whole cluster)."""
    host_path: str = Field("/var/cache/expertmesh", min_length=1, description="node directory (hostPath)")
    claim_name: Optional[str] = Field(None, min_length=1, description="a PVC to use instead of the hostPath")


FETCHED_SCHEMES = ("http://", "https://", "hf://", "s3://")


class CheckpointSource(_Spec):
    """Where the checkpoint lives: a PVC mounted into every pod, a path inside the image, or a remote source
    (http(s)://BASE or s3://BUCKET/PREFIX with an expertmesh-index.json, hf://ORG/NAME[@REVISION]) that an init
    container fetches into the cache volume, verifying every file's size and sha256."""
    pvc: Optional[PVCSource] = None
    uri: Optional[str] = Field(None, min_length=1, description="http(s)://…, hf://ORG/NAME[@REVISION], "
                                                               "s3://BUCKET/PREFIX, or a path inside the image")
    cache: CheckpointCache = Field(default_factory=CheckpointCache, json_schema_extra=_DEFAULT_EMPTY)
    token_secret_ref: Optional[SecretKeyRef] = Field(
        None, description="Secret key with a bearer token for the source (HF_TOKEN for hf://)")
    endpoint: Optional[str] = Field(None, min_length=1, description="s3://: an S3-compatible endpoint URL "
                                                                    "(default: AWS's, in region)")
    region: Optional[str] = Field(None, min_length=1, description="s3://: the signing region (default us-east-1)")
    credentials_secret: Optional[str] = Field(
        None, min_length=1, description="s3://: a Secret whose keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and "
                                        "AWS_SESSION_TOKEN) become the fetch container's environment")
    format: Literal["expertmesh-mxfp4"] = "expertmesh-mxfp4"

    @model_validator(mode="after")
    def _one_source(self) -> "CheckpointSource":
        if (self.pvc is None) == (self.uri is None):
            raise ValueError("set exactly one of model.checkpoint.pvc and model.checkpoint.uri")
        if self.uri is not None and "://" in self.uri and not self.uri.startswith(FETCHED_SCHEMES):
            raise ValueError(f"uri {self.uri!r}: supported sources are http://, https://, "
                             f"hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX and paths inside the image")
        if self.uri is not None and self.uri.startswith("hf://"):
            repo = self.uri[5:].partition("@")[0]
            if repo.count("/") != 1 or not all(repo.split("/")):
                raise ValueError(f"uri {self.uri!r}: expected hf://ORG/NAME[@REVISION]")
        if self.uri is not None and self.uri.startswith("s3://") and not self.uri[5:].split("/")[0]:
            raise ValueError(f"uri {self.uri!r}: expected s3://BUCKET/PREFIX")
        s3_only = [f for f in ("endpoint", "region", "credentials_secret") if getattr(self, f) is not None]
        if s3_only and not (self.uri or "").startswith("s3://"):
            raise ValueError(f"{', '.join(s3_only)}: only for an s3:// uri")
        return self

    @property
    def fetched(self) -> bool:
        """A remote source (fetched by the pods' init container) rather than a mounted or baked-in path."""
        return self.uri is not None and self.uri.startswith(FETCHED_SCHEMES)


class ModelSpec(_Spec):
    preset: Optional[Literal["tiny", "small", "full-2.8t"]] = Field(
        None, description="a built-in model preset; exclusive with config")
    config: Optional[dict[str, Any]] = Field(
        None, description="an inline model config, as in a checkpoint's config.json: an expertmesh ModelConfig or "
                          "a Hugging Face kimi_linear / deepseek_v32 config; exclusive with preset")
    checkpoint: CheckpointSource

    @model_validator(mode="after")
    def _one_model(self) -> "ModelSpec":
        if (self.preset is None) == (self.config is None):
            raise ValueError("set exactly one of model.preset and model.config")
        return self


# ------------------------------------------------------------------------------------------------ workloads
class RouterSpec(_Spec):
    replicas: int = Field(1, ge=1)
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_DEFAULT_EMPTY)
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(50051, ge=1, le=65535)
    api_key_secret_ref: Optional[SecretKeyRef] = Field(
        None, description="Secret key holding the API key clients must present")

    @model_validator(mode="after")
    def _ports(self) -> "RouterSpec":
        if self.http_port == self.grpc_port:
            raise ValueError(f"router.httpPort and router.grpcPort must differ (both {self.http_port})")
        return self


class AttentionWorkersSpec(_Spec):
    replicas: int = Field(1, ge=1)
    gpus_per_pod: int = Field(1, ge=0, description="0 runs on CPU (tiny/small presets)")
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_DEFAULT_EMPTY)


class ExpertWorkersSpec(_Spec):
    replicas: int = Field(2, ge=1, description="expert worker pods (StatefulSet ordinals 0..replicas-1)")
    gpus_per_pod: int = Field(1, ge=0, description="0 runs on CPU; planned as one device per pod")
    gpu_memory_gib: float = Field(80.0, gt=0, alias="gpuMemoryGiB", description="memory of one device, GiB")
    reserve_gib: float = Field(8.0, ge=0, alias="reserveGiB",
                               description="per-device memory kept free for activations and buffers, GiB")
    redundant_experts: int = Field(0, ge=0, description="extra physical replicas of hot experts, per MoE layer")
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_DEFAULT_EMPTY)

    @model_validator(mode="after")
    def _reserve(self) -> "ExpertWorkersSpec":
        if self.reserve_gib >= self.gpu_memory_gib:
            raise ValueError(f"expertWorkers.reserveGiB={self.reserve_gib} must be below "
                             f"expertWorkers.gpuMemoryGiB={self.gpu_memory_gib}")
        return self

    @property
    def devices_per_pod(self) -> int:
        return max(1, self.gpus_per_pod)


class PlacementSpec(_Spec):
    strategy: Literal["eplb"] = "eplb"
    rebalance_interval_seconds: int = Field(300, ge=1, description="how often the router's expert load is read")
    imbalance_threshold: float = Field(1.25, ge=1.0,
                                       description="re-plan when max/mean GPU load under observed traffic exceeds this")
    replan_grace_seconds: int = Field(120, ge=0, description="how long expert pods may be lost before their "
                                                             "experts are re-planned onto the survivors")


class KVSpec(_Spec):
    max_context: Optional[int] = Field(None, ge=1, description="tokens; default: the model's max_context")
    block_size: int = Field(16, ge=1, description="tokens per KV page")


class ThinkingSpec(_Spec):
    """Reasoning-token limits per thinking tier; overrides the model's defaults."""
    low: int = Field(gt=0)
    high: int = Field(gt=0)
    max: int = Field(gt=0)

    @model_validator(mode="after")
    def _order(self) -> "ThinkingSpec":
        if not self.low <= self.high <= self.max:
            raise ValueError(f"thinking limits must satisfy low <= high <= max, got "
                             f"low={self.low} high={self.high} max={self.max}")
        return self


class TelemetrySpec(_Spec):
    otlp_endpoint: Optional[str] = Field(None, min_length=1, description="e.g. http://otel-collector:4317")
    protocol: Literal["grpc", "http/protobuf"] = "grpc"


class ImageSpec(_Spec):
    repository: str = Field("ghcr.io/expertmesh/expertmesh", min_length=1)
    tag: str = Field("0.1.0", min_length=1)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


class Toleration(_Spec):
    key: Optional[str] = None
    operator: Optional[Literal["Exists", "Equal"]] = None
    value: Optional[str] = None
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = None
    toleration_seconds: Optional[int] = None


class SchedulingSpec(_Spec):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    topology_spread_key: Optional[str] = Field(
        None, min_length=1, description="spread worker pods over this node label, e.g. kubernetes.io/hostname")


class SecuritySpec(_Spec):
    worker_tls: bool = Field(
        True, description="mutual TLS on every worker RPC with per-deployment certificates the operator issues "
                          "(Secret <name>-worker-tls); false for clusters whose service mesh already does mTLS")


class MoEDeploymentSpec(_Spec):
    model: ModelSpec
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra=_DEFAULT_EMPTY)
    attention_workers: AttentionWorkersSpec = Field(default_factory=AttentionWorkersSpec,
                                                    json_schema_extra=_DEFAULT_EMPTY)
    expert_workers: ExpertWorkersSpec = Field(default_factory=ExpertWorkersSpec, json_schema_extra=_DEFAULT_EMPTY)
    placement: PlacementSpec = Field(default_factory=PlacementSpec, json_schema_extra=_DEFAULT_EMPTY)
    kv: KVSpec = Field(default_factory=KVSpec, json_schema_extra=_DEFAULT_EMPTY)
    thinking: Optional[ThinkingSpec] = None
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec, json_schema_extra=_DEFAULT_EMPTY)
    image: ImageSpec = Field(default_factory=ImageSpec, json_schema_extra=_DEFAULT_EMPTY)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, json_schema_extra=_DEFAULT_EMPTY)
    security: SecuritySpec = Field(default_factory=SecuritySpec, json_schema_extra=_DEFAULT_EMPTY)
    transport: Literal["grpc", "collective"] = Field(
        "grpc", description="how attention workers exchange each MoE layer with the expert workers: grpc, or "
                            "collective (torch.distributed pairs: NCCL on GPUs, gloo on CPU; gRPC stays for "
                            "control, health and fallback)")

    def to_yaml_dict(self) -> dict:
        """The spec as it reads in YAML: camelCase, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True)


# ------------------------------------------------------------------------------------------------ status
class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(_Status):
    type: Literal["PlacementReady", "WeightsReady", "WorkersReady", "RouterReady", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase, machine-readable")
    message: str = ""
    last_transition_time: str = Field(description="RFC 3339; changes only when status flips")
    observed_generation: Optional[int] = None


class PlacementStatus(_Status):
    logical_experts: int
    physical_experts: int
    imbalance: float = Field(description="expected max/mean per-GPU load under the loads the plan was made with")
    bytes_per_gpu: int = Field(description="the largest per-GPU expert bytes of the plan")
    plan_hash: str
    moved_shards: int = 0
    lost_workers: list[int] = Field(default_factory=list, description="expert ordinals the plan routes around")
    observed_imbalance: Optional[float] = Field(None, description="imbalance of the plan under the router's "
                                                                  "last observed load")


class ScaleStatus(_Status):
    """The expert StatefulSet as the scale subresource reports it."""
    replicas: int = Field(description="desired expert worker pods")
    ready: int
    selector: str = Field(description="label selector of the expert pods (for autoscalers)")


class WorkerCounts(_Status):
    ready: int
    desired: int


class LostWorker(_Status):
    ordinal: int
    since: str = Field(description="RFC 3339: when the operator first saw this expert pod lost")


class Endpoints(_Status):
    http: str
    grpc: str


class MoEDeploymentStatus(_Status):
    phase: Optional[Literal["Pending", "Planning", "Deploying", "Ready", "Degraded", "Failed"]] = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: Optional[int] = None
    revision: Optional[str] = Field(None, description="hash of the children last applied (changes roll pods)")
    placement: Optional[PlacementStatus] = None
    ready_workers: Optional[int] = None
    desired_workers: Optional[int] = None
    expert_workers: Optional[ScaleStatus] = None
    attention_workers: Optional[WorkerCounts] = None
    router: Optional[WorkerCounts] = None
    endpoints: Optional[Endpoints] = None
    lost_since: list[LostWorker] = Field(default_factory=list)
    last_rebalance_time: Optional[str] = None
    message: Optional[str] = Field(None, description="why the phase is what it is, when not Ready")


# ------------------------------------------------------------------------------------------------ helpers
class SpecError(ValueError):
    """A spec that cannot be deployed as written; the message names the field(s)."""


def format_validation_error(err: ValidationError, root: str = "spec") -> str:
    """One line per problem, each naming the camelCase field path: `spec.expertWorkers.replicas: ...`."""
    lines = []
    for e in err.errors():
        loc = ".".join([root, *(str(p) for p in e["loc"])])
        msg = e["msg"].removeprefix("Value error, ")
        got = f" (got {e['input']!r})" if e["type"] not in ("missing", "value_error") and \
            not isinstance(e.get("input"), dict) else ""
        lines.append(f"{loc}: {msg}{got}")
    return "; ".join(lines)


def parse_spec(spec: dict) -> MoEDeploymentSpec:
    """Validate a resource's `.spec` (a plain dict, camelCase). Raises SpecError naming the bad fields."""
    try:
        return MoEDeploymentSpec.model_validate(dict(spec or {}))
    except ValidationError as e:
        raise SpecError(format_validation_error(e)) from None


HF_MODEL_TYPES = ("kimi_linear", "deepseek_v32")   # configs mapped by expertmesh.hf_config


def resolve_model(spec: MoEDeploymentSpec):
    """The `ModelConfig` a spec names (preset or inline), with its thinking/context overrides checked."""
    if spec.model.preset is not None:
        cfg = preset(spec.model.preset)
    elif spec.model.config.get("model_type") in HF_MODEL_TYPES:
        try:
            cfg = config_from_hf(spec.model.config, set(), name=spec.model.config.get("name", "model"))
        except HFCheckpointError as e:
            raise SpecError(f"spec.model.config: {str(e).removeprefix('config.json: ')}") from None
        except ValidationError as e:
            raise SpecError(format_validation_error(e, root="spec.model.config")) from None
    else:
        try:
            cfg = ModelConfig.model_validate(spec.model.config)
        except ValidationError as e:
            raise SpecError(format_validation_error(e, root="spec.model.config")) from None
    if spec.kv.max_context is not None and spec.kv.max_context > cfg.max_context:
        raise SpecError(f"spec.kv.maxContext={spec.kv.max_context} exceeds the model's max_context={cfg.max_context}")
    if spec.thinking is not None:
        cfg = cfg.model_copy(update={"thinking": ThinkingBudgets(**spec.thinking.model_dump())})
    return cfg
