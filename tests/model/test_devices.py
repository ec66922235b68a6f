"""Devices, dtypes, memory-honest loading and the meta dry run (expertmesh/model/memory.py, placement/sizing.py)."""

import json

import numpy as np
import pytest
import torch

from expertmesh.model import memory
from expertmesh.model.config import preset
from expertmesh.placement import sizing
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import StepSegment
from expertmesh.worker import cli, server
from expertmesh.worker.attention import AttentionWorker
from expertmesh.worker.expert import ExpertWorker

GIB = 2**30


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.fixture(scope="module")
def full_plan(tmp_path_factory):
    from expertmesh.placement.planner import ClusterShape, plan_placement

    cfg = preset("full-2.8t")
    plan = plan_placement(cfg, ClusterShape(16, 8, 141 * GIB), redundant_slots=32)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(plan.to_json())
    return plan, path


def _dry(argv, capsys):
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_expert_dry_run_holds_its_slots_packed(full_plan, capsys):
    plan, path = full_plan
    cfg = preset("full-2.8t")
    total = 0
    for ordinal in (0, 15):
        out = _dry(
            [
                "--role",
                "expert",
                "--preset",
                "full-2.8t",
                "--plan",
                str(path),
                "--ordinal",
                str(ordinal),
                "--device",
                "meta",
                "--dry-run",
            ],
            capsys,
        )
        slots = len(plan.experts_of(ordinal))
        assert out["experts"] == slots
        assert abs(out["weights_bytes"] - slots * cfg.expert_bytes_mxfp4) <= 0.01 * slots * cfg.expert_bytes_mxfp4
        assert sorted(out["devices"]) == [f"cuda:{g}" for g in range(8)]
        for g, gpu in enumerate(plan.workers[ordinal].gpus):  # each GPU's shards on its own device
            assert out["devices"][f"cuda:{g}"] >= gpu.bytes
        assert max(out["devices"].values()) <= 141 * GIB
        assert out == json.loads(sizing.plan_expert_memory(cfg, plan, ordinal).to_json(experts=slots))
        total += out["weights_bytes"]
    assert total == sum(len(plan.experts_of(o)) for o in (0, 15)) * plan.expert_bytes  # the planner's bytes


def test_attention_dry_run_is_bf16_non_expert_weights(capsys):
    cfg = preset("full-2.8t")
    out = _dry(
        [
            "--role",
            "attention",
            "--preset",
            "full-2.8t",
            "--device",
            "meta",
            "--dry-run",
            "--gpu-memory-utilization",
            "0.9",
            "--device-memory-gib",
            "141",
        ],
        capsys,
    )
    # bf16 for everything but the fp32 routing / decay / indexer-head tensors (over all-bf16 102.47 GiB)
    assert out["weights_bytes"] == sizing.dense_weight_bytes(cfg, torch.bfloat16)
    assert cfg.dense_bytes_bf16 <= out["weights_bytes"] <= 1.015 * cfg.dense_bytes_bf16
    assert abs(cfg.dense_bytes_bf16 / GIB - 102.47) < 0.05
    assert out["kv_bytes"] == out["kv_blocks"] * sizing.kv_block_bytes(cfg, 16, torch.bfloat16) > 0
    assert out["devices"]["cuda:0"] <= 0.9 * 141 * GIB
    assert out == json.loads(
        sizing.attention_memory(cfg, kv_blocks=out["kv_blocks"], block_size=16).to_json(kv_blocks=out["kv_blocks"])
    )


def test_attention_worker_from_checkpoint_builds_no_experts(ckpt):
    w = AttentionWorker(ckpt, kv_blocks=8, block_size=4)
    for layer in w.model.layers:
        if layer.is_moe:
            assert layer.moe.experts.gate_up_blocks.shape[0] == 0 and layer.moe.experts.down_blocks.numel() == 0
    held = sum(b.numel() for n, b in w.model.named_buffers() if n.endswith(("_blocks", "_scales")))
    assert held == 0
    assert w.memory().weights_bytes == sizing.dense_weight_bytes(ckpt.cfg, torch.float32)


def test_expert_worker_holds_exactly_its_assignment_packed(ckpt):
    pairs = [(1, 3), (1, 9), (3, 0)]
    w = ExpertWorker(ckpt, pairs)
    got = {(layer, e) for layer, shards in w.experts.items() for _, mod, _ in shards for e in mod.ids}
    assert got == set(pairs)
    for layer, shards in w.experts.items():
        for _, mod, _ in shards:
            assert mod.gate_up_blocks.dtype == torch.uint8 and mod.down_scales.dtype == torch.uint8
            full = ckpt.tensor(f"layers.{layer}.moe.experts.gate_up.blocks")
            assert torch.equal(mod.gate_up_blocks, full[mod.ids])
    assert w.memory().weights_bytes == len(pairs) * ckpt.cfg.expert_bytes_mxfp4


def test_expert_worker_splits_gpus_same_bits(ckpt):
    """One process, the plan's GPUs as separate shards (on cpu here): same outputs as one shard."""
    pairs = [(1, e) for e in range(16)]
    one = ExpertWorker(ckpt, pairs)
    split = ExpertWorker(ckpt, pairs, device="cpu", gpu_of={p: p[1] % 2 for p in pairs})
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, ckpt.cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(16, generator=g)[:4].sort().values for _ in range(5)])
    w = torch.rand(5, 4, generator=g)
    assert torch.equal(one.run(1, hidden, ids, w), split.run(1, hidden, ids, w))


def _prompt_logprobs(worker, experts, tokens):
    from expertmesh.placement.replica_table import ReplicaTable

    cfg = worker.cfg
    table = ReplicaTable(
        tuple(cfg.moe_layers), np.zeros((len(cfg.moe_layers), cfg.moe.n_routed_experts, 1), dtype=np.int64)
    )
    worker.connect_experts([experts], table)
    worker.open_sequence("s", SamplingParams(max_tokens=1, prompt_logprobs=0), reserve_tokens=len(tokens) + 1)
    r = worker.run_step(1, [StepSegment("s", tokens, True)])
    return torch.cat([lp.logprobs for lp in r.logprobs])


def test_bf16_worker_agrees_with_fp32_reference(ckpt):
    """The GPU dtype on a CPU. Tolerance: bf16 keeps 8 mantissa bits (relative rounding 2^-9); through the tiny
    model's 4 layers (with the near-ties in MoE routing and DSA top-k this can flip) the prompt log-probs stay
    within 0.15 nats on average and 0.6 at worst (seen: see the assertion message)."""
    tokens = [(7 * i + 3) % 250 + 5 for i in range(40)]
    experts = ExpertWorker(ckpt, server.all_experts(ckpt.cfg))
    ref = AttentionWorker(ckpt, kv_blocks=16, block_size=4)
    bf = AttentionWorker(ckpt, kv_blocks=16, block_size=4, dtype="bfloat16")
    assert bf.model.layers[0].attn.q_proj.weight.dtype == torch.bfloat16
    assert bf.model.layers[1].moe.router.weight.dtype == torch.float32  # FP32_PARAMETERS stay fp32
    assert bf.pool.latent[1].dtype == torch.bfloat16 and ref.pool.latent[1].dtype == torch.float32
    a, b = _prompt_logprobs(ref, experts, tokens), _prompt_logprobs(bf, experts, tokens)
    diff = (a - b.float()).abs()
    print("bf16 vs fp32 prompt log-probs: mean", float(diff.mean()), "max", float(diff.max()))
    assert diff.mean() < 0.15 and diff.max() < 0.6, (float(diff.mean()), float(diff.max()))
    assert diff.max() > 0  # it really ran in another dtype


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "gpu"], "--device: expected one of cuda, cpu, meta, found 'gpu'"),
        (["--device", "cpu", "--dry-run"], "--dry-run: needs --device meta"),
        (["--device", "meta"], "--device meta: only with --dry-run"),
    ],
)
def test_bad_device_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--role", "attention", "--preset", "tiny", "--port", "0", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cuda_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(memory.DeviceError, match="--device cuda: no CUDA device"):
        memory.check_device("cuda")
    assert memory.check_device(None) == "cpu" and memory.compute_dtype("cpu") == torch.float32
    assert memory.compute_dtype("meta") == torch.bfloat16


def test_up_passes_device_through():
    from expertmesh.entry.cluster import LocalCluster

    c = LocalCluster("/nonexistent", device="cpu", dtype="bfloat16")
    assert c.device_args == ["--device", "cpu", "--dtype", "bfloat16"]
