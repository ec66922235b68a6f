"""Checkpoint format: create, inspect, load, and the loader's errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertmesh.checkpoint.files import CheckpointError
from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint, inspect_checkpoint
from expertmesh.entry.cli import main
from expertmesh.model.config import preset


@pytest.fixture(scope="module")
def ckpt_dir(tiny_checkpoint_dir):
    return tiny_checkpoint_dir  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.fixture
def copy(ckpt_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(ckpt_dir, dst)
    return dst


def test_layout_and_inspect(ckpt_dir):
    files = sorted(p.name for p in ckpt_dir.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert "model-embed.safetensors" in files
    assert sum(f.startswith("model-layers-") for f in files) == preset("tiny").n_layers  # one file per layer
    info = inspect_checkpoint(ckpt_dir)
    assert info["bits_per_expert_weight"] == pytest.approx(4.25)
    assert info["expert_weights"] == preset("tiny").routed_expert_params
    assert info["file_overhead_bytes"] > 0
    assert info["file_bytes"] == info["tensor_bytes"] + info["file_overhead_bytes"]
    assert [row["ffn"] for row in info["layers"]] == ["dense", "moe", "moe", "moe"]


def test_experts_are_mxfp4_rest_bf16(ckpt_dir):
    t = load_file(str(ckpt_dir / "model-layers-00001-00001.safetensors"))
    cfg = preset("tiny")
    e, h, i = cfg.moe.n_routed_experts, cfg.hidden_size, cfg.moe.expert_intermediate_size
    assert t["layers.1.moe.experts.gate_up.blocks"].shape == (e, 2 * i, h // 2)
    assert t["layers.1.moe.experts.gate_up.scales"].shape == (e, 2 * i, h // 32)
    assert t["layers.1.moe.experts.down.blocks"].dtype == torch.uint8
    assert t["layers.1.attn.q_a.weight"].dtype == torch.bfloat16


def test_same_seed_same_weights_and_model_generates(ckpt_dir, tmp_path):
    other = create_checkpoint(preset("tiny"), tmp_path / "again", seed=0)
    a = load_file(str(ckpt_dir / "model-layers-00002-00002.safetensors"))
    b = load_file(str(other / "model-layers-00002-00002.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    model = Checkpoint(ckpt_dir).load_model()
    logits = model.step([1, 2, 3], model.new_cache())
    assert logits.shape == (3, preset("tiny").vocab_size) and torch.isfinite(logits).all()


def test_expert_shard_loads_only_its_experts(ckpt_dir):
    ck = Checkpoint(ckpt_dir)
    shard = ck.load_experts(2, [3, 9])
    full = ck.tensor("layers.2.moe.experts.down.blocks")
    assert torch.equal(shard.down_blocks, full[[3, 9]])
    assert shard.global_to_local[9].item() == 1 and shard.global_to_local[4].item() == -1
    with pytest.raises(CheckpointError, match="layer 0 has no routed experts"):
        ck.load_experts(0, [1])


def _rewrite(path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def test_missing_tensor(copy):
    f = copy / "model-layers-00001-00001.safetensors"
    _rewrite(f, lambda t: t.pop("layers.1.moe.router.weight"))
    with pytest.raises(
        CheckpointError, match=r"model-layers-00001-00001.safetensors: tensor 'layers.1.moe.router.weight' missing"
    ):
        Checkpoint(copy)


def test_wrong_shape(copy):
    f = copy / "model-layers-00002-00002.safetensors"
    _rewrite(f, lambda t: t.__setitem__("layers.2.attn.q_proj.weight", torch.zeros(8, 8, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError, match=r"'layers.2.attn.q_proj.weight' has shape \[8, 8\], expected \[32, 64\]"):
        Checkpoint(copy)


def test_wrong_dtype(copy):
    f = copy / "model-layers-00003-00003.safetensors"
    name = "layers.3.moe.experts.down.scales"
    _rewrite(f, lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(CheckpointError, match=rf"'{name}' has dtype F32, expected U8"):
        Checkpoint(copy)


def test_truncated_file(copy):
    f = copy / "model-embed.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model-embed.safetensors: truncated"):
        Checkpoint(copy)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"truncated \(no safetensors header\)"):
        Checkpoint(copy)


def test_missing_file_and_index_entry(copy):
    (copy / "model-layers-00000-00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-layers-00000-00000.safetensors: missing"):
        Checkpoint(copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("norm.weight")
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensor 'norm.weight' missing from the index"):
        Checkpoint(copy)


def test_config_mismatch(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["hidden_size"] = 128
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has shape \[288, 64\], expected \[288, 128\]"):
        Checkpoint(copy)
    with pytest.raises(
        CheckpointError, match=r"config does not match the expected one \(hidden_size: expected 64, found 128\)"
    ):
        Checkpoint(copy, expect_config=preset("tiny"))
    cfg["moe"]["top_k"] = 99
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"(?s)invalid model config.*top_k=99"):
        Checkpoint(copy)


def test_cli_create_inspect_generate(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["checkpoint", "create", "--preset", "tiny", "--out", str(out), "--seed", "1"]) == 0
    assert main(["checkpoint", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bits per expert weight  4.2500" in text
    assert main(["generate", "--checkpoint", str(out), "--max-tokens", "5", "--ids", "hello"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 5 and all(0 <= int(i) < preset("tiny").vocab_size for i in ids)
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    assert main(["model", "describe", "full-2.8t"]) == 0
    text = capsys.readouterr().out
    assert "2.78T" in text and "103.63B" in text and "896 (top-16, ungrouped, 2 shared" in text
