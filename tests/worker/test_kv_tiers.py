"""The KV tiers below an attention worker's device pool (worker/kv_tiers.py): a demoted prefix comes back
bit-identical from host memory and from disk, a restored prefix gives the tokens a recompute gives, the disk tier's
files survive a restart and are refused when torn, corrupted or foreign; every tier keeps its byte bound. (Files
that lie, links, FIFOs, forged payloads and unsafe folders: tests/worker/test_kv_disk_hardening.py.)"""

import json
import random
import time

import pytest
import torch

from expertmesh.entry.local import build_local_engine
from expertmesh.model.transformer import generate
from expertmesh.wire.kv_snapshot import CorruptFile, PrefixSnapshot, layout_identity
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import NotFound
from expertmesh.worker.kv_tiers import KVTiers
from expertmesh.worker.metrics import tier_metrics

CHUNK = 16
MIB = 2**20


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.fixture(scope="module")
def model(ckpt):
    return ckpt.load_model()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bitwise comparison: no float equality, -0.0 / NaN payloads included)."""
    return t.contiguous().view(torch.uint8)


def device_copy(worker, key):
    """A prefix's device contents as the model reads them: per layer [length, D] pages, and the KDA states."""
    p = worker.prefixes[key]
    pages = {
        layer: tuple(None if t is None else t.clone() for t in p.kv.read(layer, p.length))
        for layer in worker.cfg.latent_kv_layers
    }
    return pages, {i: (s.clone(), c.clone()) for i, (s, c) in p.kda_states.items()}


def assert_bit_identical(a, b):
    (pages_a, kda_a), (pages_b, kda_b) = a, b
    assert pages_a.keys() == pages_b.keys() and kda_a.keys() == kda_b.keys() and pages_a and kda_a
    for layer in pages_a:
        for x, y in zip(pages_a[layer], pages_b[layer]):
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(bits(x), bits(y)), f"layer {layer}"
    for layer in kda_a:
        for x, y in zip(kda_a[layer], kda_b[layer]):
            assert torch.equal(bits(x), bits(y)), f"KDA layer {layer}"


def test_a_demoted_prefix_comes_back_bit_identical_from_host_and_from_disk(ckpt, tmp_path):
    eng = build_local_engine(
        ckpt,
        prefill_chunk=CHUNK,
        kv_blocks=32,
        kv_tiers={"kv_host_bytes": 64 * MIB, "kv_disk_dir": str(tmp_path), "kv_disk_bytes": 64 * MIB},
    )
    try:
        prompt = [random.Random(5).randrange(256) for _ in range(80)]
        eng.generate(prompt, SamplingParams(max_tokens=2))
        w = eng.attention[0]._client
        key = max(w.prefixes, key=lambda k: w.prefixes[k].length)
        length, saved = w.prefixes[key].length, device_copy(w, key)
        for tier in ("host", "disk"):
            w.tiers.host_bytes = 64 * MIB if tier == "host" else 0  # too small: straight to disk
            free_before = w.pool.free_blocks
            free, dropped = w.demote_prefix(key)
            assert dropped == [] and key not in w.prefixes and w.tiers.tier_of(key) == tier
            assert free > free_before and (key, length, tier) in w.list_prefixes()
            cached = w.open_sequence(
                f"s-{tier}", SamplingParams(max_tokens=1), reserve_tokens=length + 1, prefix_key=key
            )
            assert cached == length and w.tiers.tier_of(key) is None
            assert_bit_identical(saved, device_copy(w, key))
            assert w.tiers.stats[tier].restores == 1 and w.tiers.stats[tier].restore_bytes > 0
            w.close_sequence(f"s-{tier}")
        metrics = {
            (f.name, s.labels["tier"]): s.value
            for f in tier_metrics(w)
            for s in f.samples
            if s.name.endswith("_total") or "_total" not in s.name
        }
        assert metrics[("expertmesh_kv_tier_hits", "host")] == metrics[("expertmesh_kv_tier_hits", "disk")] == 1
        assert (
            metrics[("expertmesh_kv_tier_demotions", "disk")] == 1
            and metrics[("expertmesh_kv_tier_capacity_bytes", "host")] == 64 * MIB
        )
        assert metrics[("expertmesh_kv_tier_restore_bytes", "disk")] == w.tiers.stats["disk"].restore_bytes > 0
        # a worker without lower tiers drops what it is asked to demote, and says so
        w.tiers.host_bytes, w.tiers.disk_bytes = 0, 0
        assert w.demote_prefix(key)[1] == [key] and key not in w.prefixes
        with pytest.raises(NotFound):
            w.open_sequence("gone", SamplingParams(max_tokens=1), reserve_tokens=length + 1, prefix_key=key)
    finally:
        eng.close()


def sessions_turn_two(ckpt, tiers, kv_blocks=12):
    """Two 'sessions' on a pool too small for both: A's first turn, B's (which pushes A's prefixes off the device),
    then A's second turn — its prompt extends A's first prompt and output. → (A's second turn, engine metrics)."""
    rng = random.Random(11)
    a, b = ([rng.randrange(256) for _ in range(96)] for _ in range(2))
    eng = build_local_engine(ckpt, prefill_chunk=CHUNK, kv_blocks=kv_blocks, kv_growth=16, kv_tiers=tiers)
    try:
        first = eng.generate(a, SamplingParams(max_tokens=12))
        eng.generate(b, SamplingParams(max_tokens=12))
        second_prompt = a + first.output + [rng.randrange(256) for _ in range(20)]
        second = eng.generate(second_prompt, SamplingParams(max_tokens=10), timeout=120)
        hits = {t: eng.metrics.prefix_hits.labels(t)._value.get() for t in ("device", "lower")}
        return second_prompt, second, hits, eng.attention[0]._client.tiers.snapshot_stats()
    finally:
        eng.close()


def test_a_restored_prefix_gives_the_tokens_of_a_recompute(ckpt, model):
    """A's second turn after its prefix went to the host tier: served from it (cached tokens, a restore), greedy
    tokens equal to the reference's full recompute; without the tier the same run recomputes the prompt."""
    prompt, second, hits, stats = sessions_turn_two(ckpt, {"kv_host_bytes": 64 * MIB})
    assert second.error is None and second.cached_tokens >= 96
    assert hits["lower"] == 1 and stats["host"].restores == 1 and stats["host"].demotions >= 1
    reference = generate(model, prompt, SamplingParams(max_tokens=10), prefill_chunk=CHUNK).tokens
    assert second.output == reference
    _, cold, cold_hits, _ = sessions_turn_two(ckpt, None)
    assert cold.cached_tokens == 0 and cold_hits["lower"] == 0 and cold.output == reference


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--kv-host-gib", "-1"], "--kv-host-gib -1.0: expected a size in GiB ≥ 0"),
        (["--kv-disk-gib", "2"], "--kv-disk-dir and --kv-disk-gib: give both"),
        (["--kv-disk-dir", "FILE", "--kv-disk-gib", "1"], "not writable"),
        (["--role", "expert", "--experts", "1:0", "--kv-host-gib", "1"], "only for --role attention"),
    ],
)
def test_bad_tier_flags_fail_fast_naming_the_flag(argv, words, capsys, tmp_path):
    from expertmesh.worker.cli import main

    (tmp_path / "file").write_text("")
    argv = [str(tmp_path / "file" / "kv") if a == "FILE" else a for a in argv]
    role = [] if "--role" in argv else ["--role", "attention"]
    with pytest.raises(SystemExit) as e:
        main([*role, "--checkpoint", str(tmp_path), "--port", "0", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def snapshot(seed: int, length: int = 32) -> PrefixSnapshot:
    g = torch.Generator().manual_seed(seed)
    return PrefixSnapshot(
        length,
        {0: torch.randn(length, 24, generator=g), 3: torch.randn(length, 24, generator=g)},
        {3: torch.randn(length, 8, generator=g)},
        {1: (torch.randn(2, 4, 4, generator=g), torch.randn(3, 3, 16, generator=g))},
    )


def same(a: PrefixSnapshot, b: PrefixSnapshot) -> bool:
    return (
        a.length == b.length
        and [n for n, _ in a.named_tensors()] == [n for n, _ in b.named_tensors()]
        and all(torch.equal(bits(x), bits(y)) for (_, x), (_, y) in zip(a.named_tensors(), b.named_tensors()))
    )


def test_every_tier_keeps_its_byte_bound_and_reports_what_it_drops(tmp_path):
    one = snapshot(0).nbytes
    tiers = KVTiers(2 * one, "id", tmp_path, int(2.5 * one))  # 2 in host; 2 files (headers) on disk
    dropped = [tiers.put(f"k{i}", snapshot(i)) for i in range(6)]
    assert [tiers.tier_of(f"k{i}") for i in range(6)] == [None, None, "disk", "disk", "host", "host"]
    assert dropped[:4] == [[], [], [], []] and dropped[4] == ["k0"] and dropped[5] == ["k1"]
    assert tiers.stats["host"].used_bytes == 2 * one <= tiers.host_bytes
    assert tiers.stats["disk"].used_bytes <= tiers.disk_bytes and len(list(tmp_path.glob("*.kv"))) == 2
    assert same(tiers.load("k2")[0], snapshot(2)) and same(tiers.load("k5")[0], snapshot(5))
    assert KVTiers(0, "id").put("x", snapshot(0)) == ["x"]  # no tier: dropped at once
    with pytest.raises(ValueError, match="expected ≥ 0"):
        KVTiers(-1, "id")


def test_disk_files_survive_a_restart_and_torn_corrupted_or_foreign_ones_are_never_served(tmp_path):
    identity = layout_identity('{"name": "tiny"}', torch.float32, 16)
    first = KVTiers(0, identity, tmp_path, 64 * MIB)
    for i in range(4):
        first.put(f"k{i}", snapshot(i))
    files = {k: e.path for k, e in first.disk.items()}
    # after a restart: the same files, checked, indexed oldest first, served bit-identical
    again = KVTiers(0, identity, tmp_path, 64 * MIB)
    assert list(again.disk) == ["k0", "k1", "k2", "k3"] and again.stats["disk"].rejected == 0
    assert same(again.load("k0")[0], snapshot(0))
    # a flipped payload byte found at restore: deleted, counted, not served
    data = bytearray(files["k1"].read_bytes())
    data[-5] ^= 0x40
    files["k1"].write_bytes(bytes(data))
    with pytest.raises(CorruptFile, match="checksum mismatch: its HMAC"):
        again.load("k1")
    assert again.stats["disk"].rejected == 1 and not files["k1"].exists() and again.tier_of("k1") is None
    # at start: a torn file, a leftover temporary, garbage — and every file of another model / layout
    files["k2"].write_bytes(files["k2"].read_bytes()[:-100])
    (tmp_path / "x.tmp").write_bytes(b"half")
    (tmp_path / "junk.kv").write_bytes(b"not a tier file")
    restarted = KVTiers(0, identity, tmp_path, 64 * MIB)
    assert list(restarted.disk) == ["k0", "k3"] and restarted.stats["disk"].rejected == 3
    foreign = KVTiers(0, layout_identity('{"name": "tiny"}', torch.bfloat16, 16), tmp_path, 64 * MIB)
    assert not foreign.disk and foreign.stats["disk"].rejected == 2 and not list(tmp_path.glob("*.kv"))


@pytest.mark.slow
def test_a_disk_tier_outlives_its_worker_and_a_corrupted_file_is_refused(ckpt, model, tmp_path):
    """`up`-style processes, a 16-block pool and a disk tier only, the worker given the launcher's key
    (--kv-disk-key-file): sessions A, B, C (160-token prompts) push each other's prefixes to disk; B's file is
    corrupted; the attention worker is killed and started again. A's next turn is served from its file (cached
    tokens, the reference's tokens); B's newest file is refused at start (counted in the log), so B's next turn
    starts from its prompt-end snapshot (144 tokens) — the same tokens."""
    from support.router_client import EOS, grpc_generate

    from expertmesh.entry.cluster import LocalCluster, free_port

    rng = random.Random(21)
    prompts = [[rng.randrange(256) for _ in range(160)] for _ in range(3)]
    disk = tmp_path / "kv"
    with LocalCluster(
        ckpt.path,
        attention_workers=1,
        expert_workers=1,
        kv_blocks=16,
        kv_disk_dir=disk,
        kv_disk_gib=0.05,
        http_port=free_port(),
        grpc_port=free_port(),
    ) as cluster:
        key = disk / "disk-key"  # the launcher's secret for the folder's tier files (0600)
        assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 32
        address = f"127.0.0.1:{cluster.grpc_port}"
        outputs = [grpc_generate(address, p, 8)[0] for p in prompts]
        files = sorted((disk / "attention-0").glob("*.kv"), key=lambda f: f.stat().st_mtime)
        assert len(files) == 4  # A's and B's prompt-end (144) and newest (160) prefixes; C's still on the device
        data = bytearray(files[3].read_bytes())
        data[-7] ^= 0x01  # one bit of B's newest payload
        files[3].write_bytes(bytes(data))
        cluster.restart("attention-0")
        for i, expect_cached in ((0, 160), (1, 144)):  # B: only its prompt-end snapshot is left
            turn2 = prompts[i] + outputs[i] + [rng.randrange(256) for _ in range(16)]
            tokens, finish = grpc_generate(address, turn2, 8)
            reference = generate(
                model, turn2, SamplingParams(max_tokens=8, stop_token_ids=(EOS,)), prefill_chunk=CHUNK
            ).tokens
            assert tokens == reference
            assert finish.usage.cached_tokens == expect_cached
        log = "\n".join(cluster.child("attention-0").lines)
        assert log.count("not served: checksum mismatch: its HMAC-SHA256 tag fails") == 1, log[-3000:]


def test_a_hit_whose_worker_cannot_make_room_is_recomputed_on_another_worker(ckpt, model):
    """Two attention workers of 16 blocks; the prompt's prefixes (4 blocks) are on one, whose other 12 blocks a
    sequence holds. The next turn's hit makes room there by demoting them, but restoring the prefix with the turn's
    reservation needs 6 blocks: the turn is recomputed on the other worker (the reference's tokens) instead of
    waiting, and the prefix stays cached — in the host tier, not lost."""
    prompt = [random.Random(8).randrange(256) for _ in range(64)]
    eng = build_local_engine(
        ckpt, attention_workers=2, prefill_chunk=CHUNK, kv_blocks=16, kv_growth=16, kv_tiers={"kv_host_bytes": 64 * MIB}
    )
    try:
        eng.generate(prompt, SamplingParams(max_tokens=2))
        (worker,) = {w for w in eng.kv.prefixes.values()}
        client = eng.attention[worker]._client
        client.open_sequence("hog", SamplingParams(max_tokens=1), reserve_tokens=client.pool.free_blocks * 16)
        eng._refresh(worker)
        turn2 = prompt + [7] * 16
        again = eng.generate(turn2, SamplingParams(max_tokens=4), timeout=60)
        assert again.worker == 1 - worker and again.cached_tokens == 0
        assert again.output == generate(model, turn2, SamplingParams(max_tokens=4), prefill_chunk=CHUNK).tokens
        held = [k for k, w in eng.kv.prefixes.items() if w == worker and eng.kv.prefix_len[k] == 64]
        assert len(held) == 1 and eng.kv.is_lower(held[0]) and client.tiers.tier_of(held[0]) == "host"
        client.close_sequence("hog")
    finally:
        eng.close()


def test_a_dry_run_reports_the_tier_bounds_it_was_given(capsys):
    from expertmesh.worker.cli import main

    assert (
        main(["--role", "attention", "--preset", "tiny", "--device", "meta", "--dry-run", "--kv-host-gib", "0.5"]) == 0
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["kv_host_bytes"] == 2**29 and "kv_disk_bytes" not in line


# ------------------------------------------------------------------ router replicas: shared salt, session affinity
def replica(eng, **kw):
    """Another router over `eng`'s workers (as a second replica of the router Deployment)."""
    from expertmesh.router.engine import Engine
    from expertmesh.router.engine_config import EngineConfig

    return Engine(
        eng.cfg,
        [a._client for a in eng.attention],
        [e._client for e in eng.experts],
        eng.placement,
        EngineConfig(prefill_chunk=CHUNK, **kw),
    ).start()


def test_router_replicas_with_one_salt_share_prefixes_and_others_still_place_the_session_alike(ckpt, model):
    """Router A serves a session's first turn on one of two attention workers. Router B, sharing A's salt, learns
    A's prefixes from the workers (its periodic ListPrefixes read) and serves the second turn from them (cached
    tokens, the reference's greedy tokens) on the same worker; router C, salted otherwise, finds nothing cached but
    places the turn on the same worker (session affinity) and computes the same tokens."""
    salt = b"the-deployment's-router-salt"
    rng = random.Random(35)
    turn1 = [rng.randrange(256) for _ in range(80)]
    a = build_local_engine(ckpt, attention_workers=2, prefill_chunk=CHUNK, prefix_salt=salt, prefix_index_refresh=0)
    b = c = None
    try:
        first = a.generate(turn1, SamplingParams(max_tokens=4))
        turn2 = turn1 + first.output + [rng.randrange(256) for _ in range(16)]
        reference = generate(model, turn2, SamplingParams(max_tokens=6), prefill_chunk=CHUNK).tokens
        b = replica(a, prefix_salt=salt, prefix_index_refresh=0.05)
        deadline = time.monotonic() + 10
        while len(b._listings) < 2 and time.monotonic() < deadline:  # its prefix-index thread read both workers
            time.sleep(0.02)
        second = b.generate(turn2, SamplingParams(max_tokens=6), timeout=60)
        assert second.error is None and second.worker == first.worker and second.cached_tokens == 80
        assert second.output == reference
        c = replica(a, prefix_salt=b"another-salt", prefix_index_refresh=0)
        c.read_prefix_index()
        other = c.generate(turn2, SamplingParams(max_tokens=6), timeout=60)
        assert other.worker == first.worker and other.cached_tokens == 0 and other.output == reference
    finally:
        for eng in (a, b, c):
            if eng is not None:
                eng.close()


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: d / "missing", "cannot read it"),
        (lambda d: d, "cannot read it"),  # a directory
        (lambda d: (d / "empty").write_bytes(b"") or d / "empty", "the file is empty"),
    ],
)
def test_a_bad_prefix_salt_file_is_refused_naming_the_flag(make, words, tmp_path, capsys):
    from expertmesh.router.server import main

    path = make(tmp_path)
    assert (
        main(
            [
                "--checkpoint",
                str(tmp_path),
                "--plan",
                str(tmp_path / "plan.json"),
                "--attention",
                "a:1",
                "--experts",
                "b:1",
                "--prefix-salt-file",
                str(path),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"--prefix-salt-file {path}: {words}" in err, err
