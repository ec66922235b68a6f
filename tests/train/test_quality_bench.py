"""bench/quality.py end to end on a checkpoint trained here for two steps: every section's numbers are there and
finite, the serving model scores the held-out windows as the training model does (MXFP4 experts both), and the
DSA top-k it is set to is the one it attends with (top-k >= the context is dense attention, a small one is not)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
from support.train_shapes import SMALL

from expertmesh.train.loop import TrainConfig, train

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_quality", REPO / "bench" / "quality.py")
quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quality)

CONTEXT = 64
SYNSETS = 600


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("quality")
    cfg = TrainConfig(
        out=root / "k3-small",
        work=root / "work",
        steps=2,
        max_synsets=SYNSETS,
        shape=SMALL,
        seq_len=CONTEXT,
        batch=2,
        eval_every=0,
        bpe_ranks=400,
        copy_warmup=2,
        copy_batch=4,
        copy_mix=2,
        mtp_chain_steps=2,
        threads=1,  # a second thread waits on a shared machine's busy core: seconds per step instead of 0.05
    )
    train(cfg, log=lambda line: None)
    out = root / "quality.json"
    quality.main(
        [
            *("--checkpoint", str(cfg.out), "--json", str(out), "--windows", "2", "--prompts", "1"),
            *("--context", str(CONTEXT), "--topk", f"4,{SMALL.index_topk},{CONTEXT}", "--max-tokens", "6"),
            *("--max-synsets", str(SYNSETS)),
        ]
    )
    return json.loads(out.read_text())


def numbers(value, where: str = ""):
    """Every number in a JSON value, with where it is."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from numbers(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from numbers(v, f"{where}[{i}]")


def test_every_section_has_finite_numbers(report):
    for section in ("experts", "dsa", "thinking", "mtp", "summary"):
        assert report.get(section), f"{section}: missing or empty"
    found = dict(numbers({k: report[k] for k in ("experts", "dsa", "thinking", "mtp")}))
    bad = {k: v for k, v in found.items() if not math.isfinite(v)}
    assert not bad, bad
    for name in ("bf16", "mxfp4", "serving_mxfp4"):
        assert report["experts"][name]["ppl"] > 1.0
    assert [r["effort"] for r in report["thinking"]] == list(quality.EFFORTS)
    assert [r["k"] for r in report["dsa"]["topk"]] == [4, SMALL.index_topk, CONTEXT]
    for key in ("mtp_agreement", "mtp_accuracy", "main_accuracy"):
        assert 0.0 <= report["mtp"][key] <= 1.0
    assert report["mtp"]["mtp_positions"] == 2 * (CONTEXT - 1)
    assert report["summary"].startswith("mxfp4 vs bf16: ")


def test_serving_model_agrees_with_the_training_model(report):
    assert abs(report["experts"]["serving_vs_train_pct"]) < 1.0
    assert report["trained_topk"] == SMALL.index_topk


def test_topk_is_the_one_attended_with(report):
    dense = report["dsa"]["dense"]
    rows = {r["k"]: r for r in report["dsa"]["topk"]}
    assert rows[CONTEXT]["ppl"] == pytest.approx(dense["ppl"], rel=1e-5)  # every key kept: dense
    assert rows[4]["ppl"] != pytest.approx(dense["ppl"], rel=1e-6)
    assert rows[SMALL.index_topk]["ppl"] == report["experts"]["serving_mxfp4"]["ppl"]


def test_names_word_counts_the_answers_that_take_up_the_asked_word(report):
    for row in report["thinking"]:
        samples = [s for s in report["thinking_samples"] if s["effort"] == row["effort"]]
        said = [re.search(rf"\b{s['word'].lower()}\b", f"{s['reasoning']} {s['answer']}".lower()) for s in samples]
        assert row["named_word_fraction"] == sum(map(bool, said)) / len(samples)
