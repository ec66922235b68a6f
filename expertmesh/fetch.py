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

Progress goes to stdout as `FETCH <pct>% <done>/<total> MiB <file>` (the operator reads the last such line of
the init container's log into the MoEDeployment's status: `Downloading 37%`); the last line is `FETCH done …`
or `FETCH failed: …` (the container's termination message).
"""
from __future__ import annotations

import argparse
import fcntl
import fnmatch
import hashlib
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

INDEX_NAME = "expertmesh-index.json"
INDEX_FORMAT = "expertmesh-index/1"
STATE_DIR = ".expertmesh-fetch"
CHUNK = 1 << 20
PROGRESS_RE = re.compile(r"^FETCH (\d+(?:\.\d+)?)% ")


class FetchError(Exception):
    """A fetch that cannot succeed by retrying (the message names the file and what is wrong)."""


class TransientError(Exception):
    """Worth retrying: no connection, a timeout, a throttled or failing server."""


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: Optional[str] = None
    git_sha1: Optional[str] = None   # the git blob id (Hub files not stored in LFS)


@dataclass
class Source:
    """Where a checkpoint's files come from: `base` + a file's path, with `headers` (and `sign`, which adds the
    request's signature headers, for S3)."""
    uri: str
    base: str = ""
    headers: dict = field(default_factory=dict)
    kind: str = "http"        # http | hf | s3 | local
    sign: Optional[Callable[[str, str, dict], dict]] = None


# ------------------------------------------------------------------------------------------------ S3 (SigV4)
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def sigv4_headers(method: str, url: str, headers: dict, *, access_key: str, secret_key: str, region: str,
                  amz_date: str, session_token: Optional[str] = None, service: str = "s3") -> dict:
    """`headers` plus the AWS Signature Version 4 headers of a request without a body (x-amz-date,
    x-amz-content-sha256, Authorization; every given header is signed)."""
    import hmac
    u = urllib.parse.urlsplit(url)
    out = {**headers, "x-amz-date": amz_date, "x-amz-content-sha256": EMPTY_SHA256}
    if session_token:
        out["x-amz-security-token"] = session_token
    canon = {k.lower().strip(): " ".join(str(v).split()) for k, v in {"host": u.netloc, **out}.items()}
    signed = ";".join(sorted(canon))
    query = "&".join(sorted(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
                            for k, v in urllib.parse.parse_qsl(u.query, keep_blank_values=True)))
    request = "\n".join([method, urllib.parse.quote(u.path or "/", safe="/-_.~"), query,
                         "".join(f"{k}:{canon[k]}\n" for k in sorted(canon)), signed, EMPTY_SHA256])
    scope = f"{amz_date[:8]}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(request.encode()).hexdigest()])
    key = f"AWS4{secret_key}".encode()
    for part in (amz_date[:8], region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope},SignedHeaders={signed},"
                            f"Signature={signature}")
    return out


def _s3_source(uri: str) -> Source:
    """s3://BUCKET/PREFIX: path-style URLs on $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL (an S3-compatible store)
    or AWS's regional endpoint; signed with $AWS_ACCESS_KEY_ID / $AWS_SECRET_ACCESS_KEY (and
    $AWS_SESSION_TOKEN) when set, anonymous otherwise; region $AWS_REGION / $AWS_DEFAULT_REGION (us-east-1)."""
    u = urllib.parse.urlsplit(uri)
    if not u.netloc:
        raise FetchError(f"{uri}: expected s3://BUCKET/PREFIX")
    env = os.environ
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or
                f"https://s3.{region}.amazonaws.com").rstrip("/")
    prefix = u.path.strip("/")
    base = f"{endpoint}/{u.netloc}/" + (urllib.parse.quote(prefix) + "/" if prefix else "")
    sign = None
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        creds = dict(access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"], region=region,
                     session_token=env.get("AWS_SESSION_TOKEN"))

        def sign(method: str, url: str, headers: dict) -> dict:
            return sigv4_headers(method, url, headers, amz_date=time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
                                 **creds)
    return Source(uri, base=base, kind="s3", sign=sign)


# ------------------------------------------------------------------------------------------------ index
def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1()
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def build_index(directory: Path) -> dict:
    """The index of every file under `directory` (sorted by path; the index itself and fetch state left out)."""
    directory = Path(directory)
    files = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if not p.is_file() or rel == INDEX_NAME or rel.startswith(STATE_DIR + "/") or rel.endswith(".partial"):
            continue
        files.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_file(p)})
    return {"format": INDEX_FORMAT, "files": files}


def write_index(directory: Path) -> Path:
    out = Path(directory) / INDEX_NAME
    out.write_text(json.dumps(build_index(directory), indent=1) + "\n")
    return out


def parse_index(payload: dict, where: str) -> list[FileEntry]:
    """Validate an index; raises FetchError naming what is malformed."""
    if not isinstance(payload, dict) or payload.get("format") != INDEX_FORMAT or \
            not isinstance(payload.get("files"), list):
        raise FetchError(f"{where}: not an {INDEX_FORMAT} index (expected {{\"format\": \"{INDEX_FORMAT}\", "
                         f"\"files\": [...]}})")
    out = []
    for i, f in enumerate(payload["files"]):
        ok = isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int) \
            and f["size"] >= 0 and isinstance(f.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", f["sha256"])
        if not ok:
            raise FetchError(f"{where}: files[{i}] needs path, size >= 0 and a hex sha256, got {str(f)[:120]}")
        out.append(FileEntry(_safe_path(f["path"], where), f["size"], sha256=f["sha256"]))
    return out


def _safe_path(path: str, where: str) -> str:
    parts = Path(path).parts
    if not path or Path(path).is_absolute() or ".." in parts:
        raise FetchError(f"{where}: file path {path!r} must be relative, inside the checkpoint")
    return Path(path).as_posix()


# ------------------------------------------------------------------------------------------------ sources
def parse_source(uri: str) -> Source:
    """A checkpoint URI → Source. Raises FetchError for a scheme it does not know."""
    u = urllib.parse.urlsplit(uri)
    if u.scheme in ("http", "https"):
        return Source(uri, base=uri.rstrip("/") + "/")
    if u.scheme == "hf":
        repo, _, rev = (u.netloc + u.path).partition("@")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise FetchError(f"{uri}: expected hf://ORG/NAME[@REVISION]")
        rev = rev or "main"
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else {}
        return Source(uri, base=f"{endpoint}/{repo}/resolve/{urllib.parse.quote(rev, safe='')}/", headers=headers,
                      kind="hf")
    if u.scheme == "s3":
        return _s3_source(uri)
    if u.scheme in ("", "file"):
        return Source(uri, base=u.path if u.scheme else uri, kind="local")
    raise FetchError(f"{uri}: unsupported checkpoint source (http://, https://, hf://, s3:// or a local path)")


def _request(url: str, headers: dict, timeout: float, offset: int = 0, sign=None):
    """Open `url` (from byte `offset` on); maps failures to TransientError / FetchError."""
    h = dict(headers, **({"Range": f"bytes={offset}-"} if offset else {}))
    if sign is not None:
        h = sign("GET", url, h)
    req = urllib.request.Request(url, headers={"User-Agent": "expertmesh-fetch", **h})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:  # the part on disk is already whole (or longer): start over
            raise TransientError(f"GET {url}: HTTP 416 at offset {offset}") from None
        if e.code in (408, 429) or e.code >= 500:
            raise TransientError(f"GET {url}: HTTP {e.code}") from None
        raise FetchError(f"GET {url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise TransientError(f"GET {url}: {getattr(e, 'reason', e)}") from None


def fetch_index(src: Source, timeout: float) -> list[FileEntry]:
    if src.kind == "local":
        p = Path(src.base) / INDEX_NAME
        if not p.exists():
            raise FetchError(f"{src.uri}: no {INDEX_NAME} (write one with `expertmesh fetch --write-index DIR`)")
        return parse_index(json.loads(p.read_text()), str(p))
    if src.kind == "hf":
        return _hf_index(src, timeout)
    url = src.base + INDEX_NAME
    with _request(url, src.headers, timeout, sign=src.sign) as r:
        try:
            payload = json.loads(r.read())
        except ValueError as e:
            raise FetchError(f"{url}: not JSON: {e}") from None
    return parse_index(payload, url)


def _hf_index(src: Source, timeout: float) -> list[FileEntry]:
    """The Hub's file list: LFS files carry their sha256, the others their git blob id."""
    endpoint, rest = src.base.split("/resolve/", 1)
    repo = endpoint.split("/", 3)[3]
    rev = rest.rstrip("/")
    api = f"{endpoint.rsplit('/' + repo, 1)[0]}/api/models/{repo}/revision/{rev}?blobs=true"
    with _request(api, src.headers, timeout) as r:
        payload = json.loads(r.read())
    out = []
    for s in payload.get("siblings") or []:
        name, lfs = s.get("rfilename"), s.get("lfs") or {}
        if lfs.get("sha256"):
            out.append(FileEntry(_safe_path(name, api), int(lfs.get("size", s.get("size", 0))), sha256=lfs["sha256"]))
        elif s.get("blobId") and s.get("size") is not None:
            out.append(FileEntry(_safe_path(name, api), int(s["size"]), git_sha1=s["blobId"]))
        else:
            raise FetchError(f"{api}: file {name!r} has neither an LFS sha256 nor a blob id and size")
    if not out:
        raise FetchError(f"{api}: the repository lists no files")
    return out


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
    return min(cap, base * 2 ** attempt) * (0.5 + random.random() / 2)


def _verified(state: dict, dest: Path, entry: FileEntry) -> bool:
    """Already fetched and verified (recorded with the same size, digest and mtime)."""
    rec = state.get(entry.path)
    if not rec or not dest.exists():
        return False
    st = dest.stat()
    return rec == [entry.size, entry.sha256 or entry.git_sha1, st.st_mtime_ns] and st.st_size == entry.size


def _check(path: Path, entry: FileEntry) -> Optional[str]:
    """None when `path` matches the index entry, else what is wrong."""
    size = path.stat().st_size
    if size != entry.size:
        return f"size {size} bytes, the index says {entry.size}"
    if entry.sha256 is not None:
        got = sha256_file(path)
        return None if got == entry.sha256 else f"sha256 {got}, the index says {entry.sha256}"
    got = git_blob_sha1(path)
    return None if got == entry.git_sha1 else f"git blob id {got}, the index says {entry.git_sha1}"


def _download(src: Source, entry: FileEntry, part: Path, progress: Progress, timeout: float) -> None:
    """Append the rest of the file to `part` (resuming from its size); TransientError on interruption."""
    offset = part.stat().st_size if part.exists() else 0
    if offset > entry.size:
        part.unlink()
        offset = 0
    if offset == entry.size and offset > 0:
        return
    url = src.base + urllib.parse.quote(entry.path)
    with _request(url, src.headers, timeout, offset, sign=src.sign) as r:
        if offset and r.status != 206:  # the server ignored the Range: start over
            progress.done -= offset
            offset = 0
        with open(part, "ab" if offset else "wb") as f:
            try:
                while block := r.read(CHUNK if entry.size > CHUNK else 65536):
                    f.write(block)
                    progress.done += len(block)
                    progress.downloaded += len(block)
                    progress.report(entry.path)
            except (OSError, TimeoutError, http.client.HTTPException) as e:
                raise TransientError(f"GET {url}: interrupted after {f.tell()} bytes: {e!r}") from None
            if f.tell() < entry.size:  # the server closed the connection early: resume from here
                raise TransientError(f"GET {url}: connection closed after {f.tell()} of {entry.size} bytes")


def fetch(uri: str, cache: Path, *, patterns: Iterable[str] = (), retries: int = 8, backoff: float = 0.5,
          timeout: float = 60.0, out: Callable[[str], None] = print, progress_every: float = 1.0) -> dict:
    """Fetch the checkpoint at `uri` into `cache` (see the module doc). `patterns`: only files matching one of
    these globs (plus every non-safetensors file). Returns {"files", "bytes", "downloaded", "skipped"}.
    Raises FetchError (permanent) or TransientError (retries exhausted)."""
    src = parse_source(uri)
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / STATE_DIR).mkdir(exist_ok=True)
    with open(cache / STATE_DIR / "lock", "w") as lock:
        try:  # one fetch per cache directory at a time (pods on one node share it)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            out(f"FETCH waiting: another fetch into {cache} is under way")
            fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _retrying(lambda: fetch_index(src, timeout), retries, backoff, out, "index")
        patterns = list(patterns)
        if patterns:
            entries = [e for e in entries if not e.path.endswith(".safetensors")
                       or any(fnmatch.fnmatch(e.path, p) for p in patterns)]
        if src.kind == "local":
            return _verify_in_place(Path(src.base), entries, out)
        state_file = cache / STATE_DIR / "verified.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        progress = Progress(total=sum(e.size for e in entries), out=out, every=progress_every)
        skipped = 0
        for entry in entries:
            dest = cache / entry.path
            if _verified(state, dest, entry):
                progress.done += entry.size
                skipped += 1
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_name(dest.name + ".partial")
            if dest.exists():  # unrecorded (an older cache, an interrupted rename): verify what is there
                if _check(dest, entry) is None:
                    progress.done += entry.size
                    state[entry.path] = [entry.size, entry.sha256 or entry.git_sha1, dest.stat().st_mtime_ns]
                    state_file.write_text(json.dumps(state))
                    continue
                dest.unlink()
            start = progress.done
            for fresh in (False, True):
                if part.exists():
                    progress.done = start + part.stat().st_size
                _retrying(lambda: _download(src, entry, part, progress, timeout), retries, backoff, out, entry.path,
                          reset=lambda: setattr(progress, "done", start + (part.stat().st_size if part.exists()
                                                                           else 0)))
                wrong = _check(part, entry)
                if wrong is None:
                    break
                part.unlink()
                progress.done = start
                if fresh:
                    raise FetchError(f"checkpoint file {entry.path!r} from {src.base}: {wrong} (refused: the source "
                                     f"serves corrupted or different bytes)")
                out(f"FETCH {entry.path}: {wrong}; downloading it again from the start")
            os.replace(part, dest)
            state[entry.path] = [entry.size, entry.sha256 or entry.git_sha1, dest.stat().st_mtime_ns]
            state_file.write_text(json.dumps(state))
            progress.report(entry.path, force=True)
        progress.report("", force=True)
        return {"files": len(entries), "bytes": progress.total, "downloaded": progress.downloaded, "skipped": skipped}


def _verify_in_place(directory: Path, entries: list[FileEntry], out) -> dict:
    for e in entries:
        p = directory / e.path
        if not p.exists():
            raise FetchError(f"checkpoint file {e.path!r}: missing in {directory}")
        wrong = _check(p, e)
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


def parse_progress(log: str) -> Optional[float]:
    """The percentage of the last `FETCH <pct>% …` line of a log, or None."""
    for line in reversed(log.splitlines()):
        mt = PROGRESS_RE.match(line.strip())
        if mt:
            return float(mt.group(1))
    return None


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", nargs="?", help="http(s)://…, hf://ORG/NAME[@REV] or a local checkpoint directory")
    p.add_argument("--cache", type=Path, help="directory the checkpoint is fetched into (created)")
    p.add_argument("--only", action="append", default=[], metavar="GLOB",
                   help="fetch only the .safetensors files matching GLOB (repeatable; other files always)")
    p.add_argument("--retries", type=int, default=8, help="retries per file after a transient failure (default 8)")
    p.add_argument("--backoff", type=float, default=0.5, help="first retry delay in seconds, doubled each time")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per network read (default 60)")
    p.add_argument("--write-index", type=Path, metavar="DIR",
                   help=f"write DIR/{INDEX_NAME} (size and sha256 of every file) and exit")


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
        r = fetch(args.source, args.cache, patterns=args.only, retries=args.retries, backoff=args.backoff,
                  timeout=args.timeout, out=say)
    except FetchError as e:
        say(f"FETCH failed: {e}")
        return 1
    say(f"FETCH done {r['files']} files, {r['bytes']} bytes ({r['downloaded']} downloaded, "
        f"{r['skipped']} already verified)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="expertmesh fetch", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
