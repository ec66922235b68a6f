"""`expertmesh fetch`: bring a checkpoint from a remote source into a local cache directory, every file verified.

    expertmesh fetch https://host/ckpt/tiny --cache /var/cache/expertmesh/<key>      # the init container
    expertmesh fetch hf://org/model@revision --cache DIR                              # Hugging Face Hub
    expertmesh fetch --write-index DIR                                                # publish a checkpoint

Sources: `http(s)://BASE` (a checkpoint directory served over HTTP; its file index at `BASE/expertmesh-index.json`),
`hf://ORG/NAME[@REVISION]` (the Hub's file list with LFS sha256 and git blob ids; `$HF_ENDPOINT` overrides
https://huggingface.co, `$HF_TOKEN` is sent as a bearer token), `s3://BUCKET/PREFIX` (an S3-compatible store:
`$AWS_ENDPOINT_URL_S3`, path-style, SigV4 with `$AWS_ACCESS_KEY_ID` / `$AWS_SECRET_ACCESS_KEY`; the index at
`PREFIX/expertmesh-index.json`), or a local directory (verified in place when it has an index).

The index lists every file with its size and sha256 (`expertmesh fetch --write-index DIR` writes one):

    {"format": "expertmesh-index/1", "files": [{"path": "config.json", "size": 1234, "sha256": "…"}, …]}

Every file is downloaded to `<path>.partial` and resumed from there (HTTP Range) after an interruption, verified
(size, then sha256 — or the git blob id for small Hub files) and only then renamed into place; a verified file
is recorded under `.expertmesh-fetch/` so a rerun (another pod on the same node, a restarted init container)
skips it without re-hashing. Transient failures (no connection, timeouts, 408/429/5xx) are retried with
exponential backoff; a refusal (other 4xx) or a file whose bytes do not match the index (twice: once more from
scratch, in case a resumed part was stale) stops the fetch with one line naming the file. Pods on one node share
the cache directory: a lock file makes the second wait for the first, then find everything verified.

What a source sends is bounded by what the index says: a file is read up to its indexed size and refused at one
byte more (or at a Content-Length that disagrees), the index itself up to `--max-index-mib` (16). Credentials
(`$HF_TOKEN`, the SigV4 signature and session token) go only to the origin they are for: a redirect to another
origin (the Hub's CDN, a presigned URL) is followed without them, and a redirect from https to http is refused.
Every path the index names must be a plain relative name (no `.`, `..`, empty or over-long parts, no control
characters, not the fetch's own `.expertmesh-fetch/` state nor a `.partial`; no file that another needs as a
directory). The cache is walked without following symbolic links: a link where the index puts a file or a
directory is removed (and said so) and a real file or directory made in its place.

The index is checkpoint/fetch_index.py, the sources checkpoint/fetch_sources.py, the cache directory
checkpoint/fetch_cache.py; this module downloads, verifies, retries and reports.

Progress goes to stdout as `FETCH <pct>% <done>/<total> MiB <file>` (the operator reads the last such line of
the init container's log into the MoEDeployment's status: `Downloading 37%`); the last line is `FETCH done …`
or `FETCH failed: …` (the container's termination message).
"""

from __future__ import annotations

import argparse
import fcntl
import fnmatch
import http.client
import json
import os
import random
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from expertmesh.checkpoint.fetch_cache import CacheDir, write_all
from expertmesh.checkpoint.fetch_index import (
    CHUNK,
    INDEX_NAME,
    LOCK_FILE,
    MAX_INDEX_BYTES,
    PARTIAL,
    STATE_DIR,
    FetchError,
    FileEntry,
    TransientError,
    check_file_at,
    write_index,
)
from expertmesh.checkpoint.fetch_sources import Source, fetch_index, open_url, parse_source

PROGRESS_RE = re.compile(r"^FETCH (\d+(?:\.\d+)?)% ")


# ------------------------------------------------------------------------------------------------ fetching
@dataclass
class Progress:
    """Byte counts across the whole fetch; prints `FETCH <pct>% …` at most every `every` seconds or 1%."""

    total: int
    done: int = 0
    downloaded: int = 0
    out: Callable[[str], None] = print
    every: float = 1.0
    _last: tuple = (-1.0, -1.0)

    @property
    def percent(self) -> float:
        return 100.0 if self.total == 0 else 100.0 * self.done / self.total

    def report(self, file: str, force: bool = False) -> None:
        pct, now = self.percent, time.monotonic()
        if force or now - self._last[1] >= self.every or int(pct) > int(self._last[0]):
            self._last = (pct, now)
            self.out(f"FETCH {pct:.1f}% {self.done / 2**20:.1f}/{self.total / 2**20:.1f} MiB {file}")


def _backoff(attempt: int, base: float, cap: float = 60.0) -> float:
    return min(cap, base * 2**attempt) * (0.5 + random.random() / 2)


def _download(
    src: Source, entry: FileEntry, cache: CacheDir, dfd: int, part: str, progress: Progress, timeout: float
) -> None:
    """Append the rest of the file to `part` in `dfd` (resuming from its size), never past the indexed size:
    TransientError on an interruption, FetchError when the server announces another size or sends more."""
    rel = entry.path + PARTIAL
    st = cache.regular(dfd, part, rel)
    offset = st.st_size if st is not None else 0
    if offset > entry.size or (st is not None and st.st_nlink != 1):  # too long, or shared with another file
        os.unlink(part, dir_fd=dfd)
        offset = 0
    if offset == entry.size and offset > 0:
        return
    url = src.base + urllib.parse.quote(entry.path)
    what = f"checkpoint file {entry.path!r} from {src.base}"
    with open_url(src, url, timeout, offset) as r:
        if offset and r.status != 206:  # the server ignored the Range: start over
            progress.done -= offset
            offset = 0
        length = (r.headers.get("Content-Length") or "").strip()
        if length.isdigit() and offset + int(length) != entry.size:
            raise FetchError(
                f"{what}: size {offset + int(length)} bytes (the server's Content-Length), the index says {entry.size}"
            )
        fd = cache.open(dfd, part, rel, os.O_WRONLY | os.O_APPEND) if offset else cache.create(dfd, part, rel)
        done = offset
        try:
            while True:
                try:  # one byte more than the index leaves room for tells a body that goes on
                    block = r.read(min(CHUNK, entry.size - done + 1))
                except (OSError, http.client.HTTPException) as e:
                    raise TransientError(f"GET {url}: interrupted after {done} bytes: {e!r}") from None
                if not block:
                    break
                if done + len(block) > entry.size:
                    os.unlink(part, dir_fd=dfd)
                    raise FetchError(
                        f"{what}: the server sends more than the {entry.size} bytes the index lists "
                        f"(refused at byte {entry.size + 1}; nothing kept)"
                    )
                try:
                    write_all(fd, block)
                except OSError as e:
                    raise FetchError(f"{what}: cannot write {cache.root / rel}: {e.strerror or e}") from None
                done += len(block)
                progress.done += len(block)
                progress.downloaded += len(block)
                progress.report(entry.path)
        finally:
            os.close(fd)
    if done < entry.size:  # the server closed the connection early: resume from here
        raise TransientError(f"GET {url}: connection closed after {done} of {entry.size} bytes")


def fetch(
    uri: str,
    cache: Path,
    *,
    patterns: Iterable[str] = (),
    retries: int = 8,
    backoff: float = 0.5,
    timeout: float = 60.0,
    out: Callable[[str], None] = print,
    progress_every: float = 1.0,
    max_index_bytes: int = MAX_INDEX_BYTES,
) -> dict:
    """Fetch the checkpoint at `uri` into `cache` (see the module doc). `patterns`: only files matching one of
    these globs (plus every non-safetensors file). `max_index_bytes`: the most of an index read. Returns
    {"files", "bytes", "downloaded", "skipped"}. Raises FetchError (permanent) or TransientError (retries
    exhausted)."""
    src = parse_source(uri)
    try:
        store = CacheDir(Path(cache), out)
    except OSError as e:
        raise FetchError(f"cache {cache}: {e}") from None
    try:
        sfd = store.directory([STATE_DIR])
        try:
            lock = store.open(sfd, LOCK_FILE, f"{STATE_DIR}/{LOCK_FILE}", os.O_RDWR | os.O_CREAT)
            try:
                try:  # one fetch per cache directory at a time (pods on one node share it)
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    out(f"FETCH waiting: another fetch into {cache} is under way")
                    fcntl.flock(lock, fcntl.LOCK_EX)
                return _fetch_locked(
                    src, store, sfd, patterns, retries, backoff, timeout, out, progress_every, max_index_bytes
                )
            finally:
                os.close(lock)
        finally:
            os.close(sfd)
    except OSError as e:  # the cache's file system: permissions, a full disk, …
        raise FetchError(f"cache {cache}: {e}") from None
    finally:
        store.close()


def _fetch_locked(
    src: Source, store: CacheDir, sfd: int, patterns, retries, backoff, timeout, out, progress_every, max_index_bytes
) -> dict:
    entries = _retrying(lambda: fetch_index(src, timeout, max_index_bytes), retries, backoff, out, "index")
    patterns = list(patterns)
    if patterns:
        entries = [
            e
            for e in entries
            if not e.path.endswith(".safetensors") or any(fnmatch.fnmatch(e.path, p) for p in patterns)
        ]
    if src.kind == "local":
        return _verify_in_place(Path(src.base), entries, out)
    state = store.load_state(sfd)
    progress = Progress(total=sum(e.size for e in entries), out=out, every=progress_every)
    skipped = 0
    for entry in entries:
        *dirs, name = entry.path.split("/")
        try:
            dfd = store.directory(dirs)
            try:
                skipped += _fetch_file(
                    src,
                    entry,
                    store,
                    dfd,
                    name,
                    state,
                    lambda: store.save_state(sfd, state),
                    progress,
                    retries,
                    backoff,
                    timeout,
                    out,
                )
            finally:
                os.close(dfd)
        except OSError as e:
            raise FetchError(f"checkpoint file {entry.path!r} in {store.root}: {e.strerror or e}") from None
    progress.report("", force=True)
    return {"files": len(entries), "bytes": progress.total, "downloaded": progress.downloaded, "skipped": skipped}


def _fetch_file(
    src: Source,
    entry: FileEntry,
    store: CacheDir,
    dfd: int,
    name: str,
    state: dict,
    save,
    progress,
    retries,
    backoff,
    timeout,
    out,
) -> bool:
    """One file into its directory `dfd`, verified; True when it was already there and recorded (skipped)."""
    rel, digest = entry.path, entry.sha256 or entry.git_sha1
    st = store.regular(dfd, name, rel)
    if st is not None and state.get(rel) == [entry.size, digest, st.st_mtime_ns] and st.st_size == entry.size:
        progress.done += entry.size
        return True
    if st is not None:  # unrecorded (an older cache, an interrupted rename): verify what is there
        if store.check(dfd, name, rel, entry) is None:
            progress.done += entry.size
            state[rel] = [entry.size, digest, st.st_mtime_ns]
            save()
            return False
        os.unlink(name, dir_fd=dfd)
    part = name + PARTIAL
    part_size = lambda: getattr(store.regular(dfd, part, rel + PARTIAL), "st_size", 0)  # noqa: E731
    start = progress.done
    for fresh in (False, True):
        progress.done = start + part_size()
        _retrying(
            lambda: _download(src, entry, store, dfd, part, progress, timeout),
            retries,
            backoff,
            out,
            rel,
            reset=lambda: setattr(progress, "done", start + part_size()),
        )
        wrong = store.check(dfd, part, rel + PARTIAL, entry)
        if wrong is None:
            break
        os.unlink(part, dir_fd=dfd)
        progress.done = start
        if fresh:
            raise FetchError(
                f"checkpoint file {rel!r} from {src.base}: {wrong} (refused: the source serves "
                f"corrupted or different bytes)"
            )
        out(f"FETCH {rel}: {wrong}; downloading it again from the start")
    os.replace(part, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    state[rel] = [entry.size, digest, os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime_ns]
    save()
    progress.report(rel, force=True)
    return False


def _verify_in_place(directory: Path, entries: list[FileEntry], out) -> dict:
    for e in entries:
        try:
            wrong = check_file_at(directory / e.path, e)
        except FileNotFoundError:
            raise FetchError(f"checkpoint file {e.path!r}: missing in {directory}") from None
        except OSError as x:
            raise FetchError(f"checkpoint file {e.path!r} in {directory}: {x.strerror or x}") from None
        if wrong is not None:
            raise FetchError(f"checkpoint file {e.path!r} in {directory}: {wrong}")
    out(f"FETCH 100.0% verified {len(entries)} files in place")
    return {"files": len(entries), "bytes": sum(e.size for e in entries), "downloaded": 0, "skipped": len(entries)}


def _retrying(fn, retries: int, backoff: float, out, what: str, reset=None):
    for attempt in range(retries + 1):
        try:
            return fn()
        except TransientError as e:
            if attempt == retries:
                raise FetchError(f"{what}: giving up after {retries + 1} attempts: {e}") from None
            delay = _backoff(attempt, backoff)
            out(f"FETCH retry {attempt + 1}/{retries} in {delay:.1f}s: {e}")
            if reset is not None:
                reset()
            time.sleep(delay)


def parse_progress(log: str) -> float | None:
    """The percentage of the last `FETCH <pct>% …` line of a log, or None."""
    for line in reversed(log.splitlines()):
        mt = PROGRESS_RE.match(line.strip())
        if mt:
            return float(mt.group(1))
    return None


# ------------------------------------------------------------------------------------------------ CLI
def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", nargs="?", help="http(s)://…, hf://ORG/NAME[@REV] or a local checkpoint directory")
    p.add_argument("--cache", type=Path, help="directory the checkpoint is fetched into (created)")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="GLOB",
        help="fetch only the .safetensors files matching GLOB (repeatable; other files always)",
    )
    p.add_argument("--retries", type=int, default=8, help="retries per file after a transient failure (default 8)")
    p.add_argument("--backoff", type=float, default=0.5, help="first retry delay in seconds, doubled each time")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per network read (default 60)")
    p.add_argument(
        "--max-index-mib",
        type=_positive,
        default=MAX_INDEX_BYTES / 2**20,
        metavar="MIB",
        help=f"refuse an index (or the Hub's file list) larger than this (default {MAX_INDEX_BYTES >> 20})",
    )
    p.add_argument(
        "--write-index",
        type=Path,
        metavar="DIR",
        help=f"write DIR/{INDEX_NAME} (size and sha256 of every file) and exit",
    )


def run(args) -> int:
    if args.write_index is not None:
        path = write_index(args.write_index)
        print(f"wrote {path} ({len(json.loads(path.read_text())['files'])} files)")
        return 0
    if not args.source or args.cache is None:
        print("expertmesh fetch: need SOURCE and --cache DIR (or --write-index DIR)", file=sys.stderr)
        return 2
    say = lambda line: print(line, flush=True)  # noqa: E731
    try:
        r = fetch(
            args.source,
            args.cache,
            patterns=args.only,
            retries=args.retries,
            backoff=args.backoff,
            timeout=args.timeout,
            out=say,
            max_index_bytes=int(args.max_index_mib * 2**20),
        )
    except FetchError as e:
        say(f"FETCH failed: {e}")
        return 1
    say(
        f"FETCH done {r['files']} files, {r['bytes']} bytes ({r['downloaded']} downloaded, "
        f"{r['skipped']} already verified)"
    )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="expertmesh fetch", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
