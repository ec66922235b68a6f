"""The router's KV manager: which attention worker holds each sequence, free blocks per worker, and the
prefix cache index (token-block hashes → the worker and key of a saved prefix, in any of its tiers).

The router owns the index; each worker owns its tiers. A prefix is on its worker's device pool or below it (host
memory, disk: worker/kv_tiers.py); to make room the router asks the worker to demote a prefix (router/eviction.py
picks which), the worker moves it down within its byte bounds and answers with the keys it finally dropped, which
the index forgets. A key found gone later (NotFound) is forgotten too: the engine falls back to the next candidate.

Prefixes are saved at multiples of `chunk` tokens (the prefill chunk, itself a multiple of the KV block),
so a request that reuses one prefills exactly the chunks a fresh run would: same numbers, fewer tokens.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from expertmesh.router.eviction import ANSWERED, PrefixInfo, eviction_order, session_state


class PrefixHasher:
    """The hash chain of a growing token list, chunk by chunk: equal prefixes hash equal and any difference
    changes all later keys. Feeding it as a sequence grows costs O(new tokens), not O(length). `salt`: a secret of
    the router instance, so nobody else can compute (and replace or drop) the keys it saves on the workers.
    `scope`: whom the prefixes are shared with (router/prefix_scope.py: a digest of the API key, cache_salt,
    prompt_cache_key; b"" shared by all): the same tokens in two scopes give unrelated keys, so one scope never
    hits — nor times — another's prefixes."""

    def __init__(self, chunk: int, salt: bytes = b"", scope: bytes = b""):
        self.chunk = chunk
        self.length = 0
        self._h = hashlib.sha256(b"expertmesh-prefix-v1" + salt)
        if scope:
            self._h.update(b"\0scope\0" + scope)

    def copy(self) -> PrefixHasher:
        """An independent chain in the same state (the scheduler plans with copies; the engine keeps the one sent)."""
        other = PrefixHasher.__new__(PrefixHasher)
        other.chunk, other.length, other._h = self.chunk, self.length, self._h.copy()
        return other

    def advance(self, tokens: list[int], upto: int) -> str:
        """The key of tokens[:upto] (`upto` a multiple of the chunk, ≥ what was hashed so far)."""
        for end in range(self.length + self.chunk, upto + 1, self.chunk):
            self._h.update(b"".join(t.to_bytes(4, "little") for t in tokens[end - self.chunk : end]))
            self.length = end
        return self._h.hexdigest()[:32]


def prefix_hashes(tokens: list[int], chunk: int, salt: bytes = b"", scope: bytes = b"") -> list[tuple[int, str]]:
    """(length, key of tokens[:length]) for every multiple of `chunk` ≤ len(tokens), shortest first."""
    hasher = PrefixHasher(chunk, salt, scope)
    return [(end, hasher.advance(tokens, end)) for end in range(chunk, len(tokens) + 1, chunk)]


@dataclass
class WorkerKV:
    index: int
    block_size: int
    total_blocks: int
    free_blocks: int
    sequences: int = 0


class KVManager:
    """Its per-worker counts change only through the named operations below (`add_worker`, `report`, `opened`,
    `released`, `promise`, `withdraw`, `lost`): the engine and the health watch say what happened, not what to
    write."""

    def __init__(
        self,
        workers: list[WorkerKV] | None,
        chunk: int,
        max_prefixes_per_worker: int = 256,
        salt: bytes = b"",
        *,
        store: bool = False,
    ):
        """`workers`: known now, or none until each is added (`add_worker`, once it answered: Engine.start).
        `store`: the attention workers share a cluster store and write every prefix they save through to it
        (worker/kv_store.py), so a saved prefix is in the store from the start — no listing needed to learn it,
        and a worker that dies right after saving loses it from nobody's view."""
        self.workers: list[WorkerKV] = []
        self.chunk = chunk
        self.salt = salt
        self.max_prefixes = max_prefixes_per_worker
        # key → worker index, in LRU order (oldest first)
        self.prefixes: OrderedDict[str, int] = OrderedDict()
        self.prefix_len: dict[str, int] = {}
        self.lower: set[str] = set()  # keys held below their worker's device pool (host / disk)
        self.parent: dict[str, str] = {}  # key → the cached shorter prefix of the same conversation it extends
        # keys at a turn's prompt end (the last chunk boundary before it): what a resent prompt — a retry, a
        # regenerate, a second sample — hits; a longer prefix cannot serve it (KDA state is never cut back)
        self.prompt_ends: set[str] = set()
        # keys held in the deployment's cluster store (worker/kv_store.py): any attention worker restores them, so
        # they outlive their worker and a turn placed elsewhere still hits
        self.cluster: set[str] = set()
        self.store = store
        self.user: dict[str, object] = {}  # key → the request that last saved or hit it (its session state)
        for w in workers or ():
            self.add_worker(w)

    # ------------------------------------------------------------------ per-worker counts
    def add_worker(self, worker: WorkerKV) -> None:
        """A worker as its first answer describes it (block size, total and free blocks); workers join in order."""
        if self.chunk % worker.block_size:
            raise ValueError(f"prefill chunk {self.chunk} must be a multiple of every worker's KV block size")
        if worker.index != len(self.workers):
            raise ValueError(f"worker {worker.index} added as number {len(self.workers)}")
        self.workers.append(worker)

    def report(self, worker: int, free_blocks: int) -> None:
        """The worker's own count of its free blocks (every call that changes them answers it)."""
        self.workers[worker].free_blocks = free_blocks

    def opened(self, worker: int) -> None:
        """A sequence of this router now lives on `worker` (its blocks: the `report` that follows)."""
        self.workers[worker].sequences += 1

    def released(self, worker: int) -> None:
        """A sequence left `worker` (closed, preempted, recovered or handed off)."""
        self.workers[worker].sequences -= 1

    def promise(self, worker: int, blocks: int) -> None:
        """A hand-off on its way to `worker`: its blocks count as taken and its sequence as there (later choices see
        them) until it lands (the promise then holds) or is withdrawn."""
        self.workers[worker].free_blocks -= blocks
        self.workers[worker].sequences += 1

    def withdraw(self, worker: int, blocks: int) -> None:
        """A promised hand-off that did not land: what `promise` took is given back."""
        self.workers[worker].sequences -= 1
        self.workers[worker].free_blocks += blocks

    def lost(self, worker: int) -> None:
        """`worker` is down: its prefixes are forgotten — but those in the cluster store, which another worker
        restores — and no block of it is offered until it reports again."""
        for key in self.eviction_candidates(worker):
            if key in self.cluster:
                self.lower.add(key)
            else:
                self.forget(key)
        self.workers[worker].free_blocks = 0

    def prefixes_of(self, worker: int) -> set[str]:
        """The keys the index places on `worker` (a copy: another thread may record while this one reads)."""
        return {k for k, w in list(self.prefixes.items()) if w == worker}

    def blocks_for(self, worker: int, tokens: int, cached: int = 0) -> int:
        bs = self.workers[worker].block_size
        return -(-tokens // bs) - cached // bs

    def hasher(self, scope: bytes = b"") -> PrefixHasher:
        """A new hash chain of this router's keys within `scope` (PrefixHasher)."""
        return PrefixHasher(self.chunk, self.salt, scope)

    def prefix_keys(self, tokens: list[int], scope: bytes = b"") -> list[tuple[int, str]]:
        """(length, key) of every chunk-multiple prefix of `tokens` within `scope`, as this router keys them."""
        return prefix_hashes(tokens, self.chunk, self.salt, scope)

    def find_prefix(
        self, tokens: list[int], scope: bytes = b"", keys: list[tuple[int, str]] | None = None
    ) -> tuple[int, str, int] | None:
        """The longest saved prefix of `tokens` within `scope` that leaves at least one token to compute:
        (worker, key, length), or None. Reads only: `touch` marks it used. `keys`: prefix_keys(tokens, scope)
        when the caller kept them (hashing an 8K prompt costs milliseconds; a waiting one is placed every pass)."""
        best = None
        for length, key in keys if keys is not None else self.prefix_keys(tokens, scope):
            if length >= len(tokens):
                break
            if key in self.prefixes:
                best = (self.prefixes[key], key, length)
        return best

    def touch(self, key: str, user: object | None = None) -> None:
        """Mark a saved prefix as the most recently used (evicted last); `user`: the request now using it."""
        if key in self.prefixes:
            self.prefixes.move_to_end(key)
            if user is not None:
                self.user[key] = user

    def eviction_candidates(self, worker: int) -> list[str]:
        """Saved prefixes on `worker` (any tier), least recently used first."""
        return [k for k, w in self.prefixes.items() if w == worker]

    def record_prefix(
        self,
        worker: int,
        key: str,
        length: int,
        *,
        parent: str | None = None,
        user: object | None = None,
        tier: str = "device",
        prompt_end: bool = False,
    ) -> list[str]:
        """Note a saved prefix (extending cached prefix `parent`, saved by request `user`; `prompt_end`: at its
        turn's prompt end, kept for a resent prompt); returns the keys to take off the device to stay within the
        per-worker cap of device prefixes, victims first."""
        if prompt_end:
            self.prompt_ends.add(key)
        self.prefixes[key] = worker
        self.prefix_len[key] = length
        self.prefixes.move_to_end(key)
        if parent is not None and parent != key:
            self.parent[key] = parent
        if user is not None:
            self.user[key] = user
        if tier == "device":
            self.lower.discard(key)
        else:
            self.lower.add(key)
        if self.store:  # written through when saved; a put that was not made is a miss there, then a recompute
            self.cluster.add(key)
        over = len(self.on_device(worker)) - self.max_prefixes
        return self.victims(worker)[: max(0, over)]

    def on_device(self, worker: int) -> list[str]:
        return [k for k, w in list(self.prefixes.items()) if w == worker and k not in self.lower]

    def is_lower(self, key: str) -> bool:
        """Held below the device pool of its worker: a hit copies it back (restore) before the sequence opens."""
        return key in self.lower

    def demoted(self, key: str) -> None:
        if key in self.prefixes:
            self.lower.add(key)

    def restored(self, key: str, worker: int | None = None) -> None:
        """A hit on `key` opened on `worker`: on that worker's device now (a cluster key restored by another
        worker than the one that saved it moves there)."""
        self.lower.discard(key)
        if worker is not None and key in self.prefixes:
            self.prefixes[key] = worker

    def stored(self, key: str) -> None:
        """`key` reached the cluster store (demoted by a worker that has one)."""
        if key in self.prefixes:
            self.cluster.add(key)

    def in_cluster(self, key: str) -> bool:
        return key in self.cluster

    def mark_prompt_end(self, key: str) -> None:
        """A cached prefix is (also) a turn's prompt end: kept for a resent prompt, never dropped as superseded."""
        if key in self.prefixes:
            self.prompt_ends.add(key)

    def superseded(self, key: str) -> bool:
        """A longer cached prefix of the same conversation exists (it holds all of this one) and this one is no
        turn's prompt end: only the granules between a prompt end and the next are."""
        return key in self._superseded()

    def _superseded(self) -> set[str]:
        return set(self.parent.values()) - self.prompt_ends

    def victims(self, worker: int, last: tuple[str, ...] | list[str] = ()) -> list[str]:
        """`worker`'s device prefixes in eviction order (router/eviction.py), the keys of `last` (used by the
        plan being made) after all others, in that order."""
        # copies first (list() of a dict runs without a thread switch): the health thread records the prefixes of
        # a worker it takes back while the scheduler plans
        supers = self._superseded()
        order = {k: i for i, k in enumerate(list(self.prefixes))}
        infos = [
            PrefixInfo(k, self.prefix_len.get(k, 0), order.get(k, len(order)), k in supers, self._session(k))
            for k in self.on_device(worker)
            if k not in last
        ]
        return [v.key for v in eviction_order(infos)] + [
            k for k in last if k not in self.lower and self.prefixes.get(k) == worker
        ]

    def _session(self, key: str) -> str:
        req = self.user.get(key)
        if req is None:
            return ANSWERED
        return session_state(
            done=req.done,
            awaiting_tool=req.awaiting_tool,
            tools_offered=req.tools_offered,
            continued=req.cached_tokens > 0,
        )

    def forget(self, key: str) -> None:
        self.prefixes.pop(key, None)
        self.prefix_len.pop(key, None)
        self.lower.discard(key)
        self.user.pop(key, None)
        self.prompt_ends.discard(key)
        self.cluster.discard(key)
        up = self.parent.pop(key, None)
        for k, p in list(self.parent.items()):  # its longer prefixes now extend its own parent
            if p == key:
                if up is None:
                    del self.parent[k]
                else:
                    self.parent[k] = up

    def learn(self, worker: int, listing: list[tuple[str, int, str]], known: set[str] | None = None) -> None:
        """Merge what `worker` says it holds (its ListPrefixes: (key, length, tier)) into the index: keys new here
        are recorded (saved by another router replica sharing this one's salt, or before this router was there),
        keys of this worker change tier as it says, and those of `known` — this worker's keys in the index when the
        listing was asked for — that it no longer lists are forgotten (another replica dropped them), but for keys
        in the cluster store (a restarted worker no longer lists what it put there; the store still holds it)."""
        listed = set()
        for key, length, tier in listing:  # a key in the cluster store is listed twice: its local tier, "store"
            listed.add(key)
            if key not in self.prefixes:
                self.record_prefix(worker, key, length, tier=tier)
            elif self.prefixes[key] == worker and tier != "store":
                if tier == "device":
                    self.lower.discard(key)
                else:
                    self.lower.add(key)
            if tier == "store":
                self.cluster.add(key)
        for key in (known or set()) - listed:
            if self.prefixes.get(key) == worker and key not in self.cluster:
                self.forget(key)

    def has(self, key: str) -> bool:
        return key in self.prefixes
