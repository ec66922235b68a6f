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

Progress goes to stdout as `FETCH <pct>% <done>/<total> MiB <file>` (the operator reads the last such line of
the init container's log into the MoEDeployment's status: `Downloading 37%`); the last line is `FETCH done …`
or `FETCH failed: …` (the container's termination message).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import fnmatch
import hashlib
import http.client
import json
import os
import random
import re
import reprlib
import stat
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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
PROGRESS_RE = re.compile(r"^FETCH (\d+(?:\.\d+)?)% ")


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


@dataclass
class Source:
    """Where a checkpoint's files come from: `base` + a file's path, its index at `index_url`. `headers` (the Hub's
    bearer token) and `sign` (which adds a request's SigV4 headers, for S3) are credentials for the origin of
    `base`: no request to another origin carries them."""

    uri: str
    base: str = ""
    headers: dict = field(default_factory=dict)
    kind: str = "http"  # http | hf | s3 | local
    sign: Callable[[str, str, dict], dict] | None = None
    index_url: str = ""


# ------------------------------------------------------------------------------------------------ S3 (SigV4)
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def sigv4_headers(
    method: str,
    url: str,
    headers: dict,
    *,
    access_key: str,
    secret_key: str,
    region: str,
    amz_date: str,
    session_token: str | None = None,
    service: str = "s3",
) -> dict:
    """`headers` plus the AWS Signature Version 4 headers of a request without a body (x-amz-date,
    x-amz-content-sha256, Authorization; every given header is signed)."""
    import hmac

    u = urllib.parse.urlsplit(url)
    out = {**headers, "x-amz-date": amz_date, "x-amz-content-sha256": EMPTY_SHA256}
    if session_token:
        out["x-amz-security-token"] = session_token
    canon = {k.lower().strip(): " ".join(str(v).split()) for k, v in {"host": u.netloc, **out}.items()}
    signed = ";".join(sorted(canon))
    query = "&".join(
        sorted(
            f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
            for k, v in urllib.parse.parse_qsl(u.query, keep_blank_values=True)
        )
    )
    request = "\n".join(
        [
            method,
            urllib.parse.quote(u.path or "/", safe="/-_.~"),
            query,
            "".join(f"{k}:{canon[k]}\n" for k in sorted(canon)),
            signed,
            EMPTY_SHA256,
        ]
    )
    scope = f"{amz_date[:8]}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(request.encode()).hexdigest()])
    key = f"AWS4{secret_key}".encode()
    for part in (amz_date[:8], region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope},SignedHeaders={signed},Signature={signature}"
    )
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
    endpoint = (
        env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or f"https://s3.{region}.amazonaws.com"
    ).rstrip("/")
    prefix = u.path.strip("/")
    base = f"{endpoint}/{u.netloc}/" + (urllib.parse.quote(prefix) + "/" if prefix else "")
    sign = None
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        creds = dict(
            access_key=env["AWS_ACCESS_KEY_ID"],
            secret_key=env["AWS_SECRET_ACCESS_KEY"],
            region=region,
            session_token=env.get("AWS_SESSION_TOKEN"),
        )

        def sign(method: str, url: str, headers: dict) -> dict:
            return sigv4_headers(method, url, headers, amz_date=time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), **creds)

    return Source(uri, base=base, kind="s3", sign=sign, index_url=base + INDEX_NAME)


# ------------------------------------------------------------------------------------------------ index
def _hash(fh, h) -> str:
    while block := fh.read(CHUNK):
        h.update(block)
    return h.hexdigest()


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    with open(path, "rb") as f:
        return _hash(f, hashlib.sha256())


def git_blob_sha1(path: Path) -> str:
    with open(path, "rb") as f:
        return _hash(f, hashlib.sha1(f"blob {os.fstat(f.fileno()).st_size}\0".encode()))


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


_brief = reprlib.Repr()  # a value from an index as a failure line shows it: one line, bounded
_brief.maxstring = _brief.maxother = 60


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
            raise FetchError(f"{what} must be an object with path, size and sha256, got {_brief.repr(f)}")
        path = _safe_path(f.get("path"), what)
        what = f"{what} ({path!r})"
        out.append(FileEntry(path, _whole(f.get("size"), what), sha256=_hex(f.get("sha256"), 64, what, "sha256")))
    _check_layout(out, where, "files")
    return out


def _whole(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FetchError(f"{what}: size must be a whole number of bytes (>= 0), got {_brief.repr(value)}")
    return value


def _hex(value, digits: int, what: str, name: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(f"[0-9a-f]{{{digits}}}", value):
        raise FetchError(f"{what}: {name} must be {digits} lowercase hex digits, got {_brief.repr(value)}")
    return value


def _safe_path(path, what: str) -> str:
    """`path` when it is a plain relative path the cache can hold, else FetchError naming it (`what`: the entry)."""

    def bad(why: str):
        raise FetchError(f"{what}: file path {_brief.repr(path)} {why}")

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


def _check_layout(entries: list[FileEntry], where: str, key: str) -> None:
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


def _too_big(what: str, limit: int) -> FetchError:
    return FetchError(f"{what}: more than {limit} bytes (the limit, --max-index-mib {limit / 2**20:g})")


def _read_bounded(r, limit: int, what: str) -> bytearray:
    """The body of response `r`, refused past `limit` bytes: never more than that read or held."""
    length = (r.headers.get("Content-Length") or "").strip()
    if length.isdigit() and int(length) > limit:
        raise _too_big(what, limit)
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
            raise _too_big(what, limit)


def _json(data, where: str):
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise FetchError(f"{where}: not JSON: {e}") from None


# ------------------------------------------------------------------------------------------------ sources
def parse_source(uri: str) -> Source:
    """A checkpoint URI → Source. Raises FetchError for a scheme it does not know."""
    u = urllib.parse.urlsplit(uri)
    if u.scheme in ("http", "https"):
        if not u.hostname:
            raise FetchError(f"{uri}: expected {u.scheme}://HOST[:PORT]/PATH")
        base = uri.rstrip("/") + "/"
        return Source(uri, base=base, index_url=base + INDEX_NAME)
    if u.scheme == "hf":
        repo, _, rev = (u.netloc + u.path).partition("@")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise FetchError(f"{uri}: expected hf://ORG/NAME[@REVISION]")
        repo, rev = urllib.parse.quote(repo), urllib.parse.quote(rev or "main", safe="")
        endpoint = _hf_endpoint()
        headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else {}
        return Source(
            uri,
            base=f"{endpoint}/{repo}/resolve/{rev}/",
            headers=headers,
            kind="hf",
            index_url=f"{endpoint}/api/models/{repo}/revision/{rev}?blobs=true",
        )
    if u.scheme == "s3":
        return _s3_source(uri)
    if u.scheme in ("", "file"):
        base = u.path if u.scheme else uri
        return Source(uri, base=base, kind="local", index_url=str(Path(base) / INDEX_NAME))
    raise FetchError(f"{uri}: unsupported checkpoint source (http://, https://, hf://, s3:// or a local path)")


def _hf_endpoint() -> str:
    """$HF_ENDPOINT (default https://huggingface.co); a path is kept as a prefix (a mirror at https://host/hf)."""
    raw = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    u = urllib.parse.urlsplit(raw)
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
        raise FetchError(f"HF_ENDPOINT {raw!r}: expected http(s)://HOST[:PORT][/PATH]")
    return raw.rstrip("/")


def _origin(url: str) -> tuple:
    u = urllib.parse.urlsplit(url)
    try:
        port = u.port
    except ValueError:
        raise FetchError(f"{_shown(url)}: malformed port") from None
    scheme = u.scheme.lower()
    return scheme, (u.hostname or "").lower(), port or {"http": 80, "https": 443}.get(scheme)


def _shown(url: str) -> str:
    """`url` as a log line may show it: no userinfo, no query (a presigned URL's signature lives there)."""
    u = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((u.scheme, u.netloc.rpartition("@")[2], u.path, "", ""))


def _headers_for(src: Source, url: str, offset: int) -> dict:
    """A GET's headers: the Range from `offset` on, and the source's credentials only where `url` is on the origin
    they are for."""
    h = {"Range": f"bytes={offset}-"} if offset else {}
    if (src.headers or src.sign is not None) and _origin(url) == _origin(src.base):
        h.update(src.headers)
        if src.sign is not None:
            h = src.sign("GET", url, h)
    return {"User-Agent": "expertmesh-fetch", **h}


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect with the headers made for its target (credentials only on their own origin, a SigV4
    signature made again for the new URL); refuses one from https to http, or to anything but http(s)."""

    def __init__(self, src: Source, offset: int):
        self.src, self.offset = src, offset

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is None:
            return None
        old, to = (urllib.parse.urlsplit(u).scheme.lower() for u in (req.full_url, new.full_url))
        why = (
            "refused: from https to http (credentials and the file would travel unprotected)"
            if (old, to) == ("https", "http")
            else None
            if to in ("http", "https")
            else f"refused: {to or 'no'} scheme (only http and https)"
        )
        if why is not None:
            fp.close()
            raise FetchError(f"GET {_shown(req.full_url)}: redirected to {_shown(new.full_url)}: {why}")
        fp.close()  # its body unread: urllib would read all of it into memory, however long
        new.headers, new.unredirected_hdrs = {}, {}
        for k, v in _headers_for(self.src, new.full_url, self.offset).items():
            new.add_header(k, v)
        return new


def _request(src: Source, url: str, timeout: float, offset: int = 0):
    """Open `url` (from byte `offset` on) with the headers meant for it, through redirects as _Redirects allows;
    maps failures to TransientError / FetchError."""
    req = urllib.request.Request(url, headers=_headers_for(src, url, offset))
    try:
        return urllib.request.build_opener(_Redirects(src, offset)).open(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:  # the part on disk is already whole (or longer): start over
            raise TransientError(f"GET {url}: HTTP 416 at offset {offset}") from None
        if e.code in (408, 429) or e.code >= 500:
            raise TransientError(f"GET {url}: HTTP {e.code}") from None
        raise FetchError(f"GET {url}: HTTP {e.code} {e.reason}") from None
    except http.client.InvalidURL as e:
        raise FetchError(f"GET {url}: {e}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise TransientError(f"GET {url}: {getattr(e, 'reason', e)}") from None


def fetch_index(src: Source, timeout: float, limit: int = MAX_INDEX_BYTES) -> list[FileEntry]:
    """The source's file list (at most `limit` bytes of it read), validated."""
    if src.kind == "local":
        try:
            with open(src.index_url, "rb") as fh:
                data = fh.read(limit + 1)
        except FileNotFoundError:
            raise FetchError(
                f"{src.uri}: no {INDEX_NAME} (write one with `expertmesh fetch --write-index DIR`)"
            ) from None
        except OSError as e:
            raise FetchError(f"{src.index_url}: {e.strerror or e}") from None
        if len(data) > limit:
            raise _too_big(src.index_url, limit)
        return parse_index(_json(data, src.index_url), src.index_url)
    with _request(src, src.index_url, timeout) as r:
        payload = _json(_read_bounded(r, limit, src.index_url), src.index_url)
    return _hf_files(payload, src.index_url) if src.kind == "hf" else parse_index(payload, src.index_url)


def _hf_files(payload, api: str) -> list[FileEntry]:
    """The Hub's file list: LFS files carry their sha256, the others their git blob id."""
    siblings = payload.get("siblings") if isinstance(payload, dict) else None
    if not isinstance(siblings, list):
        raise FetchError(f"{api}: expected the Hub's model info, an object with a list of siblings")
    out = []
    for i, s in enumerate(siblings):
        what = f"{api}: siblings[{i}]"
        if not isinstance(s, dict):
            raise FetchError(f"{what} must be an object with rfilename and size, got {_brief.repr(s)}")
        name = _safe_path(s.get("rfilename"), what)
        what = f"{what} ({name!r})"
        lfs = s.get("lfs")
        if lfs is not None and not isinstance(lfs, dict):
            raise FetchError(f"{what}: lfs must be an object, got {_brief.repr(lfs)}")
        if lfs and lfs.get("sha256") is not None:
            out.append(
                FileEntry(
                    name, _whole(lfs.get("size", s.get("size")), what), sha256=_hex(lfs["sha256"], 64, what, "sha256")
                )
            )
        elif s.get("blobId") is not None and s.get("size") is not None:
            out.append(FileEntry(name, _whole(s["size"], what), git_sha1=_hex(s["blobId"], 40, what, "blobId")))
        else:
            raise FetchError(f"{what}: has neither an LFS sha256 nor a blob id and size")
    if not out:
        raise FetchError(f"{api}: the repository lists no files")
    _check_layout(out, api, "siblings")
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
    return min(cap, base * 2**attempt) * (0.5 + random.random() / 2)


def _check_file(fh, entry: FileEntry) -> str | None:
    """None when the open file `fh` matches the index entry, else what is wrong."""
    size = os.fstat(fh.fileno()).st_size
    if size != entry.size:
        return f"size {size} bytes, the index says {entry.size}"
    if entry.sha256 is not None:
        got = _hash(fh, hashlib.sha256())
        return None if got == entry.sha256 else f"sha256 {got}, the index says {entry.sha256}"
    got = _hash(fh, hashlib.sha1(f"blob {size}\0".encode()))
    return None if got == entry.git_sha1 else f"git blob id {got}, the index says {entry.git_sha1}"


def _check(path: Path, entry: FileEntry) -> str | None:
    with open(path, "rb") as fh:
        return _check_file(fh, entry)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a fifo planted in the cache cannot hang us


class _Cache:
    """The cache directory, walked from a directory descriptor one name at a time, never through a symbolic link:
    a link (or a file) where the index needs a directory, or a link (or a fifo, …) where it puts a file, is
    removed — and said so — and a real one made in its place, so nothing outside the cache is read or written. A
    directory in the way is left alone (FetchError). The cache directory itself may be a link: whoever chose
    `--cache` chose that."""

    def __init__(self, root: Path, out):
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.out = root, out
        self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self.fd)

    def clear(self, dfd: int, name: str, rel: str, need: str) -> None:
        """Remove what is at `rel` (not a `need`) so that one can be made there."""
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            raise FetchError(
                f"{self.root / rel}: a directory in the cache where fetch needs a {need} (left alone: "
                f"remove it by hand)"
            )
        if stat.S_ISLNK(st.st_mode):
            what = f"a symbolic link in the cache (→ {os.readlink(name, dir_fd=dfd)!r})"
            why = "fetch never follows links out of the cache"
        else:
            what = "a file in the cache" if stat.S_ISREG(st.st_mode) else "a special file in the cache"
            why = "it is in the way"
        os.unlink(name, dir_fd=dfd)
        self.out(f"FETCH replaced {rel!r}: {what} where fetch needs a {need}: {why}")

    def directory(self, parts: list[str]) -> int:
        """A descriptor of the directory `parts` below the root, made where missing."""
        fd = os.dup(self.fd)
        try:
            for k, name in enumerate(parts):
                rel = "/".join(parts[: k + 1])
                for _ in range(3):  # there, made, or cleared and made
                    try:
                        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
                        break
                    except FileNotFoundError:
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(name, 0o755, dir_fd=fd)
                    except OSError as e:
                        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                            raise
                        self.clear(fd, name, rel, "directory")
                else:
                    raise FetchError(f"{self.root / rel}: cannot make it a directory (something keeps replacing it)")
                os.close(fd)
                fd = sub
            return fd
        except BaseException:
            os.close(fd)
            raise

    def open(self, dfd: int, name: str, rel: str, flags: int) -> int:
        """os.open of the regular file `name` in `dfd`, never through a link (whatever else is there is cleared)."""
        for _ in range(3):
            try:
                fd = os.open(name, flags | _NOFOLLOW, 0o644, dir_fd=dfd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                    raise
                self.clear(dfd, name, rel, "file")
                continue
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            self.clear(dfd, name, rel, "file")
        raise FetchError(f"{self.root / rel}: cannot open it as a file (something keeps replacing it)")

    def create(self, dfd: int, name: str, rel: str) -> int:
        """A new, empty regular file `name` in `dfd` for writing: whatever was there is removed first, so nothing is
        written through a link — symbolic, or a hard link to a file elsewhere."""
        if self.regular(dfd, name, rel) is not None:
            os.unlink(name, dir_fd=dfd)
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=dfd)

    def regular(self, dfd: int, name: str, rel: str) -> os.stat_result | None:
        """The stat of the regular file at `rel`, None when there is none (anything else there is cleared)."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISREG(st.st_mode):
            return st
        self.clear(dfd, name, rel, "file")
        return None

    def check(self, dfd: int, name: str, rel: str, entry: FileEntry) -> str | None:
        with os.fdopen(self.open(dfd, name, rel, os.O_RDONLY), "rb") as fh:
            return _check_file(fh, entry)

    def load_state(self, sfd: int) -> dict:
        """The record of verified files ({} when there is none or it is unreadable: everything is verified again)."""
        try:
            fh = os.fdopen(self.open(sfd, STATE_FILE, f"{STATE_DIR}/{STATE_FILE}", os.O_RDONLY), "rb")
        except FileNotFoundError:
            return {}
        with fh:
            with contextlib.suppress(ValueError, RecursionError):
                state = json.loads(fh.read())
                if isinstance(state, dict):
                    return state
        self.out(f"FETCH {STATE_DIR}/{STATE_FILE} unreadable: every file is verified again")
        return {}

    def save_state(self, sfd: int, state: dict) -> None:
        """Written whole to a temporary file, then renamed over the record: never torn."""
        tmp = STATE_FILE + ".tmp"
        fd = self.create(sfd, tmp, f"{STATE_DIR}/{tmp}")
        try:
            _write_all(fd, json.dumps(state).encode())
        finally:
            os.close(fd)
        os.replace(tmp, STATE_FILE, src_dir_fd=sfd, dst_dir_fd=sfd)


def _download(
    src: Source, entry: FileEntry, cache: _Cache, dfd: int, part: str, progress: Progress, timeout: float
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
    with _request(src, url, timeout, offset) as r:
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
                    _write_all(fd, block)
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
        store = _Cache(Path(cache), out)
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
    src: Source, store: _Cache, sfd: int, patterns, retries, backoff, timeout, out, progress_every, max_index_bytes
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
    store: _Cache,
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
            wrong = _check(directory / e.path, e)
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
