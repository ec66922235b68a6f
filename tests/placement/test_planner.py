"""The placement-plan schema (expertmesh/placement/plan.py), the planner (expertmesh/placement/planner.py) and `expertmesh plan`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.model.config import preset
from expertmesh.operator import plan_cli
from expertmesh.placement.plan import PlacementPlan
from expertmesh.placement.planner import (
    ClusterShape,
    PlanError,
    group_homes,
    imbalance,
    moved_shards,
    plan_placement,
    pods_needed,
    replica_counts,
    zipf_loads,
)

GIB = 2**30
TINY = preset("tiny")


def _cfg(n_experts: int = 16, n_moe_layers: int = 3):
    """tiny with another expert count / MoE layer count (only the fields the planner reads change)."""
    moe = TINY.moe.model_copy(update={"n_routed_experts": n_experts, "top_k": min(TINY.moe.top_k, n_experts)})
    return TINY.model_copy(update={"moe": moe, "layer_types": ("kda",) * (1 + n_moe_layers), "first_k_dense": 1})


def _shape(cfg, pods, gpus, extra_slots=0, reserve=0, slack=0):
    """A cluster whose GPUs hold exactly ceil(logical / GPUs) + extra_slots experts after `reserve`."""
    B = cfg.expert_bytes_mxfp4
    slots = -(-cfg.n_logical_experts // (pods * gpus)) + extra_slots
    return ClusterShape(pods, gpus, slots * B + slack + reserve, reserve)


# ----------------------------------------------------------------------------------------------- references
def _naive_replica_counts(loads, redundant, max_replicas):
    """EPLB's greedy, one replica at a time: to the expert with the highest load per replica (lowest index on
    ties), never above max_replicas, never to an expert without load."""
    counts = np.ones(loads.shape, dtype=np.int64)
    for l in range(loads.shape[0]):
        for _ in range(redundant):
            per = np.where((counts[l] < max_replicas) & (loads[l] > 0), loads[l] / counts[l], -1.0)
            e = int(np.argmax(per))
            if per[e] <= 0:
                break
            counts[l, e] += 1
    return counts


def _naive_imbalance(plan, loads):
    """Per-layer max/mean of per-GPU load, by walking the plan's workers (loads split evenly over replicas)."""
    reps = defaultdict(int)
    for w in plan.workers:
        for g in w.gpus:
            for le in g.shards:
                reps[le] += 1
    out = []
    for li, layer in enumerate(plan.moe_layers):
        per_gpu = [
            sum(loads[li][e] / reps[(l, e)] for (l, e) in g.shards if l == layer) for w in plan.workers for g in w.gpus
        ]
        mean = sum(per_gpu) / len(per_gpu)
        out.append(max(per_gpu) / mean if mean > 0 else 1.0)
    return np.array(out)


def _check_plan(plan, cfg, shape, loads=None):
    """The invariants every plan must satisfy, checked from the plan's public lookups."""
    L, E, B = cfg.n_moe_layers, cfg.moe.n_routed_experts, cfg.expert_bytes_mxfp4
    slots = shape.slots_per_gpu(B)
    assert plan.model_name == cfg.name and list(plan.moe_layers) == cfg.moe_layers
    assert plan.n_experts == E and plan.top_k == cfg.moe.top_k and plan.cluster == shape
    total = 0
    for p, worker in enumerate(plan.workers):
        assert worker.ordinal == p and len(worker.gpus) == shape.gpus_per_pod
        for gpu in worker.gpus:
            assert len(gpu.shards) <= slots  # capacity
            assert gpu.bytes == len(gpu.shards) * B <= shape.gpu_memory_bytes - shape.reserve_bytes
            total += len(gpu.shards)
        held = plan.experts_of(p)
        assert len(held) == len(set(held)) == sum(len(g.shards) for g in worker.gpus)
    for layer in cfg.moe_layers:
        for e in range(E):
            reps = plan.replicas(layer, e)
            assert len(reps) >= 1  # placed at least once
            assert len(set(reps)) == len(reps) and reps == sorted(reps)  # distinct pods
            for p in reps:
                assert (layer, e) in plan.experts_of(p)
    f = plan.figures
    assert f.logical_experts == L * E and f.physical_experts == total and f.replicas == total - L * E
    assert f.physical_experts <= L * (E + f.redundant_per_layer)
    assert f.redundant_per_layer <= min(f.redundant_requested, E * (shape.pods - 1))
    arr = np.ones((L, E)) if loads is None else np.asarray(loads, dtype=np.float64)
    ref = _naive_imbalance(plan, arr)
    assert f.imbalance == pytest.approx(ref.mean(), rel=1e-9)
    assert f.imbalance_worst_layer == pytest.approx(ref.max(), rel=1e-9)
    got = imbalance(plan, arr)
    np.testing.assert_allclose(got.per_layer, ref, rtol=1e-9)


# ----------------------------------------------------------------------------------------------- replication
@settings(max_examples=60, deadline=None)
@given(
    L=st.integers(1, 3),
    E=st.integers(1, 12),
    redundant=st.integers(0, 30),
    max_replicas=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    integer=st.booleans(),
)
def test_replica_counts_match_the_one_at_a_time_greedy(L, E, redundant, max_replicas, seed, integer):
    rng = np.random.default_rng(seed)
    # integer loads (with zeros) exercise the tie-breaking, floats the general case
    loads = rng.integers(0, 4, (L, E)).astype(float) if integer else rng.pareto(1.5, (L, E))
    got = replica_counts(loads, redundant, max_replicas)
    np.testing.assert_array_equal(got, _naive_replica_counts(loads, redundant, max_replicas))
    assert (got >= 1).all() and (got <= max_replicas).all() and (got.sum(1) <= E + redundant).all()


def test_replicas_go_to_the_hottest_experts():
    loads = np.array([[1.0, 10.0, 2.0, 4.0]])
    # quotients 10, 5 (e1); 4 (e3); 3.33 (e1); 2 (e2, e3) ...
    np.testing.assert_array_equal(replica_counts(loads, 3, 8), [[1, 3, 1, 2]])
    np.testing.assert_array_equal(replica_counts(loads, 3, 2), [[1, 2, 2, 2]])  # one per pod at most


# ----------------------------------------------------------------------------------------------- invariants
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    E=st.sampled_from([4, 8, 12, 16, 20]),
    L=st.integers(1, 4),
    pods=st.integers(1, 5),
    gpus=st.integers(1, 4),
    extra=st.integers(0, 12),
    reserve=st.integers(0, 3),
    redundant=st.integers(0, 70),
    kind=st.sampled_from(["uniform", "zipf", "random"]),
    seed=st.integers(0, 1000),
)
def test_plans_satisfy_the_invariants(E, L, pods, gpus, extra, reserve, redundant, kind, seed):
    cfg = _cfg(E, L)
    B = cfg.expert_bytes_mxfp4
    shape = _shape(cfg, pods, gpus, extra_slots=extra, reserve=reserve * B, slack=seed % B)
    loads = {
        "uniform": None,
        "zipf": zipf_loads(cfg, 1.2, seed),
        "random": np.random.default_rng(seed).integers(0, 5, (L, E)),
    }[kind]
    plan = plan_placement(cfg, shape, redundant, loads)
    _check_plan(plan, cfg, shape, loads)
    # deterministic: the same inputs give bitwise-equal JSON
    assert plan_placement(cfg, shape, redundant, loads).to_json() == plan.to_json()
    # re-planning from itself moves nothing and keeps the hash
    again = plan_placement(cfg, shape, redundant, loads, previous=plan)
    assert again.figures.moved_shards == 0 and again.plan_hash() == plan.plan_hash()
    assert again.figures.previous_hash == plan.plan_hash()


def test_more_gpus_than_experts_and_one_pod():
    cfg = TINY  # 16 experts x 3 MoE layers
    for pods, gpus in [(1, 1), (2, 1), (3, 1), (4, 1), (5, 4)]:  # 5 x 4 = 20 GPUs > 16 experts per layer
        shape = _shape(cfg, pods, gpus, extra_slots=2)
        plan = plan_placement(cfg, shape, 0)
        _check_plan(plan, cfg, shape)
        per_gpu = [len(g.shards) for w in plan.workers for g in w.gpus]
        assert max(per_gpu) - min(per_gpu) <= 1  # uniform loads: counts balanced
    one = plan_placement(cfg, _shape(cfg, 1, 2, extra_slots=40), redundant_slots=8, loads=zipf_loads(cfg))
    assert one.figures.redundant_per_layer == 0 and one.figures.physical_experts == cfg.n_logical_experts
    assert any("1 pod" in n and "distinct pods" in n for n in one.notes)


def test_redundancy_beyond_what_is_useful_or_fits_is_reduced_with_a_note():
    cfg = TINY
    plan = plan_placement(cfg, _shape(cfg, 3, 1, extra_slots=100), redundant_slots=1000)
    assert plan.figures.redundant_per_layer == 16 * 2 and plan.figures.redundant_requested == 1000
    assert (plan.replica_counts() == 3).all() and any("one replica of an expert per pod" in n for n in plan.notes)
    tight = _shape(cfg, 4, 1, extra_slots=2)  # 12 + 2 slots per GPU: room for 56 of 48 + 3r
    plan = plan_placement(cfg, tight, redundant_slots=10)
    assert plan.figures.redundant_per_layer == 2 and any("leave room for 2 more per layer" in n for n in plan.notes)
    _check_plan(plan, cfg, tight)
    zero = np.ones((3, 16))
    zero[:, 4:] = 0  # only 4 experts carry load: 12 useful replicas
    plan = plan_placement(cfg, _shape(cfg, 4, 1, extra_slots=20), redundant_slots=20, loads=zero)
    assert plan.figures.replicas == 3 * 12 and any("zero load" in n for n in plan.notes)


def test_full_preset_plan_on_16_pods():
    cfg = preset("full-2.8t")
    shape = ClusterShape(16, 8, 141 * GIB, 0)
    loads = zipf_loads(cfg)
    plan = plan_placement(cfg, shape, 32, loads)
    f = plan.figures
    E = cfg.moe.n_routed_experts
    assert f.logical_experts == 92 * E and f.physical_experts == 92 * (E + 32)
    assert f.shards_per_gpu_max - f.shards_per_gpu_min <= 0.05 * f.shards_per_gpu_mean
    assert (plan.replica_counts() <= 16).all()
    reps = [plan.replicas(l, e) for l in cfg.moe_layers[:3] for e in range(E)]
    assert all(len(set(r)) == len(r) for r in reps)
    assert len(plan.to_json()) < 2**20  # fits a ConfigMap
    base = plan_placement(cfg, shape, 0, loads)
    assert f.imbalance < base.figures.imbalance / 5  # redundancy pays on skewed loads
    # LPT cannot beat the hottest replica: imbalance >= max(load/replicas) / per-GPU mean, and stays near it
    bound = (loads / plan.replica_counts()).max(axis=1) / (loads.sum(axis=1) / 128)
    assert f.imbalance >= bound.mean() * (1 - 1e-9) and f.imbalance < 1.1 * bound.mean()


# ----------------------------------------------------------------------------------------------- load balance
@pytest.mark.parametrize("pods,gpus", [(4, 1), (2, 2), (4, 2)])
def test_redundancy_lowers_imbalance_on_skewed_loads(pods, gpus):
    cfg = _cfg(16, 3)
    shape = _shape(cfg, pods, gpus, extra_slots=30)
    loads = zipf_loads(cfg, s=1.3, seed=1)
    without = plan_placement(cfg, shape, 0, loads).figures.imbalance
    with_r = [plan_placement(cfg, shape, r, loads).figures.imbalance for r in (2, 4, 8)]
    # (LPT is a heuristic: more replicas need not be monotonically better, but all beat none by a margin)
    assert all(x < 0.8 * without for x in with_r)


def test_uniform_loads_balance_within_one_shard():
    cfg = _cfg(12, 4)
    shape = _shape(cfg, 2, 4, extra_slots=1)  # 12 experts on 8 GPUs: 4 get 2 per layer
    plan = plan_placement(cfg, shape)
    assert plan.figures.imbalance == pytest.approx(2 / 1.5)
    per_gpu = [len(g.shards) for w in plan.workers for g in w.gpus]
    assert max(per_gpu) - min(per_gpu) <= 1


def test_zipf_loads():
    cfg = TINY
    a, b = zipf_loads(cfg, s=1.1, seed=3), zipf_loads(cfg, s=1.1, seed=3)
    np.testing.assert_array_equal(a, b)
    w = np.arange(1, 17) ** -1.1
    for row in a:
        np.testing.assert_allclose(np.sort(row)[::-1], w * 16 / w.sum())
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a, zipf_loads(cfg, seed=4))
    assert a.shape == (3, 16) and a.mean() == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------------- re-planning
@settings(max_examples=100, deadline=None)
@given(
    pods=st.integers(2, 5),
    gpus=st.integers(1, 3),
    redundant=st.integers(0, 20),
    seed=st.integers(0, 100),
    skewed=st.booleans(),
)
def test_removing_a_pod_moves_only_its_shards(pods, gpus, redundant, seed, skewed):
    cfg = _cfg(16, 3)
    B = cfg.expert_bytes_mxfp4
    big = ClusterShape(pods, gpus, 60 * B)  # room for everything on pods - 1 as well
    loads = zipf_loads(cfg, 1.2, seed) if skewed else None
    before = plan_placement(cfg, big, redundant, loads)
    small = ClusterShape(pods - 1, gpus, 60 * B)
    after = plan_placement(cfg, small, redundant, loads, previous=before)
    _check_plan(after, cfg, small, loads)
    on_lost_pod = len(before.experts_of(pods - 1))
    assert after.figures.moved_shards == moved_shards(before, after) <= on_lost_pod
    if redundant == 0:
        assert after.figures.moved_shards == on_lost_pod
        # every still-valid placement is kept
        for p in range(pods - 1):
            for g in range(gpus):
                assert set(before.shards_of(p, g)) <= set(after.shards_of(p, g))


def test_adding_a_pod_or_changing_loads_moves_only_what_must_move():
    cfg = TINY
    B = cfg.expert_bytes_mxfp4
    before = plan_placement(cfg, ClusterShape(3, 1, 40 * B))
    grown = plan_placement(cfg, ClusterShape(4, 1, 40 * B), previous=before)
    assert grown.figures.moved_shards == 0 and grown.experts_of(3) == []  # nothing has to move
    fresh = plan_placement(cfg, ClusterShape(4, 1, 40 * B))
    assert moved_shards(before, fresh) > 0 and fresh.figures.imbalance < grown.figures.imbalance
    # new loads with redundancy: only the added replicas are new
    hot = zipf_loads(cfg, 1.5, seed=2)
    replanned = plan_placement(cfg, ClusterShape(3, 1, 40 * B), 4, hot, previous=before)
    assert replanned.figures.moved_shards == replanned.figures.replicas == 3 * 4
    # a smaller GPU evicts what no longer fits, with a note
    shrunk = plan_placement(cfg, ClusterShape(3, 1, 17 * B), 2, hot, previous=replanned)
    _check_plan(shrunk, cfg, ClusterShape(3, 1, 17 * B), hot)
    assert any("no longer fit their GPU (17 slots now)" in n for n in shrunk.notes)


def test_previous_plan_of_another_model_is_rejected():
    other = plan_placement(_cfg(8, 3), ClusterShape(2, 1, 40 * TINY.expert_bytes_mxfp4))
    with pytest.raises(ValueError, match="previous: plan is for model"):
        plan_placement(TINY, ClusterShape(2, 1, 40 * TINY.expert_bytes_mxfp4), previous=other)


# ----------------------------------------------------------------------------------------------- errors
def test_too_small_cluster_says_what_is_missing_and_how_many_pods_fit():
    cfg = preset("full-2.8t")
    shape = ClusterShape(4, 8, 40 * GIB, 8 * GIB)
    with pytest.raises(PlanError) as err:
        plan_placement(cfg, shape)
    assert isinstance(err.value, ValueError)
    B = cfg.expert_bytes_mxfp4
    have = (32 * GIB // B) * B * 32
    missing = (cfg.n_logical_experts * B - have) / GIB
    assert f"{missing:,.1f} GiB missing" in str(err.value)
    need = pods_needed(cfg, shape)
    assert f"{need} pods of this shape would fit" in str(err.value)
    plan_placement(cfg, ClusterShape(need, 8, 40 * GIB, 8 * GIB))  # and they do
    with pytest.raises(PlanError):
        plan_placement(cfg, ClusterShape(need - 1, 8, 40 * GIB, 8 * GIB))
    with pytest.raises(PlanError, match="no number of pods"):
        plan_placement(cfg, ClusterShape(4, 8, 40 * GIB, 40 * GIB))


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="ClusterShape.pods"):
        ClusterShape(0, 1, 1)
    with pytest.raises(ValueError, match="ClusterShape.reserve_bytes"):
        ClusterShape(1, 1, 10, -1)
    shape = ClusterShape(2, 1, GIB)
    with pytest.raises(ValueError, match=r"loads: expected shape \[3, 16\].*found \[3, 15\]"):
        plan_placement(TINY, shape, loads=np.ones((3, 15)))
    with pytest.raises(ValueError, match="loads: expected finite values"):
        plan_placement(TINY, shape, loads=-np.ones((3, 16)))
    with pytest.raises(ValueError, match="redundant_slots"):
        plan_placement(TINY, shape, redundant_slots=-1)
    plan = plan_placement(TINY, shape)
    with pytest.raises(ValueError, match="layer 0 is not an MoE layer"):
        plan.replicas(0, 0)
    with pytest.raises(ValueError, match="expert 16 is out of range"):
        plan.replicas(1, 16)
    with pytest.raises(ValueError, match="worker 2"):
        plan.experts_of(2)


# ----------------------------------------------------------------------------------------------- schema
def test_json_round_trip_and_hash():
    cfg = TINY
    shape = ClusterShape(3, 2, 40 * cfg.expert_bytes_mxfp4, 0)
    plan = plan_placement(cfg, shape, 6, zipf_loads(cfg))
    text = plan.to_json()
    back = PlacementPlan.from_json(text)
    assert back == plan and back.to_json() == text and back.plan_hash() == plan.plan_hash()
    assert len(plan.plan_hash()) == 16 and int(plan.plan_hash(), 16) >= 0
    assert [back.replicas(l, e) for l in cfg.moe_layers for e in range(16)] == [
        plan.replicas(l, e) for l in cfg.moe_layers for e in range(16)
    ]
    # the hash covers the placement, not the figures: a different placement changes it
    other = plan_placement(cfg, shape, 6, None)
    assert other.plan_hash() != plan.plan_hash()
    data = json.loads(text)
    data["figures"]["imbalance"] = 9.0
    assert PlacementPlan.from_json(json.dumps(data)).plan_hash() == plan.plan_hash()
    # copies with updates are validated again
    assert plan.model_copy(update={"notes": ("x",)}).notes == ("x",)
    with pytest.raises(ValueError, match="workers: expected 3"):
        plan.model_copy(update={"workers": plan.workers[:2]})


def _copy_shard(d, src, dst):
    """Put a copy of the first shard of GPU src onto GPU dst (keeping dst sorted and its bytes right)."""
    a, b = d["workers"][src[0]]["gpus"][src[1]], d["workers"][dst[0]]["gpus"][dst[1]]
    b["shards"] = sorted(b["shards"] + [a["shards"][0]])
    b["bytes"] += d["expert_bytes"]


def _add_shard(d, shard):
    gpu = d["workers"][0]["gpus"][0]
    gpu["shards"] = sorted(gpu["shards"] + [shard])
    gpu["bytes"] += d["expert_bytes"]


def _tampered(plan, edit) -> str:
    data = json.loads(plan.to_json())
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda d: d["workers"][0]["gpus"][0].update(
                shards=d["workers"][0]["gpus"][0]["shards"][1:],
                bytes=d["workers"][0]["gpus"][0]["bytes"] - d["expert_bytes"],
            ),
            "no shard",
        ),
        (lambda d: d["workers"][1].update(ordinal=5), r"workers\[1\].ordinal: expected 1, found 5"),
        (lambda d: d["workers"][0]["gpus"][0].update(bytes=1), r"workers\[0\].gpus\[0\].bytes: expected"),
        (lambda d: _add_shard(d, [99, 0]), "layer 99 is not one of moe_layers"),
        (lambda d: _add_shard(d, [1, 16]), "expert 16 of layer 1 is out of range"),
        (lambda d: _copy_shard(d, src=(0, 0), dst=(0, 1)), "distinct workers"),
        (lambda d: d["cluster"].update(pods=0), "ClusterShape.pods"),
        (lambda d: d["workers"].pop(), r"workers: expected 3 \(cluster.pods\)"),
        (lambda d: d["cluster"].update(reserve_bytes=d["cluster"]["gpu_memory_bytes"] - 1), "usable memory"),
        (lambda d: d.update(surprise=1), "surprise"),
    ],
)
def test_invalid_plans_are_rejected_naming_the_field(edit, message):
    plan = plan_placement(TINY, ClusterShape(3, 2, 40 * TINY.expert_bytes_mxfp4))
    with pytest.raises(ValueError, match=message):
        PlacementPlan.from_json(_tampered(plan, edit))


# ----------------------------------------------------------------------------------------------- the CLI
def _args(*argv):
    p = argparse.ArgumentParser()
    plan_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_prints_the_table_and_writes_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = plan_cli.run(
        _args(
            "--preset",
            "tiny",
            "--expert-pods",
            "4",
            "--gpus-per-pod",
            "1",
            "--gpu-memory-gib",
            "0.001",
            "--redundant-experts",
            "4",
            "--json",
            str(out),
        )
    )
    text = capsys.readouterr().out
    assert rc == 0
    for label in (
        "uniform, r=0",
        "uniform, r=4 *",
        "zipf s=1.1, r=0",
        "zipf s=1.1, r=4",
        "physical experts",
        "shards/GPU min/mean/max",
        "imbalance uniform",
        "imbalance zipf s=1.1",
        "planning time",
    ):
        assert label in text, label
    plan = PlacementPlan.from_json(out.read_text())
    assert plan.figures.physical_experts == 48 + 12 and plan.figures.load_source == "uniform"
    assert plan.plan_hash() in text
    _check_plan(plan, TINY, plan.cluster)


@pytest.mark.parametrize("suffix", [".npy", ".json"])
def test_cli_reads_loads_and_previous(tmp_path, capsys, suffix):
    loads = zipf_loads(TINY, 1.4, seed=5)
    path = tmp_path / f"loads{suffix}"
    np.save(path, loads) if suffix == ".npy" else path.write_text(json.dumps(loads.tolist()))
    prev = tmp_path / "prev.json"
    base = ["--preset", "tiny", "--expert-pods", "3", "--gpus-per-pod", "2", "--gpu-memory-gib", "0.001"]
    assert plan_cli.run(_args(*base, "--json", str(prev))) == 0
    out = tmp_path / "plan.json"
    assert (
        plan_cli.run(
            _args(*base, "--redundant-experts", "3", "--loads", str(path), "--previous", str(prev), "--json", str(out))
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "given loads, r=3 *" in text and "moved shards" in text
    plan = PlacementPlan.from_json(out.read_text())
    assert plan.figures.load_source == "given" and plan.figures.moved_shards == 9
    assert plan.figures.imbalance == pytest.approx(imbalance(plan, loads).mean)


def test_cli_errors_exit_2(tmp_path, capsys):
    rc = plan_cli.run(
        _args("--preset", "full-2.8t", "--expert-pods", "4", "--gpu-memory-gib", "40", "--reserve-gib", "8")
    )
    err = capsys.readouterr().err
    assert rc == 2 and "GiB missing" in err and "6 pods of this shape would fit" in err
    bad = tmp_path / "loads.json"
    bad.write_text("[[1, 2], [3, 4]]")
    rc = plan_cli.run(_args("--preset", "tiny", "--expert-pods", "2", "--loads", str(bad)))
    assert rc == 2 and "loads: expected shape [3, 16]" in capsys.readouterr().err
    rc = plan_cli.run(_args("--preset", "tiny", "--expert-pods", "2", "--loads", str(tmp_path / "x.csv")))
    assert rc == 2 and "expected a .npy or .json" in capsys.readouterr().err


def test_cli_as_a_module():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertmesh.operator.plan_cli",
            "--preset",
            "full-2.8t",
            "--expert-pods",
            "2",
            "--gpu-memory-gib",
            "80",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd="/",
    )
    assert proc.returncode == 2 and "cluster too small for full-2.8t" in proc.stderr
    assert "3 pods of this shape would fit" in proc.stderr


@pytest.mark.parametrize("pods,redundant", [(2, 0), (3, 0), (3, 2), (2, 16)])
def test_group_aware_plans_keep_each_combine_group_on_one_pod(pods, redundant):
    from expertmesh.entry.cluster import make_placement

    cfg = preset("tiny")
    plan = make_placement(cfg, pods, redundant)  # what `up` and the in-process engine use
    S = cfg.moe.n_routed_experts // cfg.moe.combine_groups
    for layer in cfg.moe_layers:
        for g in range(cfg.moe.combine_groups):
            holders = [set(plan.replicas(layer, e)) for e in range(g * S, (g + 1) * S)]
            assert set.intersection(*holders), (layer, g, holders)
    counts = [len(plan.experts_of(i)) for i in range(pods)]
    assert max(counts) - min(counts) <= 1
    free = plan_placement(cfg, plan.cluster, redundant)  # not group-aware: some group is split
    assert redundant == 16 or any(
        not set.intersection(*[set(free.replicas(l, e)) for e in range(g * S, (g + 1) * S)])
        for l in cfg.moe_layers
        for g in range(cfg.moe.combine_groups)
    )


def test_group_homes_full_preset():
    cfg = preset("full-2.8t")
    homes = group_homes(np.ones((cfg.n_moe_layers, cfg.moe.n_routed_experts)), cfg.moe.combine_group_size, 16, 10_000)
    assert homes.shape == (cfg.n_moe_layers, 16)
    assert all(sorted(row) == list(range(16)) for row in homes.tolist())  # one combine group per pod per layer


def test_min_replicas_puts_every_expert_on_distinct_pods():
    from expertmesh.entry.cluster import make_placement

    cfg = preset("tiny")
    plan = make_placement(cfg, 3, min_replicas=2)
    for layer in cfg.moe_layers:
        for e in range(cfg.moe.n_routed_experts):
            reps = plan.replicas(layer, e)
            assert len(reps) >= 2 and len(set(reps)) == len(reps)
    with pytest.raises(PlanError, match="min_replicas=4: every expert on 4 pods needs at least 4 pods"):
        make_placement(cfg, 3, min_replicas=4)
    with pytest.raises(PlanError, match="min_replicas=2: .* do not fit"):
        plan_placement(
            cfg,
            plan.cluster.model_copy(update={"pods": 2})
            if hasattr(plan.cluster, "model_copy")
            else ClusterShape(2, 1, plan.cluster.gpu_memory_bytes, 0),
            min_replicas=2,
        )
