"""The MTP chain stage (train/mtp_chain.py): depth 1 is the layer as serving's first draft runs it, distilled from
the main model's own next-but-one distribution; depth 2 reads depth 1's output one position back, as a chained
draft does; training the stage makes the chain agree with the main model where it did not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from support import k3_fixtures
from support.train_shapes import SMALL

from expertmesh.train.export import model_config, text_config, wrapper_config
from expertmesh.train.loop import TrainConfig
from expertmesh.train.model import TrainModel
from expertmesh.train.mtp_chain import chain_losses, mtp_outputs, train_mtp_chain


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = tmp_path_factory.mktemp("tok")
    special = k3_fixtures.write_k3_tokenizer(tok, config=False)
    n_base = sum(1 for line in (tok / "tiktoken.model").read_text().splitlines() if line.strip())
    raw = wrapper_config(text_config(SMALL, n_base + k3_fixtures.N_RESERVED, special), special, SMALL)
    return TrainModel(model_config(raw, "small"), mtp=True, seed=5)


def window(model, seed: int, length: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (2, length + 1), generator=g)


def test_depths_read_what_serving_chains(model):
    """Depth 1 at s: h_s and token s+1, against the main model's softmax at s+1; depth 2 at s: depth 1's output
    at s-1 and token s+1 (the chained draft one position on), against the same targets, from s = 1."""
    w = window(model, 1)
    topk = SMALL.index_topk
    torch.manual_seed(0)
    per_depth, _, _ = chain_losses(model, w, topk, depth=2)
    with torch.no_grad():
        tokens = w[:, :-1]
        out = model(tokens, topk)
        target = torch.softmax(out.logits[:, 1:].float(), -1)
        emb = model.embed(tokens[:, 1:])
        x1 = mtp_outputs(model, emb, out.hidden[:, :-1], topk, [])
        l1 = -(target * F.log_softmax(model.mtp.head(model.mtp.head_norm(x1)).float(), -1)).sum(-1).mean()
        shifted = torch.cat([out.hidden[:, :1], x1[:, :-1]], dim=1)
        x2 = mtp_outputs(model, emb, shifted, topk, [])
        logits2 = model.mtp.head(model.mtp.head_norm(x2))[:, 1:].float()
        l2 = -(target[:, 1:] * F.log_softmax(logits2, -1)).sum(-1).mean()
    torch.testing.assert_close(per_depth[0].detach(), l1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(per_depth[1].detach(), l2, rtol=1e-5, atol=1e-5)
    # the main model is the target, not the corpus: a window's own tokens do not enter the loss beyond its inputs
    assert not torch.allclose(
        l1, F.cross_entropy(model.mtp.head(model.mtp.head_norm(x1)).float().flatten(0, 1), w[:, 2:].flatten())
    )


def test_the_stage_trains_only_the_mtp_layer_and_makes_the_chain_agree(model):
    trained = dataclasses.replace(
        TrainConfig(out="."), mtp_chain_steps=40, mtp_chain_depth=2, mtp_chain_lr=1e-2, shape=SMALL, seq_len=24
    )
    w = window(model, 2)
    grad_before = {n: p.requires_grad for n, p in model.named_parameters()}
    main_before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("mtp.")}
    mtp_before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.")}
    _, _, agree_before = chain_losses(model, w, SMALL.index_topk, depth=2)

    def windows():
        while True:
            yield w  # one window, overfit: the chain must come to agree with the main model on it

    report = train_mtp_chain(model, windows(), w[0], trained, log=lambda line: None)
    _, _, agree_after = chain_losses(model, w, SMALL.index_topk, depth=2)
    assert agree_after[1] >= agree_before[1] + 0.3, (agree_before, agree_after)
    assert agree_after[0] >= agree_before[0] + 0.3, (agree_before, agree_after)
    for n, p in model.named_parameters():
        if n in main_before:
            assert torch.equal(p, main_before[n]), f"{n}: the main model moved"
        assert p.requires_grad == grad_before[n], f"{n}: requires_grad not restored after the stage"
    assert any(not torch.equal(p, mtp_before[n]) for n, p in model.named_parameters() if n in mtp_before)
    assert report["steps"] == 40 and len(report["held_out_agreement_after"]) == 2
