"""The pure status logic: conditions, the phase state machine, lost pods and both pools in status."""

from __future__ import annotations

import datetime as dt

import pytest
from support.tiny_deployment import TINY_EXPERT_BYTES, tiny

from expertmesh.operator.children import build_children, template_hashes
from expertmesh.operator.placement_policy import plan_for, replan_around
from expertmesh.operator.pods import PodInfo, assess, pod_info
from expertmesh.operator.spec import GIB, parse_spec, resolve_model
from expertmesh.operator.status import condition, decide, placement_status, seconds_since, set_condition
from expertmesh.placement.planner import PlanError, moved_shards

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def test_set_condition_keeps_transition_time_unless_status_flips():
    c = set_condition([], "WorkersReady", "False", "PodsStarting", "0/2", 1, NOW)
    c = set_condition(c, "WorkersReady", "False", "PodsStarting", "1/2", 1, LATER)
    assert c[0]["lastTransitionTime"] == NOW and c[0]["message"] == "1/2"
    c = set_condition(c, "WorkersReady", "True", "AllWorkersReady", "2/2", 2, LATER)
    assert c[0]["lastTransitionTime"] == LATER and c[0]["observedGeneration"] == 2
    c = set_condition(c, "PlacementReady", "True", "Planned", "", 2, LATER)
    assert [x["type"] for x in c] == ["PlacementReady", "WorkersReady"]


def _pods(spec, children, plan, *, experts=None, ready=True, template=None):
    th = template_hashes(children)
    pods = [
        PodInfo("kimi-router-a", "router", None, True, th["router"]),
        PodInfo("kimi-attention-0", "attention-worker", 0, True, th["attention-worker"]),
    ]
    for o in range(plan.cluster.pods) if experts is None else experts:
        pods.append(PodInfo(f"kimi-expert-{o}", "expert-worker", o, ready, template or th["expert-worker"]))
    return pods, th


def test_decide_state_machine(tiny_plan):
    spec, cfg, plan = tiny_plan
    children = build_children("kimi", "ns", spec, cfg, plan)
    st = {"phase": "Deploying", "placement": placement_status(plan)}

    pods, th = _pods(spec, children, plan, experts=[0])  # still starting: not a loss
    d = decide("kimi", spec, plan, st, assess(spec, plan, pods, th), 1, NOW)
    assert d.status["phase"] == "Deploying" and d.replan_excluding is None
    pods, th = _pods(spec, children, plan, template="old")  # all up, but on the old template: rolling
    assert decide("kimi", spec, plan, st, assess(spec, plan, pods, th), 1, NOW).status["phase"] == "Deploying"

    pods, th = _pods(spec, children, plan)
    d = decide("kimi", spec, plan, st, assess(spec, plan, pods, th), 1, NOW)
    assert d.status["phase"] == "Ready" and (d.status["readyWorkers"], d.status["desiredWorkers"]) == (3, 3)
    ready = {**st, **d.status}
    assert d.status["expertWorkers"]["selector"] == (
        "app.kubernetes.io/component=expert-worker,app.kubernetes.io/instance=kimi,app.kubernetes.io/name=expertmesh"
    )

    pods, th = _pods(spec, children, plan, experts=[0])  # after Ready, no replicas: Degraded, then re-plan
    d = decide("kimi", spec, plan, ready, assess(spec, plan, pods, th), 1, LATER)
    deg = condition(d.status, "Degraded")
    assert d.status["phase"] == "Degraded" and deg["reason"] == "ExpertsUnavailable" and d.replan_excluding is None
    assert deg["lastTransitionTime"] == LATER and "expert workers [1] lost; 24 experts" in deg["message"]
    assert "at 2026-01-01T00:07:00Z unless they come back" in deg["message"]  # the 120 s grace period
    assert d.status["lostSince"] == [{"ordinal": 1, "since": LATER}]
    assert condition(d.status, "WorkersReady")["status"] == "False"
    degraded = {**ready, **d.status}
    d = decide("kimi", spec, plan, degraded, assess(spec, plan, pods, th), 1, "2026-01-01T00:06:59Z")
    assert d.replan_excluding is None and d.status["lostSince"] == [{"ordinal": 1, "since": LATER}]
    d = decide("kimi", spec, plan, degraded, assess(spec, plan, pods, th), 1, "2026-01-01T00:07:00Z")
    assert d.replan_excluding == [1] and "re-planning onto the surviving workers" in d.status["message"]

    pods, th = _pods(spec, children, plan, experts=[0, 1])  # attention pod NotReady
    pods = [
        p if p.component != "attention-worker" else PodInfo(p.name, p.component, 0, False, p.template_hash)
        for p in pods
    ]
    d = decide("kimi", spec, plan, ready, assess(spec, plan, pods, th), 1, LATER)
    assert condition(d.status, "Degraded")["reason"] == "AttentionWorkersUnavailable" and d.replan_excluding is None

    failed = {"phase": "Failed"}
    assert decide("kimi", spec, plan, failed, assess(spec, plan, pods, th), 1, NOW).status == {}


def test_replicas_serving_and_replan_around_lost_pod():
    spec = parse_spec(
        tiny(expertWorkers={"replicas": 3, "redundantExperts": 16, "gpuMemoryGiB": (40 * TINY_EXPERT_BYTES) / GIB})
    )
    cfg = resolve_model(spec)
    plan = plan_for(spec, cfg)
    children = build_children("kimi", "ns", spec, cfg, plan)
    pods, th = _pods(spec, children, plan, experts=[0, 2])
    a = assess(spec, plan, pods, th)
    assert a.lost_experts == [1] and a.unserved == []  # every expert has 2 replicas on distinct pods
    d = decide("kimi", spec, plan, {"phase": "Ready"}, a, 1, NOW)
    assert condition(d.status, "Degraded")["reason"] == "ReplicasServing" and d.replan_excluding is None

    new = replan_around(spec, cfg, plan, [1])
    assert new.cluster == plan.cluster and new.experts_of(1) == []
    for layer, e in plan.experts_of(0):
        assert 1 not in new.replicas(layer, e)
    kept = set(plan.experts_of(0)) & set(new.experts_of(0))
    assert len(kept) == len(plan.experts_of(0))  # survivors keep every shard they had
    assert new.figures.moved_shards == moved_shards(plan, new) and any("lost" in n for n in new.notes)
    with pytest.raises(PlanError, match="all 3 expert workers are lost"):
        replan_around(spec, cfg, plan, [0, 1, 2])


def test_seconds_since_reads_status_times():
    now = dt.datetime(2026, 1, 1, 0, 5, tzinfo=dt.UTC)
    assert seconds_since(NOW, now) == 300.0  # the last load read, kept in status.lastRebalanceTime
    assert seconds_since(None, now) == seconds_since("garbage", now) == float("inf")


def test_status_reports_both_pools(tiny_plan):
    """status.prefillWorkers beside status.attentionWorkers (the decode pool); a prefill pod not ready keeps the
    deployment from Ready (WorkersReady False, naming the prefill pool); without a prefill pool the field is
    removed (null in the merge patch)."""
    _, cfg, plan = tiny_plan
    spec = parse_spec(tiny(prefillWorkers={"replicas": 2}))
    children = build_children("kimi", "ns", spec, cfg, plan)
    pods, th = _pods(spec, children, plan)
    sizes = {"attention-worker": 1, "prefill-worker": 2}
    st = {"phase": "Deploying", "placement": placement_status(plan)}
    one = pods + [PodInfo("kimi-prefill-0", "prefill-worker", 0, True, th["prefill-worker"])]
    d = decide("kimi", spec, plan, st, assess(spec, plan, one, th, sizes), 1, NOW)
    assert d.status["phase"] == "Deploying" and d.status["prefillWorkers"] == {"ready": 1, "desired": 2}
    assert "1/2 prefill workers ready" in condition(d.status, "WorkersReady")["message"]
    both = one + [PodInfo("kimi-prefill-1", "prefill-worker", 1, True, th["prefill-worker"])]
    d = decide("kimi", spec, plan, st, assess(spec, plan, both, th, sizes), 1, NOW)
    assert d.status["phase"] == "Ready" and d.status["prefillWorkers"] == {"ready": 2, "desired": 2}
    assert d.status["attentionWorkers"] == {"ready": 1, "desired": 1}
    assert (d.status["readyWorkers"], d.status["desiredWorkers"]) == (5, 5)
    ready = {**st, **d.status}
    d = decide("kimi", spec, plan, ready, assess(spec, plan, one, th, sizes), 1, LATER)
    assert d.status["phase"] == "Degraded" and condition(d.status, "WorkersReady")["status"] == "False"
    assert "1/2 prefill" in condition(d.status, "Degraded")["message"]
    assert (
        pod_info(
            {
                "metadata": {
                    "name": "kimi-prefill-1",
                    "labels": {"app.kubernetes.io/component": "prefill-worker", "app.kubernetes.io/instance": "kimi"},
                }
            }
        ).ordinal
        == 1
    )
    plain = parse_spec(tiny())
    pods, th = _pods(plain, build_children("kimi", "ns", plain, cfg, plan), plan)
    assert decide("kimi", plain, plan, st, assess(plain, plan, pods, th), 1, NOW).status["prefillWorkers"] is None
