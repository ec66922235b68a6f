"""`expertmesh fetch`: a tiny checkpoint over loopback HTTP — verified per file, resumed after a cut connection,
retried after 503s, skipped on a rerun, a corrupted file refused by name; the Hub layout (hf://) through
$HF_ENDPOINT; progress lines as the operator parses them."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tracemalloc

import pytest
from support.fetch_server import Faults, FileServer

from expertmesh.checkpoint import fetch as f
from expertmesh.checkpoint.fetch_index import (
    INDEX_FORMAT,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    STATE_DIR,
    FetchError,
    git_blob_sha1,
    sha256_file,
    write_index,
)
from expertmesh.checkpoint.fetch_sources import parse_source, sigv4_headers
from expertmesh.entry.cli import main
from expertmesh.runtime.tls import ephemeral_pki

LAYER = "model-layers-00001-00001.safetensors"


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny_checkpoint_copy):
    d = tiny_checkpoint_copy(tmp_path_factory.mktemp("published") / "tiny")
    write_index(d)
    return d


def _same_tree(a, b) -> bool:
    def files(d):
        return {
            p.relative_to(d).as_posix(): p.read_bytes()
            for p in d.rglob("*")  # noqa: E731
            if p.is_file() and STATE_DIR not in p.parts and p.name != INDEX_NAME
        }

    return files(a) == files(b)


def test_fetch_verifies_resumes_retries_and_skips_what_it_has(published, tmp_path):
    index = json.loads((published / INDEX_NAME).read_text())
    assert {e["path"] for e in index["files"]} >= {"config.json", LAYER} and all(
        e["sha256"] == hashlib.sha256((published / e["path"]).read_bytes()).hexdigest() for e in index["files"]
    )
    faults = Faults(fail={INDEX_NAME: 1, "config.json": 2}, cut={LAYER: 30000})
    lines: list[str] = []
    with FileServer(published, faults) as srv:
        r = f.fetch(srv.url + "/", tmp_path / "cache", backoff=0.01, out=lines.append, progress_every=0)
        assert _same_tree(published, tmp_path / "cache")
        assert (
            r["files"] == len(index["files"])
            and r["downloaded"] == r["bytes"] == sum(e["size"] for e in index["files"])
            and r["skipped"] == 0
        )
        # 503s retried with backoff; the cut file resumed from where it stopped (one Range request)
        assert sum("retry" in x for x in lines) == 1 + 2 + 1
        assert [(p, rng, s) for p, rng, s in faults.requests if p == LAYER] == [
            (LAYER, None, 200),
            (LAYER, "bytes=30000-", 206),
        ]
        pcts = [f.parse_progress(x) for x in lines if f.parse_progress(x) is not None]
        assert pcts == sorted(pcts) and pcts[-1] == 100.0 and len(set(pcts)) > 3
        assert not list((tmp_path / "cache").rglob("*.partial"))
        # a rerun (another pod on the node, a restarted init container) downloads nothing
        n = len(faults.requests)
        again = f.fetch(srv.url, tmp_path / "cache", backoff=0.01, out=lines.append)
        assert (again["downloaded"], again["skipped"]) == (0, len(index["files"]))
        assert [p for p, _, _ in faults.requests[n:]] == [INDEX_NAME]
        # only some shards (an expert pod's), every other file always
        part = f.fetch(srv.url, tmp_path / "some", patterns=["*00001-00001*"], out=lines.append)
        got = {p.name for p in (tmp_path / "some").iterdir() if p.is_file()}
        assert got == {"config.json", "model.safetensors.index.json", LAYER} and part["files"] == 3


def test_a_corrupted_file_is_refused_by_name(published, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(published, bad)
    data = bytearray((bad / LAYER).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the sha256 can tell
    (bad / LAYER).write_bytes(bytes(data))
    faults = Faults()
    with FileServer(bad, faults) as srv:
        with pytest.raises(FetchError, match=rf"checkpoint file '{LAYER}'.*sha256 [0-9a-f]{{64}}, the index says"):
            f.fetch(srv.url, tmp_path / "cache", backoff=0.01, out=lambda _: None)
        assert [p for p, _, _ in faults.requests].count(LAYER) == 2  # once more from scratch, then refused
        assert not (tmp_path / "cache" / LAYER).exists() and not list((tmp_path / "cache").rglob("*.partial"))
        # the CLI: exit 1, the last log line (the container's termination message) names the file
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["fetch", srv.url, "--cache", str(tmp_path / "cli"), "--backoff", "0.01"]) == 1
        lines = buf.getvalue().splitlines()
        assert lines[-1].startswith("FETCH failed: checkpoint file") and LAYER in lines[-1]
        # a missing file is a refusal at once (no retries), naming the URL
        (bad / "config.json").unlink()
        with pytest.raises(FetchError, match=r"config.json: HTTP 404"):
            f.fetch(srv.url, tmp_path / "c2", backoff=0.01, out=lambda _: None)
    with pytest.raises(FetchError, match="giving up after 3 attempts"):
        f.fetch("http://127.0.0.1:9/", tmp_path / "c3", retries=2, backoff=0.01, timeout=2, out=lambda _: None)
    with pytest.raises(FetchError, match="unsupported checkpoint source"):
        f.fetch("ftp://x/y", tmp_path / "c4")
    with pytest.raises(FetchError, match=r"hf://ORG/NAME"):
        parse_source("hf://just-a-name")


def _hub(tmp_path, published, prefix: str = ""):
    """A Hub layout (resolve/ URLs and the model-info API) for org/tiny@v1 under tmp_path/hub/<prefix>: returns the
    hub's root and the repository's file directory."""
    hub = tmp_path / "hub"
    root = hub / prefix if prefix else hub
    repo = root / "org" / "tiny" / "resolve" / "v1"
    shutil.copytree(published, repo)
    (repo / INDEX_NAME).unlink()
    siblings = []
    for p in sorted(repo.iterdir()):
        if p.suffix == ".safetensors":  # LFS: sha256; the rest: git blob id
            siblings.append(
                {
                    "rfilename": p.name,
                    "size": p.stat().st_size,
                    "lfs": {"sha256": sha256_file(p), "size": p.stat().st_size},
                }
            )
        else:
            siblings.append({"rfilename": p.name, "size": p.stat().st_size, "blobId": git_blob_sha1(p)})
    api = root / "api" / "models" / "org" / "tiny" / "revision" / "v1"
    api.parent.mkdir(parents=True)
    api.write_text(json.dumps({"id": "org/tiny", "siblings": siblings}))
    return hub, repo


def test_hugging_face_layout_through_hf_endpoint(published, tmp_path, monkeypatch):
    hub, repo = _hub(tmp_path, published)
    siblings = json.loads((hub / "api/models/org/tiny/revision/v1").read_text())["siblings"]
    with FileServer(hub) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        r = f.fetch("hf://org/tiny@v1", tmp_path / "cache", out=lambda _: None)
        assert r["files"] == len(siblings) and _same_tree(repo, tmp_path / "cache")
        (repo / "config.json").write_text((repo / "config.json").read_text() + " ")  # not what the Hub lists
        with pytest.raises(FetchError, match=r"'config.json'.*size"):
            f.fetch("hf://org/tiny@v1", tmp_path / "other", backoff=0.01, out=lambda _: None)


def test_hf_endpoint_with_a_path_prefix(published, tmp_path, monkeypatch):
    # a mirror under a path (https://mirror/hf): both the API and the resolve/ URLs sit below it
    hub, repo = _hub(tmp_path, published, prefix="mirror/hf")
    faults = Faults()
    with FileServer(hub, faults) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url + "/mirror/hf/")
        r = f.fetch("hf://org/tiny@v1", tmp_path / "cache", out=lambda _: None)
        assert _same_tree(repo, tmp_path / "cache") and r["downloaded"] == r["bytes"]
        assert faults.requests[0][0] == "mirror/hf/api/models/org/tiny/revision/v1"
        assert 404 not in [s for _, _, s in faults.requests]
    monkeypatch.setenv("HF_ENDPOINT", "mirror.example/hf")
    with pytest.raises(FetchError, match=r"HF_ENDPOINT 'mirror.example/hf'.*http"):
        parse_source("hf://org/tiny")


def test_local_directory_is_verified_in_place_and_progress_parses(published, tmp_path):
    r = f.fetch(str(published), tmp_path / "unused", out=lambda _: None)
    assert r["downloaded"] == 0 and r["files"] == len(json.loads((published / INDEX_NAME).read_text())["files"])
    assert f.parse_progress("x\nFETCH 12.5% 1.0/8.0 MiB a\nFETCH 37.0% 3.0/8.0 MiB b\nother") == 37.0
    assert f.parse_progress("no progress here") is None


def test_s3_source_signs_every_request(published, tmp_path, monkeypatch):
    # AWS's documented example (GET Object, first 10 bytes): the signature must come out exactly
    h = sigv4_headers(
        "GET",
        "https://examplebucket.s3.amazonaws.com/test.txt",
        {"Range": "bytes=0-9"},
        access_key="AKIAIOSFODNN7EXAMPLE",
        secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        region="us-east-1",
        amz_date="20130524T000000Z",
    )
    assert h["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )
    # an S3-compatible endpoint (path-style: /bucket/prefix/...) that checks every request's signature
    store = tmp_path / "store"
    shutil.copytree(published, store / "models" / "tiny")
    seen = []

    def check(path: str, headers: dict) -> bool:
        given = {k.lower(): v for k, v in headers.items()}
        signed = given.get("authorization", "").split("SignedHeaders=")[-1].split(",")[0].split(";")
        keep = {k: given[k] for k in signed if k not in ("host", "x-amz-date", "x-amz-content-sha256")}
        want = sigv4_headers(
            "GET",
            f"http://{given['host']}{path}",
            keep,
            access_key="AK",
            secret_key="SK",
            region="eu-west-3",
            amz_date=given.get("x-amz-date", ""),
        )
        seen.append("range" in signed)
        return want["Authorization"] == given.get("authorization")

    faults = Faults(auth=check, cut={"models/tiny/" + LAYER: 20000})
    with FileServer(store, faults) as srv:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", srv.url)
        monkeypatch.setenv("AWS_REGION", "eu-west-3")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SK")
        r = f.fetch("s3://models/tiny", tmp_path / "cache", backoff=0.01, out=lambda _: None)
        assert _same_tree(store / "models" / "tiny", tmp_path / "cache") and r["downloaded"] == r["bytes"]
        assert 403 not in [status for _, _, status in faults.requests]
        assert any(seen)  # the resumed request's Range header was signed too
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(FetchError, match="HTTP 403"):
            f.fetch("s3://models/tiny", tmp_path / "other", backoff=0.01, out=lambda _: None)


# ------------------------------------------------------------------------------------------------ hardening (#33)
def _lower(headers: dict) -> set:
    return {k.lower() for k in headers}


def test_credentials_go_only_to_their_own_origin(published, tmp_path, monkeypatch):
    """HF_TOKEN and S3 signatures are for the source's origin: a redirect to another origin (here the same host on
    another port) is followed without them; a redirect within the origin keeps them."""
    hub, repo = _hub(tmp_path, published)
    moved = hub / "moved"
    moved.mkdir()
    shutil.copy(repo / "config.json", moved / "config.json")
    cdn = Faults()
    with FileServer(repo, cdn) as other:
        faults = Faults(
            redirect={
                f"org/tiny/resolve/v1/{LAYER}": f"{other.url}/{LAYER}?X-Amz-Signature=presigned",
                "org/tiny/resolve/v1/config.json": "/moved/config.json",
            },
            auth=lambda path, h: h.get("Authorization") == "Bearer hf_secret",
        )
        with FileServer(hub, faults) as srv:
            monkeypatch.setenv("HF_ENDPOINT", srv.url)
            monkeypatch.setenv("HF_TOKEN", "hf_secret")
            f.fetch("hf://org/tiny@v1", tmp_path / "cache", out=lambda _: None)
            assert _same_tree(repo, tmp_path / "cache")
    assert ("moved/config.json", None, 200) in faults.requests  # same origin: the token went along
    assert [p for p, _ in cdn.headers] == [LAYER]
    assert all("authorization" not in _lower(h) for _, h in cdn.headers), cdn.headers

    # S3: the signature and the session token stay with the endpoint
    monkeypatch.delenv("HF_TOKEN")
    store = tmp_path / "store"
    shutil.copytree(published, store / "models" / "tiny")
    cdn = Faults()
    with FileServer(store / "models" / "tiny", cdn) as other:
        faults = Faults(redirect={f"models/tiny/{LAYER}": f"{other.url}/{LAYER}"})
        with FileServer(store, faults) as srv:
            for k, v in {
                "AWS_ENDPOINT_URL_S3": srv.url,
                "AWS_REGION": "eu-west-3",
                "AWS_ACCESS_KEY_ID": "AK",
                "AWS_SECRET_ACCESS_KEY": "SK",
                "AWS_SESSION_TOKEN": "session-secret",
            }.items():
                monkeypatch.setenv(k, v)
            f.fetch("s3://models/tiny", tmp_path / "s3cache", out=lambda _: None)
            assert _same_tree(store / "models" / "tiny", tmp_path / "s3cache")
    assert all("x-amz-security-token" in _lower(h) for _, h in faults.headers)  # the endpoint got them
    assert [p for p, _ in cdn.headers] == [LAYER]
    assert all(not any(k == "authorization" or k.startswith("x-amz-") for k in _lower(h)) for _, h in cdn.headers)


def test_a_redirect_from_https_to_http_is_refused(published, tmp_path, monkeypatch):
    pki = ephemeral_pki(tmp_path / "pki")
    monkeypatch.setenv("SSL_CERT_FILE", str(pki / "ca.crt"))  # the client trusts the test CA
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub, repo = _hub(tmp_path, published)
    plain = Faults()
    with FileServer(repo, plain) as http_srv:
        faults = Faults(redirect={"org/tiny/resolve/v1/config.json": f"{http_srv.url}/config.json?sig=s3cr3t"})
        with FileServer(hub, faults, tls=(pki / "server.crt", pki / "server.key")) as srv:
            monkeypatch.setenv("HF_ENDPOINT", srv.url)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(["fetch", "hf://org/tiny@v1", "--cache", str(tmp_path / "cache"), "--backoff", "0.01"]) == 1
    last = buf.getvalue().splitlines()[-1]
    assert (
        last.startswith(
            f"FETCH failed: GET {srv.url}/org/tiny/resolve/v1/config.json: redirected to {http_srv.url}/config.json"
        )
        and "https to http" in last
    ), last
    assert "s3cr3t" not in buf.getvalue()  # a redirect target's query (a presigned URL's signature) is not logged
    assert plain.requests == [] and ("org/tiny/resolve/v1/config.json", None, 302) in faults.requests


def test_a_file_is_read_up_to_its_indexed_size_and_no_further(published, tmp_path):
    size = (published / "config.json").stat().st_size
    faults = Faults(oversize={"config.json": 48 << 20})
    with FileServer(published, faults) as srv:
        with pytest.raises(
            FetchError,
            match=rf"checkpoint file 'config.json' from .*: the server sends more than "
            rf"the {size} bytes the index lists",
        ):
            f.fetch(srv.url, tmp_path / "cache", backoff=0.01, out=lambda _: None)
        assert [p for p, _, _ in faults.requests].count("config.json") == 1  # refused at once, not fetched again
        assert not list((tmp_path / "cache").glob("config.json*"))
        # a body without end, through the CLI: one line naming the file, nothing kept
        faults.oversize["config.json"] = None
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["fetch", srv.url, "--cache", str(tmp_path / "cli"), "--backoff", "0.01"]) == 1
        last = buf.getvalue().splitlines()[-1]
        assert last.startswith("FETCH failed: checkpoint file 'config.json'") and "more than" in last, last
        assert not list((tmp_path / "cli").glob("config.json*"))
        # the cache never held more than the index's bytes; the server could only fill the socket buffers
        assert faults.sent["config.json"] < 2 * size + (24 << 20)
        # a redirect's own body is never read (urllib would hold all of it)
        faults.oversize.clear()
        with FileServer(
            published, Faults(redirect={"config.json": f"{srv.url}/config.json"}, oversize={"config.json": 64 << 20})
        ) as hop:
            tracemalloc.start()
            try:
                f.fetch(hop.url, tmp_path / "hop", backoff=0.01, out=lambda _: None, progress_every=1e9)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert _same_tree(published, tmp_path / "hop") and peak < (8 << 20), peak
        # a Content-Length other than the indexed size is refused before the body is read
        (bigger := tmp_path / "bigger").mkdir()
        shutil.copytree(published, bigger, dirs_exist_ok=True)
        (bigger / "config.json").write_bytes((published / "config.json").read_bytes() + b" " * (32 << 20))
        faults = Faults()
        with FileServer(bigger, faults) as big:
            with pytest.raises(
                FetchError,
                match=rf"'config.json'.*size {size + (32 << 20)} bytes \(the server's "
                rf"Content-Length\), the index says {size}",
            ):
                f.fetch(big.url, tmp_path / "c3", backoff=0.01, out=lambda _: None)
            assert faults.sent.get("config.json", 0) < (24 << 20)


def test_the_index_is_bounded(published, tmp_path, monkeypatch):
    faults = Faults(pad={INDEX_NAME: 64 << 20})  # still a valid index after 64 MiB of spaces
    with FileServer(published, faults) as srv:
        buf = io.StringIO()
        tracemalloc.start()
        try:
            with contextlib.redirect_stdout(buf):
                rc = main(["fetch", srv.url, "--cache", str(tmp_path / "cache")])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        last = buf.getvalue().splitlines()[-1]
        assert rc == 1 and last == (
            f"FETCH failed: {srv.url}/{INDEX_NAME}: more than {MAX_INDEX_BYTES} bytes (the limit, --max-index-mib 16)"
        ), last
        assert peak < 3 * MAX_INDEX_BYTES, peak
        # under the bound: fetched as usual
        faults.pad[INDEX_NAME] = 1 << 20
        assert f.fetch(srv.url, tmp_path / "ok", out=lambda _: None)["files"] > 0
        # without end, with a smaller bound
        faults.pad[INDEX_NAME] = None
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["fetch", srv.url, "--cache", str(tmp_path / "c2"), "--max-index-mib", "1"]) == 1
        assert buf.getvalue().splitlines()[-1].endswith(f"more than {1 << 20} bytes (the limit, --max-index-mib 1)")
    # the Hub's file list and a local index are bounded the same way
    hub, repo = _hub(tmp_path, published)
    with FileServer(hub, Faults(pad={"api/models/org/tiny/revision/v1": None})) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        with pytest.raises(FetchError, match=r"revision/v1\?blobs=true: more than 1048576 bytes"):
            f.fetch("hf://org/tiny@v1", tmp_path / "hf", max_index_bytes=1 << 20, out=lambda _: None)
    local = tmp_path / "local"
    shutil.copytree(published, local)
    (local / INDEX_NAME).write_bytes(b" " * (2 << 20) + (published / INDEX_NAME).read_bytes())
    with pytest.raises(FetchError, match=rf"{INDEX_NAME}: more than {1 << 20} bytes"):
        f.fetch(str(local), tmp_path / "unused", max_index_bytes=1 << 20, out=lambda _: None)


ABC = hashlib.sha256(b"abc").hexdigest()


def _e(path, size=3, sha256=ABC) -> dict:
    return {"path": path, "size": size, "sha256": sha256}


# (files, the entry the failure must name, a piece of what it says)
BAD_INDEXES = {
    "dot": ([_e(".")], 0, "relative path of plain names"),
    "dot-slash": ([_e("./")], 0, "relative path of plain names"),
    "dot-prefix": ([_e("./ok.txt")], 0, "relative path of plain names"),
    "double-slash": ([_e("a//b")], 0, "relative path of plain names"),
    "trailing-slash": ([_e("a/")], 0, "relative path of plain names"),
    "empty": ([_e("")], 0, "non-empty string"),
    "absolute": ([_e("/etc/passwd")], 0, "relative path"),
    "parent": ([_e("a/../../x")], 0, "relative path of plain names"),
    "nul": ([_e("a\x00b")], 0, "control character"),
    "newline": ([_e("a\nb")], 0, "control character"),
    "surrogate": ([_e("a\ud800")], 0, "UTF-8"),
    "long-name": ([_e("x" * 300)], 0, "name of 300 bytes"),
    "long-name-with-partial": ([_e("d/" + "y" * 250)], 0, "name of 250 bytes"),
    "long-path": ([_e("/".join(["p" * 200] * 6))], 0, "bytes long"),
    "not-a-string": ([_e(7)], 0, "non-empty string"),
    "lock": ([_e(".expertmesh-fetch/lock")], 0, "the fetch's own state"),
    "state": ([_e(".expertmesh-fetch/verified.json")], 0, "the fetch's own state"),
    "state-dir": ([_e(".expertmesh-fetch")], 0, "the fetch's own state"),
    "partial": ([_e("ok.txt.partial")], 0, ".partial"),
    "file-then-dir": ([_e("ok.txt"), _e("a"), _e("a/b")], 2, "needs 'a' to be a directory"),
    "dir-then-file": ([_e("a/b/c"), _e("a/b")], 0, "needs 'a/b' to be a directory"),
    "twice": ([_e("ok.txt"), _e("ok.txt")], 1, "listed twice"),
    "size-bool": ([_e("a", size=True)], 0, "size"),
    "size-negative": ([_e("a", size=-1)], 0, "size"),
    "size-float": ([_e("a", size=3.0)], 0, "size"),
    "sha-upper": ([_e("a", sha256=ABC.upper())], 0, "sha256"),
    "entry-not-object": ([_e("ok.txt"), "a"], 1, "must be an object"),
}


def _served_index(root, payload) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "ok.txt").write_bytes(b"abc")
    (root / INDEX_NAME).write_text(json.dumps(payload) if not isinstance(payload, str) else payload)


@pytest.mark.parametrize("case", sorted(BAD_INDEXES))
def test_a_bad_index_entry_ends_in_one_failed_line(tmp_path, case):
    files, bad, says = BAD_INDEXES[case]
    served = tmp_path / "served"
    _served_index(served, {"format": INDEX_FORMAT, "files": [_e("ok.txt")]})
    cache = tmp_path / "cache"
    with FileServer(served) as srv:
        assert main(["fetch", srv.url, "--cache", str(cache)]) == 0
        state = (cache / STATE_DIR / "verified.json").read_bytes()
        for e in files:  # what the index names is there to be fetched: only the check can stop it
            p = e["path"] if isinstance(e, dict) else None
            if isinstance(p, str) and p and "\x00" not in p and not p.startswith("/") and ".." not in p:
                with contextlib.suppress(OSError, UnicodeError):
                    (served / p).parent.mkdir(parents=True, exist_ok=True)
                    (served / p).write_bytes(b"abc")
        (served / INDEX_NAME).write_text(json.dumps({"format": INDEX_FORMAT, "files": files}))
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["fetch", srv.url, "--cache", str(cache), "--retries", "0"])
    lines = buf.getvalue().splitlines()
    assert rc == 1 and lines[-1].startswith(f"FETCH failed: {srv.url}/{INDEX_NAME}: files[{bad}]"), lines
    assert sum("FETCH failed" in x for x in lines) == 1 and says in lines[-1], lines[-1]
    path = files[bad]["path"] if isinstance(files[bad], dict) else files[bad]
    assert repr(path)[:24] in lines[-1]
    assert (cache / STATE_DIR / "verified.json").read_bytes() == state
    assert (cache / "ok.txt").read_bytes() == b"abc" and (cache / STATE_DIR / "lock").is_file()


@pytest.mark.parametrize(
    "body, says",
    [
        ("not json", "not JSON"),
        ("[" * 100_000, "not JSON"),
        ('{"format": "expertmesh-index/1", "files": {}}', "not an expertmesh-index/1 index"),
        ("[]", "not an expertmesh-index/1 index"),
        (b'{"format": "expertmesh-index/1", "files": [\xff]}', "not JSON"),
    ],
)
def test_a_bad_index_ends_in_one_failed_line(tmp_path, body, says):
    served = tmp_path / "served"
    served.mkdir()
    (served / INDEX_NAME).write_bytes(body if isinstance(body, bytes) else body.encode())
    with FileServer(served) as srv:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["fetch", srv.url, "--cache", str(tmp_path / "cache")]) == 1
    last = buf.getvalue().splitlines()[-1]
    assert last.startswith(f"FETCH failed: {srv.url}/{INDEX_NAME}: {says}"), last


@pytest.mark.parametrize(
    "siblings, says",
    [
        ({}, "a list of siblings"),
        ([{"rfilename": "."}], "siblings[0]: file path '.'"),
        ([{"size": 3, "blobId": "0" * 40}], "siblings[0]: file path None"),
        ([{"rfilename": "a", "lfs": "x"}], "siblings[0] ('a'): lfs"),
        ([{"rfilename": "a", "size": "3", "blobId": "0" * 40}], "siblings[0] ('a'): size"),
        ([{"rfilename": "a", "size": 3, "lfs": {"sha256": "nothex", "size": 3}}], "siblings[0] ('a'): sha256"),
        ([{"rfilename": "a", "size": 3}], "neither an LFS sha256 nor a blob id"),
        ([{"rfilename": ".expertmesh-fetch/lock", "size": 3, "blobId": "0" * 40}], "the fetch's own state"),
        (
            [{"rfilename": "a", "size": 3, "blobId": "0" * 40}, {"rfilename": "a/b", "size": 3, "blobId": "0" * 40}],
            "siblings[1]: file path 'a/b' needs 'a' to be a directory",
        ),
    ],
)
def test_a_bad_hub_file_list_ends_in_one_failed_line(tmp_path, monkeypatch, siblings, says):
    api = tmp_path / "hub" / "api" / "models" / "org" / "tiny" / "revision" / "main"
    api.parent.mkdir(parents=True)
    api.write_text(json.dumps({"siblings": siblings}))
    with FileServer(tmp_path / "hub") as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["fetch", "hf://org/tiny", "--cache", str(tmp_path / "cache")]) == 1
    last = buf.getvalue().splitlines()[-1]
    assert (
        last.startswith(f"FETCH failed: {srv.url}/api/models/org/tiny/revision/main?blobs=true: ") and says in last
    ), last


def _snapshot(d) -> dict:
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = os.path.join(root, name)
            out[os.path.relpath(p, d)] = (
                ("link", os.readlink(p))
                if os.path.islink(p)
                else ("dir",)
                if os.path.isdir(p)
                else ("file", open(p, "rb").read())
            )
    return out


def test_links_in_the_cache_are_replaced_never_followed(tmp_path):
    served = tmp_path / "served"
    (served / "sub").mkdir(parents=True)
    for name, n in (("sub/a.bin", 5000), ("b.bin", 3000), ("c.bin", 2000), ("d.bin", 4000)):
        (served / name).write_bytes(os.urandom(n))
    write_index(served)
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    for name in ("victim", "lock", "state", "hard"):
        (outside / name).write_bytes(b"precious " + name.encode())
    (outside / "same").write_bytes((served / "c.bin").read_bytes())  # the right bytes, but outside the cache
    cache = tmp_path / "cache"
    (cache / STATE_DIR).mkdir(parents=True)
    (cache / "sub").symlink_to(outside / "dir")  # a directory the index needs: a link out
    (cache / "b.bin.partial").symlink_to(outside / "victim")  # a part to resume: a link out
    (cache / "c.bin").symlink_to(outside / "same")  # a file that would verify through the link
    os.link(outside / "hard", cache / "d.bin.partial")  # a part to resume: a hard link to a file outside
    (cache / STATE_DIR / "lock").symlink_to(outside / "lock")
    (cache / STATE_DIR / "verified.json").symlink_to(outside / "state")
    (other := tmp_path / "cache2").mkdir()
    (other / STATE_DIR).symlink_to(outside / "dir")  # the state directory itself
    before = _snapshot(outside)
    with FileServer(served) as srv:
        for c in (cache, other):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(["fetch", srv.url, "--cache", str(c)]) == 0, buf.getvalue()
            assert _same_tree(served, c)
            assert not [k for k, v in _snapshot(c).items() if v[0] == "link"]
            text = buf.getvalue()
            assert "symbolic link" in text and "FETCH failed" not in text
    assert _snapshot(outside) == before
    replaced = [x for x in text.splitlines() if "symbolic link" in x]
    assert replaced == [
        f"FETCH replaced '{STATE_DIR}': a symbolic link in the cache (→ {str(outside / 'dir')!r}) "
        f"where fetch needs a directory: fetch never follows links out of the cache"
    ]
