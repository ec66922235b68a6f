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

Write-through. A prefix is put when the worker saves it (worker/attention.py), not only when it is demoted: so
a worker killed mid-run loses no prefix whose put was made. The put runs on the store's own thread, never the
step's: the step copies the snapshot to host and queues it (at most `max_queued` waiting; when full, the put is
left out and counted); a demotion of a prefix already put makes no second put.

Faults. Every client call runs on that thread with a deadline the caller waits no longer than (200 ms for a
lookup; with the master down, a Mooncake call blocks for seconds): a call that fails or passes its deadline is a
miss, and the store is skipped for `retry_after_s` — puts are not made, gets miss — while the worker serves from
its local tiers; once the master answers again (the Mooncake client reconnects by itself; a restarted master
starts empty) puts and gets resume. Nothing here can fail or stall a step or a restore: a miss is a recompute.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
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
    gets: int = 0  # objects read from the store
    get_bytes: int = 0
    get_seconds: float = 0.0
    misses: int = 0  # gets of a key the store did not hold (or while it was unavailable)
    failures: int = 0  # calls that failed or ran past their deadline (the master down or restarting)
    puts_not_made: int = 0  # write-through puts left out: the queue full or the store unavailable


class StoreTimeout(Exception):
    """A store call that did not answer within its deadline (or could not start: the calls thread is stuck)."""


class StoreCalls:
    """Every call into the Mooncake client runs on this one thread, so no caller waits past its deadline: with the
    master down a client call blocks for seconds (about 4.3 s each here) — a step must never. `call` waits at most
    `timeout` (StoreTimeout after, the call left running); `later` queues work the caller does not wait for (the
    write-through puts), at most `max_queued` of it (False when full); urgent calls go before queued work."""

    def __init__(self, name: str, max_queued: int):
        self.max_queued = max_queued
        self._cv = threading.Condition()
        self._urgent: deque = deque()
        self._later: deque = deque()
        self._running_since: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def call(self, fn, timeout: float):
        with self._cv:
            if self._closed:
                raise StoreTimeout("closed")
            busy = self._running_since is not None and time.monotonic() - self._running_since
            if busy and busy > timeout:  # stuck in an earlier call: waiting behind it would pass the deadline
                raise StoreTimeout(f"an earlier call has been running for {busy:.1f} s")
            future: Future = Future()
            self._urgent.append((fn, future))
            self._cv.notify_all()
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()  # not started: never runs; running: its answer is ignored
            raise StoreTimeout(f"no answer within {timeout * 1000:.0f} ms") from None

    def later(self, fn, *, bounded: bool = True) -> bool:
        with self._cv:
            if self._closed or (bounded and len(self._later) >= self.max_queued):
                return False
            self._later.append(fn)
            self._cv.notify_all()
            return True

    def queued(self) -> int:
        return len(self._later)

    def idle(self, timeout: float) -> bool:
        """Wait (at most `timeout`) until every queued call has run; True when they all have."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._urgent or self._later or self._running_since is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float, last=None) -> None:
        """Stop taking calls, drop the queued ones, run `last` (if any) and end the thread, waiting at most
        `timeout`."""
        with self._cv:
            self._closed = True
            self._later.clear()
            if last is not None:
                self._later.append(last)
            self._cv.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._urgent or self._later or self._closed):
                    self._cv.wait()
                if self._urgent:
                    fn, future = self._urgent.popleft()
                    if not future.set_running_or_notify_cancel():
                        continue
                elif self._later:
                    fn, future = self._later.popleft(), None
                else:
                    return
                self._running_since = time.monotonic()
            try:
                result, error = fn(), None
            except Exception as e:
                result, error = None, e
            with self._cv:
                self._running_since = None
                self._cv.notify_all()
            if future is not None:
                future.set_exception(error) if error is not None else future.set_result(result)
            elif error is not None:
                log.warning("KV store: a queued call failed: %s", error)


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
    until `connect` succeeds (the master may start after the worker); `connect`: how to (re)connect.

    Deadlines: every client call runs on the store's own thread (StoreCalls); a caller waits `call_timeout_s` for
    a lookup (get_size), that plus the object's size at `min_bytes_per_s` for a get, `put_timeout_s` for a put it
    waits on. A call past its deadline is a miss (or a put not made) and skips the store for `retry_after_s`, as a
    failed one does. Write-through puts (`put_later`) run on that thread, at most `max_queued` waiting."""

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
        call_timeout_s: float = 0.2,
        put_timeout_s: float = 2.0,
        min_bytes_per_s: float = 100e6,
        max_queued: int = 64,
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"kv store bound {capacity_bytes} bytes: expected > 0")
        self.deployment, self.identity, self.layout = deployment, identity, layout
        self._mac_key = store_mac_key(secret)
        self.client, self._connect = client, connect
        self.retry_after_s, self.call_timeout_s, self.put_timeout_s = retry_after_s, call_timeout_s, put_timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        self.stats = StoreStats(capacity_bytes)
        self.puts: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key → (length, bytes), oldest first
        self.pending: dict[str, int] = {}  # key → length: write-through puts queued, not made yet
        self._down_until = 0.0
        self._connecting = False
        self._staged: dict[str, PrefixSnapshot] = {}  # got for `length_of`, served by the `load` that follows
        self.lock = threading.Lock()  # the bookkeeping only: never held across a client call
        self.calls = StoreCalls("kv-store-calls", max_queued)

    # ------------------------------------------------------------------ availability
    def available(self) -> bool:
        """False while a recent call failed (for `retry_after_s`), or while there is no client yet (a connect is
        then queued: the master may come up after the worker)."""
        if time.monotonic() < self._down_until:
            return False
        if self.client is None:
            if self._connect is not None and not self._connecting:
                self._connecting = True
                self.calls.later(self._connect_now, bounded=False)
            return False
        return True

    def connect(self, timeout: float) -> bool:
        """Connect now (at the worker's start), waiting at most `timeout`; False when not connected yet."""
        if self.client is None and self._connect is not None:
            self._connecting = True
            try:
                self.calls.call(self._connect_now, timeout)
            except StoreTimeout as e:
                self._failed(f"connect: {e}")
        return self.client is not None

    def _connect_now(self) -> None:  # on the calls thread
        try:
            if self.client is None:
                self.client = self._connect()
        except Exception as e:  # not there yet: local tiers only, try again later
            self._failed(f"connect: {e}")
        finally:
            self._connecting = False

    def _failed(self, why: str) -> None:
        self.stats.failures += 1
        self._down_until = time.monotonic() + self.retry_after_s
        log.warning("KV store unavailable (%s); local tiers only for %.0f s", why, self.retry_after_s)

    def _call(self, fn, timeout: float, what: str):
        """`fn()` on the calls thread within `timeout`; None (the store marked down) past it."""
        try:
            return self.calls.call(fn, timeout)
        except Exception as e:  # StoreTimeout, or the client raised
            self._failed(f"{what}: {e}")
            return None

    def _again_if_stale(self, fn):  # on the calls thread
        """`fn()`, made once more when it failed at once as unreachable: the client's first call after the master
        restarted fails on its old connection (a dead master makes a call block for seconds instead)."""
        start = time.monotonic()
        rc = fn()
        if isinstance(rc, int) and unreachable(rc) and time.monotonic() - start < self.call_timeout_s / 2:
            rc = fn()
        return rc

    # ------------------------------------------------------------------ put
    def put_later(self, key: str, snap: PrefixSnapshot) -> bool:
        """Queue a put of `key` (write-through: the caller — a step — does not wait); True when queued or held
        already, False when left out (the queue full, the store unavailable; counted in `puts_not_made`)."""
        with self.lock:
            if key in self.puts or key in self.pending:
                return True
            if not self.accepts_put():
                self.stats.puts_not_made += 1
                return False
            self.pending[key] = snap.length
        if not self.calls.later(lambda: self._put_queued(key, snap)):
            with self.lock:
                self.pending.pop(key, None)
                self.stats.puts_not_made += 1
            return False
        return True

    def accepts_put(self) -> bool:
        """Whether a write-through put would be queued now (so a caller can skip copying the snapshot)."""
        return self.available() and self.calls.queued() < self.calls.max_queued

    def _put_queued(self, key: str, snap: PrefixSnapshot) -> None:  # on the calls thread
        if key not in self.pending:  # discarded while queued
            return
        made = self._put_now(key, snap)  # still pending meanwhile: a demotion of it makes no second put
        with self.lock:
            discarded = self.pending.pop(key, None) is None
            self.stats.puts_not_made += not made
        if made and discarded:  # the router dropped it while the put was made
            self.discard(key)

    def put(self, key: str, snap: PrefixSnapshot) -> bool:
        """Put a prefix (host tensors) in the store now, waiting at most `put_timeout_s`; False when it is
        unavailable, refuses it or does not answer in time."""
        return bool(self._call(lambda: self._put_now(key, snap), self.put_timeout_s, "put"))

    def _put_now(self, key: str, snap: PrefixSnapshot) -> bool:  # on the calls thread
        if not self.available():
            return False
        data = encode(key, self.identity, snap, self._mac_key)
        if len(data) > self.stats.capacity_bytes:
            return False
        start = time.perf_counter()
        name = object_key(self.deployment, key)
        try:  # upsert: an object left under this name (another worker's, a torn one) is replaced
            rc = self._again_if_stale(lambda: self.client.upsert(name, data))
        except Exception as e:
            rc = str(e)
        seconds = time.perf_counter() - start
        if rc != 0:
            if unreachable(rc):
                self._failed(f"put: {rc}")
            else:  # full (the master evicts as it fills) or refused: this prefix stays local
                log.info("KV store: put of %s refused (code %s)", key, rc)
            return False
        if seconds > self.put_timeout_s:  # made, but the store is too slow to be waited on now
            self._failed(f"put: {seconds:.1f} s")
        with self.lock:
            self.stats.put_seconds += seconds
            self.stats.put_bytes += len(data)
            self.stats.demotions += 1
            self._forget_put(key)
            self.puts[key] = (snap.length, len(data))
            self.stats.used_bytes += len(data)
            self.stats.entries += 1
            over = []
            while self.stats.used_bytes > self.stats.capacity_bytes and self.puts:
                over.append(next(iter(self.puts)))
                self._forget_put(over[-1])
                self.stats.dropped += 1
        for old in over:
            self._remove_now(object_key(self.deployment, old))
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queued puts have run (tests, a worker stopping); True when they all have."""
        return self.calls.idle(timeout)

    # ------------------------------------------------------------------ get
    def get(self, key: str) -> PrefixSnapshot | None:
        """The snapshot of `key` (checked: header, model + layout, the MAC) or None when the store does not hold
        it, is unavailable or does not answer in time; CorruptFile when the object fails a check (removed and
        counted, never served)."""
        with self.lock:
            staged = self._staged.pop(key, None)
        if staged is not None:
            return staged
        if not self.available():
            return self._missed(key, forget=False)
        name = object_key(self.deployment, key)
        start = time.perf_counter()
        size = self._call(
            lambda: self._again_if_stale(lambda: self.client.get_size(name)), self.call_timeout_s, "get_size"
        )
        if size is None:
            return self._missed(key, forget=False)
        if not isinstance(size, int) or size <= 0:  # -704: not held (evicted, never put); <= -900: unreachable
            if unreachable(size):
                self._failed(f"get_size: {size}")
            return self._missed(key, forget=not unreachable(size))
        if size > self.stats.capacity_bytes:
            self._refuse(key, name)
            raise CorruptFile(f"store object {name}: {size} bytes, more than the tier's bound")
        data = self._call(lambda: self.client.get(name), self.call_timeout_s + size / self.min_bytes_per_s, "get")
        if data is None:
            return self._missed(key, forget=False)
        if not data:  # gone between the two calls
            return self._missed(key, forget=True)
        try:
            snap = decode(bytes(data), key=key, identity=self.identity, mac_key=self._mac_key, layout=self.layout)
        except CorruptFile as e:
            self._refuse(key, name)
            raise CorruptFile(f"store object {name}: {e}") from None
        with self.lock:
            self.stats.gets += 1
            self.stats.get_bytes += len(data)
            self.stats.get_seconds += time.perf_counter() - start
        return snap  # its restore is counted by the tiers (KVTiers.restored)

    def _missed(self, key: str, *, forget: bool) -> None:
        with self.lock:
            self.stats.misses += 1
            if forget:
                self._forget_put(key)
        return None

    def _refuse(self, key: str, name: str) -> None:
        with self.lock:
            self.stats.rejected += 1
        self._remove(key, name)

    def stage(self, key: str) -> int | None:
        """The length of `key` when the store holds it (read now and kept for the `get` that follows: a restore
        asks for the length first); None on a miss or a refused object."""
        with self.lock:
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
        """Tokens of `key` when this worker put it or queued its put (no store call)."""
        held = self.puts.get(key)
        return held[0] if held is not None else self.pending.get(key)

    def keys(self) -> list[tuple[str, int]]:
        """(key, length) of this worker's puts still counted as held (made, not only queued)."""
        return [(k, length) for k, (length, _) in list(self.puts.items())]

    def discard(self, key: str) -> None:
        """Remove `key` from the store when this worker put it (the router dropped it); a queued put is not made."""
        with self.lock:
            self._staged.pop(key, None)
            self.pending.pop(key, None)
            held = key in self.puts
        if held:
            self._remove(key)

    def _remove(self, key: str, name: str | None = None) -> None:
        """Forget `key` here and remove its object (queued: the caller does not wait; a store that is down
        evicts it in time)."""
        with self.lock:
            self._forget_put(key)
        name = name or object_key(self.deployment, key)
        self.calls.later(lambda: self._remove_now(name), bounded=False)

    def _remove_now(self, name: str) -> None:  # on the calls thread
        if self.client is not None and time.monotonic() >= self._down_until:
            try:
                self.client.remove(name)
            except Exception:  # gone already, or the store is down: the master evicts it in time
                pass

    def _forget_put(self, key: str) -> None:  # under self.lock
        held = self.puts.pop(key, None)
        if held is not None:
            self.stats.used_bytes -= held[1]
            self.stats.entries -= 1

    def close(self, timeout: float = 2.0) -> None:
        """Stop the calls thread (queued puts not made) and close the client, waiting at most `timeout`."""
        client, self.client = self.client, None
        self.calls.close(timeout, last=client.close if client is not None else None)


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
    store.connect(timeout=10.0)  # now when the master is there (else: queued again on first use)
    worker.tiers.attach_store(store)
    return store
