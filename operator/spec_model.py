"""The model a MoEDeployment serves (`spec.model`): a preset or an inline config, and where its checkpoint comes from
(a PVC, a fetched URI with its node cache, a host path); an inline config's size bounds, checked before it is built
(operator/spec.py's resolve_model builds it)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from expertmesh.checkpoint.hf_config import MODEL_TYPES
from expertmesh.operator.spec_fields import (
    DEFAULT_EMPTY,
    URL,
    AbsolutePath,
    DNSName,
    SecretKey,
    SpecModel,
    checked_string,
    pattern_check,
)
from expertmesh.operator.validation import (
    PATH_MAX,
    URL_MAX,
    VOLUME_PATH,
    absolute_path_error,
    relative_path_error,
)

MAX_CONFIG_KEYS = 256  # top-level keys of an inline model config
MAX_MODEL_LAYERS = 1024  # layers of an inline model config (checked before it is built)
HF_MODEL_TYPES = MODEL_TYPES  # the Hugging Face configs expertmesh.checkpoint.hf_config maps
MAX_EXPERTS = 65536  # routed experts per MoE layer of an inline model config


class PVCSource(SpecModel):
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


class SecretKeyRef(SpecModel):
    name: DNSName
    key: SecretKey


class CheckpointCache(SpecModel):
    """Where fetched checkpoints are kept: a directory on each node (pods on one node fetch once and share it),
    or a PersistentVolumeClaim (ReadWriteMany: one fetch for the whole cluster)."""

    host_path: AbsolutePath = Field("/var/cache/expertmesh", description="node directory (hostPath): absolute, no '..'")
    claim_name: DNSName | None = Field(None, description="a PVC to use instead of the hostPath")


FETCHED_SCHEMES = ("http://", "https://", "hf://", "s3://")
URI_PATTERN = r"^[^-\s\x00-\x1f\x7f][^\s\x00-\x1f\x7f]*$"  # no option look-alike, no spaces


class CheckpointSource(SpecModel):
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
    cache: CheckpointCache = Field(default_factory=CheckpointCache, json_schema_extra=DEFAULT_EMPTY)
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


LICENSE_NAME = r"^[A-Za-z0-9]([A-Za-z0-9._+-]*[A-Za-z0-9+])?$"  # an SPDX id or a model card's license_name
LicenseName = checked_string(
    pattern_check(LICENSE_NAME, "a licence name: letters, digits, '.', '_', '+' and '-' (e.g. modified-mit)"),
    128,
    LICENSE_NAME,
    min_length=1,
    description="the licence as its publisher names it (an SPDX id or a model card's license_name, e.g. modified-mit)",
)


class ModelLicense(SpecModel):
    """The licence the weights are published under, and the deployer's acceptance of it: the operator fetches and
    deploys nothing before `accepted` is true (operator/model_license.py)."""

    name: LicenseName
    accepted: bool = Field(
        False, description="true: the deployer has read and accepts the licence (required before any fetch)"
    )


class ModelSpec(SpecModel):
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
    license: ModelLicense | None = Field(
        None,
        description="the licence the weights are published under, and its acceptance: required, accepted, for a "
        "licensed source (e.g. hf://moonshotai/Kimi-K3) before anything is fetched",
    )

    @model_validator(mode="after")
    def _one_model(self) -> ModelSpec:
        if (self.preset is None) == (self.config is None):
            raise ValueError("set exactly one of model.preset and model.config")
        return self


def config_size_error(config: dict) -> str | None:
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
