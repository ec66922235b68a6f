"""`expertmesh fetch`: a tiny checkpoint over loopback HTTP — verified per file, resumed after a cut connection,
retried after 503s, skipped on a rerun, a corrupted file refused by name; the Hub layout (hf://) through
$HF_ENDPOINT; progress lines as the operator parses them."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil

import pytest

from expertmesh import fetch as f
from expertmesh.checkpoint import create_checkpoint
from expertmesh.cli import main
from expertmesh.config import preset

from fetch_server import Faults, FileServer

LAYER = "model-layers-00001-00001.safetensors"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    d = tmp_path_factory.mktemp("published") / "tiny"
    create_checkpoint(preset("tiny"), d, seed=0)
    f.write_index(d)
    return d


def _same_tree(a, b) -> bool:
    files = lambda d: {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*")  # noqa: E731
                       if p.is_file() and f.STATE_DIR not in p.parts and p.name != f.INDEX_NAME}
    return files(a) == files(b)


def test_fetch_verifies_resumes_retries_and_skips_what_it_has(published, tmp_path):
    index = json.loads((published / f.INDEX_NAME).read_text())
    assert {e["path"] for e in index["files"]} >= {"config.json", LAYER} and \
        all(e["sha256"] == hashlib.sha256((published / e["path"]).read_bytes()).hexdigest() for e in index["files"])
    faults = Faults(fail={f.INDEX_NAME: 1, "config.json": 2}, cut={LAYER: 30000})
    lines: list[str] = []
    with FileServer(published, faults) as srv:
        r = f.fetch(srv.url + "/", tmp_path / "cache", backoff=0.01, out=lines.append, progress_every=0)
        assert _same_tree(published, tmp_path / "cache")
        assert r["files"] == len(index["files"]) and r["downloaded"] == r["bytes"] == sum(
            e["size"] for e in index["files"]) and r["skipped"] == 0
        # 503s retried with backoff; the cut file resumed from where it stopped (one Range request)
        assert sum("retry" in x for x in lines) == 1 + 2 + 1
        assert [(p, rng, s) for p, rng, s in faults.requests if p == LAYER] == [
            (LAYER, None, 200), (LAYER, "bytes=30000-", 206)]
        pcts = [f.parse_progress(x) for x in lines if f.parse_progress(x) is not None]
        assert pcts == sorted(pcts) and pcts[-1] == 100.0 and len(set(pcts)) > 3
        assert not list((tmp_path / "cache").rglob("*.partial"))
        # a rerun (another pod on the node, a restarted init container) downloads nothing
        n = len(faults.requests)
        again = f.fetch(srv.url, tmp_path / "cache", backoff=0.01, out=lines.append)
        assert (again["downloaded"], again["skipped"]) == (0, len(index["files"]))
        assert [p for p, _, _ in faults.requests[n:]] == [f.INDEX_NAME]
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
        with pytest.raises(f.FetchError, match=rf"checkpoint file '{LAYER}'.*sha256 [0-9a-f]{{64}}, the index says"):
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
        with pytest.raises(f.FetchError, match=r"config.json: HTTP 404"):
            f.fetch(srv.url, tmp_path / "c2", backoff=0.01, out=lambda _: None)
    with pytest.raises(f.FetchError, match="giving up after 3 attempts"):
        f.fetch("http://127.0.0.1:9/", tmp_path / "c3", retries=2, backoff=0.01, timeout=2, out=lambda _: None)
    with pytest.raises(f.FetchError, match="unsupported checkpoint source"):
        f.fetch("ftp://x/y", tmp_path / "c4")
    with pytest.raises(f.FetchError, match=r"hf://ORG/NAME"):
        f.parse_source("hf://just-a-name")


def test_hugging_face_layout_through_hf_endpoint(published, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    repo = hub / "org" / "tiny" / "resolve" / "v1"
    shutil.copytree(published, repo)
    (repo / f.INDEX_NAME).unlink()
    siblings = []
    for p in sorted(repo.iterdir()):
        if p.suffix == ".safetensors":  # LFS: sha256; the rest: git blob id
            siblings.append({"rfilename": p.name, "size": p.stat().st_size,
                             "lfs": {"sha256": f.sha256_file(p), "size": p.stat().st_size}})
        else:
            siblings.append({"rfilename": p.name, "size": p.stat().st_size, "blobId": f.git_blob_sha1(p)})
    api = hub / "api" / "models" / "org" / "tiny" / "revision" / "v1"
    api.parent.mkdir(parents=True)
    api.write_text(json.dumps({"id": "org/tiny", "siblings": siblings}))
    with FileServer(hub) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        r = f.fetch("hf://org/tiny@v1", tmp_path / "cache", out=lambda _: None)
        assert r["files"] == len(siblings) and _same_tree(repo, tmp_path / "cache")
        (repo / "config.json").write_text((repo / "config.json").read_text() + " ")  # not what the Hub lists
        with pytest.raises(f.FetchError, match=r"'config.json'.*size"):
            f.fetch("hf://org/tiny@v1", tmp_path / "other", backoff=0.01, out=lambda _: None)


def test_local_directory_is_verified_in_place_and_progress_parses(published, tmp_path):
    r = f.fetch(str(published), tmp_path / "unused", out=lambda _: None)
    assert r["downloaded"] == 0 and r["files"] == len(json.loads((published / f.INDEX_NAME).read_text())["files"])
    assert f.parse_progress("x\nFETCH 12.5% 1.0/8.0 MiB a\nFETCH 37.0% 3.0/8.0 MiB b\nother") == 37.0
    assert f.parse_progress("no progress here") is None


def test_s3_source_signs_every_request(published, tmp_path, monkeypatch):
    # AWS's documented example (GET Object, first 10 bytes): the signature must come out exactly
    h = f.sigv4_headers("GET", "https://examplebucket.s3.amazonaws.com/test.txt", {"Range": "bytes=0-9"},
                        access_key="AKIAIOSFODNN7EXAMPLE", secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                        region="us-east-1", amz_date="20130524T000000Z")
    assert h["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")
    # an S3-compatible endpoint (path-style: /bucket/prefix/...) that checks every request's signature
    store = tmp_path / "store"
    shutil.copytree(published, store / "models" / "tiny")
    seen = []

    def check(path: str, headers: dict) -> bool:
        given = {k.lower(): v for k, v in headers.items()}
        signed = given.get("authorization", "").split("SignedHeaders=")[-1].split(",")[0].split(";")
        keep = {k: given[k] for k in signed if k not in ("host", "x-amz-date", "x-amz-content-sha256")}
        want = f.sigv4_headers("GET", f"http://{given['host']}{path}", keep, access_key="AK", secret_key="SK",
                               region="eu-west-3", amz_date=given.get("x-amz-date", ""))
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
        with pytest.raises(f.FetchError, match="HTTP 403"):
            f.fetch("s3://models/tiny", tmp_path / "other", backoff=0.01, out=lambda _: None)
