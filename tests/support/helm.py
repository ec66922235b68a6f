"""Rendering the Helm chart (charts/expertmesh/) with the real helm binary, offline, and picking objects out of it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache, lru_cache

import kubernetes_validate
import pytest
import yaml

from support.paths import REPO

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
