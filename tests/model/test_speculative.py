"""Speculative decoding in the reference model (expertmesh/model/speculative.py): greedy texts identical to plain
decoding for K = 1..3 (tiny random K3 and K3+DSA with an MTP layer, the shipped models/k3-tiny), a forced rejection
at every draft position leaving the caches bit for bit those of plain decoding, stop tokens and max_tokens inside an
accepted run, the n-gram drafter, and rejection sampling's distribution."""

from __future__ import annotations

import pytest
import torch
from support.k3_checkpoint import write_k3_checkpoint
from support.paths import REPO

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.model.cache import DSACache, KDACache, SequenceCache
from expertmesh.model.drafters import NgramDrafter
from expertmesh.model.sampling import Sampler
from expertmesh.model.speculative import accept_sampled, generate_speculative, speculate
from expertmesh.model.transformer import generate
from expertmesh.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
PROMPT = [5, 17, 42, 99, 17, 42, 7, 3, 250, 61, 17, 42]


def load(path):
    ck = Checkpoint(path)
    return ck.hf.load_mtp(ck.load_model(dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {
        "k3": load(write_k3_checkpoint(root / "k3", mtp=True)),
        "k3-dsa": load(write_k3_checkpoint(root / "dsa", mtp=True, with_indexer=True)),
        "k3-tiny": load(REPO / "models" / "k3-tiny"),
    }


class OracleDrafter:
    """Drafts the plain run's own continuation, with a wrong token at draft position `wrong_at` (None: never)."""

    def __init__(self, prompt: list[int], reference: list[int], vocab: int, wrong_at: int | None):
        self.n_prompt, self.reference, self.vocab, self.wrong_at = len(prompt), reference, vocab, wrong_at

    def advance(self, next_tokens, hidden) -> None:
        pass

    def propose(self, k, context):
        drafts = list(self.reference[len(context) - self.n_prompt : len(context) - self.n_prompt + k])
        if self.wrong_at is not None and self.wrong_at < len(drafts):
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % self.vocab
        return drafts, [None] * len(drafts)


def plain_cache(model, prompt: list[int], tokens: list[int]) -> SequenceCache:
    """The cache plain decoding leaves after emitting `tokens`: the prompt, then every token but the last."""
    cache = model.new_cache()
    model.step(prompt, cache)
    for t in tokens[:-1]:
        model.step([t], cache)
    return cache


def assert_caches_equal(a: SequenceCache, b: SequenceCache) -> None:
    assert a.length == b.length
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        if isinstance(x, KDACache):
            assert torch.equal(x.state, y.state) and torch.equal(x.conv, y.conv), f"layer {i}: KDA state"
        else:
            assert isinstance(x, DSACache)
            assert torch.equal(x.latent, y.latent), f"layer {i}: latent cache"
            assert (x.index_k is None) == (y.index_k is None)
            assert x.index_k is None or torch.equal(x.index_k, y.index_k), f"layer {i}: indexer keys"


@pytest.mark.parametrize("name", ["k3", "k3-dsa", "k3-tiny"])
def test_greedy_text_is_identical_with_mtp_speculation(models, name):
    model = models[name]
    ref = generate(model, PROMPT, GREEDY)
    for k in (1, 2, 3):
        got = generate_speculative(model, PROMPT, GREEDY, method="mtp", k=k)
        assert (got.tokens, got.finish_reason) == (ref.tokens, ref.finish_reason), f"k={k}"
        assert got.drafted == sum(got.drafted_by_position) and got.accepted == sum(got.accepted_by_position)
        assert got.verify_steps == len(got.tokens) - 1 - got.accepted  # each step: its accepted drafts + one


def test_greedy_identical_with_prefill_chunks_and_ngram(models):
    model = models["k3-dsa"]
    ref = generate(model, PROMPT, GREEDY, prefill_chunk=5)
    for method in ("mtp", "ngram"):
        got = generate_speculative(model, PROMPT, GREEDY, method=method, k=3, prefill_chunk=5)
        assert got.tokens == ref.tokens, method


@pytest.mark.parametrize("name", ["k3", "k3-dsa"])
@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2])
def test_forced_rejection_at_each_draft_position_keeps_output_and_caches(models, name, wrong_at):
    """Every step's draft is the plain run's continuation but for a wrong token at `wrong_at` (None: all right):
    the text is the same, and the caches after it equal plain decoding's bit for bit (KDA state and conv, latent
    entries, indexer keys) — no rejected position left anywhere."""
    model = models[name]
    ref = generate(model, PROMPT, GREEDY)
    drafter = OracleDrafter(PROMPT, ref.tokens, model.cfg.vocab_size, wrong_at)
    got, cache = speculate(model, PROMPT, Sampler(GREEDY), drafter, k=3)
    assert got.tokens == ref.tokens
    if wrong_at is None:
        assert got.accepted == got.drafted > 0  # whole runs accepted, the bonus token after each
    else:
        assert got.accepted_by_position[wrong_at:] == [0] * (3 - wrong_at)  # never past the wrong draft
        assert all(n > 0 for n in got.accepted_by_position[:wrong_at])
    assert_caches_equal(cache, plain_cache(model, PROMPT, ref.tokens))


def test_stop_token_and_max_tokens_cut_inside_an_accepted_run(models):
    model = models["k3"]
    ref = generate(model, PROMPT, GREEDY)
    i = next(i for i in range(5, len(ref.tokens)) if ref.tokens[i] not in ref.tokens[:i])  # first occurrence
    stop = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[ref.tokens[i]])
    oracle = OracleDrafter(PROMPT, ref.tokens, model.cfg.vocab_size, None)
    got, _ = speculate(model, PROMPT, Sampler(stop), oracle, k=3)
    assert (got.tokens, got.finish_reason) == (ref.tokens[: i + 1], "stop")
    for max_tokens in (6, 7, 8):
        short = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        got, cache = speculate(model, PROMPT, Sampler(short), oracle, k=3)
        assert (got.tokens, got.finish_reason) == (ref.tokens[:max_tokens], "length")
        assert cache.length == len(PROMPT) + max_tokens - 1


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter(max_n=3, min_n=1)
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3]
    assert d.propose(3, ctx)[0] == [4, 7, 8]  # "2 3" last seen before at 6..7 (3 tokens: "8 2 3" never)
    assert d.propose(2, [1, 2, 3])[0] == []  # nothing repeats
    assert d.propose(4, [5, 6, 5])[0] == [6, 5]  # fewer than k when the context ends
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(max_n=1, min_n=2)


def test_ngram_speculation_accepts_repeated_text_on_k3_tiny(models):
    """A prompt that repeats a phrase: the model copies it back (greedy) and prompt lookup drafts it."""
    model = models["k3-tiny"]
    phrase = [101, 202, 303, 404, 505, 606, 707, 808]
    prompt = phrase * 4
    params = SamplingParams(max_tokens=20, temperature=0.0)
    ref = generate(model, prompt, params)
    got = generate_speculative(model, prompt, params, method="ngram", k=3)
    assert got.tokens == ref.tokens
    assert got.drafted > 0


def chi_square(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=len(p)).double()
    expected = p.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square with 5 degrees of freedom: P(X > 20.5) ≈ 0.001
CHI2_BOUND = 20.5


@pytest.mark.parametrize("drafter", ["mtp-like", "point-mass"])
def test_rejection_sampling_emits_the_target_distribution(drafter):
    """p ≠ q over 6 tokens: the token accept_sampled emits for a draft x ~ q is distributed as p (chi-square at
    p-value 0.001 over 20,000 seeds' draws); emitting the draft unconditionally would give q, and fails the bound."""
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.40, 0.05, 0.25, 0.05, 0.15, 0.10]) if drafter == "mtp-like" else None
    gen = torch.Generator().manual_seed(7)
    draws, unconditional = [], []
    for _ in range(20_000):
        x = int(torch.multinomial(q, 1, generator=gen)) if q is not None else 2
        token, _ = accept_sampled(p, q, x, gen)
        draws.append(token)
        unconditional.append(x)
    assert chi_square(torch.tensor(draws), p) < CHI2_BOUND
    if q is not None:
        assert chi_square(torch.tensor(unconditional), p) > 10 * CHI2_BOUND  # the test can fail


def test_sampled_speculation_is_seeded_and_refuses_what_it_cannot_do(models):
    model = models["k3"]
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3)
    a = generate_speculative(model, PROMPT, params, method="mtp", k=2)
    b = generate_speculative(model, PROMPT, params, method="mtp", k=2)
    assert a.tokens == b.tokens and len(a.tokens) == 12
    with pytest.raises(ValueError, match="method"):
        generate_speculative(model, PROMPT, GREEDY, method="eagle")
    with pytest.raises(ValueError, match="k: expected"):
        generate_speculative(model, PROMPT, GREEDY, k=-1)
