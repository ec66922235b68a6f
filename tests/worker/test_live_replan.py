"""A live re-plan over real gRPC workers on loopback: while requests decode, the router adopts a plan with
redundant replicas, then one that empties an expert worker (as when its pod is lost). Each expert worker loads
exactly the shards the planner counts as moved and drops the rest after the router switched its table; every
request completes with the reference model's greedy tokens."""

from __future__ import annotations

import time

import pytest

from expertmesh.model.transformer import generate
from expertmesh.placement.planner import ClusterShape, moved_shards, plan_placement
from expertmesh.router.engine_config import EngineConfig, step_deadline
from expertmesh.router.server import build_remote_engine
from expertmesh.wire.clients import RemoteExpert
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.worker.server import serve, shutdown

MAX_TOKENS = 24
CHUNK = 16


def shape(cfg, pods: int) -> ClusterShape:
    return ClusterShape(
        pods=pods, gpus_per_pod=1, gpu_memory_bytes=cfg.n_logical_experts * cfg.expert_bytes_mxfp4, reserve_bytes=0
    )


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py)


def test_live_replan_moves_only_planned_shards_and_keeps_every_token(ckpt):
    cfg = ckpt.cfg
    first = plan_placement(cfg, shape(cfg, 3))
    redundant = plan_placement(cfg, shape(cfg, 3), redundant_slots=8, previous=first)
    # expert worker 2 gone: the planner keeps what workers 0 and 1 hold and places its shards on them
    without_2 = plan_placement(cfg, shape(cfg, 2), redundant_slots=8, previous=redundant)
    assert 0 < moved_shards(first, redundant) < cfg.n_logical_experts + 8 * cfg.n_moe_layers
    att = serve("attention", ckpt, 0, kv_blocks=256, block_size=16, name="attention-0")
    experts = [serve("expert", ckpt, 0, assignment=first.experts_of(o), name=f"expert-{o}") for o in range(3)]
    addrs = [f"127.0.0.1:{s.port}" for s in experts]
    engine = build_remote_engine(
        cfg,
        [f"127.0.0.1:{att.port}"],
        addrs,
        first,
        EngineConfig(prefill_chunk=CHUNK, call_timeout=step_deadline(30.0, len(addrs))),
        timeout=30.0,
    ).start()
    try:
        prompts = [[(7 * i + j) % 200 + 1 for j in range(5 + 3 * i)] for i in range(4)]
        model = ckpt.load_model()
        reference = [
            generate(model, p, SamplingParams(max_tokens=MAX_TOKENS), prefill_chunk=CHUNK).tokens for p in prompts
        ]
        reqs = [engine.submit(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
        while engine.stats.generated_tokens == 0:
            time.sleep(0.01)
        grow = engine.replan(redundant)
        mid = engine.stats.generated_tokens
        shrink = engine.replan(without_2)
        out = [r.wait(120).output for r in reqs]
        in_flight = engine.stats.generated_tokens
        counted = engine.load_stats()
        again = engine.replan(without_2)  # the plan in force (as on a router's start): nothing moves
        assert again == {"loaded": 0, "dropped": 0, "unreachable": []}
        assert engine.load_stats() == counted  # and no reconnect (ConnectExperts would restart the counts)
        held = []
        for a in addrs:
            with RemoteExpert(a, timeout=10) as w:
                held.append(sorted(w.info()["experts"]))
    finally:
        engine.close()
        for s in [att, *experts]:
            shutdown(s, 1.0)
    assert out == reference  # the same greedy tokens, switched mid-decode
    assert engine.stats.requests_failed == 0
    assert 0 < mid < in_flight == len(prompts) * MAX_TOKENS  # the first switch happened while they decoded
    # warm + drain moved exactly what the planner says moved, nothing else was reloaded or dropped
    assert grow == {"loaded": moved_shards(first, redundant), "dropped": 0, "unreachable": []}
    assert shrink["loaded"] == moved_shards(redundant, without_2) and shrink["unreachable"] == []
    assert shrink["dropped"] == len(redundant.experts_of(2))
    assert held == [sorted(without_2.experts_of(0)), sorted(without_2.experts_of(1)), []]
    assert engine.plan_hash == without_2.plan_hash()
