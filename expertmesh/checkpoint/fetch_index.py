"""The checkpoint index of `expertmesh fetch` (checkpoint/fetch.py): writing one (`--write-index`), reading one
from an untrusted source (bounded, every path a plain relative name, a sane layout), and checking a file against
its entry (size, then sha256 or the git blob id)."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path

INDEX_NAME = "expertmesh-index.json"
INDEX_FORMAT = "expertmesh-index/1"
STATE_DIR = ".expertmesh-fetch"
STATE_FILE = "verified.json"
LOCK_FILE = "lock"
PARTIAL = ".partial"
CHUNK = 1 << 20
MAX_INDEX_BYTES = 16 << 20  # default bound on an index or the Hub's file list (~100k files; a checkpoint has ~1k)
NAME_MAX = 255  # bytes in one path component (Linux file systems), the download's `.partial` included
MAX_PATH_BYTES = 1024  # a whole path the index names


class FetchError(Exception):
    """A fetch that cannot succeed by retrying (the message names the file and what is wrong)."""


class TransientError(Exception):
    """Worth retrying: no connection, a timeout, a throttled or failing server."""


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str | None = None
    git_sha1: str | None = None  # the git blob id (Hub files not stored in LFS)


def hash_file(fh, h) -> str:
    while block := fh.read(CHUNK):
        h.update(block)
    return h.hexdigest()


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    with open(path, "rb") as f:
        return hash_file(f, hashlib.sha256())


def git_blob_sha1(path: Path) -> str:
    with open(path, "rb") as f:
        return hash_file(f, hashlib.sha1(f"blob {os.fstat(f.fileno()).st_size}\0".encode()))


def build_index(directory: Path) -> dict:
    """The index of every file under `directory` (sorted by path; the index itself and fetch state left out)."""
    directory = Path(directory)
    files = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if not p.is_file() or rel == INDEX_NAME or rel.startswith(STATE_DIR + "/") or rel.endswith(PARTIAL):
            continue
        files.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_file(p)})
    return {"format": INDEX_FORMAT, "files": files}


def write_index(directory: Path) -> Path:
    out = Path(directory) / INDEX_NAME
    out.write_text(json.dumps(build_index(directory), indent=1) + "\n")
    return out


brief = reprlib.Repr()  # a value from an index as a failure line shows it: one line, bounded
brief.maxstring = brief.maxother = 60


def parse_index(payload, where: str) -> list[FileEntry]:
    """Validate an index; raises FetchError naming the entry (`files[i]`) and what is wrong with it."""
    if (
        not isinstance(payload, dict)
        or payload.get("format") != INDEX_FORMAT
        or not isinstance(payload.get("files"), list)
    ):
        raise FetchError(
            f'{where}: not an {INDEX_FORMAT} index (expected {{"format": "{INDEX_FORMAT}", "files": [...]}})'
        )
    out = []
    for i, f in enumerate(payload["files"]):
        what = f"{where}: files[{i}]"
        if not isinstance(f, dict):
            raise FetchError(f"{what} must be an object with path, size and sha256, got {brief.repr(f)}")
        path = safe_path(f.get("path"), what)
        what = f"{what} ({path!r})"
        out.append(FileEntry(path, whole(f.get("size"), what), sha256=hex_digest(f.get("sha256"), 64, what, "sha256")))
    check_layout(out, where, "files")
    return out


def whole(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FetchError(f"{what}: size must be a whole number of bytes (>= 0), got {brief.repr(value)}")
    return value


def hex_digest(value, digits: int, what: str, name: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(f"[0-9a-f]{{{digits}}}", value):
        raise FetchError(f"{what}: {name} must be {digits} lowercase hex digits, got {brief.repr(value)}")
    return value


def safe_path(path, what: str) -> str:
    """`path` when it is a plain relative path the cache can hold, else FetchError naming it (`what`: the entry)."""

    def bad(why: str):
        raise FetchError(f"{what}: file path {brief.repr(path)} {why}")

    if not isinstance(path, str) or not path:
        bad("must be a non-empty string")
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:
        bad("is not valid UTF-8 text")
    if re.search(r"[\x00-\x1f\x7f]", path):
        bad("contains a control character")
    if len(raw) > MAX_PATH_BYTES:
        bad(f"is {len(raw)} bytes long (at most {MAX_PATH_BYTES})")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        bad(
            "must be a relative path of plain names inside the checkpoint (no leading, trailing or doubled '/', "
            "no '.' or '..')"
        )
    longest = max(len(p.encode()) for p in parts)
    if longest > NAME_MAX - len(PARTIAL):
        bad(
            f"has a name of {longest} bytes (at most {NAME_MAX - len(PARTIAL)}: the file system's {NAME_MAX} "
            f"less the {PARTIAL!r} of a download)"
        )
    if parts[0] == STATE_DIR:
        bad(f"names the fetch's own state ({STATE_DIR}/: its lock and its record of verified files)")
    if path.endswith(PARTIAL):
        bad(f"ends in {PARTIAL!r}, the suffix of a file being downloaded")
    return path


def check_layout(entries: list[FileEntry], where: str, key: str) -> None:
    """No path listed twice, none that another needs as a directory ('a' and 'a/b')."""
    first: dict[str, int] = {}
    for i, e in enumerate(entries):
        if e.path in first:
            raise FetchError(f"{where}: {key}[{i}]: file path {e.path!r} is listed twice (also {key}[{first[e.path]}])")
        first[e.path] = i
    for i, e in enumerate(entries):
        parts = e.path.split("/")
        for k in range(1, len(parts)):
            d = "/".join(parts[:k])
            if d in first:
                raise FetchError(
                    f"{where}: {key}[{i}]: file path {e.path!r} needs {d!r} to be a directory, but "
                    f"{key}[{first[d]}] lists {d!r} as a file"
                )


def too_big(what: str, limit: int) -> FetchError:
    return FetchError(f"{what}: more than {limit} bytes (the limit, --max-index-mib {limit / 2**20:g})")


def read_bounded(r, limit: int, what: str) -> bytearray:
    """The body of response `r`, refused past `limit` bytes: never more than that read or held."""
    length = (r.headers.get("Content-Length") or "").strip()
    if length.isdigit() and int(length) > limit:
        raise too_big(what, limit)
    buf = bytearray()
    while True:
        try:
            block = r.read(min(CHUNK, limit + 1 - len(buf)))
        except (OSError, http.client.HTTPException) as e:
            raise TransientError(f"GET {what}: interrupted after {len(buf)} bytes: {e!r}") from None
        if not block:
            return buf
        buf += block
        if len(buf) > limit:
            raise too_big(what, limit)


def json_payload(data, where: str):
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise FetchError(f"{where}: not JSON: {e}") from None


def check_open_file(fh, entry: FileEntry) -> str | None:
    """None when the open file `fh` matches the index entry, else what is wrong."""
    size = os.fstat(fh.fileno()).st_size
    if size != entry.size:
        return f"size {size} bytes, the index says {entry.size}"
    if entry.sha256 is not None:
        got = hash_file(fh, hashlib.sha256())
        return None if got == entry.sha256 else f"sha256 {got}, the index says {entry.sha256}"
    got = hash_file(fh, hashlib.sha1(f"blob {size}\0".encode()))
    return None if got == entry.git_sha1 else f"git blob id {got}, the index says {entry.git_sha1}"


def check_file_at(path: Path, entry: FileEntry) -> str | None:
    with open(path, "rb") as fh:
        return check_open_file(fh, entry)
