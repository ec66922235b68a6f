"""pods.assess at K3 scale: the experts a lost pod leaves without a live replica are counted over the plan's shard
array, the same set as asking each expert for its replicas, and far cheaper — a K3 plan has ~80k shards, and the
per-expert way held Kopf's event loop for about a second per reconcile while a deployment's pods were starting."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import yaml
from support.kopf_cluster import GIB, TINY_EXPERT_BYTES
from support.tiny_deployment import tiny

from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.pods import assess, plan_ordinals, unserved_experts
from expertmesh.operator.spec import parse_spec, resolve_model

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "kimi-k3-h200.yaml"


def by_replicas(plan, lost, live) -> list[tuple[int, int]]:
    """The definition: every expert a lost ordinal holds whose replicas are all not live."""
    return sorted(
        {
            (layer, e)
            for o in lost
            for layer, e in plan.experts_of(o)
            if not any(r in live for r in plan.replicas(layer, e))
        }
    )


def test_every_live_subset_of_a_replicated_plan_leaves_the_experts_the_definition_does():
    spec = parse_spec(
        tiny(expertWorkers={"replicas": 3, "redundantExperts": 16, "gpuMemoryGiB": 40 * TINY_EXPERT_BYTES / GIB})
    )
    plan = plan_for(spec, resolve_model(spec))
    holding = plan_ordinals(plan)
    assert len(holding) == 3
    for n in range(len(holding) + 1):
        for live in itertools.combinations(holding, n):
            lost = [o for o in holding if o not in live]
            got = unserved_experts(plan, lost, set(live))
            assert got == by_replicas(plan, lost, set(live)), live
            assert all(isinstance(x, int) for pair in got for x in pair)  # plain ints: they go into the status
    assert unserved_experts(plan, [], set(holding)) == [] and unserved_experts(plan, holding, set()) != []


def test_a_k3_deployment_with_no_pods_yet_is_assessed_in_a_fraction_of_the_per_expert_time():
    spec = parse_spec(yaml.safe_load(EXAMPLE.read_text())["spec"])
    plan = plan_for(spec, resolve_model(spec))
    holding = plan_ordinals(plan)
    start = time.process_time()
    reference = by_replicas(plan, holding, set())
    per_expert = time.process_time() - start
    start = time.process_time()
    a = assess(spec, plan, [], {})
    counted = time.process_time() - start
    assert a.lost_experts == holding and a.unserved == reference and len(reference) > 50_000
    assert counted < per_expert / 4, (counted, per_expert)
