"""The MTP layer's routed experts on the expert workers (#52): a plan made with `mtp` places layer n_layers' experts
like any MoE layer's (and one without it places exactly the MoE layers, as before); an expert worker loads them from
a K3 checkpoint and computes what the MTP layer's own experts compute; an attention worker speculating with the MTP
layer holds none of them and sends its MoE rows through the expert exchange; a router given a plan without them
refuses, naming the flag."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.k3_checkpoint import write_k3_checkpoint

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import make_placement
from expertmesh.entry.local import build_local_engine
from expertmesh.model.config import preset
from expertmesh.placement.planner import ClusterShape, placed_layers, plan_placement, pods_needed
from expertmesh.placement.sizing import plan_expert_memory
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.worker.expert import ExpertWorker


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return write_k3_checkpoint(tmp_path_factory.mktemp("mtpplace") / "k3", mtp=True)


def test_a_plan_with_mtp_places_the_mtp_layer_and_one_without_is_unchanged(k3):
    cfg = Checkpoint(k3).cfg
    assert placed_layers(cfg) == cfg.moe_layers
    assert placed_layers(cfg, mtp=True) == [*cfg.moe_layers, cfg.n_layers]
    shape = ClusterShape(pods=2, gpus_per_pod=1, gpu_memory_bytes=64 * cfg.expert_bytes_mxfp4)
    plain, mtp = plan_placement(cfg, shape), plan_placement(cfg, shape, mtp=True)
    assert list(plain.moe_layers) == cfg.moe_layers
    assert list(mtp.moe_layers) == [*cfg.moe_layers, cfg.n_layers]
    E = cfg.moe.n_routed_experts
    assert mtp.figures.logical_experts == plain.figures.logical_experts + E
    assert all(len(mtp.replicas(cfg.n_layers, e)) == 1 for e in range(E))
    assert plain.plan_hash() != mtp.plan_hash()
    # sizing counts them: the expert workers' bytes grow by the MTP layer's experts
    grown = sum(plan_expert_memory(cfg, mtp, w).weights_bytes for w in range(2))
    base = sum(plan_expert_memory(cfg, plain, w).weights_bytes for w in range(2))
    assert grown - base == E * cfg.expert_bytes_mxfp4


def test_the_full_model_needs_more_pods_for_its_mtp_layer_only_with_mtp():
    cfg = preset("full-2.8t").model_copy(update={"n_mtp_layers": 1})  # as Kimi K3 ships: one MTP layer
    shape = ClusterShape(pods=1, gpus_per_pod=8, gpu_memory_bytes=141 * 2**30, reserve_bytes=8 * 2**30)
    slots = shape.slots_per_gpu(cfg.expert_bytes_mxfp4) * 8
    n = cfg.n_logical_experts
    assert pods_needed(cfg, shape) == -(-n // slots)
    assert pods_needed(cfg, shape, mtp=True) == -(-(n + cfg.moe.n_routed_experts) // slots)


def test_mtp_on_a_model_without_an_mtp_layer_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="mtp: the model .* has no MTP layers"):
        placed_layers(tiny_checkpoint.cfg, mtp=True)


def test_an_expert_worker_computes_the_mtp_layers_experts_as_the_layer_does(k3):
    ckpt = Checkpoint(k3)
    cfg = ckpt.cfg
    model = ckpt.load_model()
    ckpt.hf.load_mtp(model, experts=True)
    local = model.mtp[0].block.moe.experts
    E, k = cfg.moe.n_routed_experts, cfg.moe.top_k
    worker = ExpertWorker(Checkpoint(k3), [(cfg.n_layers, e) for e in range(E)])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, cfg.expert_hidden_size, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k].sort().values for _ in range(5)])
    weights = torch.rand(5, k, generator=g)
    from expertmesh.kernels.moe.combine import group_partials

    want = group_partials(
        local.outputs_fp32(hidden, ids), ids, weights, E // cfg.moe.combine_groups, cfg.moe.combine_groups
    )
    assert torch.equal(worker.run(cfg.n_layers, hidden, ids, weights), want)


def test_speculating_attention_workers_send_the_mtp_layers_rows_to_the_expert_workers(k3):
    cfg = Checkpoint(k3).cfg
    engine = build_local_engine(str(k3), speculative_tokens=2, speculative_method="mtp", expert_workers=2)
    try:
        engine.generate([5, 17, 42, 99, 17, 42, 7], SamplingParams(max_tokens=12), timeout=300)
        worker = engine.attention[0]._client
        assert worker.model.mtp[0].block.moe.experts.ids == []  # none held on the attention worker
        load = worker.expert_load()
        assert sum(load[cfg.n_layers]) > 0  # its MoE rows went through the exchange
        held = {layer for w in engine.experts for layer, _ in w._client.assignment}
        assert cfg.n_layers in held
    finally:
        engine.close()


def test_a_router_given_a_plan_without_the_mtp_layer_refuses_naming_the_flag(k3):
    cfg = Checkpoint(k3).cfg
    with pytest.raises(ValueError, match=r"--speculative-method mtp: the MTP layer \d+'s experts too"):
        build_local_engine(
            str(k3), speculative_tokens=2, speculative_method="mtp", placement=make_placement(cfg, 1)
        ).close()


def test_the_operator_plans_the_mtp_layer_for_a_spec_that_drafts_with_it():
    from support.tiny_deployment import TINY_EXPERT_BYTES, tiny

    from expertmesh.operator.placement_policy import plan_for, rebalance
    from expertmesh.operator.spec import parse_spec, resolve_model

    config = preset("tiny").model_dump(mode="json") | {"n_mtp_layers": 1}
    model = {"config": config, "checkpoint": {"uri": "/opt/expertmesh/checkpoints/tiny-mtp"}}
    room = {"gpuMemoryGiB": (40 * TINY_EXPERT_BYTES + 10) / 2**30}  # the MTP layer's experts too
    mtp = parse_spec({**tiny(speculative={"method": "mtp", "tokens": 2}, expertWorkers=room), "model": model})
    ngram = parse_spec({**tiny(speculative={"method": "ngram", "tokens": 2}, expertWorkers=room), "model": model})
    cfg = resolve_model(mtp)
    with_mtp, without = plan_for(mtp, cfg), plan_for(ngram, cfg)
    assert list(with_mtp.moe_layers) == [*cfg.moe_layers, cfg.n_layers]
    assert list(without.moe_layers) == cfg.moe_layers  # no MTP drafting: planned exactly as before
    # the previous plan of other layers is not reused; observed loads (the MoE layers') still plan the MTP layer
    assert list(plan_for(mtp, cfg, previous=without).moe_layers) == list(with_mtp.moe_layers)
    loads = np.random.default_rng(0).random((cfg.n_moe_layers, cfg.moe.n_routed_experts)) * 100
    decision = rebalance(mtp, cfg, with_mtp, loads)
    assert decision.plan is None or list(decision.plan.moe_layers) == list(with_mtp.moe_layers)
