"""The trainable K3+DSA model against the serving code: a TrainModel written as a K3 directory loads through the
serving loader (the path every Kimi K3 checkpoint takes, itself checked against llama.cpp) and gives the same
logits, dense and sparse; the training KDA against the recurrent reference, values and gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import k3_fixtures
from support.train_shapes import SMALL

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.kernels.kda.naive import kda_recurrent_reference
from expertmesh.train.export import (
    load_train_model,
    model_config,
    stored,
    text_config,
    wrapper_config,
    write_checkpoint,
)
from expertmesh.train.kda import chunk_kda_train
from expertmesh.train.model import TrainModel


@pytest.mark.parametrize("T", [1, 31, 70])
def test_chunk_kda_train_matches_the_recurrent_reference(T):
    torch.manual_seed(T)
    B, H, K, V = 2, 2, 16, 8
    q = torch.randn(B, T, H, K, dtype=torch.float64, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1).requires_grad_()
    v = torch.randn(B, T, H, V, dtype=torch.float64, requires_grad=True)
    g = (-5 * torch.sigmoid(torch.randn(B, T, H, K, dtype=torch.float64))).requires_grad_()
    beta = torch.rand(B, T, H, dtype=torch.float64, requires_grad=True)
    inputs = (q, k, v, g, beta)
    weights = torch.randn(B, T, H, V, dtype=torch.float64)
    o = chunk_kda_train(*inputs, chunk_size=16)
    grads = torch.autograd.grad((o * weights).sum(), inputs)
    ref, _ = kda_recurrent_reference(*inputs)
    ref_grads = torch.autograd.grad((ref * weights).sum(), inputs)
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("q k v g beta".split(), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"d/d{n}: {m}")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tok = tmp_path_factory.mktemp("tok")
    special = k3_fixtures.write_k3_tokenizer(tok, config=False)
    n_base = sum(1 for line in (tok / "tiktoken.model").read_text().splitlines() if line.strip())
    raw = wrapper_config(text_config(SMALL, n_base + k3_fixtures.N_RESERVED, special), special, SMALL)
    model = TrainModel(model_config(raw, "small"), mtp=True, seed=3)
    with torch.no_grad():  # trained-looking, not initial: non-zero mixes and biases everywhere
        for name, p in model.named_parameters():
            if name.endswith(("res.proj.weight", "router_bias")):
                p.copy_(torch.randn_like(p) * 0.5)
    out = write_checkpoint(model, raw, tok, tmp_path_factory.mktemp("ckpt") / "small")
    return model, out


@pytest.mark.parametrize("dense", [False, True])
def test_exported_model_serves_the_training_logits(exported, dense):
    """40 tokens, DSA top-8: the serving reference model on the written directory (MXFP4 experts as stored,
    bf16 weights) equals the TrainModel with the same stored weights, dense and sparse."""
    _, path = exported
    serving = Checkpoint(path).load_model(dense_attention=dense)
    trained = load_train_model(path)
    tokens = torch.randint(0, 400, (1, 40), generator=torch.Generator().manual_seed(0))
    expected = serving.step(tokens[0].tolist(), serving.new_cache())
    with torch.no_grad():
        got = trained(tokens, topk=None if dense else SMALL.index_topk).logits[0]
    torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4)


def test_sparse_attention_changes_the_logits(exported):
    """The comparison above can fail: top-8 of 40 keys is not dense attention."""
    _, path = exported
    trained = load_train_model(path)
    tokens = torch.randint(0, 400, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sparse, dense = trained(tokens, topk=SMALL.index_topk).logits, trained(tokens, topk=None).logits
    assert (sparse - dense).abs().max() > 1e-3


def test_exported_experts_are_the_qat_view_of_the_masters(exported):
    """The packed experts are what the QAT forward saw; the bf16 masters differ from them."""
    model, path = exported
    mx, bf = load_train_model(path, "mxfp4"), load_train_model(path, "bf16")
    layer = SMALL.layers - 1
    master = model.layers[layer].moe.experts.gate_up.detach()
    from expertmesh.train.model import fake_mxfp4

    torch.testing.assert_close(mx.layers[layer].moe.experts.gate_up, fake_mxfp4(master), rtol=0, atol=0)
    torch.testing.assert_close(bf.layers[layer].moe.experts.gate_up, master.bfloat16().float(), rtol=0, atol=0)
    assert not torch.equal(mx.layers[layer].moe.experts.gate_up, bf.layers[layer].moe.experts.gate_up)


def test_checkpoint_has_k3_layout(exported):
    _, path = exported
    ck = Checkpoint(path)
    assert ck.cfg.model_type == "kimi_k3" and "dsa" in ck.cfg.layer_types
    assert ck.cfg.indexer.index_topk == SMALL.index_topk
    sizes = [f.stat().st_size for f in path.glob("*.safetensors")]
    assert max(sizes) <= 5 << 20


def test_mtp_layer_round_trips(exported):
    model, path = exported
    back = load_train_model(path, "bf16")
    for name, p in model.mtp.named_parameters():
        if ".experts." not in name:
            torch.testing.assert_close(dict(back.mtp.named_parameters())[name], stored(name, p).float())


def test_shape_overrides_are_dataclass_fields():
    assert dataclasses.replace(SMALL, hidden=32).hidden == 32
