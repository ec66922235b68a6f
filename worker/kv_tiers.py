"""The lower tiers of an attention worker's prefix cache: host memory, then local disk, each with a hard byte bound.

A prefix the router asks to demote leaves the device pool as a `PrefixSnapshot` — tokens [0, length) of every
latent-KV layer (MLA/DSA latent entries and DSA indexer keys) and the KDA recurrent + conv state at `length` — and
comes back bit-identical: the tensors are copied, never recomputed or converted. A tier that is full pushes its
oldest entries down (host → disk → dropped); the keys finally dropped are reported so the router's index stays true.
The order inside a tier is the order the router demoted in, which follows its session-aware policy
(router/eviction.py): the least valuable prefix entered first and leaves first.

Disk files (one per prefix, `<sha256(key)[:40]>.kv`, in expertmesh/wire/kv_snapshot.py's format, the worker's
`identity` being model config + dtype + block size), written to a temporary name then renamed (a crash leaves no
half file under the real name). A file whose header does not parse, whose identity or key differ, whose payload is short or whose
checksum fails is deleted and counted (`rejected`), never served. On CUDA the host tier holds pinned memory and the
copies are non-blocking (synchronised before use); on CPU the same path copies ordinary tensors.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from expertmesh.wire.kv_snapshot import CorruptFile, PrefixSnapshot, decode, encode, read_header

log = logging.getLogger("expertmesh.worker")


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
    rejected: int = 0  # disk only: torn, corrupted or foreign files deleted, never served


@dataclass
class _DiskEntry:
    path: Path
    nbytes: int  # file size (header included): what counts against the bound
    length: int


@dataclass
class KVTiers:
    """The host and disk tiers of one worker. `host_bytes` / `disk_bytes`: hard bounds (0: no such tier);
    `disk_dir`: where disk files live (reused at start when they match `identity`)."""

    host_bytes: int
    identity: str
    disk_dir: Path | None = None
    disk_bytes: int = 0
    host: OrderedDict = field(default_factory=OrderedDict)  # key → PrefixSnapshot (host tensors), oldest first
    disk: OrderedDict = field(default_factory=OrderedDict)  # key → _DiskEntry, oldest first
    stats: dict = field(default_factory=dict)  # "host" / "disk" → TierStats

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError(f"tier bounds: host {self.host_bytes} / disk {self.disk_bytes} bytes, expected ≥ 0")
        self.stats = {"host": TierStats(self.host_bytes), "disk": TierStats(self.disk_bytes)}
        if self.disk_dir is not None and self.disk_bytes > 0:
            self.disk_dir = Path(self.disk_dir)
            self._scan()

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0

    def tier_of(self, key: str) -> str | None:
        return "host" if key in self.host else "disk" if key in self.disk else None

    def length_of(self, key: str) -> int | None:
        """Tokens of prefix `key` (None: not held below the device)."""
        held = self.host.get(key) or self.disk.get(key)
        return None if held is None else held.length

    def keys(self) -> list[tuple[str, int, str]]:
        """(key, length, tier) of every prefix held below the device."""
        return [(k, s.length, "host") for k, s in self.host.items()] + [
            (k, e.length, "disk") for k, e in self.disk.items()
        ]

    # ------------------------------------------------------------------ demotion
    def put(self, key: str, snap: PrefixSnapshot) -> list[str]:
        """Keep a demoted prefix (host tensors) in the highest tier it fits, pushing older entries down; returns
        the keys dropped for good (possibly `key` itself, when no tier can hold it)."""
        self.discard(key)
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
        data = encode(key, self.identity, snap)
        if len(data) > self.disk_bytes:
            self.stats["disk"].dropped += 1
            return [key]
        dropped = []
        while self.disk and self.stats["disk"].used_bytes + len(data) > self.disk_bytes:
            old_key, _ = next(iter(self.disk.items()))
            self._remove_disk(old_key)
            self.stats["disk"].dropped += 1
            dropped.append(old_key)
        path = self.disk_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.kv"
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:  # a full or failing disk costs this prefix, never the step that demoted it
            tmp.unlink(missing_ok=True)
            log.warning("KV disk tier: cannot write %s (%s); prefix dropped", path.name, e)
            self.stats["disk"].dropped += 1
            return dropped + [key]
        self.disk[key] = _DiskEntry(path, len(data), snap.length)
        self.stats["disk"].demotions += 1
        self._held("disk", len(data), 1)
        return dropped

    def _remove_disk(self, key: str) -> None:
        entry = self.disk.pop(key)
        entry.path.unlink(missing_ok=True)
        self._held("disk", -entry.nbytes, -1)

    def discard(self, key: str) -> bool:
        """Forget `key` in every lower tier (its disk file deleted); True when it was held."""
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
        entry = self.disk[key]
        try:
            return decode(entry.path.read_bytes(), key=key, identity=self.identity), "disk"
        except (OSError, CorruptFile) as e:
            self._remove_disk(key)
            self.stats["disk"].rejected += 1
            raise CorruptFile(f"{entry.path.name}: {e}") from None

    def restored(self, key: str, tier: str, nbytes: int, seconds: float) -> None:
        s = self.stats[tier]
        s.restores += 1
        s.restore_bytes += nbytes
        s.restore_seconds += seconds
        self.discard(key)

    # ------------------------------------------------------------------ start
    def _scan(self) -> None:
        """Index the files a previous run left (oldest first); delete and count the ones that fail a check."""
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.disk_dir.glob("*.tmp"):  # a write cut short by a crash
            tmp.unlink(missing_ok=True)
            self.stats["disk"].rejected += 1
        files = sorted(self.disk_dir.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                data = path.read_bytes()
                header, _ = read_header(data)
                key = str(header["key"])
                if path.name != f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.kv":
                    raise CorruptFile("file name does not match its key")
                snap_len = decode(data, key=key, identity=self.identity).length
            except (OSError, CorruptFile) as e:
                path.unlink(missing_ok=True)
                self.stats["disk"].rejected += 1
                log.warning("KV disk tier: deleted %s, not served: %s", path.name, e)
                continue
            self.disk[key] = _DiskEntry(path, len(data), snap_len)
            self._held("disk", len(data), 1)
        while self.disk and self.stats["disk"].used_bytes > self.disk_bytes:  # a smaller bound than before
            self._remove_disk(next(iter(self.disk)))
            self.stats["disk"].dropped += 1

    def snapshot_stats(self) -> dict[str, TierStats]:
        return {k: TierStats(**vars(v)) for k, v in self.stats.items()}
