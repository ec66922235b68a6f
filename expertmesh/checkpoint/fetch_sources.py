"""Where `expertmesh fetch` (checkpoint/fetch.py) reads a checkpoint from: `http(s)://`, `hf://` (the Hugging Face
Hub), `s3://` (SigV4-signed) or a local directory; each source's index, and requests whose credentials go only to
the origin they are for (a redirect elsewhere drops them, https → http is refused)."""

from __future__ import annotations

import hashlib
import http.client
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from expertmesh.checkpoint.fetch_index import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    FetchError,
    FileEntry,
    TransientError,
    brief,
    check_layout,
    hex_digest,
    json_payload,
    parse_index,
    read_bounded,
    safe_path,
    too_big,
    whole,
)


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


def s3_source(uri: str) -> Source:
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
        endpoint = hf_endpoint()
        headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else {}
        return Source(
            uri,
            base=f"{endpoint}/{repo}/resolve/{rev}/",
            headers=headers,
            kind="hf",
            index_url=f"{endpoint}/api/models/{repo}/revision/{rev}?blobs=true",
        )
    if u.scheme == "s3":
        return s3_source(uri)
    if u.scheme in ("", "file"):
        base = u.path if u.scheme else uri
        return Source(uri, base=base, kind="local", index_url=str(Path(base) / INDEX_NAME))
    raise FetchError(f"{uri}: unsupported checkpoint source (http://, https://, hf://, s3:// or a local path)")


def hf_endpoint() -> str:
    """$HF_ENDPOINT (default https://huggingface.co); a path is kept as a prefix (a mirror at https://host/hf)."""
    raw = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    u = urllib.parse.urlsplit(raw)
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
        raise FetchError(f"HF_ENDPOINT {raw!r}: expected http(s)://HOST[:PORT][/PATH]")
    return raw.rstrip("/")


def origin(url: str) -> tuple:
    u = urllib.parse.urlsplit(url)
    try:
        port = u.port
    except ValueError:
        raise FetchError(f"{shown_url(url)}: malformed port") from None
    scheme = u.scheme.lower()
    return scheme, (u.hostname or "").lower(), port or {"http": 80, "https": 443}.get(scheme)


def shown_url(url: str) -> str:
    """`url` as a log line may show it: no userinfo, no query (a presigned URL's signature lives there)."""
    u = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((u.scheme, u.netloc.rpartition("@")[2], u.path, "", ""))


def headers_for(src: Source, url: str, offset: int) -> dict:
    """A GET's headers: the Range from `offset` on, and the source's credentials only where `url` is on the origin
    they are for."""
    h = {"Range": f"bytes={offset}-"} if offset else {}
    if (src.headers or src.sign is not None) and origin(url) == origin(src.base):
        h.update(src.headers)
        if src.sign is not None:
            h = src.sign("GET", url, h)
    return {"User-Agent": "expertmesh-fetch", **h}


class Redirects(urllib.request.HTTPRedirectHandler):
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
            raise FetchError(f"GET {shown_url(req.full_url)}: redirected to {shown_url(new.full_url)}: {why}")
        fp.close()  # its body unread: urllib would read all of it into memory, however long
        new.headers, new.unredirected_hdrs = {}, {}
        for k, v in headers_for(self.src, new.full_url, self.offset).items():
            new.add_header(k, v)
        return new


def open_url(src: Source, url: str, timeout: float, offset: int = 0):
    """Open `url` (from byte `offset` on) with the headers meant for it, through redirects as Redirects allows;
    maps failures to TransientError / FetchError."""
    req = urllib.request.Request(url, headers=headers_for(src, url, offset))
    try:
        return urllib.request.build_opener(Redirects(src, offset)).open(req, timeout=timeout)
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
            raise too_big(src.index_url, limit)
        return parse_index(json_payload(data, src.index_url), src.index_url)
    with open_url(src, src.index_url, timeout) as r:
        payload = json_payload(read_bounded(r, limit, src.index_url), src.index_url)
    return hf_files(payload, src.index_url) if src.kind == "hf" else parse_index(payload, src.index_url)


def hf_files(payload, api: str) -> list[FileEntry]:
    """The Hub's file list: LFS files carry their sha256, the others their git blob id."""
    siblings = payload.get("siblings") if isinstance(payload, dict) else None
    if not isinstance(siblings, list):
        raise FetchError(f"{api}: expected the Hub's model info, an object with a list of siblings")
    out = []
    for i, s in enumerate(siblings):
        what = f"{api}: siblings[{i}]"
        if not isinstance(s, dict):
            raise FetchError(f"{what} must be an object with rfilename and size, got {brief.repr(s)}")
        name = safe_path(s.get("rfilename"), what)
        what = f"{what} ({name!r})"
        lfs = s.get("lfs")
        if lfs is not None and not isinstance(lfs, dict):
            raise FetchError(f"{what}: lfs must be an object, got {brief.repr(lfs)}")
        if lfs and lfs.get("sha256") is not None:
            out.append(
                FileEntry(
                    name,
                    whole(lfs.get("size", s.get("size")), what),
                    sha256=hex_digest(lfs["sha256"], 64, what, "sha256"),
                )
            )
        elif s.get("blobId") is not None and s.get("size") is not None:
            out.append(FileEntry(name, whole(s["size"], what), git_sha1=hex_digest(s["blobId"], 40, what, "blobId")))
        else:
            raise FetchError(f"{what}: has neither an LFS sha256 nor a blob id and size")
    if not out:
        raise FetchError(f"{api}: the repository lists no files")
    check_layout(out, api, "siblings")
    return out
