"""spec.gateway.inferencePool (issue #56): the operator renders a Gateway API Inference Extension InferencePool (v1)
whose selector, target port and endpoint picker match the router pods and the picker Service it also renders; the
objects are valid against the InferencePool CRD (tests/data/crds/) and Kubernetes' own schemas; the operator (Kopf,
for real, against kmock's API with the CRD installed) applies them and deletes them when the spec drops the pool."""

from __future__ import annotations

import pytest
from support.crd_schemas import load_crd, register, schema_errors, upstream_crd
from support.kopf_cluster import NS, Cluster, emulator, eventually, no_load, run_operator, tiny_spec
from support.tiny_deployment import by_kind_and_name, tiny

from expertmesh.operator import rbac
from expertmesh.operator.children import absent_children, build_children
from expertmesh.operator.gateway import INFERENCE_POOL_API, epp_service_name, router_headless_name
from expertmesh.operator.handlers import Deps
from expertmesh.operator.kube import Kube
from expertmesh.operator.naming import MAX_NAME_LENGTH, router_name
from expertmesh.operator.spec import SpecError, parse_spec

POOL_CRD = "inferencepools.inference.networking.k8s.io.yaml"
POOLS = f"{INFERENCE_POOL_API}/inferencepools"


def _children(tiny_plan, **over):
    _, cfg, plan = tiny_plan
    return by_kind_and_name(build_children("kimi", "serving", parse_spec(tiny(**over)), cfg, plan))


def _router_container(children):
    return children[("Deployment", router_name("kimi"))]["spec"]["template"]["spec"]["containers"][0]


def test_the_pool_selects_the_router_pods_and_names_their_picker(tiny_plan):
    children = _children(tiny_plan, gateway={"inferencePool": True}, router={"httpPort": 8080})
    pool = children[("InferencePool", "kimi")]
    svc = children[("Service", epp_service_name("kimi"))]
    router = children[("Deployment", router_name("kimi"))]
    pod_labels = router["spec"]["template"]["metadata"]["labels"]
    container = _router_container(children)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": 8080}] and ports["http"] == 8080
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "kimi-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # the picker Service: the router pods' `epp` port, gRPC (HTTP/2)
    assert svc["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [
        {"name": "epp", "port": 9002, "targetPort": "epp", "protocol": "TCP", "appProtocol": "http2"}
    ]
    assert ports["epp"] == 9002
    args = container["args"]
    assert args[args.index("--epp-port") + 1] == "9002"


def test_every_picker_knows_every_router_replica(tiny_plan):
    """With several router replicas and no subset hint from Envoy, each picker must still choose among all of them:
    the router gets `--epp-replicas` naming a headless Service over the router pods on their HTTP port, and the
    router's own parser accepts the rendered command."""
    import argparse

    from expertmesh.router.replica_set import parse_replicas
    from expertmesh.router.server import add_arguments as router_arguments

    children = _children(tiny_plan, gateway={"inferencePool": True}, router={"replicas": 3, "httpPort": 8080})
    container = _router_container(children)
    router = children[("Deployment", router_name("kimi"))]
    headless = children[("Service", router_headless_name("kimi"))]

    p = argparse.ArgumentParser()
    router_arguments(p)
    args = p.parse_args(container["args"][1:])
    assert (args.epp_port, args.epp_replicas) == (9002, "kimi-router-headless.serving.svc:8080")
    assert parse_replicas(args.epp_replicas) == [("kimi-router-headless.serving.svc", 8080)]
    # the Service: headless (its name resolves to every pod), selecting exactly the router pods, on their HTTP port
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert headless["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    assert headless["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": 8080, "protocol": "TCP"}]
    assert {p["containerPort"] for p in container["ports"] if p["name"] == "http"} == {8080}
    # the longest MoEDeployment name still gives a valid Service name (a DNS-1035 label)
    assert len(router_headless_name("x" * MAX_NAME_LENGTH)) <= 63


def test_the_rendered_pool_is_valid_against_the_crd(tiny_plan):
    children = _children(tiny_plan, gateway={"inferencePool": True, "eppPort": 9100, "failureMode": "FailOpen"})
    pool = children[("InferencePool", "kimi")]
    assert schema_errors(pool, load_crd(POOL_CRD)) == []
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    upstream = upstream_crd("inference.networking.k8s.io_inferencepools.yaml")
    if upstream is not None:  # the whole upstream CRD, where one is at hand
        assert schema_errors(pool, upstream) == []


def test_the_schema_check_refuses_what_the_api_server_would(tiny_plan):
    """The check is not vacuous: the pre-v1 shape (extensionRef), a picker Service without a port, a duplicated
    target port, a selector value no label may have."""
    crd = load_crd(POOL_CRD)
    pool = _children(tiny_plan, gateway={"inferencePool": True})[("InferencePool", "kimi")]
    old = {**pool, "spec": {**pool["spec"], "extensionRef": {"name": "kimi-epp"}}}
    del old["spec"]["endpointPickerRef"]
    assert any("extensionRef" in e for e in schema_errors(old, crd))
    no_port = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "kimi-epp"}}}
    assert any("port is required" in e for e in schema_errors(no_port, crd))
    twice = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8000}, {"number": 8000}]}}
    assert any("unique" in e for e in schema_errors(twice, crd))
    bad = {**pool, "spec": {**pool["spec"], "selector": {"matchLabels": {"a": "-x-"}}}}
    assert schema_errors(bad, crd)


def test_off_by_default_and_listed_for_deletion(tiny_plan):
    children = _children(tiny_plan)
    assert not any(k[0] == "InferencePool" or k[1] == "kimi-epp" for k in children)
    container = _router_container(children)
    assert "--epp-port" not in container["args"] and "epp" not in {p["name"] for p in container["ports"]}
    assert "--epp-replicas" not in container["args"] and ("Service", router_headless_name("kimi")) not in children
    gone = absent_children("kimi", parse_spec(tiny()), other_kinds=True)
    assert (INFERENCE_POOL_API, "InferencePool", "kimi") in gone and ("v1", "Service", "kimi-epp") in gone
    assert ("v1", "Service", "kimi-router-headless") in gone
    assert not {k for k in gone if k[1] == "InferencePool"} & set(
        absent_children("kimi", parse_spec(tiny(gateway={"inferencePool": True})), other_kinds=True)
    )


def test_children_validate_against_kubernetes_schemas(tiny_plan):
    kv = pytest.importorskip("kubernetes_validate")
    children = _children(tiny_plan, gateway={"inferencePool": True})
    for key in (("Service", "kimi-epp"), ("Service", "kimi-router-headless"), ("Deployment", router_name("kimi"))):
        kv.validate(children[key], "1.30", strict=True)


@pytest.mark.parametrize(
    "gateway, named",
    [
        ({"eppPort": 8000}, "spec.gateway.eppPort=8000"),  # the router's HTTP port
        ({"eppPort": 50051}, "spec.gateway.eppPort=50051"),  # its gRPC port
        ({"eppPort": 0}, "spec.gateway.eppPort"),
        ({"failureMode": "Retry"}, "spec.gateway.failureMode"),
        ({"inferencePool": "yes"}, "spec.gateway.inferencePool"),
        ({"picker": "x"}, "spec.gateway.picker"),
    ],
)
def test_bad_gateway_fields_are_refused_naming_them(gateway, named):
    with pytest.raises(SpecError) as e:
        parse_spec(tiny(gateway=gateway))
    assert named in str(e.value)


def test_rbac_covers_the_pool():
    granted = rbac.as_policy_rules()
    for verb in ("get", "create", "patch", "delete"):
        assert rbac.allows(granted, "inference.networking.k8s.io", "inferencepools", verb)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_the_operator_applies_the_pool_and_deletes_it_when_dropped():
    crd = load_crd(POOL_CRD)
    async with emulator() as emu:
        register(emu, crd)  # the CRD installed
        deps = Deps(kube=Kube.for_url(str(emu.url).rstrip("/")), fetch_load=no_load, load_timeout=2.0)
        async with run_operator(emu, deps):
            c = Cluster(emu, deps)
            await c.create_moe("kimi", {**tiny_spec(), "gateway": {"inferencePool": True}})
            pool = await eventually(lambda: c.get(POOLS, "kimi"), what="the InferencePool")
            svc = await eventually(lambda: c.get("v1/services", "kimi-epp"), what="the picker Service")
            assert schema_errors(pool, crd) == []
            owner = pool["metadata"]["ownerReferences"][0]
            assert (owner["kind"], owner["name"]) == ("MoEDeployment", "kimi")
            assert pool["metadata"]["namespace"] == NS
            assert svc["spec"]["ports"][0]["port"] == 9002
            assert c.router_arg("kimi", "--epp-port") == "9002"
            assert c.router_arg("kimi", "--epp-replicas") == f"kimi-router-headless.{NS}.svc:8000"
            assert (await eventually(lambda: c.get("v1/services", "kimi-router-headless")))["spec"][
                "clusterIP"
            ] == "None"
            await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="phase Deploying")

            await c.patch_moe("kimi", {"spec": {"gateway": {"inferencePool": False}}})
            await eventually(lambda: c.get(POOLS, "kimi") is None, what="the InferencePool deleted")
            await eventually(lambda: c.get("v1/services", "kimi-epp") is None, what="the picker Service deleted")
            await eventually(lambda: c.get("v1/services", "kimi-router-headless") is None, what="headless deleted")
            assert c.router_arg("kimi", "--epp-port") is None and c.router_arg("kimi", "--epp-replicas") is None
