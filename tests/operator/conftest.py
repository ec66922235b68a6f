"""The fixture the operator's unit tests share: the tiny spec, its model and its placement plan."""

import pytest
from support.tiny_deployment import tiny

from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.spec import parse_spec, resolve_model


@pytest.fixture(scope="module")
def tiny_plan():
    spec = parse_spec(tiny())
    cfg = resolve_model(spec)
    return spec, cfg, plan_for(spec, cfg)
