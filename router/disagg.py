"""Prefill/decode disaggregation as the router decides it: which pool a request is prefilled in, which decode
worker takes a sequence once its prompt is done, and the per-pool signals the autoscalers read. Pure functions of
plain data (the KV view, the pools, the workers marked down); router/engine.py makes the calls.

The attention workers form up to two pools. Without prefill workers there is one, "mixed": today's colocated
deployment, unchanged. With them, the router's other attention workers are the "decode" pool, and
  * a request is prefilled in the prefill pool (prefix-aware there: follow-up turns hit the prefixes saved there)
    when at least one prefill worker is live and its prompt has `min_tokens` or more tokens; otherwise — the pool
    is down, saturated (no prefill worker has room for it now), or the prompt is short — on a decode worker, as
    a colocated deployment would;
  * once a sequence on a prefill worker has sampled its first token, the router moves it to the decode worker
    with the most free blocks that holds its reservation (`choose_decode`); the prefill worker sends the KV itself
    (worker to worker) and the sequence goes on there, the same tokens;
  * decode workers save no prefixes while the prefill pool is live (nothing would hit them: prompts go to the
    prefill pool), so their KV holds running sequences only.
"""

from __future__ import annotations

from dataclasses import dataclass

from expertmesh.router.kv import KVManager

POOL_KINDS = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class Pools:
    """`kinds[i]`: the pool of attention worker i (router order: the decode / mixed workers, then the prefill
    ones); `min_tokens`: prompts shorter than this skip the prefill pool."""

    kinds: tuple[str, ...]
    min_tokens: int = 0

    @staticmethod
    def of(decode: int, prefill: int, min_tokens: int = 0) -> Pools:
        if decode < 1:
            raise ValueError("attention: expected at least one decode-pool worker beside the prefill pool")
        if min_tokens < 0:
            raise ValueError(f"prefill_min_tokens={min_tokens}: expected ≥ 0")
        return Pools(("decode",) * decode + ("prefill",) * prefill if prefill else ("mixed",) * decode, min_tokens)

    @property
    def split(self) -> bool:
        return "prefill" in self.kinds

    def members(self, kind: str) -> frozenset[int]:
        return frozenset(i for i, k in enumerate(self.kinds) if k == kind)

    def name(self, worker: int) -> str:
        return self.kinds[worker]

    def prefill_live(self, down: frozenset[int]) -> bool:
        return bool(self.members("prefill") - down)

    def bound_for(self, prompt_len: int, down: frozenset[int]) -> str:
        """The pool a prompt of `prompt_len` tokens is prefilled in, as a first choice."""
        if not self.split:
            return "mixed"
        return "prefill" if self.prefill_live(down) and prompt_len >= self.min_tokens else "decode"

    def excluded(self, pool: str) -> frozenset[int]:
        """The workers a request prefilled in `pool` must not be placed on."""
        if not self.split:
            return frozenset()
        return self.members("decode") if pool == "prefill" else self.members("prefill")

    def no_snapshot(self, down: frozenset[int]) -> frozenset[int]:
        """Workers that save no prefixes now: the decode pool while the prefill pool is live."""
        return self.members("decode") if self.split and self.prefill_live(down) else frozenset()


def choose_decode(
    kv: KVManager, pools: Pools, down: frozenset[int], reserve: int, taken: dict[int, int] | None = None
) -> int | None:
    """The decode worker a sequence with `reserve` tokens of KV moves to: live, with room for the reservation
    after the blocks already promised this round (`taken`: worker → blocks), the most free blocks left, then the
    fewest sequences, then the lowest index; None when no decode worker has room."""
    taken = taken or {}
    fits = []
    for w in sorted(pools.members("decode") - down):
        free = kv.workers[w].free_blocks - taken.get(w, 0)
        if free >= kv.blocks_for(w, reserve):
            fits.append((free, -kv.workers[w].sequences, -w))
    return -max(fits)[2] if fits else None


@dataclass(frozen=True)
class PoolLoad:
    """One pool's signals (router /metrics, what a HorizontalPodAutoscaler scales the pool on)."""

    requests_waiting: int  # requests waiting to enter the pool (decode: also those waiting for a hand-off)
    prefill_tokens_waiting: int  # prompt tokens bound for the pool not computed yet
    kv_utilization: float  # used / total KV blocks over the pool's live workers (0 when none is live)
    live_workers: int


def pool_load(pools: Pools, kv: KVManager, down: frozenset[int], waiting: list, running: list) -> dict[str, PoolLoad]:
    """{pool: PoolLoad} for every pool present. `waiting` / `running`: requests (prompt, worker, computed)."""
    names = sorted(set(pools.kinds))
    reqs = {p: 0 for p in names}
    tokens = {p: 0 for p in names}
    for r in waiting:
        pool = pools.bound_for(len(r.prompt), down)
        reqs[pool] += 1
        tokens[pool] += max(0, len(r.prompt) - r.cached_tokens)
    for r in running:
        if r.worker < 0:
            continue
        pool = pools.name(r.worker)
        if r.computed < len(r.prompt):
            tokens[pool] += len(r.prompt) - r.computed
        elif pool == "prefill":  # prompt done: waiting for its hand-off to the decode pool
            reqs["decode"] += 1
    out = {}
    for p in names:
        live = [kv.workers[w] for w in pools.members(p) if w not in down]
        total = sum(w.total_blocks for w in live)
        used = sum(w.total_blocks - w.free_blocks for w in live)
        out[p] = PoolLoad(reqs[p], tokens[p], used / total if total else 0.0, len(live))
    return out
