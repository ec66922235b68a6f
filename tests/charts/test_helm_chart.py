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
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.helm import (
    CHART,
    COMMON_LABELS,
    DNS_LABEL,
    K8S_VERSION,
    LABEL_VALUE,
    LONG_RELEASE,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    _set_args,
    by_kind,
    one,
    operator_container,
    render,
    run_helm,
)
from support.paths import REPO
from support.restricted_pss import pod_templates, violations

from expertmesh.operator import main as operator_main
from expertmesh.operator import rbac
from expertmesh.operator.naming import attention_name
from expertmesh.operator.pod_security import parse_allowed_host_paths
from expertmesh.operator.spec import API_VERSION, KIND, parse_spec, resolve_model


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
    # the admin's hostPath allow-list reaches the operator as given (default: the checkpoint cache's directory)
    assert parse_allowed_host_paths(args.allowed_host_paths) == tuple(op.get("allowedHostPaths", DEFAULT_ALLOWED))


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


DEFAULT_ALLOWED = ["/var/cache/expertmesh"]


@pytest.mark.parametrize("allowed", [["/mnt/nvme", "/var/cache/expertmesh"], []], ids=["two", "none"])
def test_allowed_host_paths_become_the_operators_flag(allowed):
    c = operator_container(render({"operator": {"allowedHostPaths": allowed}}))
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    args = parser.parse_args(c["args"][1:])
    assert parse_allowed_host_paths(args.allowed_host_paths) == tuple(allowed)


def test_the_operator_pod_passes_the_restricted_standard(rendered):
    name, _, docs = rendered
    for where, pod, notes in pod_templates([d for d in docs if d["kind"] in ("Deployment", "Pod")]):
        assert violations(pod, notes) == [], (name, where)
