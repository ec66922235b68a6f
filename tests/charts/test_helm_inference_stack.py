"""The chart's values for the Kubernetes inference stack (issue #56) with the real helm binary: `example.gateway`,
`example.workload`, `example.queueName` and `example.devices` off by default, rendered into the example
MoEDeployment's spec that the CRD's schema and the operator accept (and the operator turns into an InferencePool,
LeaderWorkerSets, the Kueue label, DRA claims); bad values refused by the values schema naming them; the operator's
ClusterRole covers the new kinds; `helm lint --strict` with them set."""

from __future__ import annotations

import jsonschema
import pytest
import yaml
from support.helm import CHART, CRD_FILE, NAMESPACE, RELEASE, _set_args, one, render, run_helm

from expertmesh.operator.children import build_children
from expertmesh.operator.naming import router_name
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.rbac import allows
from expertmesh.operator.spec import KIND, parse_spec, resolve_model

GATEWAY = {"example": {"enabled": True, "gateway": {"inferencePool": True, "eppPort": 9010}}}


def _children(ex: dict) -> dict:
    schema = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    errors = list(jsonschema.Draft4Validator(schema).iter_errors(ex))
    assert not errors, [e.message for e in errors]
    name, spec = ex["metadata"]["name"], parse_spec(ex["spec"])
    cfg = resolve_model(spec)
    return {
        (c["kind"], c["metadata"]["name"]): c for c in build_children(name, NAMESPACE, spec, cfg, plan_for(spec, cfg))
    }


def test_off_by_default():
    ex = one(render({"example": {"enabled": True}}), KIND)
    assert ex["spec"]["workload"] == "statefulset"
    assert not {"gateway", "queueName", "devices"} & set(ex["spec"])
    spec = parse_spec(ex["spec"])
    assert not spec.gateway.inference_pool and spec.queue_name is None and spec.devices is None


def test_the_example_behind_a_gateway_gets_its_inference_pool():
    ex = one(render(GATEWAY), KIND)
    assert ex["spec"]["gateway"] == {"inferencePool": True, "eppPort": 9010}
    name = ex["metadata"]["name"]
    children = _children(ex)
    pool = children[("InferencePool", name)]
    assert pool["spec"]["endpointPickerRef"]["name"] == f"{name}-epp"
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9010}
    args = children[("Deployment", router_name(name))]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--epp-port") + 1] == "9010"


def test_the_example_as_queued_leader_worker_sets_with_dra_claims():
    values = {
        "example": {
            "enabled": True,
            "gpusPerPod": 1,
            "workload": "leaderworkerset",
            "queueName": "team-a",
            "devices": {"resourceClaimTemplate": "one-gpu", "computeDomain": "rack-1"},
        }
    }
    ex = one(render(values), KIND)
    assert ex["spec"]["workload"] == "leaderworkerset" and ex["spec"]["queueName"] == "team-a"
    assert ex["spec"]["devices"] == {"resourceClaimTemplate": "one-gpu", "computeDomain": "rack-1"}
    children = _children(ex)
    sets = [c for (kind, _), c in children.items() if kind == "LeaderWorkerSet"]
    assert len(sets) == 2 and not [k for k in children if k[0] == "StatefulSet"]
    assert all(s["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" for s in sets)
    claims = sets[0]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["resourceClaims"]
    assert [c["resourceClaimTemplateName"] for c in claims] == ["one-gpu", "rack-1-channel"]
    assert ("ComputeDomain", "rack-1") in children


def test_the_cluster_role_covers_the_new_kinds():
    rules = one(render({}), "ClusterRole")["rules"]
    for group, resource, verbs in (
        ("inference.networking.k8s.io", "inferencepools", ("get", "create", "patch", "delete")),
        ("leaderworkerset.x-k8s.io", "leaderworkersets", ("get", "list", "watch", "create", "patch", "delete")),
        ("resource.nvidia.com", "computedomains", ("get", "create", "patch", "delete")),
    ):
        for verb in verbs:
            assert allows(rules, group, resource, verb), (resource, verb)


def test_lints_with_the_new_values():
    values = {"example": {**GATEWAY["example"], "workload": "leaderworkerset", "queueName": "team-a"}}
    run_helm("lint", "--strict", str(CHART), *_set_args(values))


@pytest.mark.parametrize(
    "example, named",
    [
        ({"gateway": {"inferencePool": "yes"}}, "/example/gateway/inferencePool"),
        ({"gateway": {"eppPort": 0}}, "/example/gateway/eppPort"),
        ({"gateway": {"picker": 1}}, "'picker'"),
        ({"workload": "deployment"}, "/example/workload"),
        ({"queueName": "Team_A"}, "/example/queueName"),
        ({"devices": {"computeDomain": "NVL72"}}, "/example/devices/computeDomain"),
        ({"devices": {"gpus": "x"}}, "'gpus'"),
    ],
)
def test_bad_values_are_refused_naming_them(example, named):
    values = {"example": {"enabled": True, **example}}
    proc = run_helm("template", RELEASE, str(CHART), *_set_args(values), check=False)
    assert proc.returncode != 0, f"helm template accepted {values}"
    assert named in proc.stderr, f"error does not name {named!r}:\n{proc.stderr}"
