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

import re
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from expertmesh.checkpoint.hf_config import MODEL_TYPES, HFCheckpointError, config_from_hf
from expertmesh.model.config import ModelConfig, ThinkingBudgets, preset
from expertmesh.operator.validation import (
    ABSOLUTE_PATH,
    DNS1123_SUBDOMAIN,
    DNS1123_SUBDOMAIN_MAX,
    IMAGE_REPOSITORY,
    IMAGE_REPOSITORY_MAX,
    IMAGE_TAG,
    LABEL_VALUE,
    LABEL_VALUE_MAX,
    NO_SPACE,
    PATH_MAX,
    QUALIFIED_NAME,
    QUALIFIED_NAME_MAX,
    QUANTITY,
    QUANTITY_MAX,
    SECRET_KEY,
    URL_MAX,
    VOLUME_PATH,
    absolute_path_error,
    dns_subdomain_error,
    is_extended_resource,
    label_value_error,
    parse_quantity,
    qualified_name_error,
    relative_path_error,
    resource_name_error,
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
CONDITION_TYPES = ("PlacementReady", "WeightsReady", "WorkersReady", "RouterReady", "Degraded")
GPU_RESOURCE = "nvidia.com/gpu"

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
MAX_RESOURCE_ENTRIES = 16
MAX_RESOURCE_INT = 10**15  # an integer quantity (bytes, cores, devices)
MAX_NODE_SELECTOR = 32
MAX_TOLERATIONS = 32
MAX_CONFIG_KEYS = 256  # top-level keys of an inline model config
MAX_MODEL_LAYERS = 1024  # layers of an inline model config (checked before it is built)
MESSAGE_MAX = 32768  # a condition's message (metav1.Condition's bound)
MAX_INT64 = 2**63 - 1
MAX_AUTOSCALE_TARGET = 2**24  # an autoscaling target: tokens or requests waiting per pod (kv_utilization: at most 1)

# Applied to nested objects with all-default fields so the API server fills their defaults in even when the
# user leaves the whole object out (Kubernetes only defaults fields whose parent object exists).
_DEFAULT_EMPTY = {"default": {}}


class _Spec(BaseModel):
    """camelCase in YAML, unknown fields rejected (a typo is an error, not silently ignored)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", allow_inf_nan=False)


def _checked(check, max_length: int, pattern: str | None = None, **field):
    """A string field bounded by `max_length` and, in the schema, `pattern`; pydantic runs `check` (value → what is
    wrong, or None) so that the message says what was expected in words rather than as a regular expression."""

    def run(value: str) -> str:
        err = check(value)
        if err:
            raise ValueError(f"{value[:80]!r} {err}")
        return value

    extra = {"pattern": pattern} if pattern else {}
    return Annotated[str, Field(max_length=max_length, json_schema_extra=extra or None, **field), AfterValidator(run)]


def _pattern_check(pattern: str, what: str):
    return lambda v: None if re.fullmatch(pattern, v) else f"must be {what}"


DNSName = _checked(dns_subdomain_error, DNS1123_SUBDOMAIN_MAX, DNS1123_SUBDOMAIN, min_length=1)
QualifiedName = _checked(qualified_name_error, QUALIFIED_NAME_MAX, QUALIFIED_NAME, min_length=1)
QualifiedNameKey = _checked(qualified_name_error, QUALIFIED_NAME_MAX, min_length=1)  # a map key: no pattern in a
LabelValue = _checked(label_value_error, LABEL_VALUE_MAX, LABEL_VALUE)  # structural schema
SecretKey = _checked(
    _pattern_check(SECRET_KEY, "a Secret key (letters, digits, '-', '_' and '.')"),
    DNS1123_SUBDOMAIN_MAX,
    SECRET_KEY,
    min_length=1,
)
AbsolutePath = _checked(absolute_path_error, PATH_MAX, ABSOLUTE_PATH, min_length=1)
URL = _checked(
    _pattern_check(r"^https?://[^\s\x00-\x1f\x7f]+$", "an http:// or https:// URL without spaces"),
    URL_MAX,
    r"^https?://[^\s\x00-\x1f\x7f]+$",
    min_length=1,
)
Endpoint = _checked(
    _pattern_check(NO_SPACE, "an endpoint without spaces or control characters"), URL_MAX, NO_SPACE, min_length=1
)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, int) and not 0 <= value <= MAX_RESOURCE_INT:
        raise ValueError(f"{value} must be between 0 and {MAX_RESOURCE_INT}")
    parse_quantity(value)  # ValueError naming the value
    return value


def _check_resource_name(name: str) -> str:
    err = resource_name_error(name)
    if err:
        raise ValueError(f"{name[:80]!r} {err}")
    return name


IntOrString = int | str  # a Kubernetes quantity ("500m", "16Gi", 2); becomes x-kubernetes-int-or-string
Quantity = Annotated[
    IntOrString,
    AfterValidator(_check_quantity),
    Field(
        json_schema_extra={"pattern": QUANTITY, "maxLength": QUANTITY_MAX, "minimum": 0, "maximum": MAX_RESOURCE_INT}
    ),
]
ResourceName = Annotated[str, Field(max_length=QUALIFIED_NAME_MAX), AfterValidator(_check_resource_name)]


class Resources(_Spec):
    """Container resources (the `resources` of a Kubernetes container, without `claims`). Extended resources
    (e.g. GPUs) must have requests equal to limits; GPUs come from `gpusPerPod`."""

    limits: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=MAX_RESOURCE_ENTRIES)
    requests: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=MAX_RESOURCE_ENTRIES)

    @model_validator(mode="after")
    def _requests_within_limits(self) -> Resources:
        for name, request in self.requests.items():
            limit = self.limits.get(name)
            if is_extended_resource(name) and limit is None:
                raise ValueError(f"requests[{name!r}]: an extended resource needs a limit equal to its request")
            if limit is None:
                continue
            req, lim = parse_quantity(request), parse_quantity(limit)
            if is_extended_resource(name) and req != lim:
                raise ValueError(
                    f"requests[{name!r}]={request} must equal limits[{name!r}]={limit} (an extended "
                    f"resource cannot be overcommitted)"
                )
            if req > lim:
                raise ValueError(f"requests[{name!r}]={request} exceeds limits[{name!r}]={limit}")
        return self

    def check_gpus(self, gpus: int) -> None:
        """GPUs are the workers' `gpusPerPod`: a GPU figure in resources must say the same."""
        for where, values in (("limits", self.limits), ("requests", self.requests)):
            if GPU_RESOURCE in values and parse_quantity(values[GPU_RESOURCE]) != Decimal(gpus):
                raise ValueError(
                    f"resources.{where}[{GPU_RESOURCE!r}]={values[GPU_RESOURCE]} must equal "
                    f"gpusPerPod={gpus} (GPUs are requested through gpusPerPod)"
                )


# ------------------------------------------------------------------------------------------------ model
class PVCSource(_Spec):
    claim_name: DNSName = Field(description="PersistentVolumeClaim holding the checkpoint")
    path: str = Field(
        "/",
        max_length=PATH_MAX,
        json_schema_extra={"pattern": VOLUME_PATH},
        description="checkpoint directory inside the volume (no '..': never above its root)",
    )
    read_only: bool = True

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        err = relative_path_error(v)
        if err:
            raise ValueError(f"{v[:80]!r} {err}")
        return v


class SecretKeyRef(_Spec):
    name: DNSName
    key: SecretKey


class CheckpointCache(_Spec):
    """Where fetched checkpoints are kept: a directory on each node (pods on one node fetch once and share it),
    or a PersistentVolumeClaim (ReadWriteMany: one fetch for the whole cluster)."""

    host_path: AbsolutePath = Field("/var/cache/expertmesh", description="node directory (hostPath): absolute, no '..'")
    claim_name: DNSName | None = Field(None, description="a PVC to use instead of the hostPath")


FETCHED_SCHEMES = ("http://", "https://", "hf://", "s3://")
URI_PATTERN = r"^[^-\s\x00-\x1f\x7f][^\s\x00-\x1f\x7f]*$"  # no option look-alike, no spaces


class CheckpointSource(_Spec):
    """Where the checkpoint lives: a PVC mounted into every pod, a path inside the image, or a remote source
    (http(s)://BASE or s3://BUCKET/PREFIX with an expertmesh-index.json, hf://ORG/NAME[@REVISION]) that an init
    container fetches into the cache volume, verifying every file's size and sha256."""

    pvc: PVCSource | None = None
    uri: str | None = Field(
        None,
        min_length=1,
        max_length=URL_MAX,
        json_schema_extra={"pattern": URI_PATTERN},
        description="http(s)://…, hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX, or an absolute path inside the image",
    )
    cache: CheckpointCache = Field(default_factory=CheckpointCache, json_schema_extra=_DEFAULT_EMPTY)
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key with a bearer token for the source (HF_TOKEN for hf://)"
    )
    endpoint: URL | None = Field(None, description="s3://: an S3-compatible endpoint URL (default: AWS's, in region)")
    region: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="s3://: the signing region (default us-east-1)",
    )
    credentials_secret: DNSName | None = Field(
        None,
        description="s3://: a Secret whose keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and "
        "AWS_SESSION_TOKEN) become the fetch container's environment",
    )
    format: Literal["expertmesh-mxfp4"] = "expertmesh-mxfp4"

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v.startswith("-"):  # it becomes a command-line argument of the fetch and worker containers
            raise ValueError(f"uri {v[:80]!r}: must not start with '-' (it would be read as an option)")
        if not re.fullmatch(URI_PATTERN, v):
            raise ValueError(f"uri {v[:80]!r}: must not contain spaces or control characters")
        if "://" not in v:
            err = absolute_path_error(v)
            if err:
                raise ValueError(f"uri {v[:80]!r}: a path inside the image {err}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> CheckpointSource:
        if (self.pvc is None) == (self.uri is None):
            raise ValueError("set exactly one of model.checkpoint.pvc and model.checkpoint.uri")
        if self.uri is not None and "://" in self.uri and not self.uri.startswith(FETCHED_SCHEMES):
            raise ValueError(
                f"uri {self.uri[:80]!r}: supported sources are http://, https://, "
                f"hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX and paths inside the image"
            )
        if self.uri is not None and self.uri.startswith("hf://"):
            repo = self.uri[5:].partition("@")[0]
            if repo.count("/") != 1 or not all(repo.split("/")):
                raise ValueError(f"uri {self.uri[:80]!r}: expected hf://ORG/NAME[@REVISION]")
        if self.uri is not None and self.uri.startswith("s3://") and not self.uri[5:].split("/")[0]:
            raise ValueError(f"uri {self.uri[:80]!r}: expected s3://BUCKET/PREFIX")
        s3_only = [f for f in ("endpoint", "region", "credentials_secret") if getattr(self, f) is not None]
        if s3_only and not (self.uri or "").startswith("s3://"):
            raise ValueError(f"{', '.join(s3_only)}: only for an s3:// uri")
        return self

    @property
    def fetched(self) -> bool:
        """A remote source (fetched by the pods' init container) rather than a mounted or baked-in path."""
        return self.uri is not None and self.uri.startswith(FETCHED_SCHEMES)


class ModelSpec(_Spec):
    preset: Literal["tiny", "small", "full-2.8t"] | None = Field(
        None, description="a built-in model preset; exclusive with config"
    )
    config: dict[str, Any] | None = Field(
        None,
        max_length=MAX_CONFIG_KEYS,
        description="an inline model config, as in a checkpoint's config.json: an expertmesh ModelConfig or "
        "a Hugging Face kimi_k3 / kimi_linear / deepseek_v32 config; exclusive with preset",
    )
    checkpoint: CheckpointSource

    @model_validator(mode="after")
    def _one_model(self) -> ModelSpec:
        if (self.preset is None) == (self.config is None):
            raise ValueError("set exactly one of model.preset and model.config")
        return self


# ------------------------------------------------------------------------------------------------ workloads
class RouterSpec(_Spec):
    replicas: int = Field(1, ge=1, le=MAX_ROUTER_REPLICAS)
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_DEFAULT_EMPTY)
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


class AutoscaleSpec(_Spec):
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
    target: float = Field(
        gt=0,
        le=MAX_AUTOSCALE_TARGET,
        description="per pod for prefill_tokens_waiting / requests_waiting; the pool's fraction "
        "(0..1] for kv_utilization",
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
    def _fraction(cls, v: float, info) -> float:
        if info.data.get("metric") == "kv_utilization" and v > 1:
            raise ValueError(f"target={v:g}: kv_utilization is a fraction, at most 1")
        return v


class AttentionWorkersSpec(_Spec):
    """The attention workers: with no prefill pool they run prompts and decode alike (pool `mixed`); beside a prefill
    pool (spec.prefillWorkers) they are the decode pool (`--pool decode`)."""

    replicas: int = Field(1, ge=1, le=MAX_ATTENTION_REPLICAS, description="pods (with autoscale: the HPA's)")
    gpus_per_pod: int = Field(1, ge=0, le=MAX_GPUS_PER_POD, description="0 runs on CPU (tiny/small presets)")
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_DEFAULT_EMPTY)
    autoscale: AutoscaleSpec | None = Field(None, description="a HorizontalPodAutoscaler on this pool")

    @model_validator(mode="after")
    def _gpus(self) -> AttentionWorkersSpec:
        self.resources.check_gpus(self.gpus_per_pod)
        return self


class PrefillWorkersSpec(_Spec):
    """The prefill pool (prefill/decode disaggregation): attention workers run with `--pool prefill`; they run the
    prompts and hand each sequence (KV and recurrent state) to a decode worker (the attention workers). The prefill
    pool holds the prefix cache and spec.kv's host and disk tiers. replicas 0 and no autoscale: no prefill pool."""

    replicas: int = Field(
        0, ge=0, le=MAX_PREFILL_REPLICAS, description="pods; 0: no prefill pool, the attention workers run prompts too"
    )
    gpus_per_pod: int = Field(1, ge=0, le=MAX_GPUS_PER_POD, description="0 runs on CPU (tiny/small presets)")
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_DEFAULT_EMPTY)
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


class ExpertWorkersSpec(_Spec):
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
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_DEFAULT_EMPTY)

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


class PlacementSpec(_Spec):
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


class KVDiskPVC(_Spec):
    storage_class_name: DNSName | None = Field(None, description="the claims' storage class (default: the cluster's)")


class KVDiskSpec(_Spec):
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


class KVSpec(_Spec):
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


class ThinkingSpec(_Spec):
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


class TelemetrySpec(_Spec):
    otlp_endpoint: Endpoint | None = Field(None, description="e.g. http://otel-collector:4317")
    protocol: Literal["grpc", "http/protobuf"] = "grpc"


class ImageSpec(_Spec):
    repository: str = Field(
        "ghcr.io/expertmesh/expertmesh", min_length=1, max_length=IMAGE_REPOSITORY_MAX, pattern=IMAGE_REPOSITORY
    )
    tag: str = Field("0.1.0", min_length=1, max_length=128, pattern=IMAGE_TAG)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


class Toleration(_Spec):
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


class SchedulingSpec(_Spec):
    node_selector: dict[QualifiedNameKey, LabelValue] = Field(default_factory=dict, max_length=MAX_NODE_SELECTOR)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_TOLERATIONS)
    topology_spread_key: QualifiedName | None = Field(
        None, description="spread worker pods over this node label, e.g. kubernetes.io/hostname"
    )


class SecuritySpec(_Spec):
    worker_tls: bool = Field(
        True,
        description="mutual TLS on every worker RPC with per-deployment certificates the operator issues "
        "(Secret <name>-worker-tls); false for clusters whose service mesh already does mTLS",
    )


class MoEDeploymentSpec(_Spec):
    model: ModelSpec
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra=_DEFAULT_EMPTY)
    attention_workers: AttentionWorkersSpec = Field(
        default_factory=AttentionWorkersSpec, json_schema_extra=_DEFAULT_EMPTY
    )
    prefill_workers: PrefillWorkersSpec = Field(default_factory=PrefillWorkersSpec, json_schema_extra=_DEFAULT_EMPTY)
    expert_workers: ExpertWorkersSpec = Field(default_factory=ExpertWorkersSpec, json_schema_extra=_DEFAULT_EMPTY)
    placement: PlacementSpec = Field(default_factory=PlacementSpec, json_schema_extra=_DEFAULT_EMPTY)
    kv: KVSpec = Field(default_factory=KVSpec, json_schema_extra=_DEFAULT_EMPTY)
    thinking: ThinkingSpec | None = None
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec, json_schema_extra=_DEFAULT_EMPTY)
    image: ImageSpec = Field(default_factory=ImageSpec, json_schema_extra=_DEFAULT_EMPTY)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, json_schema_extra=_DEFAULT_EMPTY)
    security: SecuritySpec = Field(default_factory=SecuritySpec, json_schema_extra=_DEFAULT_EMPTY)
    transport: Literal["grpc", "collective"] = Field(
        "grpc",
        description="how attention workers exchange each MoE layer with the expert workers: grpc, or "
        "collective (point-to-point pairs: NCCL on GPUs, TCP on CPU; gRPC stays for "
        "control, health and fallback)",
    )

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
    type: Literal["PlacementReady", "WeightsReady", "WorkersReady", "RouterReady", "Degraded"]
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


# ------------------------------------------------------------------------------------------------ helpers
class SpecError(ValueError):
    """A spec that cannot be deployed as written; the message names the field(s)."""


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
        lines.append(f"{loc}: {msg}{got}")
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


HF_MODEL_TYPES = MODEL_TYPES  # the Hugging Face configs expertmesh.checkpoint.hf_config maps
MAX_EXPERTS = 65536  # routed experts per MoE layer of an inline model config


def _config_size_error(config: dict) -> str | None:
    """An inline config whose size alone is out of bounds, found before it is built (a Hugging Face config's
    `num_hidden_layers` becomes a tuple of that many layer types)."""
    for prefix, part in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(part, dict):
            continue
        n = part.get("num_hidden_layers")
        try:
            n = int(n) if n is not None and not isinstance(n, bool) else None
        except (TypeError, ValueError, OverflowError):
            n = None
        if n is not None and n > MAX_MODEL_LAYERS:
            return f"spec.model.config.{prefix}num_hidden_layers={n}: at most {MAX_MODEL_LAYERS} layers"
        types = part.get("layer_types")
        if isinstance(types, (list, tuple)) and len(types) > MAX_MODEL_LAYERS:
            return f"spec.model.config.{prefix}layer_types: {len(types)} layers, at most {MAX_MODEL_LAYERS}"
    return None


def resolve_model(spec: MoEDeploymentSpec):
    """The `ModelConfig` a spec names (preset or inline), with its thinking/context overrides checked; an inline
    config is bounded (layers, experts, context) before and after it is built. Raises SpecError naming the field."""
    if spec.model.preset is not None:
        cfg = preset(spec.model.preset)
    else:
        too_big = _config_size_error(spec.model.config)
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
    if spec.thinking is not None:
        cfg = cfg.model_copy(update={"thinking": ThinkingBudgets(**spec.thinking.model_dump())})
    return cfg
