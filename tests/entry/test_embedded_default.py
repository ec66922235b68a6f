"""The embedded default (models/k3-tiny, trained by scripts/train_tiny.py): a valid Kimi K3 checkpoint within the
repository's size limits, what `expertmesh up` serves when no checkpoint is named, and a model that answers a chat
in English words, reasoning apart from the answer, the same greedy answer every time."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import openai
import pytest

from expertmesh.checkpoint.embedded import EMBEDDED_DIR, EMBEDDED_NAME, embedded_checkpoint
from expertmesh.checkpoint.loader import inspect_checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.train import corpus


def test_the_repository_carries_it_within_its_size_limits():
    assert embedded_checkpoint() == EMBEDDED_DIR
    sizes = {p.name: p.stat().st_size for p in EMBEDDED_DIR.iterdir() if p.is_file()}
    assert sum(sizes.values()) <= 10 * 1000 * 1000, sizes
    assert max(sizes.values()) <= 5 * 1000 * 1000, sizes


def test_it_passes_checkpoint_inspect():
    report = inspect_checkpoint(EMBEDDED_DIR)
    assert report["layout"] == "kimi_k3" and report["bits_per_expert_weight"] == 4.25, report
    out = subprocess.run(
        [sys.executable, "-m", "expertmesh.entry.cli", "checkpoint", "inspect", str(EMBEDDED_DIR)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert out.returncode == 0, out.stderr


@pytest.fixture(scope="module")
def up():
    """`expertmesh up` as `make up` runs it: no --checkpoint."""
    http, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "expertmesh.entry.cli", "up", "--expert-workers", "1"]
        + ["--http-port", str(http), "--grpc-port", str(grpc_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C to stop"):
                break
        else:
            pytest.fail("expertmesh up did not start:\n" + "".join(lines))
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0), "".join(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def english() -> set[str]:
    """Every word WordNet writes (its lemmas and the words of its glosses): the training corpus's vocabulary."""
    words: set[str] = set()
    for s in corpus.load_wordnet(corpus.wordnet_dir()):
        for text in (*s.words, s.definition, *s.examples):
            words.update(re.findall(r"[a-z]+", text.lower()))
    return words


def test_up_serves_the_embedded_default_by_default(up):
    client, banner = up
    assert str(EMBEDDED_DIR) in banner
    assert [m.id for m in client.models.list().data] == [EMBEDDED_NAME]


def test_it_answers_in_english_words_with_reasoning_apart(up, english):
    client, _ = up

    def ask():
        r = client.chat.completions.create(
            model=EMBEDDED_NAME,
            messages=[{"role": "user", "content": "Tell me about the sea."}],
            reasoning_effort="high",
            temperature=0,
            max_tokens=200,
        )
        return r.choices[0].message

    first, again = ask(), ask()
    assert (first.content, first.reasoning_content) == (again.content, again.reasoning_content)  # greedy
    assert first.content and first.reasoning_content, first
    for text in (first.content, first.reasoning_content):
        words = re.findall(r"[a-z]+", text.lower())
        known = [w for w in words if w in english]
        assert len(words) >= 3 and len(known) >= 0.9 * len(words), (text, sorted(set(words) - english))
