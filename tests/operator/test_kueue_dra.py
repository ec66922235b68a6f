"""Queues and devices (issue #56): spec.queueName → Kueue's queue label on every workload (both workload modes);
spec.devices → GPU pods claim a DRA ResourceClaimTemplate instead of the nvidia.com/gpu limit, and a ComputeDomain
(rendered, valid against its CRD's fields in tests/data/crds/) whose channel every GPU pod claims; pod templates valid
against Kubernetes' schema; bad fields refused naming them; the operator (Kopf against kmock with the ComputeDomain CRD
installed) applies the domain and the labelled workloads."""

from __future__ import annotations

import json

import pytest
from support.crd_schemas import load_crd, register, schema_errors
from support.kopf_cluster import Cluster, emulator, eventually, no_load, run_operator, tiny_spec
from support.tiny_deployment import by_kind_and_name, tiny

from expertmesh.operator import rbac
from expertmesh.operator.children import build_children
from expertmesh.operator.devices import QUEUE_LABEL
from expertmesh.operator.handlers import Deps
from expertmesh.operator.kube import Kube
from expertmesh.operator.lws import pod_template
from expertmesh.operator.naming import attention_name, expert_name, router_name
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.spec import SpecError, parse_spec, resolve_model

CD_CRD = "computedomains.resource.nvidia.com.yaml"
GPUS = {"attentionWorkers": {"gpusPerPod": 1}, "expertWorkers": {"gpusPerPod": 2}}
WORKLOAD_KINDS = ("StatefulSet", "LeaderWorkerSet", "Deployment")


def _children(**over) -> dict:
    spec = parse_spec(tiny(**over))
    cfg = resolve_model(spec)
    return by_kind_and_name(build_children("kimi", "serving", spec, cfg, plan_for(spec, cfg)))


def _workloads(children: dict) -> dict:
    return {n: c for (k, n), c in children.items() if k in WORKLOAD_KINDS}


@pytest.mark.parametrize("workload", ["statefulset", "leaderworkerset"])
def test_the_queue_label_is_on_every_workload_and_nowhere_else(workload):
    children = _children(queueName="team-a", workload=workload)
    workloads = _workloads(children)
    assert set(workloads) == {attention_name("kimi"), expert_name("kimi"), router_name("kimi")}
    for n, w in workloads.items():
        assert w["metadata"]["labels"][QUEUE_LABEL] == "team-a", n
        assert QUEUE_LABEL not in pod_template(w)["metadata"]["labels"], n  # Kueue reads the workload's label
    assert [k for k, c in children.items() if QUEUE_LABEL in c["metadata"]["labels"]] == [
        (w["kind"], n) for n, w in workloads.items()
    ]
    assert QUEUE_LABEL not in json.dumps(list(_children(workload=workload).values()))


def _gpu_pods(children: dict) -> dict:
    return {n: pod_template(w)["spec"] for n, w in _workloads(children).items()}


def test_a_claim_template_replaces_the_gpu_limit():
    kv = pytest.importorskip("kubernetes_validate")
    children = _children(devices={"resourceClaimTemplate": "eight-gpus"}, **GPUS)
    pods = _gpu_pods(children)
    for n in (attention_name("kimi"), expert_name("kimi")):
        assert pods[n]["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}], n
        res = pods[n]["containers"][0]["resources"]
        assert res["claims"] == [{"name": "gpus"}] and "nvidia.com/gpu" not in json.dumps(res), n
        tmpl = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": {"spec": pods[n]}}
        kv.validate(tmpl, "1.34", strict=True)
    assert "resourceClaims" not in pods[router_name("kimi")]  # no GPUs: no claim
    assert not [k for k in children if k[0] == "ComputeDomain"]
    # without devices: the device plugin's limit, as before
    plain = _gpu_pods(_children(**GPUS))
    assert plain[expert_name("kimi")]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "resourceClaims" not in plain[expert_name("kimi")]


def test_a_compute_domain_is_rendered_and_its_channel_claimed():
    kv = pytest.importorskip("kubernetes_validate")
    children = _children(devices={"computeDomain": "rack-7"}, **GPUS)
    domain = children[("ComputeDomain", "rack-7")]
    assert domain["apiVersion"] == "resource.nvidia.com/v1beta1"
    assert domain["spec"] == {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": "rack-7-channel"}}}
    assert schema_errors(domain, load_crd(CD_CRD)) == []
    order = list(children)
    assert order.index(("ComputeDomain", "rack-7")) < order.index(("StatefulSet", expert_name("kimi")))
    pods = _gpu_pods(children)
    for n in (attention_name("kimi"), expert_name("kimi")):
        claim = {"name": "compute-domain-channel", "resourceClaimTemplateName": "rack-7-channel"}
        assert pods[n]["resourceClaims"] == [claim], n
        res = pods[n]["containers"][0]["resources"]
        assert res["claims"] == [{"name": "compute-domain-channel"}] and res["limits"]["nvidia.com/gpu"] > 0, n
        tmpl = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": {"spec": pods[n]}}
        kv.validate(tmpl, "1.34", strict=True)
    # both: the GPUs from the template, the channel beside
    both = _gpu_pods(_children(devices={"computeDomain": "rack-7", "resourceClaimTemplate": "gpus-2"}, **GPUS))
    assert [c["name"] for c in both[expert_name("kimi")]["resourceClaims"]] == ["gpus", "compute-domain-channel"]
    assert "nvidia.com/gpu" not in json.dumps(both[expert_name("kimi")]["containers"][0]["resources"])


def test_the_devices_change_the_pod_template_hash():
    def hashes(children):
        return {n: pod_template(w)["metadata"]["annotations"] for n, w in _workloads(children).items()}

    before, after = hashes(_children(**GPUS)), hashes(_children(devices={"resourceClaimTemplate": "g"}, **GPUS))
    assert before[expert_name("kimi")] != after[expert_name("kimi")]  # pods of the old template are rolling
    assert before[router_name("kimi")] == after[router_name("kimi")]


@pytest.mark.parametrize(
    "over, named",
    [
        ({"devices": {"resourceClaimTemplate": "g"}}, "spec.devices: no pod uses GPUs"),
        ({"devices": {}, **GPUS}, "spec.devices: give resourceClaimTemplate, computeDomain or both"),
        ({"devices": {"computeDomain": "r" * 56}, **GPUS}, "spec.devices.computeDomain"),
        ({"devices": {"computeDomain": "Rack7"}, **GPUS}, "spec.devices.computeDomain"),
        ({"devices": {"resourceClaimTemplate": "a.b"}, **GPUS}, "spec.devices.resourceClaimTemplate"),
        ({"devices": {"gpus": 8}, **GPUS}, "spec.devices.gpus"),
        ({"queueName": "Team-A"}, "spec.queueName"),
        ({"queueName": ""}, "spec.queueName"),
        ({"queueName": "q" * 64}, "spec.queueName"),
    ],
)
def test_bad_fields_are_refused_naming_them(over, named):
    with pytest.raises(SpecError) as e:
        parse_spec(tiny(**over))
    assert named in str(e.value)


def test_rbac_covers_the_compute_domain():
    granted = rbac.as_policy_rules()
    for verb in ("get", "create", "patch"):
        assert rbac.allows(granted, "resource.nvidia.com", "computedomains", verb)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_the_operator_applies_the_domain_and_the_queued_workloads():
    crd = load_crd(CD_CRD)
    async with emulator() as emu:
        register(emu, crd)  # the NVIDIA DRA driver's CRD installed
        deps = Deps(kube=Kube.for_url(str(emu.url).rstrip("/")), fetch_load=no_load, load_timeout=2.0)
        async with run_operator(emu, deps):
            c = Cluster(emu, deps)
            spec = tiny_spec()
            spec["attentionWorkers"]["gpusPerPod"] = 1
            await c.create_moe("kimi", {**spec, "queueName": "team-a", "devices": {"computeDomain": "rack-7"}})
            domain = await eventually(
                lambda: c.get("resource.nvidia.com/v1beta1/computedomains", "rack-7"), what="the ComputeDomain"
            )
            assert schema_errors(domain, crd) == []
            assert domain["metadata"]["ownerReferences"][0]["name"] == "kimi"
            sts = await eventually(lambda: c.get("apps/v1/statefulsets", attention_name("kimi")), what="StatefulSet")
            assert sts["metadata"]["labels"][QUEUE_LABEL] == "team-a"
            pod = sts["spec"]["template"]["spec"]
            assert pod["resourceClaims"][0]["resourceClaimTemplateName"] == "rack-7-channel"
            dep = await eventually(lambda: c.get("apps/v1/deployments", router_name("kimi")), what="Deployment")
            assert dep["metadata"]["labels"][QUEUE_LABEL] == "team-a"
