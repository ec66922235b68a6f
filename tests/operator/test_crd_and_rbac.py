"""The generated CRD (up to date, structural, valid), the operator's RBAC and its namespace or cluster scope."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import yaml
from support.tiny_deployment import tiny

from expertmesh.operator import crd, rbac
from expertmesh.operator.children import absent_children, build_children
from expertmesh.operator.kube import resource
from expertmesh.operator.main import add_arguments, operator_kwargs
from expertmesh.operator.spec import parse_spec


def test_committed_crd_is_up_to_date():
    committed = crd.DEFAULT_PATH.read_text()
    assert committed == crd.render(), (
        "stale CRD: regenerate with `python -m expertmesh.operator.crd --out "
        "charts/expertmesh/crds/moedeployments.expertmesh.dev.yaml`"
    )
    r = subprocess.run([sys.executable, "-m", "expertmesh.operator.crd", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_crd_check_fails_when_stale(tmp_path):
    stale = tmp_path / "crd.yaml"
    stale.write_text(crd.render().replace("imbalanceThreshold", "imbalanceThreshhold"))
    assert crd.main(["--check", "--out", str(stale)]) == 1
    assert crd.main(["--out", str(stale)]) == 0 and crd.main(["--check", "--out", str(stale)]) == 0


def test_crd_is_structural_with_defaults_columns_and_subresources():
    doc = yaml.safe_load(crd.DEFAULT_PATH.read_text())
    assert doc["metadata"]["name"] == "moedeployments.expertmesh.dev"
    names = doc["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("MoEDeployment", "moedeployments", ["moe"])
    v = doc["spec"]["versions"][0]
    assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
    schema = v["schema"]["openAPIV3Schema"]
    assert crd.check_structural(schema) == []
    text = yaml.safe_dump(schema)
    assert "$ref" not in text and "anyOf" not in text and "definitions" not in text
    spec = schema["properties"]["spec"]
    ew = spec["properties"]["expertWorkers"]
    assert ew["default"] == {} and ew["properties"]["replicas"] == {
        "type": "integer",
        "description": "expert worker pods (StatefulSet ordinals 0..replicas-1)",
        "default": 2,
        "minimum": 1,
        "maximum": 512,
    }
    assert ew["properties"]["gpuMemoryGiB"]["minimum"] == 0 and ew["properties"]["gpuMemoryGiB"]["exclusiveMinimum"]
    assert spec["properties"]["model"]["properties"]["config"]["x-kubernetes-preserve-unknown-fields"] is True
    limits = spec["properties"]["router"]["properties"]["resources"]["properties"]["limits"]
    assert (
        limits["additionalProperties"]["x-kubernetes-int-or-string"] is True
        and "type" not in limits["additionalProperties"]
    )
    assert limits["additionalProperties"]["maximum"] and limits["additionalProperties"]["pattern"]
    assert spec["properties"]["model"]["properties"]["preset"]["enum"] == ["tiny", "small", "full-2.8t"]
    assert spec["required"] == ["model"]
    # preserve-unknown only where free-form data is expected
    preserved = [p for p, node in _walk(schema) if node.get("x-kubernetes-preserve-unknown-fields")]
    assert preserved == [".spec.model.config"]
    assert v["subresources"]["scale"]["specReplicasPath"] == ".spec.expertWorkers.replicas"
    assert v["subresources"]["scale"]["statusReplicasPath"] == ".status.expertWorkers.ready"
    assert "status" in v["subresources"]
    cols = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"]}
    assert cols == {
        "Phase": ".status.phase",
        "Ready": ".status.readyWorkers",
        "Desired": ".status.desiredWorkers",
        "Experts": ".status.placement.physicalExperts",
        "Imbalance": ".status.placement.imbalance",
        "Age": ".metadata.creationTimestamp",
    }
    status = schema["properties"]["status"]["properties"]
    assert status["conditions"]["items"]["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert status["phase"]["enum"] == ["Pending", "Planning", "Deploying", "Ready", "Degraded", "Failed"]


def _walk(node, path=""):
    yield path, node
    for k, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{k}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


def test_structural_checker_catches_violations():
    bad = {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "b": {"$ref": "#/x"},
            "c": {"properties": {}},
        },
    }
    problems = crd.check_structural(bad)
    assert any(".a: has anyOf" in p for p in problems) and any(".b: has $ref" in p for p in problems)
    assert any(".c: has no type" in p for p in problems)


def test_crd_and_children_validate_against_kubernetes_schemas(tiny_plan):
    kv = pytest.importorskip("kubernetes_validate")
    spec, cfg, plan = tiny_plan
    full = parse_spec(
        tiny(
            telemetry={"otlpEndpoint": "http://otel:4317"},
            router={
                "apiKeySecretRef": {"name": "keys", "key": "api"},
                "replicas": 2,
                "resources": {"limits": {"cpu": "2", "memory": "4Gi"}},
            },
            scheduling={
                "nodeSelector": {"pool": "gpu"},
                "topologySpreadKey": "kubernetes.io/hostname",
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
            expertWorkers={"gpusPerPod": 8},
            kv={"hostGiB": 8, "disk": {"sizeGiB": 10, "pvc": {}}},
        )
    )
    kv.validate(crd.build_crd(), "1.30", strict=True)
    for child in build_children("kimi", "serving", full, cfg, plan):
        kv.validate(child, "1.30", strict=True)


def test_rbac_covers_every_kind_the_operator_writes(tiny_plan):
    spec, cfg, plan = tiny_plan
    granted = rbac.as_policy_rules()
    group = {
        "v1": "",
        "apps/v1": "apps",
        "policy/v1": "policy",
        "networking.k8s.io/v1": "networking.k8s.io",
        "autoscaling/v2": "autoscaling",
        "inference.networking.k8s.io/v1": "inference.networking.k8s.io",
    }
    pools = parse_spec(tiny(prefillWorkers={"autoscale": {"maxReplicas": 2, "target": 100}}))
    for child in build_children("kimi", "ns", spec, cfg, plan) + build_children("kimi", "ns", pools, cfg, plan):
        for verb in ("get", "create", "patch"):
            plural = resource(child["apiVersion"], child["kind"])._api_info.plural  # as the client addresses it
            assert rbac.allows(granted, group[child["apiVersion"]], plural, verb), child["kind"]
    for verb in ("get", "list", "watch", "patch"):
        assert rbac.allows(granted, "expertmesh.dev", "moedeployments", verb)
    assert rbac.allows(granted, "expertmesh.dev", "moedeployments/status", "patch")
    # pods: watched, never created, patched, updated or deleted (a new plan is adopted live)
    assert rbac.allows(granted, "", "pods", "watch") and rbac.allows(granted, "", "pods/log", "get")
    # children a later spec no longer has are deleted (children.absent_children); the pools' sizes are watched
    for api_version, kind, _ in absent_children("kimi", spec):
        assert rbac.allows(granted, group[api_version], resource(api_version, kind)._api_info.plural, "delete"), kind
    assert rbac.allows(granted, "apps", "statefulsets", "watch") and rbac.allows(
        granted, "apps", "statefulsets", "list"
    )
    assert not any(rbac.allows(granted, "", "pods", v) for v in ("create", "patch", "update", "delete"))
    # secrets: the worker-TLS Secret is read and created once, never patched, listed or watched
    assert rbac.allows(granted, "", "secrets", "get") and rbac.allows(granted, "", "secrets", "create")
    assert not any(rbac.allows(granted, "", "secrets", v) for v in ("list", "watch", "patch", "update"))
    assert rbac.missing(granted) == []
    assert rbac.missing([r for r in granted if r["resources"] != ["pods"]]) == [
        "core/pods:get",
        "core/pods:list",
        "core/pods:watch",
    ]
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in granted)


def test_cli_namespace_scoped_or_clusterwide():
    p = argparse.ArgumentParser()
    add_arguments(p)
    kw = operator_kwargs(p.parse_args([]))
    assert kw == {"liveness_endpoint": "http://0.0.0.0:8080/healthz", "clusterwide": True, "standalone": True}
    kw = operator_kwargs(
        p.parse_args(["-n", "serving", "--namespace", "team-*", "--liveness", "none", "--peering", "expertmesh"])
    )
    priority = kw.pop("priority")
    assert kw == {"liveness_endpoint": None, "namespaces": ["serving", "team-*"], "peering_name": "expertmesh"}
    assert 0 < priority < 2**31  # random: two replicas never tie (Kopf would pause both)
    kw = operator_kwargs(p.parse_args(["--peering", "expertmesh", "--priority", "7"]))
    assert (kw["priority"], kw["clusterwide"], "standalone" in kw) == (7, True, False)
