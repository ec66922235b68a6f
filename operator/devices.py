"""Queues and devices (issue #56): the Kueue queue label on the workloads (`spec.queueName`) and GPUs through Dynamic
Resource Allocation (`spec.devices`) instead of the device plugin's `nvidia.com/gpu` limit. Pure: pod specs and
workloads (plain dicts) in, the same with these parts out.

  spec.queueName                → label kueue.x-k8s.io/queue-name on every workload (StatefulSets or LeaderWorkerSets,
                                  the router's Deployment): Kueue admits them through its LocalQueue
  spec.devices.resourceClaimTemplate R
                                → every GPU pod claims its GPUs from ResourceClaimTemplate R (the admin's: its device
                                  requests say how many; gpusPerPod still sizes the plan), no nvidia.com/gpu limit
  spec.devices.computeDomain D  → a ComputeDomain D (resource.nvidia.com/v1beta1: the NVIDIA DRA driver's multi-node
                                  NVLink domain, e.g. a GB200 NVL72 rack) and every GPU pod claims an IMEX channel from
                                  the ResourceClaimTemplate D-channel the driver makes for it
"""

from __future__ import annotations

import copy

from expertmesh.operator.naming import object_meta
from expertmesh.operator.spec import MoEDeploymentSpec
from expertmesh.operator.spec_fields import GPU_RESOURCE
from expertmesh.operator.spec_platform import CHANNEL_SUFFIX

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
COMPUTE_DOMAIN_API = "resource.nvidia.com/v1beta1"
GPU_CLAIM = "gpus"
CHANNEL_CLAIM = "compute-domain-channel"
COMPONENT_DEVICES = "devices"


def channel_template_name(compute_domain: str) -> str:
    return f"{compute_domain}{CHANNEL_SUFFIX}"


def queued(workload: dict, spec: MoEDeploymentSpec) -> dict:
    """A workload with the Kueue queue label on its metadata (the workload's, not its pods': Kueue's StatefulSet,
    LeaderWorkerSet and Deployment integrations read it there), when spec.queueName is set."""
    if spec.queue_name is not None:
        workload["metadata"]["labels"] = {**workload["metadata"].get("labels", {}), QUEUE_LABEL: spec.queue_name}
    return workload


def pod_claims(spec: MoEDeploymentSpec) -> list[dict]:
    """The pod's resourceClaims a GPU pod of this spec makes (none without spec.devices)."""
    d = spec.devices
    if d is None:
        return []
    out = []
    if d.resource_claim_template is not None:
        out.append({"name": GPU_CLAIM, "resourceClaimTemplateName": d.resource_claim_template})
    if d.compute_domain is not None:
        out.append({"name": CHANNEL_CLAIM, "resourceClaimTemplateName": channel_template_name(d.compute_domain)})
    return out


def with_devices(pod: dict, spec: MoEDeploymentSpec) -> dict:
    """A pod spec whose GPU containers (an nvidia.com/gpu limit) claim the spec's devices: with a
    resourceClaimTemplate the GPUs come from its claim instead of the limit; a computeDomain's channel is claimed
    beside. Pods without GPUs (the router, CPU workers) are left as they are."""
    claims = pod_claims(spec)
    gpu_containers = [c for c in pod["containers"] if GPU_RESOURCE in (c.get("resources") or {}).get("limits", {})]
    if not claims or not gpu_containers:
        return pod
    pod = copy.deepcopy(pod)
    for c in pod["containers"]:
        res = c.get("resources") or {}
        if GPU_RESOURCE not in res.get("limits", {}):
            continue
        if spec.devices.resource_claim_template is not None:
            for where in ("limits", "requests"):
                res.get(where, {}).pop(GPU_RESOURCE, None)
            res = {k: v for k, v in res.items() if v}
        c["resources"] = {**res, "claims": [{"name": claim["name"]} for claim in claims]}
    pod["resourceClaims"] = claims
    return pod


def compute_domain(name: str, namespace: str, spec: MoEDeploymentSpec) -> list[dict]:
    """The ComputeDomain spec.devices.computeDomain names (none without it): numNodes 0 (the driver's default
    IMEXDaemonsWithDNSNames: no node count to keep, so the domain's immutable spec never changes with the pods), its
    channel's ResourceClaimTemplate <computeDomain>-channel."""
    d = spec.devices
    if d is None or d.compute_domain is None:
        return []
    return [
        {
            "apiVersion": COMPUTE_DOMAIN_API,
            "kind": "ComputeDomain",
            "metadata": object_meta(d.compute_domain, namespace, COMPONENT_DEVICES, spec, instance=name),
            "spec": {
                "numNodes": 0,
                "channel": {"resourceClaimTemplate": {"name": channel_template_name(d.compute_domain)}},
            },
        }
    ]
