"""The operator's placement policy: the plan for a spec, the pods a new plan touches, re-balancing by load."""

from __future__ import annotations

import numpy as np
import pytest
from support.tiny_deployment import TINY_EXPERT_BYTES, tiny

from expertmesh.operator.placement_policy import changed_ordinals, parse_load, plan_for, rebalance, replan_around
from expertmesh.operator.spec import GIB, parse_spec, resolve_model
from expertmesh.placement.planner import PlanError, imbalance, moved_shards, zipf_loads


def test_changed_ordinals_are_the_expert_pods_whose_shards_move(tiny_plan):
    spec, cfg, plan = tiny_plan
    spec3 = parse_spec(tiny(expertWorkers={"replicas": 3, "gpuMemoryGiB": 40 * TINY_EXPERT_BYTES / GIB}))
    new = replan_around(spec3, cfg, plan_for(spec3, cfg), [2])  # ordinal 2's experts move to 0 and 1
    old = plan_for(spec3, cfg)
    assert changed_ordinals(old, new) == [0, 1, 2] and new.experts_of(2) == []
    assert changed_ordinals(old, old) == [] and changed_ordinals(None, new) == [0, 1]


def test_too_small_cluster_raises_plan_error_with_missing_memory():
    spec = parse_spec(tiny(expertWorkers={"replicas": 1}))
    with pytest.raises(PlanError, match=r"GiB missing; 2 pods of this shape would fit the model"):
        plan_for(spec, resolve_model(spec))


def test_parse_load_and_rebalance():
    spec = parse_spec(tiny(expertWorkers={"redundantExperts": 4}, placement={"imbalanceThreshold": 1.1}))
    cfg = resolve_model(spec)
    plan = plan_for(spec, cfg)
    skew = zipf_loads(cfg, s=1.5, seed=1) * 100
    payload = {"moe_layers": cfg.moe_layers, "tokens": {str(l): skew[i].tolist() for i, l in enumerate(cfg.moe_layers)}}
    loads = parse_load(payload, cfg)
    np.testing.assert_allclose(loads, skew)
    with pytest.raises(ValueError, match=r"tokens\[2\] must be 16 finite counts"):
        parse_load({"tokens": {"2": [1, 2]}}, cfg)
    with pytest.raises(ValueError, match="expected an object with 'tokens'"):
        parse_load({"moe_layers": []}, cfg)
    r = rebalance(spec, cfg, plan, loads)
    assert r.plan is not None and r.observed > 1.1 and r.expected < r.observed
    assert r.observed == pytest.approx(imbalance(plan, loads).mean) and r.moved == moved_shards(plan, r.plan)
    uniform = np.ones_like(loads)
    assert rebalance(spec, cfg, plan, uniform).plan is None  # balanced: nothing to do
    assert rebalance(spec, cfg, plan, 0 * loads).plan is None  # no traffic yet
