"""The Helm chart (charts/expertmesh/), rendered by the real helm binary and checked offline.

helm comes from PATH or `.tools/bin/helm` (installed by `scripts/install-tools.sh`); without it these tests
fail, never skip. Every rendered object is validated against the Kubernetes 1.3x OpenAPI schemas bundled with
`kubernetes-validate` (strict: unknown fields are errors); the example MoEDeployment against the operator's own
spec models and, when the generated CRD is in the chart, against the CRD's openAPIV3Schema.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shutil
import subprocess
import tomllib
from functools import cache, lru_cache

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.paths import REPO

from expertmesh.operator import main as operator_main
from expertmesh.operator import rbac
from expertmesh.operator.naming import attention_name, router_name
from expertmesh.operator.spec import API_VERSION, KIND, parse_spec, resolve_model

CHART = REPO / "charts" / "expertmesh"
CRD_FILE = CHART / "crds" / "moedeployments.expertmesh.dev.yaml"
NAMESPACE = "em-system"
RELEASE = "em"
# the newest 1.3x schema set kubernetes-validate bundles (the chart's kubeVersion floor is 1.28)
K8S_VERSION = max(
    (v for v in kubernetes_validate.utils.all_versions() if v.startswith("1.3")),
    key=lambda v: tuple(int(p) for p in v.split(".")),
)

COMMON_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "helm.sh/chart",
)
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
LONG_RELEASE = "a-very-long-release-name-that-fills-helms-53-char-cap"  # 53 characters: helm's maximum
assert len(LONG_RELEASE) == 53


# ------------------------------------------------------------------------------------------------ helm
@lru_cache(maxsize=1)
def helm() -> str:
    found = shutil.which("helm") or (str(REPO / ".tools/bin/helm") if (REPO / ".tools/bin/helm").exists() else None)
    if found is None:
        pytest.fail("helm not found on PATH nor at .tools/bin/helm: run scripts/install-tools.sh", pytrace=False)
    return found


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}", pytrace=False)
    return proc


def _set_args(values: dict) -> list[str]:
    """`--set-json key=<json>` per top-level key: types survive exactly (no --set string guessing)."""
    return [a for k, v in values.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]


@cache
def _render(values_json: str, release: str, include_crds: bool) -> tuple:
    args = [
        "template",
        release,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        f"v{K8S_VERSION}",
        *_set_args(json.loads(values_json)),
    ]
    if include_crds:
        args.append("--include-crds")
    docs = [d for d in yaml.safe_load_all(run_helm(*args).stdout) if d]
    return tuple(json.dumps(d) for d in docs)


def render(values: dict | None = None, release: str = RELEASE, include_crds: bool = False) -> list[dict]:
    """The objects `helm template` renders (fresh copies; cached per value set)."""
    return [json.loads(d) for d in _render(json.dumps(values or {}, sort_keys=True), release, include_crds)]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def operator_container(docs: list[dict]) -> dict:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


# Value sets the rendering/validation tests run over (ids name them in failures).
VALUE_SETS = {
    "defaults": ({}, RELEASE),
    "namespaced": ({"rbac": {"namespaced": True}}, RELEASE),
    "watch-namespace": ({"operator": {"watchNamespace": "models"}}, RELEASE),
    "example": ({"example": {"enabled": True}}, RELEASE),
    "example-namespaced-pvc": (
        {
            "example": {
                "enabled": True,
                "name": "kimi-tiny",
                "expertWorkers": 3,
                "transport": "collective",
                "checkpoint": {"uri": "/unused", "pvc": {"claimName": "weights", "path": "/tiny"}},
            },
            "operator": {"watchNamespace": "models"},
        },
        RELEASE,
    ),
    "example-pools": (
        {
            "example": {
                "enabled": True,
                "attentionWorkers": 2,
                "prefillWorkers": {
                    "replicas": 2,
                    "minPromptTokens": 32,
                    "autoscale": {
                        "enabled": True,
                        "minReplicas": 2,
                        "maxReplicas": 6,
                        "metric": "requests_waiting",
                        "target": 3,
                    },
                },
                "attentionAutoscale": {"enabled": True, "maxReplicas": 5, "target": 0.75},
            }
        },
        RELEASE,
    ),
    "custom-image": (
        {
            "image": {"repository": "registry.example.com/ml/expertmesh", "tag": "0.1.0-cu129", "pullPolicy": "Always"},
            "imagePullSecrets": [{"name": "regcred"}],
            "example": {"enabled": True},
        },
        RELEASE,
    ),
    "custom-operator": (
        {
            "operator": {
                "replicas": 0,
                "logLevel": "debug",
                "healthPort": 9443,
                "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": 2, "memory": "2Gi"}},
                "nodeSelector": {"kubernetes.io/os": "linux"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "control", "effect": "NoSchedule"}],
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}
                                    ]
                                }
                            ]
                        }
                    }
                },
                "podAnnotations": {"prometheus.io/scrape": "false"},
                "podLabels": {"team": "inference"},
                "priorityClassName": "system-cluster-critical",
            },
            "serviceAccount": {"annotations": {"iam.example.com/role": "expertmesh"}},
            "networkPolicy": {"enabled": True},
        },
        RELEASE,
    ),
    "existing-sa-no-rbac": (
        {"serviceAccount": {"create": False, "name": "preexisting"}, "rbac": {"create": False}},
        RELEASE,
    ),
    "long-release": ({"example": {"enabled": True}, "rbac": {"namespaced": True}}, LONG_RELEASE),
    "long-fullname": ({"fullnameOverride": "x" * 63, "example": {"enabled": True}}, RELEASE),
}


@pytest.fixture(params=sorted(VALUE_SETS), ids=str)
def rendered(request) -> tuple[str, dict, list[dict]]:
    values, release = VALUE_SETS[request.param]
    return request.param, values, render(values, release)


# ------------------------------------------------------------------------------------------------ chart basics
def test_helm_lint_strict():
    run_helm("lint", "--strict", str(CHART))
    run_helm(
        "lint",
        "--strict",
        str(CHART),
        "--namespace",
        NAMESPACE,
        *_set_args({"example": {"enabled": True}, "rbac": {"namespaced": True}}),
    )


def test_chart_metadata_matches_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2" and chart["name"] == "expertmesh" and chart["type"] == "application"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == project["version"] == importlib.metadata.version("expertmesh")
    assert chart["kubeVersion"] == ">=1.28.0-0" and chart["description"]


def test_kube_version_floor_enforced():
    proc = run_helm("template", RELEASE, str(CHART), "--kube-version", "1.27.0", check=False)
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr, proc.stderr


def test_values_yaml_documents_every_key():
    """Each key the schema defines has a comment line right above it in values.yaml (free-form contents such
    as resources.requests.cpu excepted), and values.yaml sets every key the schema defines."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented, seen, stack = [], set(), []  # stack: (indent, key) of the enclosing mappings
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [k for _, k in stack] + [m.group(2)]
        stack.append((indent, m.group(2)))
        node = schema
        for key in path:
            node = node.get("properties", {}).get(key) if node is not None else None
        if node is None:
            continue  # inside a free-form value
        seen.add(".".join(path))
        if not lines[i - 1].strip().startswith("#"):
            undocumented.append(f"line {i + 1}: {'.'.join(path)}")
    assert not undocumented, undocumented

    def paths(node: dict, prefix: str):
        for k, sub in node.get("properties", {}).items():
            yield f"{prefix}{k}"
            yield from paths(sub, f"{prefix}{k}.")

    assert set(paths(schema, "")) - {"global"} - seen == set(), "schema keys missing from values.yaml"


def test_schema_closes_every_object():
    """additionalProperties: false on every object the chart defines (free-form maps excepted)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)
    open_objects = []

    def walk(node: dict, path: str) -> None:
        if node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is not False:
            open_objects.append(path)
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    assert not open_objects, open_objects


# ------------------------------------------------------------------------------------------------ every value set
def _validate_moedeployment(obj: dict) -> None:
    """Via the operator's spec models (what the operator will accept), for every value set."""
    assert obj["apiVersion"] == API_VERSION and obj["kind"] == KIND
    resolve_model(parse_spec(obj["spec"]))


def test_manifests_validate_against_kubernetes_schemas(rendered):
    name, _, docs = rendered
    assert docs, name
    for obj in docs:
        where = f"[{name}] {obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == KIND:
            _validate_moedeployment(obj)  # the CRD schema check is test_example_matches_crd_schema
            continue
        if obj["apiVersion"] == "kopf.dev/v1":  # Kopf's peering object: no schema beyond its CRD's (crds/)
            assert obj["kind"] in ("ClusterKopfPeering", "KopfPeering") and set(obj) == {
                "apiVersion",
                "kind",
                "metadata",
            }, where
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {'.'.join(map(str, e.path))}: {e.message}", pytrace=False)


def test_labels_and_names(rendered):
    name, values, docs = rendered
    release = VALUE_SETS[name][1]
    for obj in docs:
        meta, where = obj["metadata"], f"[{name}] {obj['kind']}/{obj['metadata']['name']}"
        labels = meta.get("labels", {})
        assert set(COMMON_LABELS) <= set(labels), f"{where}: missing {set(COMMON_LABELS) - set(labels)}"
        assert labels["app.kubernetes.io/instance"] == release[:63]
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/part-of"] == "expertmesh"
        assert labels["app.kubernetes.io/version"] == "0.1.0" and labels["helm.sh/chart"] == "expertmesh-0.1.0"
        for k, v in labels.items():
            assert len(v) <= 63 and LABEL_VALUE.match(v), f"{where}: label {k}={v!r} is not a valid label value"
        assert len(meta["name"]) <= 63 and DNS_LABEL.match(meta["name"]), f"{where}: bad name {meta['name']!r}"
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"):
            assert meta.get("namespace"), f"{where}: namespaced object without a namespace"
    # the pod template carries the labels too, and the selector picks it
    dep = one(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert set(COMMON_LABELS) <= set(pod_labels)
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_operator_deployment_hardened_and_probed(rendered):
    name, values, docs = rendered
    op = values.get("operator", {})
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = operator_container(docs)
    replicas = op.get("replicas", 2)
    assert dep["spec"]["replicas"] == replicas
    if replicas > 1:  # a leader and standbys (Kopf peering): a new pod may start before an old one goes
        assert dep["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
    else:
        assert dep["spec"]["strategy"] == {"type": "Recreate"}  # standalone Kopf: never two pods at once
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001 and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    (tmp,) = [v for v in pod["volumes"] if v["name"] == "tmp"]
    assert "emptyDir" in tmp and {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    # the probes hit the endpoint the operator is told to serve
    port = op.get("healthPort", 8080)
    assert c["ports"] == [{"name": "health", "containerPort": port, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert c["resources"] == op.get(
        "resources", {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    )
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        assert pod.get(key) == op.get(key), key
    if op.get("affinity") or replicas <= 1:
        assert pod.get("affinity") == op.get("affinity")
    else:  # the leader and its standby on different nodes, where there are several
        term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert op.get("podAnnotations", {}).items() <= dep["spec"]["template"]["metadata"].get("annotations", {}).items()
    assert op.get("podLabels", {}).items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert pod.get("imagePullSecrets") == values.get("imagePullSecrets")


def test_operator_args_parse_with_the_real_cli(rendered):
    """The container's args are accepted by `expertmesh operator` and mean what the values say."""
    name, values, docs = rendered
    op = values.get("operator", {})
    c = operator_container(docs)
    assert c["args"][0] == "operator"
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    args = parser.parse_args(c["args"][1:])
    kw = operator_main.operator_kwargs(args)
    assert kw["liveness_endpoint"] == f"http://0.0.0.0:{op.get('healthPort', 8080)}/healthz"
    namespaced = values.get("rbac", {}).get("namespaced") or op.get("watchNamespace")
    if op.get("replicas", 2) > 1:  # leader election through the peering object the chart creates
        (peering,) = [d for d in docs if d["apiVersion"] == "kopf.dev/v1"]
        assert kw["peering_name"] == peering["metadata"]["name"] and "standalone" not in kw
        assert peering["kind"] == ("KopfPeering" if namespaced else "ClusterKopfPeering")
        if namespaced:
            assert peering["metadata"]["namespace"] == (op.get("watchNamespace") or NAMESPACE)
        assert 0 < kw["priority"] < 2**31  # each replica its own (random): Kopf pauses every replica of a tie
    else:
        assert kw.get("standalone") is True and "peering_name" not in kw
        assert not [d for d in docs if d["apiVersion"] == "kopf.dev/v1"]
    if namespaced:
        assert kw["namespaces"] == [op.get("watchNamespace") or NAMESPACE] and "clusterwide" not in kw
    else:
        assert kw["clusterwide"] is True and "namespaces" not in kw
    assert args.verbose == (op.get("logLevel") == "debug")


def test_image_reference(rendered):
    name, values, docs = rendered
    image = {
        "repository": "ghcr.io/expertmesh/expertmesh",
        "tag": "",
        "pullPolicy": "IfNotPresent",
        **values.get("image", {}),
    }
    tag = image["tag"] or "0.1.0"  # "" → the chart's appVersion
    c = operator_container(docs)
    assert c["image"] == f"{image['repository']}:{tag}" and c["imagePullPolicy"] == image["pullPolicy"]
    for ex in by_kind(docs, KIND):  # the example's pods run the same image
        assert ex["spec"]["image"] == {"repository": image["repository"], "tag": tag, "pullPolicy": image["pullPolicy"]}
    for pod in by_kind(docs, "Pod"):
        assert pod["spec"]["containers"][0]["image"] == c["image"]


def test_service_account_and_bindings(rendered):
    name, values, docs = rendered
    sa_values = values.get("serviceAccount", {})
    sa_name = one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    if sa_values.get("create", True):
        sa = one(docs, "ServiceAccount")
        assert sa["metadata"]["name"] == sa_name and sa["metadata"]["namespace"] == NAMESPACE
        assert sa["metadata"].get("annotations", {}) == sa_values.get("annotations", {})
    else:
        assert not by_kind(docs, "ServiceAccount") and sa_name == sa_values["name"]
    roles = {
        (r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"])
        for r in docs
        if r["kind"] in ("Role", "ClusterRole")
    }
    bindings = [b for b in docs if b["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert len(bindings) == len(roles)
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": NAMESPACE}]
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ref["kind"], ns, ref["name"]) in roles, f"{b['metadata']['name']} binds a role the chart lacks"


# ------------------------------------------------------------------------------------------------ RBAC contract
def _triples(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


RULE_TRIPLES = {(r.api_group, r.resource, v) for r in rbac.RULES for v in r.verbs}
CLUSTER_TRIPLES = {t for t in RULE_TRIPLES if (t[0], t[1]) in rbac.CLUSTER_SCOPED}


@pytest.mark.parametrize("values", [{}, {"example": {"enabled": True}}], ids=["defaults", "example"])
def test_cluster_rbac_equals_operator_rules(values):
    docs = render(values)
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")
    role = one(docs, "ClusterRole")
    assert _triples(role["rules"]) == RULE_TRIPLES
    assert not rbac.missing(role["rules"])
    assert all("*" not in field for rule in role["rules"] for field in rule.values())


@pytest.mark.parametrize(
    "values, watched",
    [({"rbac": {"namespaced": True}}, NAMESPACE), ({"operator": {"watchNamespace": "models"}}, "models")],
    ids=["rbac.namespaced", "operator.watchNamespace"],
)
def test_namespaced_rbac_equals_operator_rules(values, watched):
    docs = render(values)
    role, cluster_role = one(docs, "Role"), one(docs, "ClusterRole")
    assert role["metadata"]["namespace"] == one(docs, "RoleBinding")["metadata"]["namespace"] == watched
    # namespaced permissions only in the watched namespace; cluster-wide only what is cluster-scoped
    assert _triples(role["rules"]) == RULE_TRIPLES - CLUSTER_TRIPLES
    assert _triples(cluster_role["rules"]) == CLUSTER_TRIPLES
    assert not rbac.missing(role["rules"] + cluster_role["rules"])


def test_rbac_create_false_renders_no_rbac():
    docs = render({"rbac": {"create": False}})
    assert not [d for d in docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]


# ------------------------------------------------------------------------------------------------ names
def test_long_release_name_truncates_every_name():
    docs = render({"example": {"enabled": True}, "rbac": {"namespaced": True}}, LONG_RELEASE)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert all(len(n) <= 63 and not n.endswith("-") for _, n in names), names
    assert len({n for k, n in names if k in ("ClusterRole", "ClusterRoleBinding")}) == 1  # suffix kept
    assert all(n.endswith("crd-reader") for k, n in names if k == "ClusterRole")
    (pod,) = by_kind(docs, "Pod")
    assert pod["metadata"]["name"].endswith("-test-router")
    ex = one(docs, KIND)["metadata"]["name"]
    # the operator names children "<name>-attention", "<name>-expert-<n>": StatefulSet names must stay <= 52
    assert len(ex) <= 40 and len(attention_name(ex)) <= 52


def test_default_names():
    docs = render({"example": {"enabled": True}})
    assert one(docs, "Deployment")["metadata"]["name"] == "em-expertmesh"
    assert one(docs, "ClusterRole")["metadata"]["name"] == f"{NAMESPACE}-em-expertmesh"
    assert one(docs, KIND)["metadata"]["name"] == "em-expertmesh-example"
    # a release named like the chart is not doubled
    assert one(render({}, "expertmesh"), "Deployment")["metadata"]["name"] == "expertmesh"


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
