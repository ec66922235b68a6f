"""The lower tiers of an attention worker's prefix cache: host memory, then local disk, each with a hard byte bound.

A prefix the router asks to demote leaves the device pool as a `PrefixSnapshot` — tokens [0, length) of every
latent-KV layer (MLA/DSA latent entries and DSA indexer keys) and the KDA recurrent + conv state at `length` — and
comes back bit-identical: the tensors are copied, never recomputed or converted. A tier that is full pushes its
oldest entries down (host → disk → dropped); the keys finally dropped are reported so the router's index stays true.
The order inside a tier is the order the router demoted in, which follows its session-aware policy
(router/eviction.py): the least valuable prefix entered first and leaves first.

Disk files (one per prefix, `<sha256(key)[:40]>.kv`, in expertmesh/wire/kv_snapshot.py's format, the worker's
`identity` being model config + dtype + block size), written to a temporary name then renamed (a crash leaves no
half file under the real name). Each file carries an HMAC-SHA256 of its header and payload under the tier's key:
`disk_key` (the deployment's secret, `--kv-disk-key-file`: files outlive the worker), or else a random key of this
process — files an earlier process wrote are then refused, which costs their cache, never correctness. Whoever can
write the folder cannot make the model read what they wrote.

No file can stop the worker or make it read without bound: the folder must be this user's, not a link, and writable
by no one else (else ValueError naming --kv-disk-dir); files are opened only when regular (lstat, then O_NOFOLLOW
and a non-blocking open checked with fstat: no FIFO, device or link is read), never larger than the tier's bound,
header first (bounded, checked against the payload's size and the model's `layout` before anything is allocated),
then the tag. A file that fails any check is deleted and counted (`rejected`), never served. On CUDA the host tier
holds pinned memory and the copies are non-blocking (synchronised before use); on CPU the same path copies ordinary
tensors.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from expertmesh.wire.kv_snapshot import (
    PREAMBLE_BYTES,
    TAG_BYTES,
    CorruptFile,
    FileHeader,
    PrefixSnapshot,
    SnapshotLayout,
    check_header,
    check_tag,
    decode,
    encode,
    header_length,
    new_mac,
    read_header,
)

if TYPE_CHECKING:
    from expertmesh.worker.kv_store import ClusterStore

log = logging.getLogger("expertmesh.worker")

FLAG = "--kv-disk-dir"
READ_PIECE = 1 << 20  # the scan checks a file's tag reading this much at a time
_PROCESS_KEY = secrets.token_bytes(32)  # the disk tier's key when the deployment gives none


def disk_mac_key(secret: bytes | None) -> bytes:
    """The disk files' MAC key: derived from the deployment's secret (`--kv-disk-key-file`; a label keeps it apart
    from any other use of the same secret, e.g. the router's prefix salt), else this process's random key."""
    if secret is None:
        return _PROCESS_KEY
    return hmac.new(secret, b"expertmesh kv disk tier mac v2", hashlib.sha256).digest()


def file_name(key: str) -> str:
    return f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.kv"


def secure_folder(folder: str | Path, uid: int | None = None) -> Path:
    """The tier folder, created private (0700) when missing; ValueError naming --kv-disk-dir when it is a link, not
    a folder, owned by a user other than `uid` (default: this process's) or writable by its group or others —
    whoever else could write it would choose what the model reads, or fill it."""
    folder = Path(folder)
    uid = os.getuid() if uid is None else uid
    try:
        if not os.path.lexists(folder):
            folder.mkdir(mode=0o700, parents=True)
        st = os.lstat(folder)
    except OSError as e:
        raise ValueError(f"{FLAG} {folder}: not writable (cannot create it: {e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{FLAG} {folder}: a symbolic link; give the folder itself")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{FLAG} {folder}: not a folder")
    if st.st_uid != uid:
        raise ValueError(f"{FLAG} {folder}: owned by uid {st.st_uid}, not by this worker's user (uid {uid})")
    if st.st_mode & 0o022:
        raise ValueError(
            f"{FLAG} {folder}: writable by its group or by others (mode {st.st_mode & 0o777:o}); expected a "
            "folder only its owner may write (chmod go-w)"
        )
    return folder


def open_regular(path: Path):
    """`path` opened for reading when it is a regular file itself — never through a link, never waiting on a FIFO
    (CorruptFile otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CorruptFile("a symbolic link" if e.errno == errno.ELOOP else f"cannot open it ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptFile("not a regular file")
    return os.fdopen(fd, "rb")


def _read_exactly(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CorruptFile("torn: the file ends early")
    return data


def _unlink(path: Path) -> bool:
    """Delete a file or a link (never what it points at); False when it cannot be (a folder)."""
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError:
        return False


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`: pinned and non-blocking from a CUDA device (the caller synchronises), a clone on CPU."""
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
    return t.detach().clone()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of host tensor `t` (non-blocking from pinned memory on CUDA; the caller synchronises)."""
    if torch.device(device).type == "cuda":
        return t.to(device, non_blocking=t.is_pinned())
    return t.clone()


def synchronize(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TierStats:
    """One tier's counters since the worker started (bytes: tensor bytes in host memory, file bytes on disk)."""

    capacity_bytes: int
    used_bytes: int = 0
    entries: int = 0
    demotions: int = 0  # prefixes that entered this tier from the one above
    restores: int = 0  # prefixes copied back to the device from this tier (cache hits served)
    restore_bytes: int = 0
    restore_seconds: float = 0.0
    dropped: int = 0  # prefixes that left this tier for nowhere (full, or too large for it)
    rejected: int = 0  # disk only: torn, corrupted, forged or foreign files (and non-files) refused, never served


@dataclass
class _DiskEntry:
    path: Path
    nbytes: int  # file size (header included): what counts against the bound
    length: int


@dataclass
class KVTiers:
    """The host and disk tiers of one worker. `host_bytes` / `disk_bytes`: hard bounds (0: no such tier);
    `disk_dir`: where disk files live (reused at start when they match `identity`, carry `layout`'s tensors and
    pass the MAC under `disk_key` — the deployment's secret; None: a random key of this process)."""

    host_bytes: int
    identity: str
    disk_dir: Path | None = None
    disk_bytes: int = 0
    disk_key: bytes | None = field(default=None, repr=False)
    layout: SnapshotLayout | None = None
    host: OrderedDict = field(default_factory=OrderedDict)  # key → PrefixSnapshot (host tensors), oldest first
    disk: OrderedDict = field(default_factory=OrderedDict)  # key → _DiskEntry, oldest first
    stats: dict = field(default_factory=dict)  # "host" / "disk" → TierStats ("store": the cluster tier's StoreStats)
    store: ClusterStore | None = None  # the cluster tier below disk (worker/kv_store.py), set by `attach_store`

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError(f"tier bounds: host {self.host_bytes} / disk {self.disk_bytes} bytes, expected ≥ 0")
        self.stats = {"host": TierStats(self.host_bytes), "disk": TierStats(self.disk_bytes)}
        self._mac_key = disk_mac_key(self.disk_key)
        if self.disk_dir is not None and self.disk_bytes > 0:
            self.disk_dir = secure_folder(self.disk_dir)
            self._scan()

    def attach_store(self, store: ClusterStore) -> None:
        """Add the cluster tier below disk: every demoted prefix is also put there (worker/kv_store.py), and a
        prefix no local tier holds is looked for there — whichever worker put it."""
        self.store = store
        self.stats["store"] = store.stats

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0 or self.store is not None

    def tier_of(self, key: str) -> str | None:
        if key in self.host or key in self.disk:
            return "host" if key in self.host else "disk"
        return "store" if self.store is not None and self.store.length_of(key) is not None else None

    def length_of(self, key: str) -> int | None:
        """Tokens of prefix `key` (None: not held below the device). A key only the store may hold — another
        worker's — is read from it now (and kept for the `load` that follows)."""
        held = self.host.get(key) or self.disk.get(key)
        if held is not None:
            return held.length
        if self.store is None:
            return None
        return self.store.length_of(key) or self.store.stage(key)

    def keys(self) -> list[tuple[str, int, str]]:
        """(key, length, tier) of every prefix held below the device; a prefix this worker put in the cluster
        store is listed there too (any worker can restore it)."""
        stored = [(k, n, "store") for k, n in self.store.keys()] if self.store is not None else []
        return (
            [(k, s.length, "host") for k, s in self.host.items()]
            + [(k, e.length, "disk") for k, e in self.disk.items()]
            + stored
        )

    # ------------------------------------------------------------------ demotion
    def put(self, key: str, snap: PrefixSnapshot) -> list[str]:
        """Keep a demoted prefix (host tensors) in the highest tier it fits, pushing older entries down; returns
        the keys dropped for good (possibly `key` itself, when no tier can hold it). With the cluster tier the
        prefix is put there too unless its save put it already (queued: the caller does not wait; it outlives this
        worker); a key the store holds, or will once its put is made, is never reported dropped."""
        self.discard(key, keep_stored=True)
        if self.store is not None:
            self.store.put_later(key, snap)
        dropped = self._put_local(key, snap)
        return [k for k in dropped if self.store is None or self.store.length_of(k) is None]

    def _put_local(self, key: str, snap: PrefixSnapshot) -> list[str]:
        dropped: list[str] = []
        if 0 < snap.nbytes <= self.host_bytes:
            self.host[key] = snap
            self.stats["host"].demotions += 1
            self._held("host", snap.nbytes, 1)
            while self.stats["host"].used_bytes > self.host_bytes:
                old_key, old = self.host.popitem(last=False)
                self._held("host", -old.nbytes, -1)
                dropped += self._to_disk(old_key, old)
        else:
            dropped += self._to_disk(key, snap)
        return dropped

    def _held(self, tier: str, nbytes: int, entries: int) -> None:
        """An entry of `nbytes` entered (entries=1) or left (entries=-1, nbytes negative) `tier`."""
        s = self.stats[tier]
        s.entries += entries
        s.used_bytes += nbytes

    def _to_disk(self, key: str, snap: PrefixSnapshot) -> list[str]:
        if self.disk_dir is None or self.disk_bytes <= 0:
            self.stats["host"].dropped += 1
            return [key]
        data = encode(key, self.identity, snap, self._mac_key)
        if len(data) > self.disk_bytes:
            self.stats["disk"].dropped += 1
            return [key]
        dropped = []
        while self.disk and self.stats["disk"].used_bytes + len(data) > self.disk_bytes:
            old_key, _ = next(iter(self.disk.items()))
            self._remove_disk(old_key)
            self.stats["disk"].dropped += 1
            dropped.append(old_key)
        path = self.disk_dir / file_name(key)
        tmp = path.with_suffix(".tmp")
        try:  # never through a link someone left under the temporary name: a fresh private file
            _unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:  # a full or failing disk costs this prefix, never the step that demoted it
            _unlink(tmp)
            log.warning("KV disk tier: cannot write %s (%s); prefix dropped", path.name, e)
            self.stats["disk"].dropped += 1
            return dropped + [key]
        self.disk[key] = _DiskEntry(path, len(data), snap.length)
        self.stats["disk"].demotions += 1
        self._held("disk", len(data), 1)
        return dropped

    def _remove_disk(self, key: str) -> None:
        entry = self.disk.pop(key)
        _unlink(entry.path)
        self._held("disk", -entry.nbytes, -1)

    def discard(self, key: str, keep_stored: bool = False) -> bool:
        """Forget `key` in every lower tier (its disk file deleted; its store object removed unless
        `keep_stored`); True when a local tier held it."""
        if self.store is not None and not keep_stored:
            self.store.discard(key)
        if key in self.host:
            snap = self.host.pop(key)
            self._held("host", -snap.nbytes, -1)
            return True
        if key in self.disk:
            self._remove_disk(key)
            return True
        return False

    # ------------------------------------------------------------------ restore
    def load(self, key: str) -> tuple[PrefixSnapshot, str]:
        """The snapshot of `key` and its tier, still held (the caller `discard`s it once it is on the device).
        KeyError when not held; CorruptFile when its disk file fails a check (then deleted and counted)."""
        if key in self.host:
            return self.host[key], "host"
        if key not in self.disk and self.store is not None:
            snap = self.store.get(key)  # CorruptFile: refused, counted and removed there
            if snap is None:
                raise CorruptFile("no longer in the cluster store (evicted, or the store is unavailable)")
            return snap, "store"
        entry = self.disk[key]
        try:
            _, data = self._read(entry.path, key, whole=True)
            return decode(data, key=key, identity=self.identity, mac_key=self._mac_key, layout=self.layout), "disk"
        except CorruptFile as e:
            self._remove_disk(key)
            self.stats["disk"].rejected += 1
            raise CorruptFile(f"{entry.path.name}: {e}") from None

    def _read(self, path: Path, key: str | None, *, whole: bool) -> tuple[FileHeader, bytes | None]:
        """Check the file at `path` (holding `key`, or any key) → (its header, its bytes when `whole`; else the tag
        is checked reading the file piece by piece). CorruptFile for anything that must not be served: not a regular
        file, larger than the tier, a header that is not this model's, a file of another size, a tag that fails."""
        try:
            with open_regular(path) as f:
                return self._read_open(f, key, whole)
        except OSError as e:  # a failing disk, a file cut short under the reader
            raise CorruptFile(f"cannot read it ({e.strerror or e})") from None

    def _read_open(self, f, key: str | None, whole: bool) -> tuple[FileHeader, bytes | None]:
        size = os.fstat(f.fileno()).st_size
        if size > self.disk_bytes:
            raise CorruptFile(f"{size} bytes, more than the tier's bound of {self.disk_bytes}")
        head = _read_exactly(f, PREAMBLE_BYTES)
        head += _read_exactly(f, header_length(head))
        header = read_header(head)
        check_header(header, identity=self.identity, key=key, layout=self.layout)
        if size != header.file_bytes:
            raise CorruptFile(f"torn: {size} bytes, the header says {header.file_bytes}")
        if whole:
            return header, head + _read_exactly(f, size - len(head))
        mac = new_mac(self._mac_key)
        mac.update(head)
        for at in range(0, header.payload_bytes, READ_PIECE):
            mac.update(_read_exactly(f, min(READ_PIECE, header.payload_bytes - at)))
        check_tag(mac, _read_exactly(f, TAG_BYTES))
        return header, None

    def restored(self, key: str, tier: str, nbytes: int, seconds: float) -> None:
        s = self.stats[tier]
        s.restores += 1
        s.restore_bytes += nbytes
        s.restore_seconds += seconds
        self.discard(key, keep_stored=True)  # the store's copy stays: other workers may need it

    # ------------------------------------------------------------------ start
    def _scan(self) -> None:
        """Index the files a previous run left (newest first while they fit the bound, then oldest first as they
        were); delete and count the ones that fail a check, and those that no longer fit (a smaller bound)."""
        found = []
        with os.scandir(self.disk_dir) as entries:
            for e in entries:
                path = self.disk_dir / e.name
                if e.name.endswith(".tmp"):  # a write cut short by a crash
                    self._reject(path, "a temporary file left by a write cut short")
                elif e.name.endswith(".kv"):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:  # gone meanwhile
                        continue
                    found.append((st.st_mtime_ns, e.name, st))
        room, kept = self.disk_bytes, []
        for _, name, st in sorted(found, reverse=True):
            path = self.disk_dir / name
            if not stat.S_ISREG(st.st_mode):
                self._reject(path, "not a regular file (a link, FIFO, device or folder)")
                continue
            if st.st_size > room and st.st_size <= self.disk_bytes:  # would fit an empty tier: older than the rest
                _unlink(path)
                self.stats["disk"].dropped += 1
                continue
            try:
                header, _ = self._read(path, None, whole=False)
                if name != file_name(header.key):
                    raise CorruptFile("file name does not match its key")
            except CorruptFile as e:
                self._reject(path, str(e))
                continue
            if header.file_bytes > room:  # grew since it was listed
                _unlink(path)
                self.stats["disk"].dropped += 1
                continue
            room -= header.file_bytes
            kept.append((header.key, _DiskEntry(path, header.file_bytes, header.length)))
        for key, entry in reversed(kept):
            self.disk[key] = entry
            self._held("disk", entry.nbytes, 1)

    def _reject(self, path: Path, why: str) -> None:
        """A file that must not be served: deleted (a link itself, never its target; a folder stays) and counted."""
        deleted = _unlink(path)
        self.stats["disk"].rejected += 1
        log.warning("KV disk tier: %s %s, not served: %s", "deleted" if deleted else "left", path.name, why)

    def snapshot_stats(self) -> dict[str, TierStats]:
        return {k: type(v)(**vars(v)) for k, v in self.stats.items()}
