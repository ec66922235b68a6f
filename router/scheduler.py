"""The step planner: pure decisions from the running requests to one scheduler step's batches.

Plain data in, plain data out — no worker calls, no clocks — so the policy is testable on its own:
  * every decoding request feeds its next token (the one not fed yet) and samples;
  * prefilling requests feed their next chunk, which ends at the next multiple of `prefill_chunk` (so a long
    prompt never stalls decoding for more than a chunk, and cached prefixes line up with fresh runs), within
    the step's token budget, in arrival order; the last chunk samples unless the request only scores its prompt;
  * a request reaching a multiple of the chunk saves its cache as a prefix (its hash-chain key), unless the
    prefix is already cached.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from expertmesh.router.kv import PrefixHasher


@dataclass
class Planned:
    """One request's share of a step: the tokens it feeds and whether a token is sampled after them."""
    req: object                  # engine.Request (computed, prompt, tokens, params, worker, seq_id, hasher)
    tokens: list[int]
    sample: bool


def plan_step(running: list, *, max_batch_tokens: int, prefill_chunk: int) -> dict[int, list[Planned]]:
    """Requests (placed on attention workers) → {attention worker: its batch}, decode first."""
    batches: dict[int, list[Planned]] = {}
    budget = max_batch_tokens
    decoding = [r for r in running if r.computed >= len(r.prompt)]
    prefilling = [r for r in running if r.computed < len(r.prompt)]
    for req in decoding:
        batches.setdefault(req.worker, []).append(Planned(req, [req.tokens[req.computed]], True))
        budget -= 1
    for req in prefilling:
        if budget <= 0:
            break
        end = min(len(req.prompt), (req.computed // prefill_chunk + 1) * prefill_chunk)
        if end - req.computed > budget:
            break
        sample = end == len(req.prompt) and req.params.max_tokens > 0
        batches.setdefault(req.worker, []).append(Planned(req, req.prompt[req.computed:end], sample))
        budget -= end - req.computed
    return batches


def plan_snapshots(batches: dict[int, list[Planned]], *, prefill_chunk: int, max_context: int,
                   cached: Callable[[str], bool], salt: bytes = b"") -> tuple[dict[int, dict[str, str]], dict[str, int]]:
    """Prefixes to save after the step: ({worker: {seq_id: key}}, {key: length}). Advances each request's
    hash chain (a new chain when the request is new or replays after a failover)."""
    snapshots: dict[int, dict[str, str]] = {}
    lengths: dict[str, int] = {}
    for w, items in batches.items():
        for p in items:
            req = p.req
            new_len = req.computed + len(p.tokens)
            if new_len % prefill_chunk or new_len >= max_context:
                continue
            if req.hasher is None or req.hasher.length > new_len:
                req.hasher = PrefixHasher(prefill_chunk, salt)
            key = req.hasher.advance(req.hash_tokens, new_len)
            if not cached(key):
                snapshots.setdefault(w, {})[req.seq_id] = key
                lengths[key] = new_len
    return snapshots, lengths
