"""The chart's `example.speculative` (issue #52) with the real helm binary: off by default, rendered as the example
MoEDeployment's `spec.speculative` that the CRD's schema and the operator accept (and the operator turns into the
router's and attention workers' flags), bad values refused by the values schema naming them, `helm lint --strict`."""

from __future__ import annotations

import jsonschema
import pytest
import yaml
from support.helm import CHART, CRD_FILE, NAMESPACE, RELEASE, _set_args, one, render, run_helm

from expertmesh.operator.children import build_children
from expertmesh.operator.naming import attention_name, router_name
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.spec import KIND, parse_spec, resolve_model

SPECULATIVE = {"example": {"enabled": True, "speculative": {"enabled": True, "method": "ngram", "tokens": 4}}}


def test_off_by_default():
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["example"]["speculative"]
    assert defaults == {"enabled": False, "method": "ngram", "tokens": 3}
    ex = one(render({"example": {"enabled": True}}), KIND)
    assert "speculative" not in ex["spec"] and parse_spec(ex["spec"]).speculative is None


def test_the_example_speculates_and_the_operator_renders_its_flags():
    ex = one(render(SPECULATIVE), KIND)
    assert ex["spec"]["speculative"] == {"method": "ngram", "tokens": 4}
    schema = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    errors = list(jsonschema.Draft4Validator(schema).iter_errors(ex))
    assert not errors, [e.message for e in errors]
    name, spec = ex["metadata"]["name"], parse_spec(ex["spec"])
    cfg = resolve_model(spec)
    by = {
        (c["kind"], c["metadata"]["name"]): c for c in build_children(name, NAMESPACE, spec, cfg, plan_for(spec, cfg))
    }
    for kind, workload in (("Deployment", router_name(name)), ("StatefulSet", attention_name(name))):
        args = by[(kind, workload)]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--speculative-method") + 1] == "ngram", workload
        assert args[args.index("--speculative-tokens") + 1] == "4", workload


@pytest.mark.parametrize(
    "speculative, named",
    [
        ({"method": "eagle"}, "/example/speculative/method"),
        ({"tokens": 0}, "/example/speculative/tokens"),
        ({"tokens": 9}, "/example/speculative/tokens"),
        ({"tokens": "3"}, "/example/speculative/tokens"),
        ({"enabled": "yes"}, "/example/speculative/enabled"),
        ({"drafts": 3}, "'drafts'"),
    ],
)
def test_bad_values_are_refused_naming_them(speculative, named):
    values = {"example": {"enabled": True, "speculative": speculative}}
    proc = run_helm("template", RELEASE, str(CHART), *_set_args(values), check=False)
    assert proc.returncode != 0, f"helm template accepted {values}"
    assert named in proc.stderr, f"error does not name {named!r}:\n{proc.stderr}"


def test_helm_lint_strict_with_speculation():
    run_helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *_set_args(SPECULATIVE))
