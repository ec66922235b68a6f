"""bench/copy_learning.py: its batches pose the copy task it says (the target is the one noun placed among the
fillers), and a short run trains both models on them, printing finite losses for every step asked."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_copy_learning", REPO / "bench" / "copy_learning.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_each_batch_asks_for_the_one_noun_among_its_fillers():
    x = bench.copy_batch(64, 10, torch.Generator().manual_seed(3))
    assert x.shape == (64, 12) and (x[:, -2] == bench.MARKER).all()
    for row in x.tolist():
        context, target = row[:-2], row[-1]
        nouns = [t for t in context if t in bench.NOUNS]
        assert nouns == [target] and context.index(target) < len(context) - 4
        assert all(t in bench.FILLERS for t in context if t != target)


def test_a_short_run_trains_both_models_on_the_checkpoints_shape(capsys):
    out = bench.main(["--steps", "3", "--every", "1", "--batch", "4", "--seq", "6", "--tie"])
    assert out["shape"] == {"vocab": 3072, "hidden": 192, "layers": 4, "heads": 4}  # models/k3-tiny
    assert set(out["results"]) == {"k3+dsa tied", "plain"}
    for rows in out["results"].values():
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert all(math.isfinite(r["loss"]) and r["loss"] > 0 and 0 <= r["accuracy"] <= 1 for r in rows)
    assert "k3+dsa tied loss" in capsys.readouterr().out
