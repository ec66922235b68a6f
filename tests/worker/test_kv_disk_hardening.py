"""The KV disk tier under attack (worker/kv_tiers.py, expertmesh/wire/kv_snapshot.py): files whose header lies, files
that are not regular files (FIFOs, links to /dev/zero, to a file outside the folder, dangling), files larger than
the tier, payloads re-hashed by someone without the key, and tier folders that others can write. The worker starts,
refuses and counts each bad file, never touches what a link points at, and serves the good prefix bit for bit."""

import hashlib
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading

import pytest
import torch

from expertmesh.wire.kv_snapshot import CorruptFile, encode
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import NotFound, StepSegment
from expertmesh.worker.attention import AttentionWorker

BOUND = 2**20  # the tier's bound in these tests: a tiny prefix file is a few kB
KEY = b"the deployment's kv disk key, 32B"
GOOD = "good-prefix"


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint


def local_experts(ckpt):
    from expertmesh.entry.cluster import make_placement
    from expertmesh.placement.replica_table import ReplicaTable
    from expertmesh.worker.expert import ExpertWorker

    placement = make_placement(ckpt.cfg, 1, 0)
    table = ReplicaTable.from_placement(placement, ckpt.cfg.moe_layers, ckpt.cfg.moe.n_routed_experts)
    return [ExpertWorker(ckpt, placement.experts_of(0))], table


@pytest.fixture(scope="module")
def snap(ckpt):
    """A real prefix of the tiny model (40 tokens), as the device would demote it."""
    w = AttentionWorker(ckpt, kv_blocks=16, lease_seconds=0)
    w.connect_experts(*local_experts(ckpt))
    w.open_sequence("a", SamplingParams(max_tokens=2), reserve_tokens=48)
    w.run_step(1, [StepSegment("a", [random.Random(3).randrange(256) for _ in range(40)], True)])
    w.save_prefix("a", "p")
    return w._snapshot(w.prefixes["p"])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same(a, b) -> bool:
    return (
        a.length == b.length
        and [n for n, _ in a.named_tensors()] == [n for n, _ in b.named_tensors()]
        and all(torch.equal(bits(x), bits(y)) for (_, x), (_, y) in zip(a.named_tensors(), b.named_tensors()))
    )


def file_name(key: str) -> str:
    return f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.kv"


def worker(ckpt, folder, **kw) -> AttentionWorker:
    return AttentionWorker(ckpt, kv_blocks=16, lease_seconds=0, kv_disk_dir=str(folder), kv_disk_bytes=BOUND, **kw)


def write_files(ckpt, folder, snap, keys, **kw) -> dict:
    """key → the bytes of its file, written by a worker of the tiny model into `folder`."""
    w = worker(ckpt, folder, **kw)
    for k in keys:
        assert w.tiers.put(k, snap) == []
    return {k: (folder / file_name(k)).read_bytes() for k in keys}


# ------------------------------------------------------------------ file surgery, as an attacker would do it
def split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<I", data[8:12])
    return json.loads(data[12 : 12 + n]), data[12 + n :]


def join(header: dict, rest: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return data_magic() + struct.pack("<I", len(raw)) + raw + rest


def data_magic() -> bytes:
    return b"EMKVTIER"


def edit_header(data: bytes, edit) -> bytes:
    """The file with its JSON header edited by `edit(header)` (still valid JSON), everything after it kept."""
    header, rest = split(data)
    edit(header)
    return join(header, rest)


def rehash(data: bytes) -> bytes:
    """One payload byte changed, then every digest recomputed that one can recompute without the key: the header's
    sha256 of the payload (format 1), or a sha256 of everything as the trailing tag (format 2)."""
    header, rest = split(data)
    if "sha256" in header:
        body = bytearray(rest)
        body[-5] ^= 0x40
        header["sha256"] = hashlib.sha256(body).hexdigest()
        return join(header, bytes(body))
    body = bytearray(rest[:-32])
    body[-5] ^= 0x40
    head = join(header, b"")
    return head + bytes(body) + hashlib.sha256(head + body).digest()


def shape_plus_one(h):
    h["tensors"][0][2][1] += 1


def dtype_int64(h):
    h["tensors"][0][1] = "int64"


def length_1e9(h):
    h["length"] = 1e9


def length_10_9(h):
    h["length"] = 10**9


def tensor_bytes_huge(h):
    h["tensors"][0][4] = 10**12


HEADER_LIES = {"shape": shape_plus_one, "dtype": dtype_int64, "len-float": length_1e9, "len-int": length_10_9}
HEADER_LIES["nbytes"] = tensor_bytes_huge


def poison(folder, outside, files) -> dict:
    """Every kind of bad entry in the tier folder → what the scan must do with it. `files`: valid file bytes by key
    (one per header lie and for the re-hash). Returns name → kind."""
    made = {}
    for kind, edit in HEADER_LIES.items():
        (folder / file_name(kind)).write_bytes(edit_header(files[kind], edit))
        made[file_name(kind)] = f"header lie: {kind}"
    (folder / file_name("rehashed")).write_bytes(rehash(files["rehashed"]))
    made[file_name("rehashed")] = "re-hashed payload"
    os.mkfifo(folder / file_name("fifo"))
    made[file_name("fifo")] = "FIFO"
    (folder / file_name("zero")).symlink_to("/dev/zero")
    made[file_name("zero")] = "link to /dev/zero"
    (outside / file_name("outside")).write_bytes(files["outside"])
    (folder / file_name("outside")).symlink_to(outside / file_name("outside"))
    made[file_name("outside")] = "link outside"
    (folder / file_name("dangling")).symlink_to(outside / "nothing-here")
    made[file_name("dangling")] = "dangling link"
    with open(folder / file_name("big"), "wb") as f:  # sparse: larger than the tier, no disk used
        f.truncate(BOUND + 1)
    made[file_name("big")] = "larger than the tier"
    (folder / "dir.kv").mkdir()
    made["dir.kv"] = "a folder"
    (folder / "dir.tmp").mkdir()
    made["dir.tmp"] = "a folder"
    return made


def victim_keys():
    return [*HEADER_LIES, "rehashed", "outside"]


@pytest.mark.timeout(120)
def test_a_poisoned_tier_folder_is_refused_file_by_file_and_the_worker_serves(ckpt, snap, tmp_path):
    """Corrupted headers (valid JSON: a shape, a dtype, a length of 1e9, a tensor's bytes), a re-hashed payload, a
    FIFO, links to /dev/zero, outside the folder and nowhere, a sparse file over the bound and folders named like
    tier files: the worker's start refuses and counts each (the link deleted, its target untouched), indexes the good
    prefix, and the real worker server serves it over gRPC — restored bit for bit, then a step."""
    from expertmesh.wire.clients import RemoteAttention
    from expertmesh.worker.server import serve, shutdown

    folder, outside = tmp_path / "tier", tmp_path / "outside"
    folder.mkdir(mode=0o700)
    outside.mkdir()
    files = write_files(ckpt, folder, snap, [GOOD, *victim_keys()])
    for k in victim_keys():
        (folder / file_name(k)).unlink()
    made = poison(folder, outside, files)
    outside_before = (outside / file_name("outside")).read_bytes()

    server = serve(
        "attention", ckpt.path, 0, kv_blocks=16, lease_seconds=0, kv_disk_dir=str(folder), kv_disk_bytes=BOUND
    )
    try:
        att = server.attention
        stats = att.tiers.stats["disk"]
        assert list(att.tiers.disk) == [GOOD], list(att.tiers.disk)
        assert stats.rejected == len(made) and stats.entries == 1
        left = sorted(p.name for p in folder.iterdir())
        assert left == sorted([file_name(GOOD), "dir.kv", "dir.tmp"])  # folders are counted, never removed
        assert (outside / file_name("outside")).read_bytes() == outside_before
        assert os.path.exists("/dev/zero")
        att.connect_experts(*local_experts(ckpt))
        client = RemoteAttention(f"127.0.0.1:{server.port}", timeout=30)
        assert client.list_prefixes() == [(GOOD, snap.length, "disk")]
        cached = client.open_sequence(
            "s", SamplingParams(max_tokens=2), reserve_tokens=snap.length + 8, prefix_key=GOOD
        )
        assert cached == snap.length and same(att._snapshot(att.prefixes[GOOD]), snap)
        done = client.run_step(1, [StepSegment("s", [7], True)])
        assert "s" in done.tokens and not done.failed
        for kind in ("rehashed", "outside", "len-int"):
            with pytest.raises(NotFound):
                client.open_sequence(f"x-{kind}", SamplingParams(max_tokens=1), reserve_tokens=64, prefix_key=kind)
    finally:
        shutdown(server, 1)


def test_a_re_hashed_payload_is_never_served_at_start_or_at_restore(ckpt, snap, tmp_path):
    """Someone who can write the tier folder but holds no key changes a payload byte and recomputes the digests:
    refused at the next start; and when the file is rewritten under a running worker, refused when restored."""
    folder = tmp_path / "tier"
    files = write_files(ckpt, folder, snap, ["a", "b"])
    (folder / file_name("a")).write_bytes(rehash(files["a"]))
    w = worker(ckpt, folder)
    assert list(w.tiers.disk) == ["b"] and w.tiers.stats["disk"].rejected == 1
    (folder / file_name("b")).write_bytes(rehash(files["b"]))
    with pytest.raises(NotFound, match="failed a check"):
        w.open_sequence("s", SamplingParams(max_tokens=1), reserve_tokens=64, prefix_key="b")
    assert w.tiers.stats["disk"].rejected == 2 and not list(folder.glob("*.kv")) and not w.prefixes


def test_files_are_authenticated_by_the_deployment_key(ckpt, snap, tmp_path):
    """A file written under the deployment's key is served by the next worker given that key; a worker given
    another key — or none (a random key per process) — refuses it, counted; without a key, a worker reads back
    what its own process wrote."""
    folder = tmp_path / "tier"
    write_files(ckpt, folder, snap, ["a"], kv_disk_key=KEY)
    again = worker(ckpt, folder, kv_disk_key=KEY)
    assert list(again.tiers.disk) == ["a"] and same(again.tiers.load("a")[0], snap)
    other = worker(ckpt, folder, kv_disk_key=b"another deployment's key, 32 B.")
    assert not other.tiers.disk and other.tiers.stats["disk"].rejected == 1
    write_files(ckpt, folder, snap, ["b"], kv_disk_key=KEY)
    keyless = worker(ckpt, folder)
    assert not keyless.tiers.disk and keyless.tiers.stats["disk"].rejected == 1
    write_files(ckpt, folder, snap, ["c"])
    assert list(worker(ckpt, folder).tiers.disk) == ["c"]


def reseal(data: bytes, mac_key: bytes) -> bytes:
    """The file's tag recomputed under `mac_key` (a writer that holds the key but wrote a wrong header)."""
    import hmac

    body = data[:-32]
    return body + hmac.new(mac_key, body, hashlib.sha256).digest()


@pytest.mark.parametrize(
    "edit, words",
    [
        (shape_plus_one, "needs"),
        (lambda h: h["tensors"][0][2].__setitem__(1, h["tensors"][0][2][1] // 2), "needs"),
        (dtype_int64, "dtype 'int64'"),
        (length_1e9, "length 1000000000.0, expected a int"),
        (length_10_9, "expected [1000000000, width]"),
        (tensor_bytes_huge, "holds 1000000000000 bytes"),
        (lambda h: h["tensors"][0].__setitem__(0, "latent.99"), "latent.1 missing"),
        (lambda h: h["tensors"][0].__setitem__(0, "bogus.1"), "name 'bogus.1'"),
        (lambda h: h.__setitem__("tensors", h["tensors"][1:]), "at offset"),
        (lambda h: h.__setitem__("length", True), "expected a int"),
        (lambda h: h.__setitem__("key", ["x"]), "header: key"),
        (lambda h: h["tensors"][0].__setitem__(3, -1), "offset -1"),
        (lambda h: h.__setitem__("version", 1), "format version 1"),
        (lambda h: h.__setitem__("payload_bytes", 10**15), "payload_bytes says"),
    ],
)
def test_a_header_under_a_valid_tag_is_still_checked_against_the_payload_and_the_model(
    ckpt, snap, tmp_path, edit, words
):
    """Even a writer holding the key (a bug, not an attacker) cannot make the worker allocate or misread: a header
    whose shapes, dtypes, length, byte counts or names disagree with the payload or the model is CorruptFile."""
    from expertmesh.worker.kv_tiers import disk_mac_key

    folder = tmp_path / "tier"
    data = write_files(ckpt, folder, snap, ["a"], kv_disk_key=KEY)["a"]
    (folder / file_name("a")).write_bytes(reseal(edit_header(data, edit), disk_mac_key(KEY)))
    w = worker(ckpt, folder, kv_disk_key=KEY)
    assert not w.tiers.disk and w.tiers.stats["disk"].rejected == 1
    with pytest.raises(CorruptFile, match=re.escape(words)):
        _decode(w, data, edit)


def _decode(w, data, edit):
    """kv_snapshot.decode of the resealed bytes with the worker's identity and layout (the message the scan logs)."""
    from expertmesh.wire.kv_snapshot import decode
    from expertmesh.worker.kv_tiers import disk_mac_key

    bad = reseal(edit_header(data, edit), disk_mac_key(KEY))
    return decode(bad, key="a", identity=w.tiers.identity, mac_key=disk_mac_key(KEY), layout=w.tiers.layout)


def test_oversized_and_nested_headers_are_refused_before_they_are_parsed(ckpt, snap, tmp_path):
    from expertmesh.wire.kv_snapshot import MAX_HEADER_BYTES, decode

    w = worker(ckpt, tmp_path / "tier")
    ident = w.tiers.identity
    huge = data_magic() + struct.pack("<I", MAX_HEADER_BYTES + 1) + b" " * 16
    with pytest.raises(CorruptFile, match="a header of"):
        decode(huge, key="a", identity=ident)
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(CorruptFile, match="unreadable header"):
        decode(data_magic() + struct.pack("<I", len(deep)) + deep, key="a", identity=ident)
    valid = encode("a", ident, snap, b"k")
    assert same(decode(valid, key="a", identity=ident, mac_key=b"k", layout=w.tiers.layout), snap)
    with pytest.raises(CorruptFile, match="torn"):
        decode(valid[:-1], key="a", identity=ident, mac_key=b"k")


# ------------------------------------------------------------------ the tier folder itself
@pytest.mark.parametrize("unsafe", ["symlink", "world-writable", "group-writable", "other owner", "a file"])
def test_an_unsafe_tier_folder_is_refused_at_start_naming_the_flag(unsafe, ckpt, tmp_path, monkeypatch, capsys):
    """A tier folder that is a symbolic link, that others may write, or that another user owns: the worker refuses
    to start — AttentionWorker with a ValueError, `expertmesh worker` with one line on stderr (exit 2) — naming
    --kv-disk-dir; a missing folder is created private (0700)."""
    from expertmesh.worker.cli import main

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    folder = tmp_path / "tier"
    if unsafe == "symlink":
        folder.symlink_to(real)
    elif unsafe == "a file":
        folder.write_bytes(b"")
    else:
        folder.mkdir()
        folder.chmod({"world-writable": 0o777, "group-writable": 0o770, "other owner": 0o700}[unsafe])
    if unsafe == "other owner":
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(ValueError, match="--kv-disk-dir"):
        worker(ckpt, folder)
    with pytest.raises(SystemExit) as e:
        main(["--role", "attention", "--checkpoint", str(ckpt.path), "--port", "0", "--kv-disk-dir", str(folder),
              "--kv-disk-gib", "0.01"])  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--kv-disk-dir {folder}:" in err and "Traceback" not in err, err
    fresh = tmp_path / "made" / "tier"
    if unsafe != "other owner":
        worker(ckpt, fresh)
        assert fresh.is_dir() and fresh.stat().st_mode & 0o777 == 0o700


def key_file(folder, data: bytes):
    (folder / "key").write_bytes(data)
    return folder / "key"


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: d / "missing", "cannot read it"),
        (lambda d: key_file(d, b""), "expected at least 16 secret bytes"),
        (lambda d: key_file(d, b"1234"), "expected at least 16 secret bytes"),
    ],
)
def test_a_bad_kv_disk_key_file_is_refused_naming_the_flag(make, words, tmp_path, capsys):
    from expertmesh.worker.cli import main

    path = make(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--role", "attention", "--checkpoint", str(tmp_path), "--port", "0", "--kv-disk-dir",
              str(tmp_path / "tier"), "--kv-disk-gib", "1", "--kv-disk-key-file", str(path)])  # fmt: skip
    assert e.value.code == 2 and f"--kv-disk-key-file {path}: {words}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--role", "attention", "--checkpoint", str(tmp_path), "--port", "0", "--kv-disk-key-file", str(path)])
    assert "--kv-disk-key-file: only with --kv-disk-dir" in capsys.readouterr().err


# ------------------------------------------------------------------ a real worker process
def start_worker(ckpt, folder, tmp_path, *extra) -> tuple[subprocess.Popen, str]:
    """`expertmesh worker --role attention` over tier `folder`, its log in tmp_path/worker.log (a file, not a pipe:
    nothing the process leaves behind can hold the test up) → (the process, its address once READY)."""
    cmd = [sys.executable, "-m", "expertmesh.worker.cli", "--role", "attention", "--checkpoint", str(ckpt.path),
           "--port", "0", "--kv-blocks", "16", "--kv-disk-dir", str(folder), "--kv-disk-gib", str(BOUND / 2**30),
           *extra]  # fmt: skip
    with open(tmp_path / "worker.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "EXPERTMESH_TORCH_THREADS": "1", "PYTHONSAFEPATH": "1"},
        )
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout=150)
    if not (line and line[0].startswith("READY attention 127.0.0.1:")):
        proc.kill()
        raise AssertionError(f"no READY line: {line} rc={proc.wait()} {(tmp_path / 'worker.log').read_text()[-3000:]}")
    return proc, line[0].split()[-1]


def stop_worker(proc, tmp_path) -> str:
    """SIGTERM, a clean exit, its log."""
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    proc.stdout.close()
    log = (tmp_path / "worker.log").read_text()
    assert rc == 0, log[-3000:]
    return log


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_worker_process_starts_on_a_poisoned_folder_and_serves_what_its_key_authenticates(ckpt, snap, tmp_path):
    """`expertmesh worker --kv-disk-key-file K` over a folder with every kind of bad entry: READY, each refused (a
    log line), the good prefix listed and restored over gRPC, the link's target outside untouched. Started again
    without the key file (a random key per process), the same good file is refused as unauthenticated."""
    from expertmesh.wire.clients import RemoteAttention

    folder, outside = tmp_path / "tier", tmp_path / "outside"
    outside.mkdir()
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    files = write_files(ckpt, folder, snap, [GOOD, *victim_keys()], kv_disk_key=KEY)
    for k in victim_keys():
        (folder / file_name(k)).unlink()
    made = poison(folder, outside, files)
    outside_before = (outside / file_name("outside")).read_bytes()
    proc, address = start_worker(ckpt, folder, tmp_path, "--kv-disk-key-file", str(key_file))
    try:
        with RemoteAttention(address, timeout=30) as client:
            assert client.list_prefixes() == [(GOOD, snap.length, "disk")]
            assert client.open_sequence("s", SamplingParams(max_tokens=1), reserve_tokens=64, prefix_key=GOOD) == 40
    finally:
        err = stop_worker(proc, tmp_path)
    assert err.count("not served:") == len(made), err[-3000:]
    assert (outside / file_name("outside")).read_bytes() == outside_before
    # the restore moved GOOD to the device; write it again under the key, then start without the key
    write_files(ckpt, folder, snap, [GOOD], kv_disk_key=KEY)
    proc, address = start_worker(ckpt, folder, tmp_path)
    try:
        with RemoteAttention(address, timeout=30) as client:
            assert client.list_prefixes() == []
    finally:
        err = stop_worker(proc, tmp_path)
    assert "not served: checksum mismatch" in err and not (folder / file_name(GOOD)).exists()
