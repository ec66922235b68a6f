"""The router engine over in-process workers: token-exact vs the reference, batching, calls, prefix cache, and the
executor's answers to workers that say no (out of blocks, a prefix gone, a refused request)."""

import random

import pytest

from expertmesh.entry.cluster import make_placement
from expertmesh.entry.local import build_local_engine
from expertmesh.model.attention import LatentAttention
from expertmesh.model.transformer import generate
from expertmesh.router.engine import QueueFull, RequestError
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import NotFound, WorkerError
from expertmesh.worker.kv import PagedSequenceKV

CHUNK = 16


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py)


def prompts(n, lo=3, hi=70, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(ckpt):
    model = ckpt.load_model()
    ps = prompts(16)
    return ps, [generate(model, p, SamplingParams(max_tokens=32), prefill_chunk=CHUNK).tokens for p in ps]


@pytest.mark.parametrize(
    "attention, experts, redundant, grouped",
    [(1, 1, 0, True), (1, 2, 0, True), (2, 3, 0, False), (2, 3, 2, True), (1, 2, 16, True)],
)
def test_engine_tokens_equal_reference(ckpt, reference, attention, experts, redundant, grouped):
    """Whole groups pre-reduced on one worker (group-aware plans) or split across workers (per-slot rows folded
    on the attention worker), with and without replicas: the reference's bits."""
    ps, ref = reference
    eng = build_local_engine(
        ckpt,
        attention_workers=attention,
        expert_workers=experts,
        prefill_chunk=CHUNK,
        placement=make_placement(ckpt.cfg, experts, redundant, group_aware=grouped),
    )
    try:
        reqs = [eng.submit(p, SamplingParams(max_tokens=32)) for p in ps]
        out = [r.wait(120).output for r in reqs]
    finally:
        eng.close()
    assert out == ref
    assert eng.stats.generated_tokens == 16 * 32 and eng.stats.requests_failed == 0


def test_batched_equals_alone_and_calls_per_step_are_bounded(ckpt):
    cfg = ckpt.cfg
    eng = build_local_engine(ckpt, attention_workers=2, expert_workers=3, prefill_chunk=CHUNK)
    try:
        ps = prompts(8, lo=2, hi=60, seed=11)
        alone = [eng.generate(p, SamplingParams(max_tokens=12)).output for p in ps]
        steps, calls = eng.stats.steps, eng.stats.attention_calls
        expert_calls = sum(e.calls for e in eng.expert_clients)
        together = [r.wait(60).output for r in [eng.submit(p, SamplingParams(max_tokens=12)) for p in ps]]
    finally:
        eng.close()
    assert together == alone
    steps = eng.stats.steps - steps
    # the router calls each attention worker once per step; each attention worker calls each expert worker at
    # most once per MoE layer — whatever the number of tokens
    assert steps <= eng.stats.attention_calls - calls <= 2 * steps
    assert 0 < sum(e.calls for e in eng.expert_clients) - expert_calls <= 2 * steps * 3 * cfg.n_moe_layers
    assert steps < sum(len(p) for p in ps)  # requests really shared steps


def test_decoding_sequences_share_one_attention_call_with_the_bits_each_gets_alone(ckpt, monkeypatch):
    """On CPU the decoding sequences of a step attend in one kernel call per layer (their contexts within the
    index top-k, 16 in the tiny preset): every token and log-prob is the one each sequence gets decoded alone."""
    together_calls = []
    decode_together = LatentAttention._decode_together

    def counting(self, decodes, *args, **kw):
        done = decode_together(self, decodes, *args, **kw)
        together_calls.append(len(done))
        return done

    monkeypatch.setattr(LatentAttention, "_decode_together", counting)
    ps = prompts(4, lo=2, hi=6, seed=21)
    params = SamplingParams(max_tokens=8, logprobs=2)
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK)
    try:
        alone = [eng.generate(p, params) for p in ps]
        assert not any(together_calls)
        together = [r.wait(60) for r in [eng.submit(p, params) for p in ps]]
    finally:
        eng.close()
    assert max(together_calls) == 4
    for a, t in zip(alone, together):
        assert t.output == a.output and t.logprobs == a.logprobs


def test_prefix_cache_prefills_only_the_remainder(ckpt):
    eng = build_local_engine(ckpt, attention_workers=2, expert_workers=2, prefill_chunk=CHUNK)
    try:
        base = prompts(1, lo=160, hi=161, seed=3)[0]
        first = eng.generate(base, SamplingParams(max_tokens=4))
        before = eng.stats.prefilled_tokens
        second_prompt = base[:144] + [7] * 16  # shares 90% of its 160 tokens with the first
        second = eng.generate(second_prompt, SamplingParams(max_tokens=4))
        computed = eng.stats.prefilled_tokens - before
        fresh = build_local_engine(ckpt, attention_workers=1, expert_workers=1, prefill_chunk=CHUNK)
        try:
            cold = fresh.generate(second_prompt, SamplingParams(max_tokens=4))
        finally:
            fresh.close()
    finally:
        eng.close()
    assert first.cached_tokens == 0
    assert second.cached_tokens == 144 and computed == 16
    assert second.output == cold.output  # reuse at chunk boundaries computes exactly what a cold run does


def test_larger_prefill_steps_keep_the_cache_granularity_at_the_prompts_end(ckpt):
    """Steps of up to 4 granules (prefill_tokens) prefill a 100-token prompt in 64 + 32 + 4 tokens; the prompt's
    last multiple of the granularity (96) is saved, so a follow-up turn that starts with the whole prompt computes
    only what follows it; a prompt diverging inside a step finds the step boundary before it (64). Cached runs give
    the tokens of cold runs."""

    def engine():
        return build_local_engine(ckpt, prefill_chunk=CHUNK, prefill_tokens=4 * CHUNK)

    base = prompts(1, lo=100, hi=101, seed=5)[0]
    follow_up = base + [9] * 20
    diverging = base[:80] + [11] * 20
    eng = engine()
    try:
        eng.generate(base, SamplingParams(max_tokens=2))
        runs = {}
        for name, prompt in (("follow_up", follow_up), ("diverging", diverging)):
            before = eng.stats.prefilled_tokens
            runs[name] = (eng.generate(prompt, SamplingParams(max_tokens=4)), eng.stats.prefilled_tokens - before)
    finally:
        eng.close()
    assert runs["follow_up"][0].cached_tokens == 96 and runs["follow_up"][1] == 24
    assert runs["diverging"][0].cached_tokens == 64 and runs["diverging"][1] == 36
    for name, prompt in (("follow_up", follow_up), ("diverging", diverging)):
        cold = engine()
        try:
            assert cold.generate(prompt, SamplingParams(max_tokens=4)).output == runs[name][0].output, name
        finally:
            cold.close()


def test_bad_requests_are_refused_and_engine_keeps_serving(ckpt):
    eng = build_local_engine(ckpt, max_waiting=2, prefill_chunk=CHUNK)
    try:
        with pytest.raises(RequestError, match="prompt: expected at least one token"):
            eng.submit([], SamplingParams())
        with pytest.raises(RequestError, match="max_tokens=0"):
            eng.submit([1, 2], SamplingParams(max_tokens=0))
        with pytest.raises(RequestError, match="prompt: 5000 tokens, the model's context is 4096"):
            eng.submit([1] * 5000, SamplingParams())
        with pytest.raises(RequestError, match="token id 999"):
            eng.submit([1, 999], SamplingParams())
        assert len(eng.generate([1, 2, 3], SamplingParams(max_tokens=3)).output) == 3
    finally:
        eng.close()


def test_queue_bound_answers_at_once(ckpt):
    eng = build_local_engine(ckpt, max_waiting=1, max_running=1, prefill_chunk=CHUNK)
    try:
        reqs, refused = [], 0
        for p in prompts(6, seed=5):
            try:
                reqs.append(eng.submit(p, SamplingParams(max_tokens=8)))
            except QueueFull as e:
                assert "waiting queue full" in str(e)
                refused += 1
        assert refused >= 1
        assert all(len(r.wait(60).output) == 8 for r in reqs)
    finally:
        eng.close()


def test_decode_reads_the_pages_in_place(ckpt, monkeypatch):
    """Serving decode goes through the paged decode kernels: a sequence's latent cache is gathered whole only by
    prefill chunks (one read per chunk per MLA/DSA layer), never by a decode step."""
    reads = []
    original = PagedSequenceKV.read
    monkeypatch.setattr(
        PagedSequenceKV, "read", lambda self, layer, length: reads.append(length) or original(self, layer, length)
    )
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK)
    try:
        prompt = prompts(1, lo=40, hi=41, seed=5)[0]
        out = eng.generate(prompt, SamplingParams(max_tokens=12)).output
    finally:
        eng.close()
    assert len(out) == 12
    chunks = -(-len(prompt) // CHUNK)
    assert len(reads) == chunks * len(ckpt.cfg.latent_kv_layers) and max(reads) == len(prompt)


def test_penalties_and_logit_bias_match_the_reference(ckpt):
    """The worker counts the generated tokens it is fed, as the reference counts what it samples: token-exact."""
    params = SamplingParams(max_tokens=24, presence_penalty=0.8, frequency_penalty=1.5, logit_bias=((65, 2.5),))
    model = ckpt.load_model()
    ps = prompts(3, seed=9)
    want = [generate(model, p, params, prefill_chunk=CHUNK).tokens for p in ps]
    plain = [generate(model, p, SamplingParams(max_tokens=24), prefill_chunk=CHUNK).tokens for p in ps]
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK)
    try:
        got = [r.wait(60).output for r in [eng.submit(p, params) for p in ps]]
        with pytest.raises(RequestError, match="logit_bias: token id 99999"):
            eng.submit(ps[0], SamplingParams(logit_bias=((99999, 1.0),)))
    finally:
        eng.close()
    assert got == want and want != plain


def test_kv_grows_as_sequences_decode_and_preemption_replays_the_same_tokens(ckpt, reference):
    """KV is reserved 16 tokens ahead, not prompt + max_tokens up front: 6 requests whose full reservations
    (prompt + 32) could not all fit the 12 blocks run together; when the pool runs out the youngest is preempted
    and later replays — every output token-exact with the reference."""
    ps, ref = reference
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK, kv_blocks=12, block_size=16, kv_growth=16)
    try:
        reqs = [eng.submit(p, SamplingParams(max_tokens=32)) for p in ps[:6]]
        out = [r.wait(120).output for r in reqs]
    finally:
        eng.close()
    assert out == ref[:6]
    assert eng.stats.preempted > 0 and eng.stats.requests_failed == 0
    full = sum(-(-(len(p) + 32) // 16) for p in ps[:6])
    assert full > 12  # up-front reservations would have serialized them


@pytest.fixture(scope="module")
def model(ckpt):
    return ckpt.load_model()


def greedy(model, prompt, max_tokens):
    return generate(model, prompt, SamplingParams(max_tokens=max_tokens), prefill_chunk=CHUNK).tokens


def test_a_full_worker_drops_cached_prefixes_before_it_ends_or_preempts_a_sequence(ckpt, model):
    """8 blocks of 16 tokens: a finished 64-token prompt leaves its prefixes holding 4 blocks; the next request fills
    the other 4 and, decoding past them, gets its room from those prefixes — not cut short at 17 tokens."""
    first = [(3 * j + 1) % 256 for j in range(64)]
    second = [(5 * j + 2) % 256 for j in range(40)]
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK, kv_blocks=8, block_size=16, kv_growth=16)
    try:
        eng.generate(first, SamplingParams(max_tokens=2))
        held = set(eng.kv.prefixes)
        assert held and eng.kv.workers[0].free_blocks == 4
        req = eng.generate(second, SamplingParams(max_tokens=40), timeout=120)
    finally:
        eng.close()
    assert (req.finish_reason, req.output) == ("length", greedy(model, second, 40))
    assert not held & set(eng.kv.prefixes) and eng.stats.preempted == 0


def test_a_sequence_alone_on_a_worker_that_cannot_hold_more_ends_with_length(ckpt, model):
    """4 blocks: a 40-token prompt reserves 56 tokens; at 56 nothing is left to drop or preempt."""
    prompt = [(7 * j + 3) % 256 for j in range(40)]
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK, kv_blocks=4, block_size=16, kv_growth=16)
    try:
        req = eng.generate(prompt, SamplingParams(max_tokens=40), timeout=120)
        assert eng.generate(prompt[:20], SamplingParams(max_tokens=4)).output == greedy(model, prompt[:20], 4)
    finally:
        eng.close()
    assert req.finish_reason == "length" and req.error is None
    assert req.output == greedy(model, prompt, 40)[: 56 - 40 + 1]


def test_a_request_that_fits_only_without_the_cached_prefixes_evicts_them(ckpt, model):
    """8 blocks: a finished 96-token prompt's prefixes hold 6, leaving 2; the next request needs 3 — the prefixes
    are dropped (least recently used first, until it fits) instead of the request waiting for room forever."""
    first = [(3 * j + 1) % 256 for j in range(96)]
    second = [(5 * j + 2) % 256 for j in range(40)]
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK, kv_blocks=8, block_size=16, kv_growth=16, max_queue_wait=5.0)
    try:
        eng.generate(first, SamplingParams(max_tokens=2))
        assert eng.kv.workers[0].free_blocks == 2
        req = eng.generate(second, SamplingParams(max_tokens=8), timeout=60)
    finally:
        eng.close()
    assert req.error is None and req.output == greedy(model, second, 8) and req.cached_tokens == 0


def test_a_request_its_worker_refuses_fails_alone_and_the_queue_moves_on(ckpt):
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK)
    w = eng.attention[0]._client
    orig = w.open_sequence

    def refuse_seed_13(seq_id, params, **kw):
        if params.seed == 13:
            raise WorkerError("params: refused")
        return orig(seq_id, params, **kw)

    w.open_sequence = refuse_seed_13
    try:
        reqs = [eng.submit([1, 2, 3, 4], SamplingParams(max_tokens=3, seed=s)) for s in (12, 13, 14, 15)]
        with pytest.raises(RequestError, match="params: refused"):
            reqs[1].wait(60)
        assert [len(r.wait(60).output) for r in reqs[::2] + reqs[3:]] == [3, 3, 3]
    finally:
        eng.close()


def test_a_worker_that_no_longer_has_the_planned_prefix_gets_the_whole_prompt(ckpt, model):
    """The plan starts the request after its cached prefix; the worker has lost it (NotFound), so the request opens
    fresh and the step is planned again from position 0 — the reference's tokens, nothing cached."""
    base = [(11 * j + 5) % 256 for j in range(48)]
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK)
    w = eng.attention[0]._client
    orig, lost = w.open_sequence, []

    def prefix_gone(seq_id, params, *, prefix_key=None, **kw):
        if prefix_key is not None:
            lost.append(prefix_key)
            raise NotFound(f"prefix_key {prefix_key!r}: no such cached prefix")
        return orig(seq_id, params, **kw)

    try:
        eng.generate(base, SamplingParams(max_tokens=2))
        w.open_sequence = prefix_gone
        again = eng.generate(base[:40] + [9] * 8, SamplingParams(max_tokens=6), timeout=60)
    finally:
        eng.close()
    assert lost and again.cached_tokens == 0
    assert again.output == greedy(model, base[:40] + [9] * 8, 6)
