"""The router's KV manager: which attention worker holds each sequence, free blocks per worker, and the
prefix cache index (token-block hashes → the worker and key of a saved prefix).

Prefixes are saved at multiples of `chunk` tokens (the prefill chunk, itself a multiple of the KV block),
so a request that reuses one prefills exactly the chunks a fresh run would: same numbers, fewer tokens.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


class PrefixHasher:
    """The hash chain of a growing token list, chunk by chunk: equal prefixes hash equal and any difference
    changes all later keys. Feeding it as a sequence grows costs O(new tokens), not O(length). `salt`: a secret of
    the router instance, so nobody else can compute (and replace or drop) the keys it saves on the workers."""

    def __init__(self, chunk: int, salt: bytes = b""):
        self.chunk = chunk
        self.length = 0
        self._h = hashlib.sha256(b"expertmesh-prefix-v1" + salt)

    def copy(self) -> "PrefixHasher":
        """An independent chain in the same state (the scheduler plans with copies; the engine keeps the one sent)."""
        other = PrefixHasher.__new__(PrefixHasher)
        other.chunk, other.length, other._h = self.chunk, self.length, self._h.copy()
        return other

    def advance(self, tokens: list[int], upto: int) -> str:
        """The key of tokens[:upto] (`upto` a multiple of the chunk, ≥ what was hashed so far)."""
        for end in range(self.length + self.chunk, upto + 1, self.chunk):
            self._h.update(b"".join(t.to_bytes(4, "little") for t in tokens[end - self.chunk: end]))
            self.length = end
        return self._h.hexdigest()[:32]


def prefix_hashes(tokens: list[int], chunk: int, salt: bytes = b"") -> list[tuple[int, str]]:
    """(length, key of tokens[:length]) for every multiple of `chunk` ≤ len(tokens), shortest first."""
    hasher = PrefixHasher(chunk, salt)
    return [(end, hasher.advance(tokens, end)) for end in range(chunk, len(tokens) + 1, chunk)]


@dataclass
class WorkerKV:
    index: int
    block_size: int
    total_blocks: int
    free_blocks: int
    sequences: int = 0


class KVManager:
    def __init__(self, workers: list[WorkerKV], chunk: int, max_prefixes_per_worker: int = 256, salt: bytes = b""):
        if any(chunk % w.block_size for w in workers):
            raise ValueError(f"prefill chunk {chunk} must be a multiple of every worker's KV block size")
        self.workers = workers
        self.chunk = chunk
        self.salt = salt
        self.max_prefixes = max_prefixes_per_worker
        # key → worker index, in LRU order (oldest first)
        self.prefixes: OrderedDict[str, int] = OrderedDict()
        self.prefix_len: dict[str, int] = {}

    def blocks_for(self, worker: int, tokens: int, cached: int = 0) -> int:
        bs = self.workers[worker].block_size
        return -(-tokens // bs) - cached // bs

    def find_prefix(self, tokens: list[int]) -> tuple[int, str, int] | None:
        """The longest saved prefix of `tokens` that leaves at least one token to compute:
        (worker, key, length), or None. Reads only: `touch` marks it used."""
        best = None
        for length, key in prefix_hashes(tokens, self.chunk, self.salt):
            if length >= len(tokens):
                break
            if key in self.prefixes:
                best = (self.prefixes[key], key, length)
        return best

    def touch(self, key: str) -> None:
        """Mark a saved prefix as the most recently used (evicted last)."""
        if key in self.prefixes:
            self.prefixes.move_to_end(key)

    def eviction_candidates(self, worker: int) -> list[str]:
        """Saved prefixes on `worker`, least recently used first."""
        return [k for k, w in self.prefixes.items() if w == worker]

    def record_prefix(self, worker: int, key: str, length: int) -> list[str]:
        """Note a saved prefix; returns the keys to drop to stay within the per-worker cap."""
        self.prefixes[key] = worker
        self.prefix_len[key] = length
        self.prefixes.move_to_end(key)
        mine = self.eviction_candidates(worker)
        drop = mine[: max(0, len(mine) - self.max_prefixes)]
        for k in drop:
            self.forget(k)
        return drop

    def forget(self, key: str) -> None:
        self.prefixes.pop(key, None)
        self.prefix_len.pop(key, None)

    def has(self, key: str) -> bool:
        return key in self.prefixes
