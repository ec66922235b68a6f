"""Sampling with speculation keeps the target's distribution through the serving path (#52): on a tiny K3 checkpoint,
many seeded requests at temperature 1 (top_k 3) through an in-process deployment whose attention worker verifies
drafts by rejection sampling (worker/speculation.py's verify, the request's own seeded generator); the first two
emitted tokens' empirical joint distribution is held against the target's own, p(t1) p(t2 | t1) from a plain
deployment's log-probs, by Pearson's chi-square. The drafter proposes one likely second token every time (a point
mass: a random-weight MTP layer's drafts lie outside the target's top 3 and would never be accepted), so some drafts
are accepted and some rejected. The same harness with an acceptance that takes every draft fails it."""

from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.k3_checkpoint import write_k3_checkpoint

from expertmesh.entry.local import build_local_engine
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.worker import speculation

pytestmark = pytest.mark.timeout(900)  # hundreds of requests: slow on a shared machine
PROMPT = [5, 17, 42, 99, 17, 42, 7, 3]
TOP_K = 3
CHI2_8DF_P001 = 26.12  # chi-square's 0.999 quantile with 8 degrees of freedom (9 bins)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_k3_checkpoint(tmp_path_factory.mktemp("specsample") / "k3")


def top(engine, prompt: list[int]) -> dict[int, float]:
    """The target's top-k distribution after `prompt` (renormalised as top_k sampling does)."""
    r = engine.generate(prompt, SamplingParams(max_tokens=1, logprobs=TOP_K), timeout=300)
    alternatives = r.logprobs[0].top
    z = sum(math.exp(lp) for _, lp in alternatives)
    return {int(t): math.exp(lp) / z for t, lp in alternatives}


@pytest.fixture(scope="module")
def target(ckpt):
    plain = build_local_engine(str(ckpt))
    try:
        first = top(plain, PROMPT)
        return {(a, b): pa * pb for a, pa in first.items() for b, pb in top(plain, [*PROMPT, a]).items()}
    finally:
        plain.close()


class OneToken:
    """Drafts `token` at every position, as a point mass (q = None)."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, k, context):
        return [self.token] * k, [None] * k


@pytest.fixture(scope="module")
def spec(ckpt, target):
    second = Counter()
    for (_, b), p in target.items():
        second[b] += p
    drafter = OneToken(second.most_common(1)[0][0])  # a likely second token: accepted often, not always

    def hook(spec) -> None:
        spec.ngram = drafter

    engine = build_local_engine(
        str(ckpt),
        speculative_tokens=2,
        speculative_method="ngram",
        drafter=hook,
        max_waiting=512,
        speculative_max_batch=64,  # the 32 requests at once all speculate
    )
    yield engine
    engine.close()


def chi_square(engine, target: dict, n: int) -> float:
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, seed=seed) for seed in range(n)]
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda p: engine.generate(PROMPT, p, timeout=300).output, params))
    seen = Counter((o[0], o[1]) for o in outs)
    outside = n - sum(seen[pair] for pair in target)
    if outside:
        return math.inf  # a pair the target never samples
    return sum((seen[pair] - n * p) ** 2 / (n * p) for pair, p in target.items())


def test_rejection_sampling_through_the_serving_path_keeps_the_targets_distribution(spec, target):
    assert len(target) == TOP_K * TOP_K and abs(sum(target.values()) - 1) < 1e-5
    before = spec.stats.drafted, spec.stats.accepted
    stat = chi_square(spec, target, 300)
    drafted, accepted = spec.stats.drafted - before[0], spec.stats.accepted - before[1]
    assert 0 < accepted < drafted  # drafts were verified, some kept and some rejected: the test exercised both
    assert stat < CHI2_8DF_P001, stat


def test_accepting_every_draft_fails_the_same_test(spec, target, monkeypatch):
    monkeypatch.setattr(speculation, "accept_sampled", lambda p, q, draft, generator: (draft, True))
    assert chi_square(spec, target, 120) > CHI2_8DF_P001
