"""scripts/train_tiny.py on a small slice: the whole recipe runs (data, tokenizer, dense warm-up, sparse DSA, QAT,
MTP, export) and its loss falls; the directory it writes is a K3 checkpoint the serving loader takes."""

from __future__ import annotations

import json
import runpy
import sys

import pytest
import torch
from safetensors import safe_open

from expertmesh.checkpoint.loader import Checkpoint

HIDDEN = 64


SLICE = ("--batch", "4", "--seq-len", "48", "--max-synsets", "800", "--bpe-ranks", "300", "--eval-every", "0")
COPY = ("--copy-warmup", "2", "--copy-batch", "4", "--copy-mix", "2")  # the copy task, briefly
CHAIN = ("--mtp-chain-steps", "2")  # the MTP chain stage, briefly


def train_tiny(*args: str) -> None:
    """scripts/train_tiny.py as its command line runs it."""
    argv = sys.argv
    sys.argv = ["train_tiny.py", *args, *SLICE, *COPY, *CHAIN, "--hidden", str(HIDDEN)]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path("scripts/train_tiny.py", run_name="__main__")
    finally:
        sys.argv = argv
    assert done.value.code == 0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    train_tiny("--out", str(root / "k3-small"), "--work", str(root / "work"), "--steps", "16", "--lr", "0.01")
    return root / "k3-small"


def test_loss_falls(run):
    report = json.loads((run / "training.json").read_text())
    assert report["last_loss"] < report["first_loss"] - 0.5, report
    assert report["data"]["held_out_tokens"] > 0 and report["data"]["train_tokens"] > 0


def test_the_trained_slice_loads_for_serving(run):
    ck = Checkpoint(run)
    assert ck.cfg.model_type == "kimi_k3" and ck.cfg.layer_types[-1] == "dsa"
    model = ck.load_model()
    logits = model.step([1, 2, 3], model.new_cache())
    assert logits.shape[-1] == ck.cfg.vocab_size


def test_small_shape_is_what_the_script_trained(run):
    shape = json.loads((run / "config.json").read_text())["expertmesh_training_shape"]
    assert shape["hidden"] == HIDDEN


def test_a_run_continues_from_a_written_checkpoint(run, tmp_path):
    """--init: the trained slice's weights, not a random start (its first loss is near where the slice ended)."""
    out = tmp_path / run.name  # the same name: the same model config
    train_tiny("--out", str(out), "--work", str(tmp_path / "work"), "--init", str(run), "--steps", "2")
    before, after = (json.loads((d / "training.json").read_text()) for d in (run, out))
    assert after["first_loss"] < before["first_loss"] - 0.5, (before, after)


def test_the_mtp_stage_alone_keeps_the_main_model_bit_for_bit(run, tmp_path):
    """--init with --steps 0: only the MTP chain stage trains; every tensor outside the MTP layer (main experts'
    MXFP4 codes and bf16 masters included) is the init's, the MTP layer's differ; the report says how both were
    made."""
    out = tmp_path / run.name
    train_tiny("--out", str(out), "--work", str(tmp_path / "work"), "--init", str(run), "--steps", "0")
    n_layers = json.loads((run / "config.json").read_text())["text_config"]["num_hidden_layers"]
    mtp_prefix = f"language_model.model.layers.{n_layers}."
    before, after = tensors(run), tensors(out)
    assert set(before) == set(after)
    main = [n for n in before if not n.startswith(mtp_prefix)]
    assert main and all(torch.equal(before[n], after[n]) for n in main)
    assert any(not torch.equal(before[n], after[n]) for n in before if n.startswith(mtp_prefix))
    report = json.loads((out / "training.json").read_text())
    assert report["mtp_chain"]["steps"] == 2 and report["init_report"]["config"]["steps"] == 16


def tensors(directory) -> dict:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out |= {n: f.get_tensor(n) for n in f.keys()}  # the bf16 masters' names are their own
    return out
