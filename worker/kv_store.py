"""The cluster tier of the attention workers' prefix cache: Mooncake's distributed store, below host and disk.

Every attention worker of a deployment is a client of one store (`mooncake_master` holds the objects' metadata, a
store process — `mooncake_client`, started beside it — holds their memory, so a worker that dies loses nothing it
put): a prefix demoted off a worker's device is also put there, in the format the disk tier writes
(expertmesh/wire/kv_snapshot.py), and any worker restores it by key. So a session whose next turn lands on another
worker (its own is gone, full, or placement chose another) starts from its prefix instead of cold.

Keys. The object key is a hash of the deployment's name and the router's prefix key — itself a hash chain salted
with the router's secret and the request's tenant scope (router/kv.py, router/prefix_scope.py) — so two deployments
sharing a store never meet, no tenant can name another's prefix, and the store sees no tokens. Each object carries
an HMAC-SHA256 under the deployment's store secret (`--kv-store-key-file`) over header and payload, and the header
names the model + layout and the prefix key: an object that fails a check (corrupt, forged, another deployment's or
model's) is removed, counted (`rejected`) and never served.

Bounded. This worker's puts are kept within `capacity_bytes` (its oldest removed first); the store's own memory
(the store process's segment) is bounded too, the master evicting least recently used objects when it fills.

Faults. Every call is guarded: a store that fails (the master down or restarting) is skipped for `retry_after_s`
— puts are not made, gets miss — and the worker serves from its local tiers meanwhile; once the master answers
again (the Mooncake client reconnects by itself) puts and gets resume. Nothing here can fail a step or a restore:
a miss is a recompute.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from expertmesh.wire.kv_snapshot import CorruptFile, PrefixSnapshot, SnapshotLayout, decode, encode

log = logging.getLogger("expertmesh.worker")

FLAG = "--kv-store-master"
KEY_LABEL = b"expertmesh kv store mac v1"
OBJECT_PREFIX = "expertmesh-kv/"


def unreachable(code) -> bool:
    """A Mooncake call's answer saying the master could not be reached (RPC failures: -900 and below), not that
    the store refused (full: -200, a lease: -706, ...); an exception's text counts as unreachable."""
    return not isinstance(code, int) or code <= -900


def store_mac_key(secret: bytes) -> bytes:
    """The store objects' MAC key, derived from the deployment's store secret (a label keeps it apart from any
    other use of the same secret)."""
    return hmac.new(secret, KEY_LABEL, hashlib.sha256).digest()


def object_key(deployment: str, key: str) -> str:
    """The store's name for prefix `key` of `deployment`: a hash of both (no collision across deployments, no
    prefix key or deployment name in the store's listing)."""
    digest = hashlib.sha256(b"expertmesh kv store v1\0" + deployment.encode() + b"\0" + key.encode()).hexdigest()
    return OBJECT_PREFIX + digest


@dataclass
class StoreStats:
    """The cluster tier's counters since the worker started (TierStats' fields, and the store's own)."""

    capacity_bytes: int
    used_bytes: int = 0  # bytes of this worker's puts still held
    entries: int = 0
    demotions: int = 0  # prefixes put
    restores: int = 0  # prefixes got and served (hits)
    restore_bytes: int = 0
    restore_seconds: float = 0.0
    dropped: int = 0  # this worker's puts it removed to stay within its bound
    rejected: int = 0  # objects refused unserved: corrupt, forged, another deployment's or model's
    put_bytes: int = 0
    put_seconds: float = 0.0
    misses: int = 0  # gets of a key the store did not hold (or while it was unavailable)
    failures: int = 0  # calls that failed (the master down or restarting)


def connect_mooncake(master: str, metadata: str, local_hostname: str, local_buffer_bytes: int = 64 << 20):
    """A Mooncake store client over TCP that contributes no memory (the store process holds it): its `setup`
    answer checked. RuntimeError naming --kv-store-master when the master cannot be reached."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup(local_hostname, metadata, 0, local_buffer_bytes, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"{FLAG} {master}: the Mooncake store did not set up (code {rc}; metadata {metadata})")
    return client


class ClusterStore:
    """This worker's view of the cluster tier. `client`: a connected Mooncake store (connect_mooncake), or None
    until `connect` succeeds (the master may start after the worker); `connect`: how to (re)connect."""

    def __init__(
        self,
        *,
        deployment: str,
        secret: bytes,
        identity: str,
        layout: SnapshotLayout | None,
        capacity_bytes: int,
        client=None,
        connect=None,
        retry_after_s: float = 2.0,
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"kv store bound {capacity_bytes} bytes: expected > 0")
        self.deployment, self.identity, self.layout = deployment, identity, layout
        self._mac_key = store_mac_key(secret)
        self.client, self._connect = client, connect
        self.retry_after_s = retry_after_s
        self.stats = StoreStats(capacity_bytes)
        self.puts: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key → (length, bytes), oldest first
        self._down_until = 0.0
        self._staged: dict[str, PrefixSnapshot] = {}  # got for `length_of`, served by the `load` that follows
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ availability
    def available(self) -> bool:
        """False while a recent call failed (for `retry_after_s`); connects lazily when there is no client yet."""
        if time.monotonic() < self._down_until:
            return False
        if self.client is None and self._connect is not None:
            try:
                self.client = self._connect()
            except Exception as e:  # not there yet: local tiers only, try again later
                self._failed(f"connect: {e}")
                return False
        return self.client is not None

    def _failed(self, why: str) -> None:
        self.stats.failures += 1
        self._down_until = time.monotonic() + self.retry_after_s
        log.warning("KV store unavailable (%s); local tiers only for %.0f s", why, self.retry_after_s)

    # ------------------------------------------------------------------ put / get
    def put(self, key: str, snap: PrefixSnapshot) -> bool:
        """Put a demoted prefix (host tensors) in the store; False when it is unavailable or refuses it."""
        with self.lock:
            if not self.available():
                return False
            data = encode(key, self.identity, snap, self._mac_key)
            if len(data) > self.stats.capacity_bytes:
                return False
            start = time.perf_counter()
            try:  # upsert: an object left under this name (another worker's, a torn one) is replaced
                rc = self.client.upsert(object_key(self.deployment, key), data)
            except Exception as e:
                rc = str(e)
            if rc != 0:
                if unreachable(rc):
                    self._failed(f"put: {rc}")
                else:  # full (the master evicts as it fills) or refused: this prefix stays local
                    log.debug("KV store: put of %s refused (code %s)", key, rc)
                return False
            self.stats.put_seconds += time.perf_counter() - start
            self.stats.put_bytes += len(data)
            self.stats.demotions += 1
            self._forget_put(key)
            self.puts[key] = (snap.length, len(data))
            self.stats.used_bytes += len(data)
            self.stats.entries += 1
            while self.stats.used_bytes > self.stats.capacity_bytes and self.puts:
                old = next(iter(self.puts))
                self._remove(old)
                self.stats.dropped += 1
            return True

    def get(self, key: str) -> PrefixSnapshot | None:
        """The snapshot of `key` (checked: header, model + layout, the MAC) or None when the store does not hold
        it or is unavailable; CorruptFile when the object fails a check (removed and counted, never served)."""
        with self.lock:
            staged = self._staged.pop(key, None)
            if staged is not None:
                return staged
            if not self.available():
                self.stats.misses += 1
                return None
            name = object_key(self.deployment, key)
            try:  # a get answers b"" both for a miss and an unreachable master: ask which first
                held = self.client.is_exist(name)
                data = self.client.get(name) if held == 1 else b""
            except Exception as e:
                held = str(e)
            if held not in (0, 1):
                self._failed(f"get: {held}")
                self.stats.misses += 1
                return None
            if not data:
                self.stats.misses += 1
                self._forget_put(key)
                return None
            try:
                if len(data) > self.stats.capacity_bytes:
                    raise CorruptFile(f"{len(data)} bytes, more than the tier's bound of {self.stats.capacity_bytes}")
                snap = decode(bytes(data), key=key, identity=self.identity, mac_key=self._mac_key, layout=self.layout)
            except CorruptFile as e:
                self.stats.rejected += 1
                self._remove(key, name)
                raise CorruptFile(f"store object {name}: {e}") from None
            return snap  # its restore is counted by the tiers (KVTiers.restored)

    def stage(self, key: str) -> int | None:
        """The length of `key` when the store holds it (read now and kept for the `get` that follows: a restore
        asks for the length first); None on a miss or a refused object."""
        if key in self._staged:
            return self._staged[key].length
        try:
            snap = self.get(key)
        except CorruptFile as e:
            log.warning("prefix %s: %s; not served", key, e)
            return None
        if snap is None:
            return None
        with self.lock:
            self._staged = {key: snap}  # one at a time: the restore in progress
        return snap.length

    def length_of(self, key: str) -> int | None:
        """Tokens of `key` when this worker put it (no store call)."""
        held = self.puts.get(key)
        return None if held is None else held[0]

    def keys(self) -> list[tuple[str, int]]:
        """(key, length) of this worker's puts still counted as held."""
        return [(k, length) for k, (length, _) in list(self.puts.items())]

    def discard(self, key: str) -> None:
        """Remove `key` from the store when this worker put it (the router dropped it)."""
        with self.lock:
            self._staged.pop(key, None)
            if key in self.puts:
                self._remove(key)

    def _remove(self, key: str, name: str | None = None) -> None:
        self._forget_put(key)
        if self.client is not None and time.monotonic() >= self._down_until:
            try:
                self.client.remove(name or object_key(self.deployment, key))
            except Exception:  # gone already, or the store is down: the master evicts it in time
                pass

    def _forget_put(self, key: str) -> None:
        held = self.puts.pop(key, None)
        if held is not None:
            self.stats.used_bytes -= held[1]
            self.stats.entries -= 1

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass


def attach_cluster_store(
    worker,
    *,
    master: str,
    metadata: str,
    deployment: str,
    secret: bytes,
    capacity_bytes: int,
    local_hostname: str = "127.0.0.1",
) -> ClusterStore:
    """Give attention worker `worker` the cluster tier below its own (`worker.tiers`, worker/kv_tiers.py): a
    ClusterStore checked against its model and layout, connected to `master` now or, when the master is not up
    yet, on first use."""

    def connect():
        return connect_mooncake(master, metadata, local_hostname)

    store = ClusterStore(
        deployment=deployment,
        secret=secret,
        identity=worker.tiers.identity,
        layout=worker.tiers.layout,
        capacity_bytes=capacity_bytes,
        connect=connect,
    )
    store.available()  # connect now when the master is there (else: the first put or get tries again)
    worker.tiers.attach_store(store)
    return store
