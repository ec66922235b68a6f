"""The MoEDeployment fields that fit it into the Kubernetes inference stack a platform team already runs (issue #56):
`spec.gateway` (a Gateway API Inference Extension InferencePool with the router as its endpoint picker: gateway.py),
`spec.workload` + `spec.leaderWorkerSet` (the pools as LeaderWorkerSet groups: lws.py), `spec.queueName` (Kueue) and
`spec.devices` (DRA ResourceClaimTemplates and an NVIDIA ComputeDomain: devices.py). The models and the checks across
them (`platform_errors`, called by MoEDeploymentSpec's validator); operator/spec.py holds the fields."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from expertmesh.operator.spec_fields import SpecModel, checked_string
from expertmesh.operator.validation import DNS1123_LABEL, DNS1123_LABEL_MAX

# the Gateway API Inference Extension's conventional endpoint-picker port (an InferencePool's endpointPickerRef
# defaults to it for a Service); the router serves its ext_proc picker there (`expertmesh router --epp-port`)
DEFAULT_EPP_PORT = 9002
MAX_GROUP_RESTARTS = 1000
MAX_RESTART_WINDOW = 7 * 24 * 3600
WORKLOADS = ("statefulset", "leaderworkerset")
CHANNEL_SUFFIX = "-channel"  # a ComputeDomain's IMEX-channel ResourceClaimTemplate: <computeDomain>-channel


def _dns_label_error(value: str) -> str | None:
    if len(value) > DNS1123_LABEL_MAX or not re.fullmatch(DNS1123_LABEL, value):
        return (
            f"must be a DNS-1123 label: at most {DNS1123_LABEL_MAX} lowercase letters, digits and '-', "
            "alphanumeric at both ends"
        )
    return None


# an object name that is also a label value (a Kueue LocalQueue, a ResourceClaimTemplate, a ComputeDomain): a DNS-1123
# label, at most 63 characters
DNSLabel = checked_string(_dns_label_error, DNS1123_LABEL_MAX, f"^{DNS1123_LABEL}$", min_length=1)


class GatewaySpec(SpecModel):
    """The deployment behind a Gateway API Inference Extension gateway: an InferencePool (inference.networking.k8s.io/v1)
    named like the MoEDeployment selects the router pods on router.httpPort, and names the router's endpoint picker
    (an Envoy ext_proc gRPC service on eppPort, Service <name>-epp) as its endpointPickerRef."""

    inference_pool: bool = Field(
        False,
        strict=True,  # a boolean, as the CRD's schema says: not "yes"
        description="render an InferencePool selecting the router pods, the router as its endpoint picker",
    )
    epp_port: int = Field(
        DEFAULT_EPP_PORT, ge=1, le=65535, description="the router's endpoint-picker (ext_proc) port: --epp-port"
    )
    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        "FailClose",
        description="what the gateway does when the picker does not answer: FailClose refuses the request, "
        "FailOpen sends it to any router pod",
    )


class LeaderWorkerSetSpec(SpecModel):
    """How the LeaderWorkerSets of `workload: leaderworkerset` behave (lws.py): the attention pools' groups are one
    pod each, the expert workers one group of expertWorkers.replicas pods (ordinal 0 its leader)."""

    startup_policy: Literal["LeaderCreated", "LeaderReady"] = Field(
        "LeaderCreated",
        description="LeaderReady: a group's workers are created once its leader is ready; LeaderCreated: at once",
    )
    restart_policy: Literal["RecreateGroupOnPodRestart", "None"] = Field(
        "RecreateGroupOnPodRestart",
        description="RecreateGroupOnPodRestart: a pod's restart recreates its whole group; None: pods restart alone "
        "(the operator re-plans around a lost expert pod)",
    )
    max_group_restarts: int = Field(
        5,
        ge=0,
        le=MAX_GROUP_RESTARTS,
        strict=True,
        description="recreations of one group (RecreateGroupOnPodRestart) within groupRestartWindowSeconds the "
        "operator lets happen; at this many it sets that LeaderWorkerSet's restartPolicy to None (pods restart "
        "alone) until the spec changes, condition GroupRestartsBounded naming the group; 0: no bound",
    )
    group_restart_window_seconds: int = Field(
        600,
        ge=1,
        le=MAX_RESTART_WINDOW,
        strict=True,
        description="a group's restart count starts again after this many seconds without a recreation",
    )


class DevicesSpec(SpecModel):
    """GPUs through Dynamic Resource Allocation instead of the nvidia.com/gpu device-plugin limit (devices.py)."""

    resource_claim_template: DNSLabel | None = Field(
        None,
        description="a ResourceClaimTemplate (resource.k8s.io) in the namespace claiming one worker pod's GPUs: "
        "every GPU pod claims from it instead of the nvidia.com/gpu limit",
    )
    compute_domain: DNSLabel | None = Field(
        None,
        description="an NVIDIA ComputeDomain (multi-node NVLink, e.g. a GB200 NVL72 rack) the operator creates; "
        "every GPU pod claims an IMEX channel from its ResourceClaimTemplate <computeDomain>-channel",
    )


class GroupRestarts(BaseModel):
    """`status.groupRestarts[]`: one LeaderWorkerSet group as the operator last saw it (lws_restarts.py) — its leader
    pod's uid and template revision; a new uid on the same revision is a recreation of the group."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    set: str = Field(max_length=DNS1123_LABEL_MAX, description="the LeaderWorkerSet")
    group: int = Field(ge=0, le=1_000_000, description="its group index")
    leader_uid: str = Field(max_length=64)
    revision: str = Field(max_length=64, description="the leader's leaderworkerset.sigs.k8s.io/template-revision-hash")
    restarts: int = Field(ge=0, le=1_000_000, description="recreations within groupRestartWindowSeconds")
    last_restart_time: str | None = Field(None, max_length=64, description="RFC 3339")
    bound_at_generation: int | None = Field(
        None,
        ge=0,
        le=2**63 - 1,
        description="the spec generation at which this group set its set's restartPolicy to None",
    )


def platform_errors(spec) -> list[str]:
    """What a MoEDeploymentSpec asks of these fields that cannot be rendered, each naming the field."""
    out = []
    g, r = spec.gateway, spec.router
    if g.epp_port in (r.http_port, r.grpc_port):
        out.append(
            f"spec.gateway.eppPort={g.epp_port} must differ from router.httpPort={r.http_port} and "
            f"router.grpcPort={r.grpc_port} (the picker has a port of its own)"
        )
    lw = spec.leader_worker_set
    if lw is not None and spec.workload != "leaderworkerset":
        out.append(f"spec.leaderWorkerSet is set but spec.workload is {spec.workload!r}: it needs leaderworkerset")
    bound = {"max_group_restarts", "group_restart_window_seconds"} & (lw.model_fields_set if lw else set())
    if bound and lw.restart_policy == "None":
        out.append(
            f"spec.leaderWorkerSet.{'maxGroupRestarts' if 'max_group_restarts' in bound else 'groupRestartWindowSeconds'}"
            " bounds group recreations, which restartPolicy None never makes: set restartPolicy "
            "RecreateGroupOnPodRestart or leave it out"
        )
    d = spec.devices
    if d is not None:
        if d.resource_claim_template is None and d.compute_domain is None:
            out.append("spec.devices: give resourceClaimTemplate, computeDomain or both (or leave devices out)")
        gpus = [
            spec.attention_workers.gpus_per_pod,
            spec.expert_workers.gpus_per_pod,
            spec.prefill_workers.gpus_per_pod if spec.prefill_workers.enabled else 0,
        ]
        if d.compute_domain is not None and len(d.compute_domain) > DNS1123_LABEL_MAX - len(CHANNEL_SUFFIX):
            out.append(
                f"spec.devices.computeDomain={d.compute_domain!r}: at most {DNS1123_LABEL_MAX - len(CHANNEL_SUFFIX)} "
                f"characters (its channel claim template is <computeDomain>{CHANNEL_SUFFIX}, a DNS-1123 label)"
            )
        if not any(gpus):
            out.append("spec.devices: no pod uses GPUs (every gpusPerPod is 0): nothing would claim these devices")
    return out
