"""The recipe's copy task (expertmesh/train/copy_task.ChatCopy): K3 chat turns about random one-token words, the
loss on the word's later occurrences only; and the warm-up's stopping rule."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from expertmesh.chat.k3 import K3Chat
from expertmesh.chat.tiktoken_tokenizer import TikTokenTokenizer
from expertmesh.train.copy_task import ChatCopy
from expertmesh.train.export import model_config
from expertmesh.train.loop import TrainConfig, copy_warmup
from expertmesh.train.model import TrainModel

SHIPPED = Path("models/k3-tiny")


def chat() -> K3Chat:
    return K3Chat(TikTokenTokenizer(SHIPPED))


def test_rows_ask_about_one_random_word_and_only_its_copies_are_scored():
    copies = ChatCopy(chat(), seed=1)
    assert len(copies.words) > 500  # the shipped vocabulary's one-token words
    for _ in range(4):  # every template, thinking on and off
        tokens, words = copies.batch(6)
        assert tokens.shape[0] == 6 and len(set(words.tolist())) > 1
        mask = ChatCopy.copies(tokens, words)
        for row, word, m in zip(tokens.tolist(), words.tolist(), mask):
            seen = row.count(word)
            assert seen >= 2, copies.tokenizer.decode(row)  # asked, then taken up
            assert int(m.sum()) == seen - 1  # every occurrence but the first
            assert all(row[i + 1] == word for i in m.nonzero()[:, 0].tolist())
            assert m.nonzero()[0, 0].item() + 1 > row.index(word)  # the question's occurrence is not a target


def test_loss_rewards_copying_and_not_guessing():
    copies = ChatCopy(chat(), seed=2)
    tokens, words = copies.batch(8)
    v = copies.tokenizer.vocab_size

    def copier(x):  # puts its mass on the row's word: what a model that copies does at the copies
        logits = torch.zeros(*x.shape, v)
        logits[torch.arange(x.shape[0]), :, words] = 20.0
        return logits

    def guesser(x):  # the same word for every row: what "the usual noun after 'about the'" does
        logits = torch.zeros(*x.shape, v)
        logits[..., words[0]] = 20.0
        return logits

    loss, accuracy = ChatCopy.loss(copier, tokens, words)
    assert accuracy == 1.0 and loss.item() < 1e-3
    loss, accuracy = ChatCopy.loss(guesser, tokens, words)
    assert accuracy < 0.5 and loss.item() > 5.0
    loss, _ = ChatCopy.loss(lambda x: torch.zeros(*x.shape, v), tokens, words)
    assert math.isclose(loss.item(), math.log(v), rel_tol=1e-5)


def test_warmup_stops_at_the_target_accuracy_or_its_step_limit():
    import json

    cfg_json = json.loads((SHIPPED / "config.json").read_text())
    model = TrainModel(model_config(cfg_json, "k3-tiny"), mtp=False, seed=0, tie_embeddings=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    copies = ChatCopy(chat(), seed=0)
    run = TrainConfig(out=Path("."), copy_warmup=3, copy_batch=2, copy_target=2.0)  # unreachable: the limit
    assert len(copy_warmup(model, opt, run, copies, log=lambda line: None)) == 3
    run = TrainConfig(out=Path("."), copy_warmup=3, copy_batch=2, copy_target=0.0)  # reached at once
    assert len(copy_warmup(model, opt, run, copies, log=lambda line: None)) == 1
