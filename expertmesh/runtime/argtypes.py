"""argparse types that refuse out-of-range numbers with the flag's own name in the error."""

from __future__ import annotations

import argparse
from pathlib import Path


def _number(kind, low, strict: bool, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
        if value != value or (value <= low if strict else value < low):  # NaN or out of range
            raise argparse.ArgumentTypeError(f"expected {what}, found {text}")
        return value

    return parse


positive_int = _number(int, 0, True, "an integer > 0")
nonnegative_int = _number(int, 0, False, "an integer >= 0")
positive_float = _number(float, 0.0, True, "a number > 0")
nonnegative_float = _number(float, 0.0, False, "a number >= 0")


def check_kv_tiers(host_gib: float, disk_dir: str | None, disk_gib: float) -> None:
    """The KV tier flags (`expertmesh worker`, `expertmesh up`): ValueError naming the flag for a negative size, a
    disk folder without its bound > 0 or the reverse, a folder that cannot be created or written."""
    for flag, gib in (("--kv-host-gib", host_gib), ("--kv-disk-gib", disk_gib)):
        if not gib >= 0:
            raise ValueError(f"{flag} {gib}: expected a size in GiB ≥ 0")
    if (disk_dir is None) != (disk_gib == 0):
        raise ValueError("--kv-disk-dir and --kv-disk-gib: give both (a folder and its bound > 0) or neither")
    if disk_dir is not None:
        probe = Path(disk_dir) / ".write-probe"
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"--kv-disk-dir {disk_dir}: not writable ({e.strerror or e})") from None
