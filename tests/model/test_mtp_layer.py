"""The MTP layers served for speculative decoding: the config field, loading them from K3 directories (names and
shapes checked), the serving layer's logits against the training model's on the shipped models/k3-tiny."""

from __future__ import annotations

import json

import pytest
import torch
from support.k3_checkpoint import write_k3_checkpoint
from support.paths import REPO

from expertmesh.checkpoint.hf_config import HFCheckpointError
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.model.cache import Segment
from expertmesh.model.transformer import Transformer, module_shapes
from expertmesh.train.export import load_train_model

K3_TINY = REPO / "models" / "k3-tiny"


@pytest.fixture(scope="module")
def k3_dirs(tmp_path_factory):
    """Tiny random K3 checkpoints with one MTP layer: plain (MLA) and the K3+DSA twin, and one without MTP."""
    root = tmp_path_factory.mktemp("k3mtp")
    return {
        "mla": write_k3_checkpoint(root / "mla", mtp=True),
        "dsa": write_k3_checkpoint(root / "dsa", mtp=True, with_indexer=True),
        "none": write_k3_checkpoint(root / "none"),
    }


def test_config_counts_the_mtp_layers(k3_dirs):
    assert Checkpoint(k3_dirs["mla"]).cfg.n_mtp_layers == 1
    assert Checkpoint(k3_dirs["none"]).cfg.n_mtp_layers == 0
    assert Checkpoint(K3_TINY).cfg.n_mtp_layers == 1
    assert Checkpoint(k3_dirs["dsa"]).cfg.mtp_layer_type == "dsa"
    assert Checkpoint(k3_dirs["mla"]).cfg.mtp_layer_type == "mla"


@pytest.mark.parametrize("kind", ["mla", "dsa"])
def test_load_mtp_reads_every_tensor_of_the_layer(k3_dirs, kind):
    ck = Checkpoint(k3_dirs[kind])
    model = ck.load_model(dtype=torch.bfloat16)
    main_state = {k: v.clone() for k, v in model.state_dict().items()}
    ck.hf.load_mtp(model)
    layer = model.mtp[0]
    assert layer.block.kind == kind and layer.block.is_moe and layer.block.block_size is None
    assert layer.block.moe.router.weight.dtype == torch.float32  # FP32_PARAMETERS stay fp32
    stored = ck.hf.files.read(f"language_model.model.layers.{ck.cfg.n_layers}.eh_proj.weight")
    assert torch.equal(layer.eh_proj.weight, stored)
    assert layer.block.moe.experts.gate_up_blocks.any()  # the experts were read
    for name, t in main_state.items():  # the main model untouched
        assert torch.equal(model.state_dict()[name], t), name


def test_default_model_has_no_mtp_and_mtp_needs_layers(k3_dirs):
    cfg = Checkpoint(k3_dirs["mla"]).cfg
    assert not any(name.startswith("mtp.") for name in module_shapes(cfg))
    with torch.device("meta"):
        assert any(n.startswith("mtp.0.block.moe") for n in Transformer(cfg, mtp=True).state_dict())
    none = Checkpoint(k3_dirs["none"])
    with pytest.raises(ValueError, match="no MTP layers"):
        Transformer(none.cfg, mtp=True)
    with pytest.raises(HFCheckpointError, match="num_nextn_predict_layers"):
        none.hf.load_mtp(none.load_model())


def test_load_mtp_refuses_a_wrong_shape_and_an_unknown_tensor(k3_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    n = Checkpoint(k3_dirs["mla"]).cfg.n_layers
    for case in ("shape", "unknown"):
        out = write_k3_checkpoint(tmp_path / case, mtp=True)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        name = f"language_model.model.layers.{n}.eh_proj.weight"
        fname = index["weight_map"][name]
        tensors = load_file(str(out / fname))
        if case == "shape":
            tensors[name] = tensors[name][:, :-32].contiguous()
        else:
            tensors[f"language_model.model.layers.{n}.stray.weight"] = torch.zeros(2)
            index["weight_map"][f"language_model.model.layers.{n}.stray.weight"] = fname
            (out / "model.safetensors.index.json").write_text(json.dumps(index))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        ck = Checkpoint(out)  # the main model loads: MTP tensors are the drafter's business
        model = ck.load_model(dtype=torch.bfloat16)
        expected = r"eh_proj.weight'? has shape" if case == "shape" else "unexpected tensor .*stray"
        with pytest.raises(HFCheckpointError, match=expected):
            ck.hf.load_mtp(model)


def test_serving_mtp_layer_equals_the_training_one_on_k3_tiny():
    """models/k3-tiny (trained here, K3+DSA, 1 MTP layer): the serving MTP layer fed the training model's normed
    hidden states gives the training MTPLayer's logits (fp32 both, the weights as stored; 40 tokens, under the
    DSA top-k, so dense on both sides). The main models agree on their greedy tokens; their hidden states are
    compared loosely: the training KDA (train/kda.py, chunks of 32 solved in fp32) drifts from the exact recurrence
    by up to ~0.2 on a few late rows of this model's sharply decaying heads, while the serving chunked form equals
    its own recurrent form (tests/kernels)."""
    ck = Checkpoint(K3_TINY)
    serving = ck.hf.load_mtp(ck.load_model())
    trained = load_train_model(K3_TINY)
    tokens = torch.randint(0, ck.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = serving.new_cache()
    with torch.no_grad():
        x = serving.hidden_states(serving.embed(tokens[0]), [Segment(0, 40, cache)])
        hidden = serving.norm(x)
        layer = serving.mtp[0]
        mtp_cache = layer.new_cache()
        out = trained(tokens)
        got = layer.logits(layer(serving.embed(tokens[0, 1:]), out.hidden[0, :-1], [Segment(0, 39, mtp_cache)]))
        expected, _ = trained.mtp_logits(tokens, out)
    assert (hidden - out.hidden[0]).abs().mean() < 0.02  # 0.006 seen; the values are O(1)
    main_agree = (serving.logits(x).argmax(-1) == trained.lm_head(out.hidden[0]).argmax(-1)).float().mean()
    assert main_agree > 0.95, main_agree
    torch.testing.assert_close(got, expected[0], rtol=2e-3, atol=2e-3)
    assert (got.argmax(-1) == expected[0].argmax(-1)).float().mean() > 0.95
