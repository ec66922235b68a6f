"""The scheduler: the router's continuous-batching decisions as pure functions of plain data.

`schedule()` turns the waiting queue, the running batch and the router's view of the KV (free blocks per attention
worker, the prefix-cache index, the workers marked down) into one step's plan:
  * admission, in arrival order while fewer than `max_running` run: a request goes where the longest cached prefix
    of its prompt lives, in any tier of that worker (pinned there: the cached tokens are not computed again; a
    prefix below the device is restored, after demoting device prefixes there if the pool lacks room for it), unless
    that worker runs `affinity_slack` or more sequences beyond the least loaded live worker — then the prompt is
    recomputed elsewhere (moving the prefix would cost a restore on a busy worker anyway); with no cached prefix
    known, to its session's worker (`affinity_worker`: rendezvous hashing of the prompt's first chunk over the live
    workers, the same on every router replica) when that one holds its reservation and is not `affinity_slack`
    sequences busier than the least loaded; else to the live worker with the most free blocks that holds its
    reservation (what it has + `kv_growth` tokens), else — nothing fits,
    nothing is cached for it — prefixes cached on the live worker with the most free blocks are demoted, in the
    session-aware order of router/eviction.py, until it fits. A head of the queue that fits nowhere keeps the ones behind it waiting (first come, first
    served); those that waited longer than `max_queue_wait` are refused;
  * growth: a decoding sequence whose reservation does not cover the token it feeds reserves `kv_growth` more; when
    its worker is out of blocks, the prefixes cached there go first (router/eviction.py's order), then the youngest
    other sequences there are preempted (requeued: they replay what they had, the same tokens, later); a sequence
    alone on a worker that cannot hold more of it ends with "length";
  * speculation (`speculative_tokens` K): a decoding sequence may emit up to K + 1 tokens a step (`max_new`: within
    what max_tokens and the context leave, the KV it has reserved, and short of its next chunk boundary, so a prefix
    is only ever saved where no draft was verified; one while it replays or a token filter may force a token), and
    its reservation grows while it does not hold K + 1 more (without evicting or preempting for it);
  * the batches: every decoding sequence feeds its next token and samples; prefilling ones feed their next chunk
    (`prefill_end`), which ends at the next multiple of `prefill_tokens` (one granule, `prefill_chunk`, when unset),
    sooner deep in a long prompt (fewer rows, a multiple of the granule, within `prefill_work`'s attention work), or
    earlier at the prompt's last multiple of `prefill_chunk` — the prefix cache's granularity, so the prefix a
    follow-up turn starts with is saved; not where the workers save a prefix inside a step (a model without
    recurrent layers: `snapshot_within_step`) — or at its end: fixed by the prompt and the limits alone, so a sequence
    computes the same chunks whatever runs beside it (a long prompt never stalls decoding for more than a chunk), within
    `max_batch_tokens`, in arrival order (a chunk that does not fit waits); the last chunk samples unless the
    request only scores its prompt;
  * snapshots: a sequence reaching or passing a multiple of the chunk in a step saves its cache up to the step's
    last one as a prefix under its hash-chain key, unless that prefix is cached already;
  * pools (prefill/decode disaggregation, router/disagg.py): a request is placed within the pool it is prefilled
    in — the prefill pool first when it is live and the prompt long enough, the decode pool when the prefill pool
    cannot take it now — and decode workers save no prefixes while the prefill pool is live.
`update_from_output()` turns one attention worker's step result into what changes: per request the tokens computed,
its log-probs, the token it accepts and whether it finishes (stop token, max_tokens, context) or fails, and the
prefixes saved.

No worker calls, no clocks (the time comes in as `now`), no locks, and the inputs are never modified. The engine
(router/engine.py) makes the calls a plan asks for and applies what comes back. The view is the router's own and a
worker may answer otherwise (blocks freed behind the router's back, a prefix gone), so an admission carries the
candidates to try next and a growth the prefixes to drop and sequences to preempt while the worker says it is out
of blocks; when a worker did answer otherwise, the engine plans the rest of the step again from the new state.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from expertmesh.router.disagg import Pools
from expertmesh.router.kv import KVManager, PrefixHasher
from expertmesh.router.request import ContextLengthExceeded, ExpertsUnavailable, Request, RequestError, TokenLogprob
from expertmesh.wire.sampling_params import SamplingParams, check_sampling
from expertmesh.wire.worker_api import StepDone, TokenLogprobs


@dataclass(frozen=True)
class Limits:
    """The engine's scheduling settings."""

    prefill_chunk: int  # the prefix cache's granularity: chunks end (and snapshots are) at its multiples
    max_batch_tokens: int
    max_running: int
    kv_growth: int  # tokens of KV a sequence reserves ahead (when placed, and each time it runs out)
    max_context: int
    max_queue_wait: float = float("inf")  # seconds a request may wait for KV room before it is refused
    prefill_tokens: int = 0  # prompt chunks end at its multiples (0: at prefill_chunk's)
    # the attention work one prompt chunk may do, in row·context units (chunk_work; 0: unbounded): deep in a long
    # prompt a chunk has fewer rows, so a step's time stays bounded and the sequences decoding beside it stall less
    prefill_work: int = 0
    affinity_slack: int = 4  # a prefix hit is recomputed elsewhere on a worker this many sequences busier
    session_affinity: bool = True  # no prefix known: place by the session-affinity key (else by load alone)
    # the workers save a prefix inside a step (a model without recurrent layers: its cache at any position is its
    # pages), so a prompt's chunks need not stop at its last multiple of prefill_chunk to save it
    snapshot_within_step: bool = False
    speculative_tokens: int = 0  # drafts per decode step the attention workers verify (0: no speculation)
    speculative_max_batch: int = 16  # a worker running more sequences than this drafts and verifies nothing


@dataclass(frozen=True)
class Seq:
    """A placed request as the scheduler reads it."""

    req: Request
    worker: int
    computed: int  # tokens of prompt + output fed so far
    reserved: int  # tokens of KV reserved on its worker


@dataclass
class Admission:
    """Place a waiting request: open its sequence on the first candidate that takes it."""

    req: Request
    reserve: int  # tokens of KV to reserve
    candidates: list[tuple[int, str | None, int]]  # (worker, prefix key or None, cached tokens), in order
    hit: str | None = None  # the longest cached prefix of its prompt (marked used)
    evict: list[str] = field(default_factory=list)  # first evict these prefixes on the candidate's worker, in
    need: int = 0  # order, until it has `need` free blocks (none: not placed)


@dataclass
class Growth:
    """Reserve `target` tokens for a sequence; while its worker is out of blocks, evict the next prefix of `evict`,
    then preempt the next of `preempt` (youngest first); with both spent the request ends with "length"."""

    req: Request
    target: int
    evict: list[str]
    preempt: list[Request]
    optional: bool = False  # speculation's room only: the worker being out of blocks changes nothing


@dataclass
class Planned:
    """One request's share of a step: the tokens it feeds from position `start` and whether a token is sampled
    after them; `snapshot`: the prefix key to save its cache's first `prefix_end` tokens under after the step."""

    req: Request
    start: int
    tokens: list[int]
    sample: bool
    snapshot: str | None = None
    snapshot_at: int | None = None  # where the prefix ends inside the step (a chunk boundary); None: at `end`
    hasher: PrefixHasher | None = None  # its hash chain advanced to `prefix_end` (what the request keeps once sent)
    chain_key: str | None = None  # the prefix key of the tokens up to `prefix_end`
    max_new: int = 1  # tokens the worker may emit after `tokens` (speculation: up to speculative_tokens + 1)
    hold_at: int = 0  # speculation: the chunk boundary whose state the worker keeps if the kept tokens reach it
    saves_held: bool = False  # its snapshot is the one its request's last step held (Request.held_mark)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def prefix_end(self) -> int:
        """The length of the prefix this entry saves (or keys, when it is cached already)."""
        return self.end if self.snapshot_at is None else self.snapshot_at


@dataclass
class StepPlan:
    admissions: list[Admission] = field(default_factory=list)
    blocked: bool = False  # the head of the queue fits nowhere in the router's view
    expire: list[Request] = field(default_factory=list)  # blocked, and waited longer than max_queue_wait
    growth: list[Growth] = field(default_factory=list)
    batches: dict[int, list[Planned]] = field(default_factory=dict)  # attention worker → its batch


def reserve_tokens(tokens: int, prompt_len: int, max_tokens: int, limits: Limits) -> int:
    """KV reserved when a request is placed: what it has (`tokens`: the prompt, or prompt + output when it replays)
    plus up to `kv_growth` tokens, within prompt + max_tokens and the context. A large max_tokens holds no KV it
    does not use yet: the reservation grows by `kv_growth` as the request decodes."""
    return min(prompt_len + max_tokens, limits.max_context, tokens + limits.kv_growth)


def affinity_key(tokens: list[int], chunk: int) -> bytes | None:
    """A conversation's session-affinity key: the hash of its prompt's first `chunk` tokens, which every turn of
    the conversation starts with (the turns resend the history). Unsalted, so every router instance computes the
    same key; None for a prompt shorter than a chunk (placed by load)."""
    if chunk <= 0 or len(tokens) < chunk:
        return None
    return hashlib.sha256(
        b"expertmesh-affinity-v1" + b"".join(t.to_bytes(4, "little") for t in tokens[:chunk])
    ).digest()


def affinity_worker(key: bytes, workers: Iterable[int]) -> int | None:
    """Rendezvous (highest-random-weight) hashing: of `workers` (attention worker indices — the same list on every
    router replica), the one whose hash with `key` is highest; None for no workers. A pure function of its
    arguments: the same key goes to the same worker on any router instance, and a worker leaving the set moves
    only the keys that went to it (the others' highest weight is unchanged)."""
    return max(workers, key=lambda w: (hashlib.sha256(key + w.to_bytes(4, "little")).digest(), -w), default=None)


def check_request(prompt: list[int], params: SamplingParams, *, vocab_size: int, kv: KVManager, limits: Limits) -> None:
    """Refuse what can never run, naming the field: RequestError, ContextLengthExceeded."""
    if not prompt:
        raise RequestError("prompt: expected at least one token")
    if params.max_tokens < 0 or (params.max_tokens == 0 and params.prompt_logprobs is None):
        raise RequestError(
            f"max_tokens={params.max_tokens}: expected a positive integer (0 only when scoring "
            f"the prompt with prompt_logprobs)"
        )
    context = limits.max_context
    counts = {"prompt_tokens": len(prompt), "max_tokens": params.max_tokens, "context": context}
    if len(prompt) >= context and params.max_tokens > 0:
        raise ContextLengthExceeded(
            f"prompt: {len(prompt)} tokens, the model's context is {context} "
            f"tokens (at least one must remain to generate)",
            param="prompt",
            **counts,
        )
    if len(prompt) + params.max_tokens > context:
        raise ContextLengthExceeded(
            f"max_tokens={params.max_tokens}: the prompt ({len(prompt)} tokens) plus "
            f"max_tokens exceeds the model's context of {context} tokens",
            param="max_tokens",
            **counts,
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt: token id {bad[0]} outside [0, {vocab_size})")
    bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"logit_bias: token id {bad[0]} outside [0, {vocab_size})")
    try:
        check_sampling(params)
    except ValueError as err:
        raise RequestError(str(err)) from None
    need = reserve_tokens(len(prompt), len(prompt), params.max_tokens, limits)
    if all(kv.blocks_for(w.index, need) > w.total_blocks for w in kv.workers):
        raise RequestError(
            f"prompt: {len(prompt)} tokens (+ the first {need - len(prompt)} to generate) exceed "
            f"the KV capacity of every attention worker"
        )


class _View:
    """The KV state as the plan leaves it: free blocks and sequences per worker after its admissions, prefixes it
    marked used (last in the eviction order). A copy: the KVManager is only read."""

    def __init__(self, kv: KVManager, down: frozenset[int]):
        self.kv, self.down = kv, down
        self.free = {w.index: w.free_blocks for w in kv.workers}
        self.sequences = {w.index: w.sequences for w in kv.workers}
        self.touched: list[str] = []

    def touch(self, key: str) -> None:
        if key in self.touched:
            self.touched.remove(key)
        self.touched.append(key)

    def evictable(self, worker: int) -> list[str]:
        """Prefixes on `worker`'s device pool, victims first (router/eviction.py; those this plan used last)."""
        return self.kv.victims(worker, self.touched)

    def overloaded(self, worker: int, limits: Limits) -> bool:
        """Running `affinity_slack` or more sequences beyond the least loaded live worker."""
        live = [n for w, n in self.sequences.items() if w not in self.down]
        return len(live) > 1 and self.sequences[worker] >= min(live) + limits.affinity_slack

    def choose_worker(self, need: int) -> int | None:
        """The live worker with the most free blocks that fits `need` (then the fewest sequences, the lowest index)."""
        fits = [w for w, free in self.free.items() if free >= need and w not in self.down]
        return max(fits, key=lambda w: (self.free[w], -self.sequences[w], -w)) if fits else None

    def session_worker(self, req: Request, need: int, limits: Limits) -> int | None:
        """Its session's worker (affinity_worker over the live workers) when it fits `need` blocks and is not
        overloaded; None otherwise, or for a prompt shorter than a chunk, or with one live worker."""
        key = affinity_key(req.hash_prompt, limits.prefill_chunk) if limits.session_affinity else None
        live = [w.index for w in self.kv.workers if w.index not in self.down]
        if key is None or len(live) < 2:
            return None
        w = affinity_worker(key, live)
        return w if self.free[w] >= need and not self.overloaded(w, limits) else None

    def elsewhere(self, req: Request, hit: tuple[int, str, int], reserve: int, limits: Limits, adm: Admission):
        """A hit its worker cannot serve now, on another worker when the cluster store holds it (restored there
        whole: the reservation's blocks, none shared) — its session's worker, else the one with the most room, else
        the live one with the most free blocks after evictions (set on `adm`); None otherwise."""
        worker, key, length = hit
        if not self.kv.in_cluster(key):
            return None
        fresh = self.kv.blocks_for(0, reserve)
        w = self.session_worker(req, fresh, limits)
        if w is None or w == worker:
            others = [x for x in self.free if x not in self.down and x != worker]
            fits = [x for x in others if self.free[x] >= fresh]
            w = max(fits, key=lambda x: (self.free[x], -self.sequences[x], -x)) if fits else None
            if w is None and others:  # make room there: its prefixes demoted (into the store too) or dropped
                target = max(others, key=lambda x: (self.free[x], -x))
                adm.evict, adm.need = self.evictable(target), fresh
                w = target if adm.evict else None
        return None if w is None else (w, key, length)

    def take(self, worker: int, reserve: int, cached: int) -> None:
        self.free[worker] -= self.kv.blocks_for(worker, reserve, cached)
        self.sequences[worker] += 1


def place(req: Request, view: _View, limits: Limits) -> Admission | None:
    """Where a waiting request would go (None: nowhere now)."""
    reserve = reserve_tokens(len(req.tokens), len(req.prompt), req.params.max_tokens, limits)
    # scoring the prompt needs every prompt position computed: no cached prefix
    hit = None
    if req.params.prompt_logprobs is None:
        if req.prompt_keys is None:
            req.prompt_keys = view.kv.prefix_keys(req.hash_prompt, req.cache_scope)
        hit = view.kv.find_prefix(req.hash_prompt, req.cache_scope, keys=req.prompt_keys)
    adm = Admission(req, reserve, [], hit=hit[1] if hit is not None else None)
    if hit is not None:
        view.touch(hit[1])
        worker, key, _ = hit
        # a prefix below the device comes back whole: the reservation's blocks, none shared
        need = view.kv.blocks_for(worker, reserve, 0 if view.kv.is_lower(key) else hit[2])
        if worker in view.down or view.overloaded(worker, limits):
            hit = view.elsewhere(req, hit, reserve, limits, adm)
        elif view.free[worker] < need:
            adm.evict, adm.need = view.evictable(worker), need  # the hit itself last (demoted: then restored)
            if not adm.evict:
                hit = view.elsewhere(req, hit, reserve, limits, adm)
        if hit is not None:
            adm.candidates.append(hit)
    fresh = view.kv.blocks_for(0, reserve)
    w = view.choose_worker(fresh)
    if w is not None and adm.hit is None:  # no prefix known here: its session's worker, then today's choice
        mine = view.session_worker(req, fresh, limits)
        if mine is not None and mine != w:
            adm.candidates.append((mine, None, 0))
    if w is not None:
        adm.candidates.append((w, None, 0))
    elif hit is None and len(view.down) < len(view.kv.workers):
        target = max((x.index for x in view.kv.workers if x.index not in view.down), key=lambda i: view.free[i])
        adm.evict = view.evictable(target)
        if adm.evict:
            adm.candidates.append((target, None, 0))
            adm.need = view.kv.blocks_for(target, reserve)
    return adm if adm.candidates else None


def place_in_pools(req: Request, view: _View, limits: Limits, pools: Pools | None) -> Admission | None:
    """`place` within the pool the request is prefilled in (router/disagg.py): the prefill pool when it is live
    and the prompt long enough, else — or when no prefill worker can take it now — the decode pool."""
    if pools is None or not pools.split:
        return place(req, view, limits)
    base = view.down
    first = pools.bound_for(len(req.prompt), base)
    adm = None
    try:
        for pool in (first, "decode") if first == "prefill" else (first,):
            view.down = base | pools.excluded(pool)
            adm = place(req, view, limits)
            if adm is not None:
                break
    finally:
        view.down = base
    return adm


def schedule(
    waiting: list[Request],
    running: list[Request],
    kv: KVManager,
    *,
    limits: Limits,
    down: frozenset[int] = frozenset(),
    now: float = 0.0,
    admit: bool = True,
    pools: Pools | None = None,
) -> StepPlan:
    """One step's plan (see the module's docstring). `running`: placed requests in admission order, none cancelled;
    `waiting`: the queue, head first; `admit=False`: plan growth and batches of the running ones only; `pools`:
    the attention workers' pools (None: one pool)."""
    plan = StepPlan()
    view = _View(kv, frozenset(down))
    seqs = [Seq(r, r.worker, r.computed, r.reserved) for r in running]
    for req in waiting if admit else ():
        if len(seqs) >= limits.max_running:
            break
        adm = place_in_pools(req, view, limits, pools)
        if adm is None:
            plan.blocked = True
            plan.expire = [r for r in waiting if now - r.queued_at > limits.max_queue_wait]
            break
        plan.admissions.append(adm)
        worker, key, cached = adm.candidates[0]
        seqs.append(Seq(req, worker, cached, adm.reserve))
        if adm.evict:
            break  # what the evictions free only the worker can say: the rest wait for the next plan
        moved = key is not None and kv.prefixes.get(key) != worker  # a cluster key restored elsewhere
        view.take(worker, adm.reserve, 0 if key is not None and (kv.is_lower(key) or moved) else cached)
    plan.growth = plan_growth(seqs, view, limits)
    grown = {id(g.req): g.target for g in plan.growth}
    seqs = [Seq(s.req, s.worker, s.computed, grown.get(id(s.req), s.reserved)) for s in seqs]
    plan.batches = plan_batches(seqs, kv, limits, pools.no_snapshot(frozenset(down)) if pools else frozenset())
    return plan


def plan_growth(seqs: list[Seq], view: _View, limits: Limits) -> list[Growth]:
    """The decoding sequences whose reservation does not cover the token they feed, in admission order; with
    speculation also those that do but not the K + 1 a step may write (`Growth.optional`: no room, no matter)."""
    out = []
    for s in seqs:
        cap = min(len(s.req.prompt) + s.req.params.max_tokens, limits.max_context)
        want = limits.speculative_tokens + 1 if s.computed >= len(s.req.prompt) else 1
        if s.computed + 1 <= s.reserved and (s.computed + want <= s.reserved or s.reserved >= cap):
            continue
        target = min(cap, max(s.reserved + limits.kv_growth, s.computed + want))
        if s.computed + 1 <= s.reserved:
            out.append(Growth(s.req, target, [], [], optional=True))
            continue
        youngest_first = [o.req for o in reversed(seqs) if o.worker == s.worker and o.req is not s.req]
        out.append(Growth(s.req, target, view.evictable(s.worker), youngest_first))
    return out


def plan_batches(
    seqs: list[Seq], kv: KVManager, limits: Limits, no_snapshot: frozenset[int] = frozenset()
) -> dict[int, list[Planned]]:
    """{attention worker: its batch}, decoding sequences first, then prefill chunks within the token budget; each
    entry with the prefix to save after it, if any (none on the workers of `no_snapshot`)."""
    batches: dict[int, list[Planned]] = {}
    budget = limits.max_batch_tokens
    decoding = [s for s in seqs if s.computed >= len(s.req.prompt)]
    prefilling = [s for s in seqs if s.computed < len(s.req.prompt)]
    per_worker: dict[int, int] = {}
    for s in seqs:  # every sequence a worker runs, decoding or prefilling
        per_worker[s.worker] = per_worker.get(s.worker, 0) + 1
    # a large batch speculates not at all (compute-bound: the drafts cost more than they save); where a worker does,
    # its prompt chunks say so too (max_new K + 1: the worker feeds their rows to its drafter, which it skips else)
    speculating = {w for w, n in per_worker.items() if limits.speculative_tokens and n <= limits.speculative_max_batch}
    for s in decoding:
        new = max_new(s, limits) if s.worker in speculating else 1
        boundary = (s.computed // limits.prefill_chunk + 1) * limits.prefill_chunk  # the next one it may reach
        hold = boundary if new > 1 and boundary <= s.computed + new and boundary < limits.max_context else 0
        batches.setdefault(s.worker, []).append(
            Planned(s.req, s.computed, [s.req.tokens[s.computed]], True, max_new=new, hold_at=hold)
        )
        budget -= new
    for s in prefilling:
        if budget <= 0:
            break
        end = prefill_end(s.computed, len(s.req.prompt), limits)
        if end - s.computed > budget:
            break
        sample = end == len(s.req.prompt) and s.req.params.max_tokens > 0
        chunk = Planned(s.req, s.computed, s.req.prompt[s.computed : end], sample)
        chunk.max_new = limits.speculative_tokens + 1 if s.worker in speculating else 1
        batches.setdefault(s.worker, []).append(chunk)
        budget -= end - s.computed
    for worker, items in batches.items():
        for p in items:
            _snapshot(p, kv, limits)
            if worker in no_snapshot:
                p.snapshot = None
    return batches


def max_new(s: Seq, limits: Limits) -> int:
    """Tokens a decoding sequence may emit this step: 1 without speculation, else up to K + 1 within what is left
    of max_tokens and the context, the KV it reserved, and one chunk (a verified run crosses at most one chunk
    boundary: the worker holds the state there — Planned.hold_at — and the next step saves that prefix); 1 while it
    replays or has a token filter."""
    req, k = s.req, limits.speculative_tokens
    if not k or req.token_filter is not None or s.computed + 1 < len(req.tokens):
        return 1
    left = min(
        k + 1,
        req.params.max_tokens - len(req.output),
        limits.max_context - len(req.tokens),
        s.reserved - s.computed,
        limits.prefill_chunk,
    )
    return max(1, left)


def chunk_work(start: int, rows: int) -> int:
    """The attention work of feeding `rows` tokens from position `start`, in row·context units: each row attends to
    the context before it, start + i + 1 tokens for the i-th (rows · (start + rows/2), rounded up)."""
    return rows * (2 * start + rows + 1) // 2


def work_rows(computed: int, work: int, g: int) -> int:
    """The most rows from `computed` whose attention work (chunk_work) stays within `work`, rounded down to a
    multiple of `g` and at least `g` (a chunk always advances)."""
    # rows·(2c + rows + 1) ≤ 2·work  ⇔  rows ≤ (√((2c+1)² + 8·work) − (2c+1)) / 2, exact in integers
    b = 2 * computed + 1
    rows = (math.isqrt(b * b + 8 * work) - b) // 2
    return max(g, rows // g * g)


def prefill_end(computed: int, prompt_len: int, limits: Limits) -> int:
    """Where a prompt's next chunk ends, from `computed` tokens: at the next multiple of `prefill_tokens` (of the
    granularity g = `prefill_chunk` when unset) — or, where a chunk of `prefill_tokens` rows would do more attention
    work than `prefill_work` (chunk_work: a row attends to the context before it, so the same rows cost more the
    further into the prompt), after the most multiples of g within that work (at least one g) —, or earlier at the
    prompt's last multiple of g (a stop of its own: that prefix is snapshotted, and a chat's next turn starts with
    it — unless the workers save it inside the step: `snapshot_within_step`), or at the prompt's end. The ends
    depend on the prompt and the limits alone — never on the batch — so a sequence's numbers do not either."""
    g = limits.prefill_chunk
    step = max(limits.prefill_tokens, g)
    end = (computed // step + 1) * step
    if limits.prefill_work and chunk_work(computed, step) > limits.prefill_work:
        end = (computed + work_rows(computed, limits.prefill_work, g)) // g * g
    end = min(prompt_len, end)
    last_mark = prompt_len // g * g
    return last_mark if computed < last_mark < end and not limits.snapshot_within_step else end


def _snapshot(p: Planned, kv: KVManager, limits: Limits) -> None:
    """At the entry's last multiple of the chunk — its end, or inside it with `snapshot_within_step` — below the
    context: advance a copy of the request's hash chain (a new chain when the request is new or replays) and save
    the prefix under its key unless it is cached."""
    chunk = limits.prefill_chunk
    mark = p.end // chunk * chunk
    if p.req.held_mark:  # a boundary its last (verified) step crossed: saved from the state the worker held there
        mark, p.saves_held = p.req.held_mark, True
    elif p.hold_at:  # a verified run ends where acceptance says: its boundary is held, saved by the next step
        return
    elif mark <= p.start or mark >= limits.max_context or (mark != p.end and not limits.snapshot_within_step):
        return
    own = p.req.hasher
    p.hasher = own.copy() if own is not None and own.length <= mark else kv.hasher(p.req.cache_scope)
    key = p.chain_key = p.hasher.advance(p.req.hash_tokens, mark)
    p.snapshot_at = mark if mark != p.end else None
    if not kv.has(key):
        p.snapshot = key


@dataclass
class SeqUpdate:
    """What one step did to one request."""

    req: Request
    error: Exception | None = None  # it fails (nothing else applies)
    computed: int = 0  # tokens fed so far, after the step
    prefilled: int = 0  # prompt tokens computed by this step
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # positions not scored before
    token: int | None = None  # the token it accepts (after its token filter)
    logprob: TokenLogprob | None = None  # that token's entry (asked for with params.logprobs)
    more: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # speculation: the tokens after it
    drafted: int = 0  # drafts the worker verified for it (speculation)
    finish: str | None = None  # "stop" | "length", after the token if any
    diverged: tuple[int, int] | None = None  # a greedy replay computed (position, token) otherwise than before


@dataclass
class StepUpdate:
    """What one attention worker's step result changes."""

    free_blocks: int
    experts_down: set[int]
    exchange_bytes: int
    saved: list[tuple[str, int]]  # prefixes now cached on the worker: (key, length)
    seqs: list[SeqUpdate]


def finish_reason(req: Request, token: int, max_context: int) -> str | None:
    """Why a request ends once it accepts `token`: a stop token, max_tokens reached, or the context full."""
    if token in req.params.stop_token_ids:
        return "stop"
    if len(req.output) + 1 >= req.params.max_tokens or len(req.tokens) + 1 >= max_context:
        return "length"
    return None


def _finish_after(req: Request, more: int, token: int, max_context: int) -> str | None:
    """finish_reason for `token`, the `more`-th token after the step's first (the output not yet applied)."""
    if token in req.params.stop_token_ids:
        return "stop"
    if len(req.output) + more + 1 >= req.params.max_tokens or len(req.tokens) + more + 1 >= max_context:
        return "length"
    return None


def update_from_output(batch: list[Planned], done: StepDone, *, max_context: int) -> StepUpdate:
    """One attention worker's answer to its batch → the changes, in batch order. Pure but for one call: an
    accepted token goes through the request's own `token_filter` (the API layer's thinking budget, which may force
    another token) before the finish decision. A token sampled where the request already has one (it replays after
    a failover or preemption: same schedule, same bits) is not accepted again."""
    runs: dict[str, list[TokenLogprobs]] = {}
    for run in done.logprobs:
        runs.setdefault(run.seq_id, []).append(run)
    saved = [(p.snapshot, p.prefix_end) for p in batch if p.snapshot is not None and p.req.seq_id not in done.failed]
    seqs = []
    for p in batch:
        req = p.req
        reason = done.failed.get(req.seq_id)
        if reason is not None:
            error = RuntimeError(reason) if reason.startswith("sampling failed") else ExpertsUnavailable(reason)
            seqs.append(SeqUpdate(req, error=error))
            continue
        emitted = done.emitted(req.seq_id)
        u = SeqUpdate(req, computed=p.start + len(emitted) if len(emitted) > 1 else p.end)
        u.drafted = done.drafted.get(req.seq_id, 0)
        sampled: dict[int, TokenLogprob] = {}  # output position → entry
        for run in runs.get(req.seq_id, ()):
            for i, entry in enumerate(TokenLogprob.entries(run)):
                position = run.position + i
                if position >= len(req.prompt):
                    sampled[position] = entry
                elif position not in req.prompt_logprobs:  # a replay scores it again: the first entry stays
                    u.prompt_logprobs.setdefault(position, entry)
        if u.computed <= len(req.prompt):
            u.prefilled = len(p.tokens)
        if u.computed == len(req.prompt) and req.params.max_tokens == 0:
            u.finish = "length"  # scored the prompt, nothing to generate
        elif p.sample and u.computed < len(req.tokens):
            token = done.tokens[req.seq_id]
            if req.params.temperature == 0 and token != req.tokens[u.computed]:
                u.diverged = (u.computed, token)
        elif p.sample:
            token = done.tokens[req.seq_id]
            if req.token_filter is not None:
                token = req.token_filter(req, token)
            u.token = token
            entry = sampled.get(p.end)
            if entry is not None:
                u.logprob = entry if entry.token == token else entry.forced(token)
            u.finish = finish_reason(req, token, max_context)
            for i, t in enumerate(emitted[1 : p.max_new] if u.finish is None else ()):
                u.more.append((t, sampled.get(p.end + 1 + i)))  # accepted drafts, then the target's own token
                u.finish = _finish_after(req, len(u.more), t, max_context)
                if u.finish is not None:
                    break
        seqs.append(u)
    return StepUpdate(done.free_blocks, set(done.experts_down), done.exchange_bytes, saved, seqs)
