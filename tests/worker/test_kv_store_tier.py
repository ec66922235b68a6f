"""The cluster KV tier (worker/kv_store.py) on a real Mooncake store — mooncake_master and its store process on
loopback (expertmesh/entry/kv_store_service.py): a prefix one attention worker demoted comes back bit-identical on
another; keys differ per deployment; a corrupt or foreign object is refused and counted, never served; the bound
holds; the master killed → local tiers only, restarted → puts and gets resume."""

import random
import threading
import time

import pytest
import torch

pytest.importorskip("mooncake.store", reason="the Mooncake wheel (mooncake-transfer-engine-non-cuda)")

from expertmesh.entry.kv_store_service import KVStoreService  # noqa: E402
from expertmesh.entry.local import build_local_engine  # noqa: E402
from expertmesh.model.transformer import generate  # noqa: E402
from expertmesh.wire.kv_snapshot import CorruptFile, encode  # noqa: E402
from expertmesh.wire.sampling_params import SamplingParams  # noqa: E402
from expertmesh.worker.kv_store import ClusterStore, connect_mooncake, object_key  # noqa: E402
from expertmesh.worker.metrics import store_metrics  # noqa: E402

CHUNK = 16
MIB = 2**20
SECRET = b"the deployment's store secret 0123456789"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with KVStoreService(64 * MIB, log_dir=tmp_path_factory.mktemp("mooncake")) as s:
        yield s


def store_of(service, deployment="dep-a", secret=SECRET):
    return {
        "master": service.master_address,
        "metadata": service.metadata_url,
        "deployment": deployment,
        "secret": secret,
        "capacity_bytes": 32 * MIB,
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def device_copy(worker, key):
    p = worker.prefixes[key]
    pages = {layer: p.kv.read(layer, p.length) for layer in worker.cfg.latent_kv_layers}
    return {layer: tuple(None if t is None else bits(t).clone() for t in pair) for layer, pair in pages.items()}, {
        i: (bits(s).clone(), bits(c).clone()) for i, (s, c) in p.kda_states.items()
    }


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, service):
    eng = build_local_engine(
        tiny_checkpoint, attention_workers=2, prefill_chunk=CHUNK, kv_blocks=32, kv_store=store_of(service)
    )
    yield eng
    eng.close()


def test_a_prefix_is_written_through_on_save_and_restored_bit_identical_by_the_other_worker(engine):
    prompt = [random.Random(1).randrange(256) for _ in range(70)]
    engine.generate(prompt, SamplingParams(max_tokens=2))
    a, b = (engine.attention[i]._client for i in range(2))
    if not a.prefixes:
        a, b = b, a
    assert a.tiers.store.flush()
    key = max(a.prefixes, key=lambda k: a.prefixes[k].length)
    length, saved = a.prefixes[key].length, device_copy(a, key)
    # saved → put already, with no demotion (a worker killed now loses nothing): every prefix it saved is listed
    assert {(k, p.length, "store") for k, p in a.prefixes.items()} <= set(a.list_prefixes())
    puts = a.tiers.store.stats.demotions
    free, dropped = a.demote_prefix(key)
    assert dropped == [] and key not in a.prefixes and a.tiers.tier_of(key) == "store"  # no host / disk tier
    assert a.tiers.store.flush() and a.tiers.store.stats.demotions == puts  # no second put of the same prefix
    cached = b.open_sequence("s-b", SamplingParams(max_tokens=1), reserve_tokens=length + 1, prefix_key=key)
    assert cached == length
    assert_same(saved, device_copy(b, key))
    stats = b.tiers.snapshot_stats()["store"]
    assert stats.restores == 1 and stats.restore_bytes > 0 and stats.gets >= 1 and a.tiers.store.stats.put_bytes > 0
    b.close_sequence("s-b")
    # the worker's /metrics: puts (bytes, seconds) where it was put, gets (bytes) where it was restored
    put = {f.name: f.samples[0].value for f in store_metrics(a)}
    got = {f.name: f.samples[0].value for f in store_metrics(b)}
    assert put["expertmesh_kv_store_puts"] >= 1 and put["expertmesh_kv_store_put_bytes"] > 0
    assert put["expertmesh_kv_store_put_seconds"] > 0
    assert got["expertmesh_kv_store_gets"] >= 1 and got["expertmesh_kv_store_get_bytes"] >= stats.restore_bytes


def test_write_through_puts_wait_on_their_own_thread_and_are_left_out_counted_when_the_queue_is_full(engine):
    w, key, snap = snapshot_of(engine)
    store = ClusterStore(
        deployment="dep-queue",
        secret=SECRET,
        identity=w.tiers.identity,
        layout=w.tiers.layout,
        capacity_bytes=32 * MIB,
        client=w.tiers.store.client,
        max_queued=1,
    )
    started, release = threading.Event(), threading.Event()

    def slow_put():
        started.set()
        release.wait()

    assert store.calls.later(slow_put) and started.wait(5)  # the calls thread busy: nothing queued runs
    start = time.monotonic()
    assert store.put_later("q0", snap) and store.length_of("q0") == snap.length  # queued, counted as held
    assert not store.accepts_put() and not store.put_later("q1", snap)  # full: left out, counted, never waited on
    assert time.monotonic() - start < 0.1 and store.stats.puts_not_made == 1
    assert store.get("q0") is None  # a lookup behind a busy thread: a miss within its deadline, not a wait
    release.set()
    store._down_until = 0.0
    assert store.flush() and [k for k, _ in store.keys()] == ["q0"] and store.get("q0").length == snap.length
    store.calls.close(1.0)  # the client is the worker's


def assert_same(x, y):
    (pages_x, kda_x), (pages_y, kda_y) = x, y
    assert pages_x.keys() == pages_y.keys() and kda_x.keys() == kda_y.keys() and kda_x
    for layer in pages_x:
        for p, q in zip(pages_x[layer], pages_y[layer]):
            assert (p is None and q is None) or torch.equal(p, q)
    for layer in kda_x:
        assert all(torch.equal(p, q) for p, q in zip(kda_x[layer], kda_y[layer]))


def snapshot_of(engine):
    w = next(engine.attention[i]._client for i in range(2) if engine.attention[i]._client.prefixes)
    key = next(iter(w.prefixes))
    return w, key, w._snapshot(w.prefixes[key])


def test_keys_are_the_deployments_own_and_corrupt_or_foreign_objects_are_refused_and_counted(engine, service):
    engine.generate([random.Random(2).randrange(256) for _ in range(40)], SamplingParams(max_tokens=1))
    w, key, snap = snapshot_of(engine)
    assert object_key("dep-a", key) != object_key("dep-b", key) and key not in object_key("dep-a", key)
    mine = w.tiers.store
    assert mine.put(key, snap) and mine.get(key).length == snap.length
    # another deployment sharing the store: its own names, so it never sees ours
    other = ClusterStore(
        deployment="dep-b",
        secret=b"another deployment's secret 98765",
        identity=mine.identity,
        layout=mine.layout,
        capacity_bytes=32 * MIB,
        client=connect_mooncake(service.master_address, service.metadata_url, "127.0.0.1"),
    )
    assert other.get(key) is None
    # its object written under our name (a foreign writer): refused by the MAC, counted, removed
    raw = other.client
    assert other.put(key, snap)
    assert raw.upsert(object_key("dep-a", key), raw.get(object_key("dep-b", key))) == 0
    rejected = mine.stats.rejected
    with pytest.raises(CorruptFile, match="tag|MAC|checksum"):
        mine.get(key)
    assert mine.stats.rejected == rejected + 1
    # a torn / corrupted object
    assert mine.put(key, snap)
    data = bytearray(raw.get(object_key("dep-a", key)))
    data[-40] ^= 1
    assert raw.upsert(object_key("dep-a", key), bytes(data)) == 0
    with pytest.raises(CorruptFile):
        mine.get(key)
    assert mine.stats.rejected == rejected + 2
    other.close()


def test_the_bound_holds_oldest_puts_removed_first(engine):
    w, key, snap = snapshot_of(engine)
    nbytes = len(encode(key, "x", snap))
    small = ClusterStore(
        deployment="dep-bound",
        secret=SECRET,
        identity=w.tiers.identity,
        layout=w.tiers.layout,
        capacity_bytes=int(nbytes * 2.5),
        client=w.tiers.store.client,
    )
    for i in range(4):
        assert small.put(f"k{i}", snap)
    assert [k for k, _ in small.keys()] == ["k2", "k3"] and small.stats.dropped == 2
    assert small.stats.used_bytes <= small.stats.capacity_bytes
    assert small.get("k0") is None and small.get("k3").length == snap.length


def test_the_master_killed_means_misses_within_their_deadline_and_its_restart_resumes_the_store(
    engine, service, tiny_checkpoint
):
    w, key, snap = snapshot_of(engine)
    store = w.tiers.store
    assert store.put(key, snap)
    service.kill_master()
    # with the master down a Mooncake call blocks for seconds: each lookup here is a miss within its deadline
    for _ in range(3):
        store._down_until = 0.0  # past the back-off: the store is tried again
        start = time.monotonic()
        assert store.get(key) is None and store.stage("never-put") is None
        store.put_later("during", snap)
        assert time.monotonic() - start < 4 * store.call_timeout_s + 0.3
    assert not store.available() and store.stats.failures >= 3
    # requests are answered from the local tiers meanwhile, the same tokens as without a store
    prompt = [random.Random(5).randrange(256) for _ in range(40)]
    start = time.monotonic()
    out = engine.generate(prompt, SamplingParams(max_tokens=3)).output
    assert time.monotonic() - start < 20
    assert (
        out == generate(tiny_checkpoint.load_model(), prompt, SamplingParams(max_tokens=3), prefill_chunk=CHUNK).tokens
    )
    service.start_master()
    deadline = time.monotonic() + 30
    while not store.put(key, snap):  # the client reconnects by itself, the store process remounts its memory
        assert time.monotonic() < deadline, "the store never came back"
        time.sleep(0.5)
        store._down_until = 0.0
    assert store.get(key).length == snap.length


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--kv-store-master", "nowhere"], "--kv-store-master 'nowhere': expected HOST:PORT"),
        (["--kv-store-master", "127.0.0.1:1"], "needs --kv-store-key-file"),
        (["--kv-store-master", "127.0.0.1:1", "--kv-store-key-file", "/nonexistent"], "--kv-store-key-file"),
    ],
)
def test_bad_store_flags_fail_fast_naming_the_flag(argv, words, capsys, tiny_checkpoint):
    from expertmesh.worker.cli import main

    with pytest.raises(SystemExit):
        main(["--role", "attention", "--port", "0", "--checkpoint", str(tiny_checkpoint.path), *argv])
    assert words in capsys.readouterr().err
