"""The Helm chart's example MoEDeployment and its helm test, the CRD it ships (structural, valid, pruning
nothing of the example), values the schema refuses, and the example's pools as the operator reads them."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.helm import (
    CHART,
    CRD_FILE,
    K8S_VERSION,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    _set_args,
    by_kind,
    one,
    render,
    run_helm,
)
from support.paths import REPO
from support.restricted_pss import pod_templates, violations

from expertmesh.operator.naming import attention_name, router_name
from expertmesh.operator.spec import KIND, parse_spec, resolve_model


# ------------------------------------------------------------------------------------------------ example + helm test
def test_example_off_by_default():
    docs = render({})
    assert not by_kind(docs, KIND) and not by_kind(docs, "Pod")


@pytest.mark.parametrize("set_name", ["example", "example-namespaced-pvc", "long-release", "example-pools"])
def test_example_and_its_helm_test(set_name):
    values, release = VALUE_SETS[set_name]
    ex_values = values["example"]
    docs = render(values, release)
    ex = one(docs, KIND)
    spec = parse_spec(ex["spec"])
    watched = values.get("operator", {}).get("watchNamespace") or NAMESPACE
    assert ex["metadata"]["namespace"] == watched
    assert spec.model.preset == ex_values.get("preset", "tiny")
    assert spec.expert_workers.replicas == ex_values.get("expertWorkers", 2)
    assert spec.attention_workers.replicas == ex_values.get("attentionWorkers", 1)
    assert spec.transport == ex_values.get("transport", "grpc")
    assert spec.expert_workers.gpus_per_pod == spec.attention_workers.gpus_per_pod == 0
    # the pools: a prefill pool only when the values ask for one, autoscalers only when enabled
    pre = ex_values.get("prefillWorkers", {})
    pre_auto, att_auto = pre.get("autoscale", {}), ex_values.get("attentionAutoscale", {})
    assert spec.prefill_workers.enabled == bool(pre.get("replicas") or pre_auto.get("enabled"))
    assert ("prefillWorkers" in ex["spec"]) == spec.prefill_workers.enabled
    assert spec.prefill_workers.replicas == pre.get("replicas", 0)
    assert spec.prefill_workers.min_prompt_tokens == pre.get("minPromptTokens", 0)
    for auto, got in ((pre_auto, spec.prefill_workers.autoscale), (att_auto, spec.attention_workers.autoscale)):
        assert (got is not None) == bool(auto.get("enabled"))
        if got is not None:
            defaults = yaml.safe_load((CHART / "values.yaml").read_text())["example"]
            want = {
                **(defaults["prefillWorkers"]["autoscale"] if auto is pre_auto else defaults["attentionAutoscale"]),
                **auto,
            }
            assert (got.min_replicas, got.max_replicas, got.metric, got.target) == (
                want["minReplicas"],
                want["maxReplicas"],
                want["metric"],
                want["target"],
            )
    pvc = ex_values.get("checkpoint", {}).get("pvc")
    if pvc:
        assert spec.model.checkpoint.pvc.claim_name == pvc["claimName"] and spec.model.checkpoint.uri is None
    else:
        assert spec.model.checkpoint.uri == "/opt/expertmesh/checkpoints/tiny"  # baked in by the Dockerfile
    # the helm test pod: a test hook that calls the example's router Service (named as the operator names it)
    (pod,) = by_kind(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["metadata"]["namespace"] == watched and pod["spec"]["restartPolicy"] == "Never"
    script = " ".join(pod["spec"]["containers"][0]["command"] + pod["spec"]["containers"][0]["args"])
    router_url = f"http://{router_name(ex['metadata']['name'])}:{spec.router.http_port}"
    assert router_url in script and "/health" in script and "/v1/models" in script
    compile(pod["spec"]["containers"][0]["args"][0], "test-router", "exec")  # the inline script is valid Python
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True


def test_notes_say_what_to_do_next():
    for values, expected in [
        (
            {},
            [
                "kubectl -n em-system apply -f -",
                "kind: MoEDeployment",
                "get moe",
                "port-forward service/tiny-router 8000:8000",
            ],
        ),
        (
            {"example": {"enabled": True}},
            [
                "get moe em-expertmesh-example",
                "helm test em",
                "port-forward service/em-expertmesh-example-router 8000:8000",
            ],
        ),
    ]:
        out = run_helm(
            "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, *_set_args(values)
        ).stdout
        notes = out.split("NOTES:", 1)[1]
        for text in expected:
            assert text in notes, f"{text!r} not in NOTES for {values}:\n{notes}"


# ------------------------------------------------------------------------------------------------ the CRD
def _crd() -> dict:
    if not CRD_FILE.exists():
        pytest.skip(
            f"{CRD_FILE.relative_to(REPO)} not generated yet "
            "(python -m expertmesh.operator.crd --out ...): CRD checks not run"
        )
    return yaml.safe_load(CRD_FILE.read_text())


def _crd_schema(crd: dict) -> dict:
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


def _structural_problems(node: dict, path: str = "") -> list[str]:
    """The API server's structural-schema rules that a generator can break: a type on every node (unless
    int-or-string / preserve-unknown-fields), no $ref / combinators / const / nullable-free unions."""
    out = [
        f"{path or '.'}: {k}"
        for k in ("$ref", "$defs", "definitions", "anyOf", "oneOf", "allOf", "not", "const")
        if k in node
    ]
    if (
        "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out.append(f"{path or '.'}: no type")
    if node.get("additionalProperties") is False or ("properties" in node and "additionalProperties" in node):
        out.append(f"{path or '.'}: additionalProperties with properties / false")
    for name, sub in node.get("properties", {}).items():
        out += _structural_problems(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out += _structural_problems(node[key], f"{path}[{key}]")
    return out


def _pruned(obj, schema: dict, path: str) -> list[str]:
    """Fields the API server would silently prune (not in the schema): typos in the example."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(obj, dict) and "properties" in schema:
        for k, v in obj.items():
            if k not in schema["properties"]:
                out.append(f"{path}.{k}")
            else:
                out += _pruned(v, schema["properties"][k], f"{path}.{k}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, v in obj.items():
            out += _pruned(v, schema["additionalProperties"], f"{path}.{k}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(obj):
            out += _pruned(v, schema["items"], f"{path}[{i}]")
    return out


def test_crd_is_structural_and_valid():
    crd = _crd()
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], names["kind"], names["plural"], "moe" in names["shortNames"]) == (
        "expertmesh.dev",
        KIND,
        "moedeployments",
        True,
    )
    assert _structural_problems(_crd_schema(crd)) == []
    # helm installs it from crds/ before the templates (so the example can be created in the same install),
    # with Kopf's peering resources (leader election of the operator replicas)
    crds = by_kind(render({}, include_crds=True), "CustomResourceDefinition")
    assert sorted(c["metadata"]["name"] for c in crds) == [
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
        "moedeployments.expertmesh.dev",
    ]
    for c in crds:
        kubernetes_validate.validate(c, K8S_VERSION, strict=True)


@pytest.mark.parametrize("set_name", ["example", "example-namespaced-pvc", "custom-image", "example-pools"])
def test_example_matches_crd_schema(set_name):
    values, release = VALUE_SETS[set_name]
    schema = _crd_schema(_crd())
    ex = one(render(values, release), KIND)
    # OpenAPI v3.0 keeps draft-4 semantics (boolean exclusiveMinimum); x-kubernetes-* keys are ignored
    errors = sorted(jsonschema.Draft4Validator(schema).iter_errors(ex), key=lambda e: list(e.path))
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    # the schema's metadata restricts name and generateName only (the API server keeps the rest of metadata)
    assert _pruned({k: v for k, v in ex.items() if k != "metadata"}, schema, "") == []


# ------------------------------------------------------------------------------------------------ bad values
BAD_VALUES = [
    ({"operator": {"replicas": -1}}, "/operator/replicas"),
    ({"operator": {"replicas": 6}}, "/operator/replicas"),  # a leader and at most 4 standbys
    ({"operator": {"replicas": "two"}}, "/operator/replicas"),
    ({"operator": {"healthPort": 80}}, "/operator/healthPort"),  # non-root cannot bind below 1024
    ({"operator": {"logLevel": "trace"}}, "/operator/logLevel"),
    ({"operator": {"watchNamespace": "Bad_NS"}}, "/operator/watchNamespace"),
    ({"operator": {"resources": {"requests": {"cpu": "lots"}}}}, "/operator/resources/requests/cpu"),
    ({"operator": {"resources": {"request": {"cpu": "1"}}}}, "'request'"),
    ({"operator": {"tolerations": [{"key": "a", "effect": "Sometimes"}]}}, "/operator/tolerations/0/effect"),
    ({"operator": {"nodeSelector": {"zone": 1}}}, "/operator/nodeSelector/zone"),
    ({"operator": {"replica": 1}}, "'replica'"),  # typo: unknown key
    ({"unknownTopLevel": True}, "'unknownTopLevel'"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"image": {"tag": 1.2}}, "/image/tag"),
    ({"image": {"repository": ""}}, "/image/repository"),
    ({"imagePullSecrets": ["regcred"]}, "/imagePullSecrets/0"),
    ({"rbac": {"create": "yes"}}, "/rbac/create"),
    ({"serviceAccount": {"create": False}}, "serviceAccount.name"),  # required, by the template
    ({"example": {"enabled": True, "preset": "full-2.8t"}}, "/example/preset"),
    ({"example": {"expertWorkers": 0}}, "/example/expertWorkers"),
    ({"example": {"transport": "nccl"}}, "/example/transport"),
    ({"example": {"name": "Not_A_Label"}}, "/example/name"),
    ({"example": {"name": "x" * 41}}, "/example/name"),
    ({"example": {"prefillWorkers": {"replicas": -1}}}, "/example/prefillWorkers/replicas"),
    ({"example": {"prefillWorkers": {"autoscale": {"metric": "gpu"}}}}, "/example/prefillWorkers/autoscale/metric"),
    ({"example": {"attentionAutoscale": {"target": 0}}}, "/example/attentionAutoscale/target"),
    ({"example": {"attentionAutoscale": {"maxReplicas": 0}}}, "/example/attentionAutoscale/maxReplicas"),
    ({"networkPolicy": {"enabled": "no"}}, "/networkPolicy/enabled"),
    ({"operator": {"allowedHostPaths": ["relative/dir"]}}, "/operator/allowedHostPaths/0"),
    ({"operator": {"allowedHostPaths": ["/var/cache/../../etc"]}}, "/operator/allowedHostPaths/0"),
    ({"operator": {"allowedHostPaths": ["/a,/etc"]}}, "/operator/allowedHostPaths/0"),  # the flag's separator
    ({"operator": {"allowedHostPaths": "/var/cache/expertmesh"}}, "/operator/allowedHostPaths"),
]


@pytest.mark.parametrize("values, named", BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_bad_values_fail_naming_the_value(values, named):
    proc = run_helm("template", RELEASE, str(CHART), *_set_args(values), check=False)
    assert proc.returncode != 0, f"helm template accepted {values}"
    assert named in proc.stderr, f"error does not name {named!r}:\n{proc.stderr}"


def test_example_pools_become_the_operators_prefill_pool_and_autoscalers():
    """The example with a prefill pool and both autoscalers: the operator (its pure rendering, from the rendered
    MoEDeployment) makes the prefill StatefulSet, an HPA per pool and the router's --prefill list."""
    from expertmesh.operator.children import build_children
    from expertmesh.operator.placement_policy import plan_for

    values, release = VALUE_SETS["example-pools"]
    ex = one(render(values, release), KIND)
    name, spec = ex["metadata"]["name"], parse_spec(ex["spec"])
    cfg = resolve_model(spec)
    by = {
        (c["kind"], c["metadata"]["name"]): c for c in build_children(name, NAMESPACE, spec, cfg, plan_for(spec, cfg))
    }
    pre = values["example"]["prefillWorkers"]["autoscale"]
    assert by[("StatefulSet", f"{name}-prefill")]["spec"]["replicas"] == pre["minReplicas"]
    assert by[("HorizontalPodAutoscaler", f"{name}-prefill")]["spec"]["maxReplicas"] == pre["maxReplicas"]
    att = by[("HorizontalPodAutoscaler", attention_name(name))]["spec"]
    assert att["metrics"][0]["external"]["metric"]["name"] == "expertmesh_pool_kv_utilization"
    args = by[("Deployment", router_name(name))]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert len(args[args.index("--prefill") + 1].split(",")) == pre["minReplicas"]
    assert args[args.index("--prefill-min-tokens") + 1] == "32"


@pytest.mark.parametrize("set_name", ["example", "example-namespaced-pvc", "example-pools"])
def test_the_examples_pods_pass_the_restricted_standard(set_name):
    """What the operator renders for the chart's example MoEDeployment (no node directory): every pod admitted under
    `enforce: restricted`."""
    from expertmesh.operator.children import build_children
    from expertmesh.operator.placement_policy import plan_for

    values, release = VALUE_SETS[set_name]
    ex = one(render(values, release), KIND)
    name, spec = ex["metadata"]["name"], parse_spec(ex["spec"])
    cfg = resolve_model(spec)
    templates = pod_templates(build_children(name, NAMESPACE, spec, cfg, plan_for(spec, cfg)))
    assert len(templates) >= 3
    for where, pod, notes in templates:
        assert violations(pod, notes) == [], where
