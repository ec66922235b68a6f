"""Generate the `MoEDeployment` CustomResourceDefinition from the pydantic models in `spec.py`.

The pydantic JSON schema (draft 2020-12, `$defs`/`$ref`, `anyOf` for optionals) is rewritten into a
*structural* OpenAPI v3.0 schema, as the API server requires:
  - every `$ref` inlined (no `$defs`/`definitions` left);
  - `anyOf [X, null]` (an Optional) collapsed to X; `anyOf [integer, string]` to `x-kubernetes-int-or-string`;
  - `const` → a one-value `enum`; draft-2020 numeric `exclusiveMinimum: n` → `minimum: n, exclusiveMinimum: true`;
  - `additionalProperties: false` dropped (the API server prunes unknown fields instead), free-form objects
    (`dict[str, Any]`, i.e. the inline model config) marked `x-kubernetes-preserve-unknown-fields`;
  - `title`, `default: null` dropped; every node carries a `type`.

    python -m expertmesh.operator.crd --out charts/expertmesh/crds/moedeployments.expertmesh.dev.yaml
    python -m expertmesh.operator.crd --check      # exits 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from expertmesh.operator.naming import MAX_NAME_LENGTH, NAME_PATTERN, STATEFULSET_NAME_MAX
from expertmesh.operator.spec import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    MoEDeploymentSpec,
    MoEDeploymentStatus,
)

CRD_NAME = f"{PLURAL}.{GROUP}"
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "charts" / "expertmesh" / "crds" / f"{CRD_NAME}.yaml"

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyWorkers"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredWorkers"},
    {"name": "Experts", "type": "integer", "jsonPath": ".status.placement.physicalExperts"},
    {"name": "Imbalance", "type": "number", "jsonPath": ".status.placement.imbalance"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# `kubectl scale moe/<name> --replicas N` scales the expert workers (and so re-plans).
SCALE = {
    "specReplicasPath": ".spec.expertWorkers.replicas",
    "statusReplicasPath": ".status.expertWorkers.ready",
    "labelSelectorPath": ".status.expertWorkers.selector",
}

_DROP = {
    "title",
    "additionalProperties",
    "$defs",
    "definitions",
    "discriminator",
    "propertyNames",
}  # map keys: structural schemas cannot constrain them; the operator checks them


class SchemaError(ValueError):
    pass


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a pydantic JSON schema (with `$defs`) into a structural OpenAPI v3.0 schema."""
    defs = schema.get("$defs", {})

    def resolve(node: dict, path: str, stack: tuple[str, ...]) -> dict:
        node = dict(node)
        if "$ref" in node:  # inline the definition; keys beside the $ref (default, description) win
            name = node.pop("$ref").rsplit("/", 1)[-1]
            if name in stack:
                raise SchemaError(f"{path}: recursive type {name} cannot be a structural schema")
            target = dict(defs[name])
            if "description" in node:
                target.pop("description", None)
            return resolve({**target, **node}, path, stack + (name,))
        for key in ("anyOf", "oneOf"):
            if key in node:
                branches = [b for b in node.pop(key) if b.get("type") != "null"]
                types = sorted(b.get("type", "") for b in branches)
                if len(branches) == 1:
                    node = {**branches[0], **node}
                    return resolve(node, path, stack)
                if types == ["integer", "string"]:
                    node["x-kubernetes-int-or-string"] = True
                else:
                    raise SchemaError(f"{path}: a union of {types} has no structural form")
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k in _DROP or (k == "default" and v is None):
                continue
            if k == "const":
                out["enum"] = [v]
            elif k == "exclusiveMinimum" and not isinstance(v, bool):
                out["minimum"], out["exclusiveMinimum"] = v, True
            elif k == "exclusiveMaximum" and not isinstance(v, bool):
                out["maximum"], out["exclusiveMaximum"] = v, True
            elif k == "properties":
                out[k] = {name: resolve(sub, f"{path}.{name}", stack) for name, sub in v.items()}
            elif k == "items":
                out[k] = resolve(v, f"{path}[]", stack)
            else:
                out[k] = v
        addl = node.get("additionalProperties")
        if isinstance(addl, dict) and addl:  # dict[str, X]: keep the value schema
            out["additionalProperties"] = resolve(addl, f"{path}.*", stack)
        elif (
            out.get("type") == "object"
            and "properties" not in out
            and (addl is True or addl == {} or "additionalProperties" not in node)
        ):
            out["x-kubernetes-preserve-unknown-fields"] = True  # free-form (dict[str, Any])
        if "enum" in out and "type" not in out:
            out["type"] = _json_type(out["enum"][0])
        if "type" not in out and not out.get("x-kubernetes-int-or-string"):
            raise SchemaError(f"{path}: no type in {node}")
        return _ordered(out)

    top = {k: v for k, v in schema.items() if k != "$defs"}
    return resolve(top, "", ())


_KEY_ORDER = (
    "type",
    "format",
    "description",
    "enum",
    "default",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "required",
)


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Readable key order in the YAML: type and description first, nested schemas last."""
    rank = {k: i for i, k in enumerate(_KEY_ORDER)}
    return dict(sorted(node.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[type(value)]


def check_structural(schema: dict[str, Any], path: str = "") -> list[str]:
    """Violations of the structural-schema rules (empty when structural): the checks the API server applies
    that a generator bug could break."""
    problems: list[str] = []
    for key in ("$ref", "$defs", "definitions", "anyOf", "oneOf", "allOf", "not", "const", "title"):
        if key in schema:
            problems.append(f"{path or '.'}: has {key}")
    if (
        "type" not in schema
        and not schema.get("x-kubernetes-int-or-string")
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        problems.append(f"{path or '.'}: has no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{path or '.'}: both properties and additionalProperties")
    if schema.get("additionalProperties") is False:
        problems.append(f"{path or '.'}: additionalProperties: false")
    if "default" in schema and schema["default"] is None:
        problems.append(f"{path or '.'}: default null")
    for name, sub in schema.get("properties", {}).items():
        problems += check_structural(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        problems += check_structural(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        problems += check_structural(schema["additionalProperties"], f"{path}.*")
    return problems


def spec_schema() -> dict[str, Any]:
    return structural(MoEDeploymentSpec.model_json_schema(by_alias=True, mode="validation"))


def status_schema() -> dict[str, Any]:
    return structural(MoEDeploymentStatus.model_json_schema(by_alias=True, mode="serialization"))


# `metadata` may carry restrictions on name and generateName only: every child's name stays valid (the StatefulSets'
# within STATEFULSET_NAME_MAX with the longest suffix the operator appends, the Services' a DNS-1035 label). The same
# rule as CEL on the root says it in words; the operator checks it again for resources created before (naming.py).
METADATA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": MAX_NAME_LENGTH, "pattern": NAME_PATTERN},
        "generateName": {"type": "string", "maxLength": MAX_NAME_LENGTH - 5, "pattern": "^[a-z][-a-z0-9]*$"},
    },
}
NAME_RULE = {
    "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')",
    "message": f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters (lowercase letters, "
    f"digits and '-', a letter first): the operator names children <name>-attention, <name>-expert, "
    f"<name>-router, and a StatefulSet's name must stay within {STATEFULSET_NAME_MAX} characters",
}


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a plain dict."""
    spec = spec_schema()
    spec["description"] = "Desired state: the model, its checkpoint, and the router/worker fleet serving it."
    status = status_schema()
    status["description"] = "Observed state, written by the operator."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "expertmesh", "app.kubernetes.io/part-of": "expertmesh"},
            "annotations": {"expertmesh.dev/generated-by": "python -m expertmesh.operator.crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["expertmesh"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": dict(SCALE)},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": f"{KIND} ({API_VERSION}): a Mixture-of-Experts model served by a router, "
                            "attention workers and expert workers placed by an expert-placement plan.",
                            "required": ["spec"],
                            "x-kubernetes-validations": [dict(NAME_RULE)],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": copy.deepcopy(METADATA),
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `python -m expertmesh.operator.crd` from operator/spec.py; do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, default_flow_style=False, width=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m expertmesh.operator.crd", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the CRD here (default: stdout)")
    p.add_argument(
        "--check",
        action="store_true",
        help=f"compare with --out (default {DEFAULT_PATH.name} in the chart); exit 1 when stale",
    )
    args = p.parse_args(argv)
    text = render()
    if args.check:
        path = args.out or DEFAULT_PATH
        current = path.read_text() if path.exists() else None
        if current != text:
            print(f"{path} is stale: regenerate with `python -m expertmesh.operator.crd --out {path}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
