"""Other projects' CustomResourceDefinitions (tests/data/crds/: InferencePool, LeaderWorkerSet, ComputeDomain, the
fields expertmesh renders) as the tests use them: an object checked against a CRD's openAPIV3Schema (jsonschema,
with every object closed: a misspelled field is an error here, where the API server would silently prune it) and
its CEL rules (the few these CRDs have, each evaluated in Python; an unknown rule fails the check rather than pass
unread), and the CRD's resource registered in kmock's in-memory API so the operator can apply such objects there.

EXPERTMESH_UPSTREAM_CRDS: a folder holding the upstream CRD files under their upstream names (e.g.
inference.networking.k8s.io_inferencepools.yaml); tests then also check the rendered objects against those.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import jsonschema
import kmock
import yaml

CRD_DIR = Path(__file__).resolve().parent.parent / "data" / "crds"

# CEL rules of these CRDs → the same check in Python (value → whether it holds); transition rules hold on create
CEL_RULES = {
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": lambda v: len({p["number"] for p in v}) == len(v),
    "self.kind != 'Service' || has(self.port)": lambda v: v.get("kind", "Service") != "Service" or "port" in v,
    "self == oldSelf": lambda v: True,
}


def load_crd(filename: str) -> dict:
    return yaml.safe_load((CRD_DIR / filename).read_text())


def upstream_crd(filename: str) -> dict | None:
    """The upstream CRD file named `filename` in $EXPERTMESH_UPSTREAM_CRDS, or None."""
    folder = os.environ.get("EXPERTMESH_UPSTREAM_CRDS")
    if not folder or not (Path(folder) / filename).is_file():
        return None
    return yaml.safe_load((Path(folder) / filename).read_text())


def version_of(crd: dict, version: str) -> dict:
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)


def api_version(crd: dict, version: str) -> str:
    return f"{crd['spec']['group']}/{version}"


def _closed(node: dict) -> dict:
    node = dict(node)
    if "properties" in node:
        node["properties"] = {k: _closed(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
    if isinstance(node.get("items"), dict):
        node["items"] = _closed(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _closed(node["additionalProperties"])
    return node


def schema_errors(obj: dict, crd: dict, *, closed: bool = True) -> list[str]:
    """Where `obj` breaks its version's openAPIV3Schema (closed: unknown fields too) or a CEL rule."""
    v = version_of(crd, obj["apiVersion"].rsplit("/", 1)[-1])
    schema = copy.deepcopy(v["schema"]["openAPIV3Schema"])
    validator = jsonschema.Draft4Validator(_closed(schema) if closed else schema)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in validator.iter_errors(obj)]
    return errors + cel_errors(obj, schema)


def cel_errors(value, schema: dict, path: str = "") -> list[str]:
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            out.append(f"{path or '.'}: CEL rule not evaluated here: {rule['rule']}")
        elif not check(value):
            out.append(f"{path or '.'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for k, sub in (schema.get("properties") or {}).items():
            if k in value:
                out += cel_errors(value[k], sub, f"{path}.{k}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += cel_errors(item, schema["items"], f"{path}[{i}]")
    return out


def register(emu: kmock.KubernetesEmulator, crd: dict) -> None:
    """The CRD's served versions as resources of kmock's in-memory API (what installing the CRD does)."""
    names = crd["spec"]["names"]
    for v in crd["spec"]["versions"]:
        if v.get("served"):
            emu.resources[f"{api_version(crd, v['name'])}/{names['plural']}"] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names["singular"],
                namespaced=crd["spec"]["scope"] == "Namespaced",
                shortnames=set(names.get("shortNames", [])),
                verbs={"get", "list", "watch", "create", "patch", "delete"},
                subresources=set(v.get("subresources", {})),
            )
