"""The tiny MoEDeployment the operator's unit tests render, and readers of the children it renders."""

from __future__ import annotations

from expertmesh.operator.spec import GIB

TINY_EXPERT_BYTES = 3264  # one tiny expert in MXFP4


def tiny(**over) -> dict:
    """A spec of the tiny preset on two CPU expert pods with room for 30 experts each; `over` replaces top-level
    fields (a dict is merged one level deep)."""
    spec = {
        "model": {"preset": "tiny", "checkpoint": {"pvc": {"claimName": "weights", "path": "/ckpt/tiny"}}},
        "attentionWorkers": {"gpusPerPod": 0},
        "expertWorkers": {
            "replicas": 2,
            "gpusPerPod": 0,
            "reserveGiB": 0,
            "gpuMemoryGiB": (30 * TINY_EXPERT_BYTES + 10) / GIB,
        },
    }
    for k, v in over.items():
        spec[k] = {**spec.get(k, {}), **v} if isinstance(v, dict) else v
    return spec


def by_kind_and_name(children: list[dict]) -> dict:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def reachable(children: list[dict], prefix: str) -> set:
    """(source workload, target workload, ports or None for any) that the NetworkPolicies named `prefix`* admit,
    between the workloads of `children`."""
    pods = {
        c["metadata"]["name"]: c["spec"]["template"]["metadata"]["labels"]
        for c in children
        if c["kind"] in ("StatefulSet", "Deployment")
    }
    allowed = set()
    for p in (c for c in children if c["kind"] == "NetworkPolicy" and c["metadata"]["name"].startswith(prefix)):
        assert p["spec"]["policyTypes"] == ["Ingress"]
        sel = p["spec"]["podSelector"]["matchLabels"]
        for target in (n for n, lab in pods.items() if sel.items() <= lab.items()):
            for rule in p["spec"]["ingress"]:
                ports = tuple(sorted(q["port"] for q in rule["ports"])) if "ports" in rule else None
                for source in rule["from"]:
                    src = source["podSelector"]["matchLabels"]
                    allowed |= {(n, target, ports) for n, lab in pods.items() if src.items() <= lab.items()}
    return allowed
