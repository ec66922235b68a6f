"""The scheduler's pure decisions (router/scheduler.py) on plain data: no workers, no threads, no clocks."""

import copy
import dataclasses

import numpy as np
import pytest

from expertmesh.router import kv as kv_module
from expertmesh.router.kv import KVManager, PrefixHasher, WorkerKV, prefix_hashes
from expertmesh.router.request import ContextLengthExceeded, ExpertsUnavailable, Request, RequestError
from expertmesh.router.scheduler import (
    Limits,
    Planned,
    affinity_key,
    affinity_worker,
    check_request,
    finish_reason,
    prefill_end,
    reserve_tokens,
    schedule,
    update_from_output,
)
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import StepDone, TokenLogprobs

CHUNK, BS = 16, 16
# placement by load alone: the session-affinity tests ("session affinity" below) turn it on
LIMITS = Limits(
    prefill_chunk=CHUNK,
    max_batch_tokens=64,
    max_running=8,
    kv_growth=16,
    max_context=512,
    max_queue_wait=10.0,
    session_affinity=False,
)
SALT = b"router-salt"


def kv_of(*free: int, total: int = 64, prefixes: dict | None = None) -> KVManager:
    """Workers with these free blocks; `prefixes`: {key: (worker, length)} in LRU order (oldest first)."""
    kv = KVManager([WorkerKV(i, BS, total, f) for i, f in enumerate(free)], chunk=CHUNK, salt=SALT)
    for key, (worker, length) in (prefixes or {}).items():
        kv.record_prefix(worker, key, length)
    return kv


def waiting(n: int, length: int = 20, max_tokens: int = 64, first: int = 0, **params) -> list[Request]:
    return [
        Request(
            prompt=[(first + i + j) % 200 + 1 for j in range(length)],
            params=SamplingParams(max_tokens=max_tokens, **params),
        )
        for i in range(n)
    ]


def running(
    worker: int,
    computed: int,
    reserved: int,
    length: int = 20,
    output: int | None = None,
    max_tokens: int = 64,
    seed: int = 0,
    **params,
) -> Request:
    """A placed request that has fed `computed` tokens; decoding (computed ≥ length), it has generated the token it
    feeds next unless `output` says how many it has."""
    req = Request(
        prompt=[(seed + j) % 200 + 1 for j in range(length)], params=SamplingParams(max_tokens=max_tokens, **params)
    )
    req.output = [7] * (output if output is not None else max(0, computed - length + 1))
    req.worker, req.seq_id, req.computed, req.reserved = worker, f"s{seed}", computed, reserved
    return req


def cache_prefix(kv: KVManager, tokens: list[int], worker: int, length: int) -> str:
    """Record on `worker` the prefix of `tokens[:length]` as the router keys it."""
    key = dict(prefix_hashes(tokens, CHUNK, SALT))[length]
    kv.record_prefix(worker, key, length)
    return key


# ------------------------------------------------------------------ admission
def test_admission_is_first_come_first_served_up_to_max_running():
    queue = waiting(5)
    busy = [running(0, 20, 40, seed=s) for s in range(6)]
    plan = schedule(queue, busy, kv_of(64, 64), limits=LIMITS)
    assert [a.req for a in plan.admissions] == queue[:2]  # 6 running + 2 = max_running
    assert not plan.blocked and plan.expire == []
    assert [a.req for a in schedule(queue, [], kv_of(64, 64), limits=LIMITS).admissions] == queue


def test_placement_goes_to_the_most_free_worker_and_counts_its_own_admissions():
    # each request reserves prompt 20 + 16 ahead = 36 tokens = 3 blocks
    queue = waiting(3)
    plan = schedule(queue, [], kv_of(4, 7, 3), limits=LIMITS)
    assert [a.reserve for a in plan.admissions] == [36, 36, 36]
    # 7 free on worker 1 → it; then 4 and 4 (and 3): the one with fewer sequences, 0; then 1 (4) over 2 (3)
    assert [a.candidates for a in plan.admissions] == [[(1, None, 0)], [(0, None, 0)], [(1, None, 0)]]
    # equal free blocks: the worker with fewer sequences, even with a higher index
    assert [a.candidates[0][0] for a in schedule(waiting(2), [], kv_of(7, 4), limits=LIMITS).admissions] == [0, 1]
    more = schedule(waiting(5), [], kv_of(4, 7, 3), limits=LIMITS)
    assert [a.candidates[0][0] for a in more.admissions] == [1, 0, 1, 2] and more.blocked  # 1, 1, 0 blocks left


def test_a_head_that_fits_nowhere_blocks_the_queue_and_the_long_waiters_expire():
    big, small = waiting(1, length=200)[0], waiting(1, length=4)[0]  # 216 tokens = 14 blocks; 20 tokens = 2
    big.queued_at, small.queued_at = 0.0, 95.0
    plan = schedule([big, small], [], kv_of(10, 10), limits=LIMITS, now=100.0)
    assert plan.admissions == [] and plan.blocked  # the small one does not overtake
    assert plan.expire == [big]  # waited 100 s > 10 s; the small one only 5 s
    assert schedule([big, small], [], kv_of(14, 10), limits=LIMITS, now=100.0).admissions[0].req is big


def test_workers_marked_down_get_nothing():
    plan = schedule(waiting(1), [], kv_of(64, 8), limits=LIMITS, down=frozenset({0}))
    assert plan.admissions[0].candidates == [(1, None, 0)]
    assert schedule(waiting(1), [], kv_of(64, 8), limits=LIMITS, down=frozenset({0, 1})).blocked


def test_a_cached_prefix_pins_the_request_to_its_worker():
    req = waiting(1, length=40)[0]
    kv = kv_of(2, 60)
    key16 = cache_prefix(kv, req.prompt, 0, 16)
    key32 = cache_prefix(kv, req.prompt, 0, 32)
    adm = schedule([req], [], kv, limits=LIMITS).admissions[0]
    assert adm.hit == key32  # the longest
    assert adm.candidates == [(0, key32, 32), (1, None, 0)]  # then a fresh start where it fits
    assert key16 != key32
    # the batch starts after the cached tokens
    plan = schedule([req], [], kv, limits=LIMITS)
    assert [(p.start, len(p.tokens), p.sample) for p in plan.batches[0]] == [(32, 8, True)]


def test_prefix_lookup_needs_a_token_left_to_compute_and_skips_scoring_requests():
    req = waiting(1, length=32)[0]
    kv = kv_of(64)
    cache_prefix(kv, req.prompt, 0, 16)
    cache_prefix(kv, req.prompt, 0, 32)  # the whole prompt: not usable
    assert schedule([req], [], kv, limits=LIMITS).admissions[0].candidates[0][2] == 16
    scoring = Request(prompt=req.prompt, params=SamplingParams(max_tokens=4, prompt_logprobs=1))
    adm = schedule([scoring], [], kv, limits=LIMITS).admissions[0]
    assert adm.hit is None and adm.candidates == [(0, None, 0)]  # every position must be computed


def test_a_prefix_on_a_worker_that_is_down_is_not_used():
    req = waiting(1, length=40)[0]
    kv = kv_of(64, 64)
    key = cache_prefix(kv, req.prompt, 0, 32)
    adm = schedule([req], [], kv, limits=LIMITS, down=frozenset({0})).admissions[0]
    assert adm.hit == key and adm.candidates == [(1, None, 0)]


def test_a_waiting_prompt_is_hashed_once_however_often_it_is_placed(monkeypatch):
    """The engine places a waiting request again on every pass (every ~2 ms while its worker is down): its prompt's
    prefix keys are hashed on the first only (an 8K-token prompt cost ~2-3 ms of the router's CPU a pass)."""
    req = waiting(1, length=40)[0]
    kv = kv_of(64)
    key = cache_prefix(kv, req.prompt, 0, 32)
    hashed, real = [], kv_module.prefix_hashes
    monkeypatch.setattr(kv_module, "prefix_hashes", lambda tokens, *a: hashed.append(len(tokens)) or real(tokens, *a))
    for _ in range(5):
        assert schedule([req], [], kv, limits=LIMITS, down=frozenset({0})).blocked
    assert schedule([req], [], kv, limits=LIMITS).admissions[0].hit == key
    assert hashed == [40]


def test_when_nothing_fits_cached_prefixes_are_dropped_least_recently_used_first():
    kv = kv_of(1, 2, prefixes={"a": (1, 16), "b": (0, 16), "c": (1, 32)})
    kv.touch("a")  # used since: evicted last
    adm = schedule(waiting(2), [], kv, limits=LIMITS).admissions
    assert len(adm) == 1  # what drops free only the worker knows
    assert adm[0].candidates == [(1, None, 0)] and adm[0].evict == ["c", "a"] and adm[0].need == 3
    # a prefix hit on a live worker is kept: room for the rest (56 tokens reserved, 32 cached: 2 blocks) is made on
    # its worker, the hit itself evicted last (demoted there, it would be restored)
    req = waiting(1, length=40)[0]
    key = cache_prefix(kv, req.prompt, 0, 32)
    adm = schedule([req], [], kv, limits=LIMITS).admissions[0]
    assert adm.candidates == [(0, key, 32)] and adm.evict == ["b", key] and adm.need == 2
    kv.workers[0].free_blocks = 2  # room enough: nothing evicted
    adm = schedule([req], [], kv, limits=LIMITS).admissions[0]
    assert adm.candidates == [(0, key, 32)] and adm.evict == []


def test_a_prefix_used_by_an_earlier_admission_of_the_plan_is_evicted_last():
    first, second = waiting(2, length=20)
    kv = kv_of(3, 0)
    used = cache_prefix(kv, first.prompt, 0, 16)  # the older one
    kv.record_prefix(0, "other", 16)
    plan = schedule([first, second], [], kv, limits=LIMITS)
    assert plan.admissions[0].candidates[0] == (0, used, 16)  # 3 blocks - 1 cached: 1 block left after it
    assert plan.admissions[1].evict == ["other", used]


def test_schedule_reads_its_inputs_and_changes_none():
    req = waiting(1, length=40)[0]
    kv = kv_of(4, 60, prefixes={"x": (0, 16)})
    key = cache_prefix(kv, req.prompt, 0, 32)
    busy = [running(1, 32, 32, length=32, seed=3)]
    busy[0].hasher = PrefixHasher(CHUNK, SALT)
    before = (
        copy.deepcopy([(w.free_blocks, w.sequences) for w in kv.workers]),
        list(kv.prefixes),
        busy[0].hasher.length,
        busy[0].computed,
        req.computed,
        req.worker,
    )
    plan = schedule([req], busy, kv, limits=LIMITS)
    assert plan.admissions and plan.growth and plan.batches
    assert before == (
        [(w.free_blocks, w.sequences) for w in kv.workers],
        list(kv.prefixes),
        busy[0].hasher.length,
        busy[0].computed,
        req.computed,
        req.worker,
    )
    assert list(kv.prefixes)[-1] == key  # the hit is marked used by the engine


# ------------------------------------------------------------------ growth and preemption
def test_a_sequence_out_of_reservation_grows_by_kv_growth_and_would_preempt_the_youngest():
    old = running(0, 36, 36, seed=1)  # decoding, its reservation just used up
    mid = running(0, 21, 36, seed=2)
    other = running(1, 40, 36, seed=3)  # another worker
    young = running(0, 22, 36, seed=4)
    kv = kv_of(0, 0, prefixes={"p": (0, 16), "q": (1, 16), "r": (0, 32)})
    growth = schedule([], [old, mid, other, young], kv, limits=LIMITS).growth
    assert [g.req for g in growth] == [old, other]
    g = growth[0]
    assert g.target == 36 + 16
    assert g.evict == ["p", "r"]  # its worker's prefixes, least recently used first
    assert g.preempt == [young, mid]  # then the youngest first, never another worker's
    assert growth[1].preempt == [] and growth[1].evict == ["q"]  # alone there: it would end with "length"


def test_growth_never_reserves_past_max_tokens_or_the_context():
    near_end = running(0, 36, 36, length=20, max_tokens=20, seed=1)  # prompt + max_tokens = 40
    at_context = running(0, 500, 500, length=480, max_tokens=32, seed=2)
    growth = schedule([], [near_end, at_context], kv_of(64), limits=LIMITS).growth
    assert [g.target for g in growth] == [40, 512]
    assert reserve_tokens(20, 20, 1000, LIMITS) == 36 and reserve_tokens(500, 480, 1000, LIMITS) == 512
    assert reserve_tokens(30, 20, 4, LIMITS) == 24  # replaying: within max_tokens


def test_newly_placed_requests_are_the_youngest_victims():
    old = running(0, 36, 36, seed=1)
    new = waiting(1)[0]
    plan = schedule([new], [old], kv_of(8), limits=LIMITS)
    assert plan.admissions[0].req is new and plan.growth[0].preempt == [new]


# ------------------------------------------------------------------ batches and snapshots
def test_decode_first_then_prefill_chunks_at_chunk_multiples_within_the_token_budget():
    dec = [running(1, 25, 40, seed=s) for s in range(3)]  # decoding: each feeds its last token
    a = running(0, 5, 60, length=50, seed=10)  # its chunk ends at 16 (a multiple), not at 5 + 16
    b = running(0, 16, 60, length=40, seed=11)  # 16..32
    c = running(0, 0, 60, length=30, seed=12)  # 0..16
    d = running(0, 16, 60, length=20, seed=13)  # 16..20
    limits = Limits(prefill_chunk=CHUNK, max_batch_tokens=40, max_running=8, kv_growth=16, max_context=512)
    batches = schedule([], [a, *dec, b, c, d], kv_of(64, 64), limits=limits).batches
    assert [(p.req, p.start, p.tokens, p.sample) for p in batches[1]] == [(r, 25, [r.tokens[25]], True) for r in dec]
    assert [(p.req, p.start, p.tokens) for p in batches[0]] == [(a, 5, a.prompt[5:16]), (b, 16, b.prompt[16:32])]
    # 40 - 3 decodes - 11 - 16 = 10 tokens left: c's 16-token chunk waits, and d behind it too (arrival order)


@pytest.mark.parametrize(
    "computed,length,end",
    [
        (0, 100, 48),  # the next multiple of prefill_tokens (48)
        (48, 100, 96),
        (96, 100, 100),  # the tail after the prompt's last multiple of the granularity (16)
        (0, 40, 32),  # the prompt ends before 48, but 32 — its last multiple of 16 — is a stop of its own
        (32, 40, 40),
        (0, 32, 32),  # a prompt that ends on a multiple
        (5, 100, 48),  # from a position off the grid: to the grid
        (64, 100, 96),  # from a cached prefix (a multiple of 16): the same ends as a cold run from there on
    ],
)
def test_a_prefill_chunk_ends_where_the_prompt_alone_says(computed, length, end):
    limits = Limits(
        prefill_chunk=CHUNK, max_batch_tokens=64, max_running=8, kv_growth=16, max_context=512, prefill_tokens=3 * CHUNK
    )
    assert prefill_end(computed, length, limits) == end


def test_a_long_chunk_that_does_not_fit_the_step_waits_rather_than_shrinks():
    """Shrinking a chunk to what a step has left would make its ends (and so its numbers) depend on the batch."""
    dec = [running(0, 25, 40, seed=s) for s in range(20)]  # 20 decoding tokens
    pre = running(0, 0, 128, length=100, seed=30)  # its chunk is 48 tokens
    limits = Limits(
        prefill_chunk=CHUNK,
        max_batch_tokens=64,
        max_running=32,
        kv_growth=16,
        max_context=512,
        prefill_tokens=3 * CHUNK,
    )
    batch = schedule([], [*dec, pre], kv_of(64), limits=limits).batches[0]
    assert pre not in [p.req for p in batch] and len(batch) == 20
    batch = schedule([], [*dec[:16], pre], kv_of(64), limits=limits).batches[0]
    assert [(p.start, p.end) for p in batch if p.req is pre] == [(0, 48)]


def test_larger_prefill_steps_snapshot_where_chunks_of_the_granularity_would():
    """Steps of 48 tokens over a 100-token prompt end at 48, 96 and 100, saving the prefixes of 48 and 96 under the
    same hash-chain keys that steps of 16 would use (so a follow-up turn finds its history either way)."""
    req = running(0, 0, 128, length=100, seed=4)
    limits = Limits(
        prefill_chunk=CHUNK, max_batch_tokens=64, max_running=8, kv_growth=16, max_context=512, prefill_tokens=3 * CHUNK
    )
    keys = dict(prefix_hashes(req.tokens, CHUNK, SALT))
    ends, saved = [], []
    while req.computed < len(req.prompt):
        p = schedule([], [req], kv_of(64), limits=limits).batches[0][0]
        ends.append(p.end)
        saved.append(p.snapshot)
        req.computed = p.end
    assert ends == [48, 96, 100]
    assert saved == [keys[48], keys[96], None]


def test_within_step_snapshots_run_a_prompt_in_whole_steps_and_save_the_same_prefixes():
    """Where the workers save a prefix inside a step (no recurrent layers), a 90-token prompt in steps of 48 ends at
    48 and 90 (not 80, its last multiple of 16): the second step saves the prefix of 80, under the key steps of 16
    would use, and the request's chain stops there; a prompt shorter than a step runs whole, saving its last multiple
    of 16; a step ending on a multiple, and decoding across one, save at their end as before."""
    limits = Limits(
        prefill_chunk=CHUNK,
        max_batch_tokens=128,
        max_running=8,
        kv_growth=16,
        max_context=512,
        prefill_tokens=3 * CHUNK,
        snapshot_within_step=True,
    )
    assert [prefill_end(c, n, limits) for c, n in ((0, 90), (48, 90), (0, 40), (0, 10), (48, 100), (96, 100))] == [
        48,
        90,
        40,
        10,
        96,
        100,
    ]
    req = running(0, 0, 128, length=90, seed=4)
    keys = dict(prefix_hashes(req.tokens, CHUNK, SALT))
    steps = []
    while req.computed < len(req.prompt):
        p = schedule([], [req], kv_of(64), limits=limits).batches[0][0]
        steps.append((p.end, p.snapshot, p.prefix_end, p.hasher.length))
        req.computed, req.hasher = p.end, p.hasher
    assert steps == [(48, keys[48], 48, 48), (90, keys[80], 80, 80)]
    short = running(0, 0, 64, length=40, seed=6)
    dec = running(0, 47, 60, length=40, output=8, seed=3)  # decoding 47 → 48
    odd = running(0, 0, 64, length=10, seed=2)  # no multiple of 16 in (0, 10]
    by_req = {p.req: p for p in schedule([], [short, dec, odd], kv_of(64), limits=limits).batches[0]}
    assert (by_req[short].end, by_req[short].snapshot_at) == (40, 32)
    assert by_req[short].snapshot == dict(prefix_hashes(short.tokens, CHUNK, SALT))[32]
    assert (by_req[dec].prefix_end, by_req[dec].snapshot) == (48, dict(prefix_hashes(dec.hash_tokens, CHUNK, SALT))[48])
    assert by_req[odd].snapshot is None and by_req[odd].hasher is None
    done = StepDone(1, {short.seq_id: 5}, 10, [], {})
    assert update_from_output([by_req[short]], done, max_context=512).saved == [(by_req[short].snapshot, 32)]


def test_the_last_chunk_samples_unless_the_request_only_scores_its_prompt():
    gen = running(0, 16, 40, length=20, seed=1)
    score = running(0, 16, 40, length=20, max_tokens=0, seed=2, prompt_logprobs=0)
    mid = running(0, 0, 40, length=20, seed=3)
    batches = schedule([], [gen, score, mid], kv_of(64), limits=LIMITS).batches
    assert [(p.tokens == p.req.prompt[p.start : p.end], p.sample) for p in batches[0]] == [
        (True, True),
        (True, False),
        (True, False),
    ]


def test_snapshot_keys_at_chunk_boundaries_are_the_hash_chain_of_the_tokens():
    prompt_req = running(0, 16, 60, length=40, seed=1)  # 16 → 32: saves the prefix of 32 tokens
    odd = running(0, 0, 60, length=10, seed=2)  # 0 → 10: no boundary
    dec = running(0, 47, 60, length=40, output=8, seed=3)  # decoding 47 → 48: a boundary during decode
    kv = kv_of(64)
    plan = schedule([], [prompt_req, odd, dec], kv, limits=LIMITS)
    by_req = {p.req: p for p in plan.batches[0]}
    assert by_req[prompt_req].snapshot == dict(prefix_hashes(prompt_req.tokens, CHUNK, SALT))[32]
    assert by_req[dec].snapshot == dict(prefix_hashes(dec.hash_tokens, CHUNK, SALT))[48]
    assert by_req[odd].snapshot is None and by_req[odd].hasher is None
    assert by_req[prompt_req].hasher.length == 32 and prompt_req.hasher is None  # the request's chain is not moved
    own = PrefixHasher(CHUNK, SALT)
    own.advance(prompt_req.tokens, 16)
    prompt_req.hasher = own
    advanced = schedule([], [prompt_req], kv, limits=LIMITS).batches[0][0]
    assert advanced.hasher is not own and (own.length, advanced.hasher.length) == (16, 32)  # advanced a copy
    assert advanced.snapshot == by_req[prompt_req].snapshot
    # already cached: nothing to save (the chain still advances)
    kv.record_prefix(0, by_req[prompt_req].snapshot, 32)
    again = {p.req: p for p in schedule([], [prompt_req], kv, limits=LIMITS).batches[0]}[prompt_req]
    assert again.snapshot is None and again.hasher.length == 32
    # no snapshot at the context's end
    full = running(0, 495, 512, length=496, max_tokens=16, seed=4)
    limits = Limits(prefill_chunk=CHUNK, max_batch_tokens=64, max_running=8, kv_growth=16, max_context=496)
    assert schedule([], [full], kv, limits=limits).batches[0][0].snapshot is None


def test_a_replaying_request_starts_a_new_hash_chain():
    req = running(0, 0, 60, length=40, seed=5)
    req.hasher = PrefixHasher(CHUNK, SALT)
    req.hasher.advance(req.tokens, 32)  # from before its failover: longer than where it restarts
    p = schedule([], [req], kv_of(64), limits=LIMITS).batches[0][0]
    assert p.end == 16 and p.snapshot == dict(prefix_hashes(req.tokens, CHUNK, SALT))[16]


# ------------------------------------------------------------------ update from a step's output
def logprob_run(seq_id: str, position: int, tokens: list[int], n: int = 2) -> TokenLogprobs:
    p = len(tokens)
    return TokenLogprobs(
        seq_id,
        position,
        np.array(tokens),
        -np.arange(1, p + 1, dtype=np.float32) / 10,
        np.arange(p * n).reshape(p, n),
        -np.ones((p, n), dtype=np.float32),
    )


def test_a_sampled_token_is_accepted_and_finishes_on_stop_max_tokens_or_context():
    go = running(0, 24, 40, length=20, max_tokens=10, seed=1, stop_token_ids=(99,))  # 5 generated
    stop = running(0, 24, 40, length=20, max_tokens=10, seed=2, stop_token_ids=(99,))
    last = running(0, 28, 40, length=20, max_tokens=10, seed=3)  # 9 of 10
    ctx = running(0, 510, 512, length=500, max_tokens=20, seed=4)  # 511 of 512
    batch = [Planned(r, r.computed, [r.tokens[r.computed]], True) for r in (go, stop, last, ctx)]
    done = StepDone(1, {"s1": 5, "s2": 99, "s3": 6, "s4": 8}, free_blocks=12, experts_down=[2], exchange_bytes=100)
    u = update_from_output(batch, done, max_context=512)
    assert (u.free_blocks, u.experts_down, u.exchange_bytes, u.saved) == (12, {2}, 100, [])
    assert [(s.req, s.computed, s.token, s.finish) for s in u.seqs] == [
        (go, 25, 5, None),
        (stop, 25, 99, "stop"),
        (last, 29, 6, "length"),
        (ctx, 511, 8, "length"),
    ]
    assert go.output == [7] * 5  # the update says; the engine applies
    assert finish_reason(go, 98, 512) is None and finish_reason(go, 99, 512) == "stop"


def test_prefill_chunks_count_prefilled_tokens_and_score_the_prompt():
    score = running(0, 16, 40, length=20, max_tokens=0, seed=1, prompt_logprobs=2)
    score.prompt_logprobs[17] = "kept"  # scored before a failover: the first entry stays
    batch = [Planned(score, 16, score.prompt[16:], False)]
    done = StepDone(1, {}, free_blocks=3, logprobs=[logprob_run("s1", 16, score.prompt[16:])])
    s = update_from_output(batch, done, max_context=512).seqs[0]
    assert (s.computed, s.prefilled, s.token, s.finish) == (20, 4, None, "length")
    assert sorted(s.prompt_logprobs) == [16, 18, 19]
    assert s.prompt_logprobs[16].token == score.prompt[16] and s.prompt_logprobs[16].logprob == pytest.approx(-0.1)


def test_failed_sequences_fail_with_their_reason_and_save_nothing():
    a, b, c = (running(0, 0, 40, length=20, seed=s) for s in (1, 2, 3))
    batch = [Planned(r, 0, r.prompt[:16], False, snapshot=f"k{i}") for i, r in enumerate((a, b, c))]
    done = StepDone(
        1,
        {},
        free_blocks=0,
        failed={"s1": "experts without a live replica: (1, 3)", "s2": "sampling failed: FloatingPointError: x"},
    )
    u = update_from_output(batch, done, max_context=512)
    assert u.saved == [("k2", 16)]
    assert isinstance(u.seqs[0].error, ExpertsUnavailable) and "(1, 3)" in str(u.seqs[0].error)
    assert type(u.seqs[1].error) is RuntimeError and str(u.seqs[1].error).startswith("sampling failed")
    assert u.seqs[2].error is None and u.seqs[2].computed == 16


def test_replay_after_recovery_accepts_nothing_again_and_notes_a_divergence():
    # recovered with 3 tokens of output: re-placed, it feeds the prompt and then its own output again
    req = running(0, 20, 40, length=20, output=3, max_tokens=8, seed=1)
    req.output = [11, 12, 13]
    first = update_from_output([Planned(req, 20, [11], True)], StepDone(1, {"s1": 12}, 5), max_context=512).seqs[0]
    assert (first.computed, first.token, first.finish, first.diverged) == (21, None, None, None)
    off = update_from_output([Planned(req, 21, [12], True)], StepDone(2, {"s1": 40}, 5), max_context=512).seqs[0]
    assert off.token is None and off.diverged == (22, 40)  # greedy: the same bits were expected
    req.computed = 22
    new = update_from_output([Planned(req, 22, [13], True)], StepDone(3, {"s1": 14}, 5), max_context=512).seqs[0]
    assert (new.computed, new.token) == (23, 14)  # past what it had: a new token
    sampled = running(0, 20, 40, length=20, output=3, seed=2, temperature=0.7)
    s = update_from_output([Planned(sampled, 20, [7], True)], StepDone(1, {"s2": 1}, 5), max_context=512).seqs[0]
    assert s.diverged is None  # sampled, not greedy: no claim


def test_the_token_filter_can_force_a_token_and_its_logprob_entry_follows():
    req = running(0, 19, 40, length=20, max_tokens=8, seed=1, logprobs=2, stop_token_ids=(1,))
    req.token_filter = lambda r, token: 1  # e.g. the thinking budget's forced end
    run = logprob_run("s1", 20, [5])
    s = update_from_output(
        [Planned(req, 19, [req.prompt[19]], True)], StepDone(1, {"s1": 5}, 5, logprobs=[run]), max_context=512
    ).seqs[0]
    assert (s.token, s.finish) == (1, "stop")
    assert s.logprob.token == 1 and s.logprob.logprob == -1.0 and s.logprob.top == [(0, -1.0), (1, -1.0)]


# ------------------------------------------------------------------ what can never run
def test_requests_that_can_never_run_are_refused_naming_the_field():
    kv = kv_of(64, total=4)  # 64 tokens of KV per worker
    ok = SamplingParams(max_tokens=8)
    check_request([1] * 40, ok, vocab_size=256, kv=kv, limits=LIMITS)
    with pytest.raises(RequestError, match=r"prompt: 60 tokens \(\+ the first 16 to generate\) exceed the KV"):
        check_request([1] * 60, SamplingParams(max_tokens=100), vocab_size=256, kv=kv, limits=LIMITS)
    with pytest.raises(ContextLengthExceeded, match="max_tokens=500") as e:
        check_request([1] * 20, SamplingParams(max_tokens=500), vocab_size=256, kv=kv, limits=LIMITS)
    assert (e.value.param, e.value.prompt_tokens, e.value.context) == ("max_tokens", 20, 512)
    with pytest.raises(RequestError, match="token id 300"):
        check_request([1, 300], ok, vocab_size=256, kv=kv, limits=LIMITS)


# ------------------------------------------------------------------ session-aware eviction, tiers, placement
def test_eviction_order_drops_superseded_prefixes_first_and_keeps_sessions_awaiting_tools_warm_longest():
    from expertmesh.router.eviction import (
        ANSWERED,
        AWAITING_TOOL,
        ONE_SHOT,
        RUNNING,
        PrefixInfo,
        Victim,
        eviction_order,
    )

    infos = [
        PrefixInfo("tool-new", 320, 1, False, AWAITING_TOOL),
        PrefixInfo("tool-old", 256, 0, True, AWAITING_TOOL),
        PrefixInfo("answered", 64, 2, False, ANSWERED),
        PrefixInfo("one-shot-recent", 64, 9, False, ONE_SHOT),
        PrefixInfo("one-shot-old", 64, 3, False, ONE_SHOT),
        PrefixInfo("running", 64, 4, False, RUNNING),
    ]
    assert eviction_order(infos) == [
        Victim("tool-old", False),
        Victim("one-shot-old", True),
        Victim("one-shot-recent", True),
        Victim("answered", True),
        Victim("running", True),
        Victim("tool-new", True),
    ]
    assert eviction_order([]) == []


def test_a_sessions_older_prefixes_are_superseded_by_its_newest_and_the_index_stays_linked_when_one_goes():
    kv = kv_of(64)
    turn1 = Request(prompt=[1] * 40, params=SamplingParams(max_tokens=4))
    turn1.finish_reason, turn1.awaiting_tool, turn1.tools_offered = "stop", True, True
    one_shot = Request(prompt=[2] * 40, params=SamplingParams(max_tokens=4))
    one_shot.finish_reason = "stop"
    kv.record_prefix(0, "s16", 16, user=turn1)
    kv.record_prefix(0, "o16", 16, user=one_shot)
    kv.record_prefix(0, "s32", 32, parent="s16", user=turn1)
    kv.record_prefix(0, "s48", 48, parent="s32", user=turn1)
    assert kv.superseded("s16") and kv.superseded("s32") and not kv.superseded("s48")
    assert kv.victims(0) == ["s16", "s32", "o16", "s48"]  # older prefixes, the one-shot, the session last
    kv.forget("s32")  # s48 now extends s16
    assert kv.parent == {"s48": "s16"} and kv.superseded("s16")
    kv.demoted("s48")  # below the device: no victim of the device pool
    assert kv.is_lower("s48") and kv.victims(0) == ["s16", "o16"] and kv.has("s48")
    kv.restored("s48")
    assert kv.victims(0, last=["s16"]) == ["o16", "s48", "s16"]  # used by the plan being made: last


def test_a_hit_below_the_device_is_placed_with_room_for_its_whole_reservation():
    req = waiting(1, length=40)[0]  # reserves 56 tokens: 4 blocks
    kv = kv_of(3, 64, prefixes={"old": (0, 16)})
    key = cache_prefix(kv, req.prompt, 0, 32)
    kv.demoted(key)
    adm = schedule([req], [], kv, limits=LIMITS).admissions[0]
    # the prefix is restored whole (no shared blocks): 4 blocks needed on its worker, 3 free → room made there
    assert adm.candidates[0] == (0, key, 32) and adm.evict == ["old"] and adm.need == 4
    kv.workers[0].free_blocks = 4
    plan = schedule([req], [], kv, limits=LIMITS)
    assert plan.admissions[0].candidates[0] == (0, key, 32) and plan.admissions[0].evict == []


def test_a_hit_on_an_overloaded_worker_is_recomputed_on_another():
    req = waiting(1, length=40)[0]
    kv = kv_of(64, 64)
    key = cache_prefix(kv, req.prompt, 0, 32)
    busy = [running(0, 20, 40, seed=s) for s in range(LIMITS.affinity_slack)]
    kv.workers[0].sequences = len(busy)
    limits = Limits(**{**LIMITS.__dict__, "max_running": 64})
    adm = schedule([req], busy, kv, limits=limits).admissions[0]
    assert adm.hit == key and adm.candidates == [(1, None, 0)]
    kv.workers[0].sequences = LIMITS.affinity_slack - 1  # within the slack: the prefix wins
    adm = schedule([req], busy[1:], kv, limits=limits).admissions[0]
    assert adm.candidates[0] == (0, key, 32)


# ------------------------------------------------------------------ session affinity (no shared state)
AFFINE = dataclasses.replace(LIMITS, session_affinity=True)


def test_affinity_worker_is_rendezvous_hashing_and_a_lost_worker_moves_only_its_keys():
    keys = [affinity_key([k, 5, 9] * 6, CHUNK) for k in range(400)]
    assert affinity_key([1] * (CHUNK - 1), CHUNK) is None  # shorter than a chunk: no key
    assert affinity_key([1] * CHUNK + [2], CHUNK) == affinity_key([1] * CHUNK + [3, 4], CHUNK)  # first chunk only
    four = {k: affinity_worker(k, [0, 1, 2, 3]) for k in keys}
    assert four == {k: affinity_worker(k, [3, 1, 0, 2]) for k in keys}  # the set decides, not its order
    assert all(n > 60 for n in np.bincount(list(four.values()), minlength=4))  # spread: 400 keys, ~100 each
    three = {k: affinity_worker(k, [0, 1, 3]) for k in keys}  # worker 2 goes down
    assert all(three[k] == four[k] for k in keys if four[k] != 2)  # only its keys move...
    assert {three[k] for k in keys if four[k] == 2} == {0, 1, 3}  # ...spread over the others
    assert affinity_worker(keys[0], []) is None


def test_a_session_lands_on_its_worker_on_any_router_whatever_its_salt():
    """Two routers with different salts and equal free blocks: a conversation's turns (same first chunk) go to
    the same worker on both, the session's worker, not the most free one; prompts shorter than a chunk go by load."""
    turn1 = [(3 * j) % 200 + 1 for j in range(40)]
    turn2 = turn1 + [9] * 30
    key = affinity_key(turn1, CHUNK)
    target = affinity_worker(key, [0, 1, 2])
    free = [40, 40, 40]
    free[(target + 1) % 3] = 50  # the most free one is another
    routers = [
        KVManager([WorkerKV(i, BS, 64, f) for i, f in enumerate(free)], chunk=CHUNK, salt=salt)
        for salt in (b"router-a", b"router-b")
    ]
    for kv in routers:
        for prompt in (turn1, turn2):
            (adm,) = schedule(
                [Request(prompt=prompt, params=SamplingParams(max_tokens=8))], [], kv, limits=AFFINE
            ).admissions
            assert adm.candidates == [(target, None, 0), ((target + 1) % 3, None, 0)]  # then today's choice
    short = Request(prompt=turn1[: CHUNK - 1], params=SamplingParams(max_tokens=8))
    assert schedule([short], [], routers[0], limits=AFFINE).admissions[0].candidates == [((target + 1) % 3, None, 0)]
    # with a worker down, the session's worker among the others (or the same one, when it is not the lost one)
    gone = (target + 2) % 3
    (adm,) = schedule(
        [Request(prompt=turn1, params=SamplingParams(max_tokens=8))],
        [],
        routers[1],
        limits=AFFINE,
        down=frozenset({gone}),
    ).admissions
    assert adm.candidates[0][0] == affinity_worker(key, [w for w in range(3) if w != gone]) == target


def test_the_session_worker_yields_to_a_known_prefix_to_load_and_to_room():
    turn1 = [(7 * j) % 200 + 1 for j in range(40)]
    target = affinity_worker(affinity_key(turn1, CHUNK), [0, 1])
    other = 1 - target
    req = lambda: Request(prompt=turn1 + [4] * 8, params=SamplingParams(max_tokens=8))  # noqa: E731
    # a prefix known here wins: pinned to its worker, even the other one
    kv = kv_of(40, 40)
    cache_prefix(kv, turn1, other, 32)
    assert schedule([req()], [], kv, limits=AFFINE).admissions[0].candidates[0] == (
        other,
        kv.find_prefix(req().hash_prompt)[1],
        32,
    )
    # overloaded by the affinity_slack rule: today's least-loaded choice
    kv = kv_of(40, 40)
    kv.workers[target].sequences = AFFINE.affinity_slack
    busy = [running(target, 20, 40, seed=s) for s in range(AFFINE.affinity_slack)]
    assert schedule([req()], busy, kv, limits=AFFINE).admissions[0].candidates == [(other, None, 0)]
    kv.workers[target].sequences = AFFINE.affinity_slack - 1  # within the slack: its session's worker
    assert schedule([req()], busy[1:], kv, limits=AFFINE).admissions[0].candidates[0] == (target, None, 0)
    # no room for its reservation there: the worker that has it
    free = [40, 40]
    free[target] = 2
    assert schedule([req()], [], kv_of(*free), limits=AFFINE).admissions[0].candidates == [(other, None, 0)]


def test_the_index_learns_a_workers_prefix_list_without_losing_what_it_saved_meanwhile():
    """KVManager.learn (another replica's saves and drops, read from the worker): new keys recorded with their
    tier, tiers corrected, keys known when the list was asked for and no longer listed forgotten — but not a key
    saved here after it was asked for, nor a key of another worker."""
    kv = kv_of(64, 64, prefixes={"mine": (0, 32), "dropped": (0, 16), "demoted": (0, 48), "theirs": (1, 16)})
    known = {"mine", "dropped", "demoted"}
    kv.record_prefix(0, "saved-meanwhile", 64)
    kv.learn(0, [("mine", 32, "device"), ("demoted", 48, "host"), ("new", 80, "disk")], known)
    assert kv.has("mine") and not kv.has("dropped") and kv.has("saved-meanwhile") and kv.has("theirs")
    assert kv.is_lower("demoted") and kv.is_lower("new") and not kv.is_lower("mine")
    assert (kv.prefixes["new"], kv.prefix_len["new"]) == (0, 80)
    kv.learn(0, [("demoted", 48, "device")])
    assert not kv.is_lower("demoted") and kv.has("new")  # no `known`: nothing forgotten
