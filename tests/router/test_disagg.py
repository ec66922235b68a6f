"""Prefill/decode disaggregation (router/disagg.py, AttentionWorker.hand_off): a prefill pool runs the prompts and
hands each sequence — KV, indexer keys, KDA state, sampler state — to a decode worker, which goes on with the same
tokens as a colocated deployment; the decode pool computes no prompt token while the prefill pool is up; a prefill
worker killed mid-run fails no request and changes no text."""

import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from expertmesh.chat.tokenizer import ByteTokenizer
from expertmesh.entry.cluster import LocalCluster, free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.model.transformer import generate
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2
from expertmesh.router.disagg import Pools, choose_decode, pool_load
from expertmesh.router.kv import KVManager, WorkerKV
from expertmesh.router.request import Request
from expertmesh.router.scheduler import Limits, schedule
from expertmesh.wire.kv_snapshot import PrefixSnapshot
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import OutOfBlocks, StepSegment, WorkerError
from expertmesh.worker.attention import AttentionWorker

CHUNK = 16
EOS = ByteTokenizer().eos_id
LIMITS = Limits(prefill_chunk=CHUNK, max_batch_tokens=256, max_running=8, kv_growth=32, max_context=4096)


# ----------------------------------------------------------------------------------------------- pure decisions
def kv_of(free: list[int]) -> KVManager:
    return KVManager([WorkerKV(i, 16, 64, f) for i, f in enumerate(free)], chunk=CHUNK)


def test_pools_route_prompts_by_pool_and_fall_back_to_decode():
    pools = Pools.of(2, 1, min_tokens=32)  # workers 0, 1: decode; 2: prefill
    assert pools.kinds == ("decode", "decode", "prefill") and pools.split
    assert Pools.of(2, 0).kinds == ("mixed", "mixed") and not Pools.of(2, 0).split
    assert pools.bound_for(40, frozenset()) == "prefill"
    assert pools.bound_for(31, frozenset()) == "decode"  # short: skips the prefill pool
    assert pools.bound_for(40, frozenset({2})) == "decode"  # prefill pool down
    assert pools.excluded("prefill") == {0, 1} and pools.excluded("decode") == {2}
    assert pools.no_snapshot(frozenset()) == {0, 1} and pools.no_snapshot(frozenset({2})) == frozenset()
    with pytest.raises(ValueError, match="prefill_min_tokens"):
        Pools.of(1, 1, min_tokens=-1)
    with pytest.raises(ValueError, match="decode-pool"):
        Pools.of(0, 1)


def test_schedule_places_in_the_prefill_pool_then_decode_when_it_cannot():
    pools = Pools.of(2, 1)
    rng = random.Random(3)
    req = Request([rng.randrange(256) for _ in range(40)], SamplingParams(max_tokens=8))
    plan = schedule([req], [], kv_of([64, 64, 64]), limits=LIMITS, pools=pools)
    assert [c[0] for c in plan.admissions[0].candidates] == [2]
    plan = schedule([req], [], kv_of([64, 64, 64]), limits=LIMITS, pools=pools, down=frozenset({2}))
    assert {c[0] for c in plan.admissions[0].candidates} <= {0, 1}
    plan = schedule([req], [], kv_of([64, 64, 1]), limits=LIMITS, pools=pools)  # prefill pool saturated
    assert {c[0] for c in plan.admissions[0].candidates} <= {0, 1}
    # no pools: any worker (its session's, then the one with the most free blocks)
    plan = schedule([req], [], kv_of([10, 60, 20]), limits=LIMITS)
    assert plan.admissions[0].candidates[-1][0] == 1


def test_decode_workers_save_no_prefix_while_the_prefill_pool_is_live():
    pools = Pools.of(1, 1)
    prompt = list(range(1, 41))
    on_decode = Request(prompt, SamplingParams(max_tokens=8), worker=0, computed=0, reserved=80)
    on_prefill = Request(prompt[::-1], SamplingParams(max_tokens=8), worker=1, computed=0, reserved=80)
    plan = schedule([], [on_decode, on_prefill], kv_of([64, 64]), limits=LIMITS, pools=pools)
    assert plan.batches[0][0].snapshot is None and plan.batches[1][0].snapshot is not None
    plan = schedule([], [on_decode, on_prefill], kv_of([64, 64]), limits=LIMITS, pools=pools, down=frozenset({1}))
    assert plan.batches[0][0].snapshot is not None  # prefill pool down: the decode pool caches again


def test_choose_decode_takes_the_most_free_live_worker_with_room():
    pools = Pools.of(3, 1)
    kv = kv_of([10, 30, 20, 64])
    assert choose_decode(kv, pools, frozenset(), reserve=64) == 1
    assert choose_decode(kv, pools, frozenset({1}), reserve=64) == 2
    assert choose_decode(kv, pools, frozenset(), reserve=64, taken={1: 25}) == 2
    assert choose_decode(kv, pools, frozenset(), reserve=31 * 16) is None  # no decode worker has room
    assert choose_decode(kv_of([0, 0, 0, 64]), pools, frozenset(), reserve=16) is None  # never the prefill pool


def test_pool_load_counts_what_waits_for_each_pool():
    pools = Pools.of(1, 1, min_tokens=20)
    kv = kv_of([48, 32])
    waiting = [Request(list(range(30)), SamplingParams()), Request(list(range(10)), SamplingParams())]
    prefilling = Request(list(range(50)), SamplingParams(), worker=1, computed=16)
    handing_off = Request(list(range(25)), SamplingParams(), worker=1, computed=25)
    load = pool_load(pools, kv, frozenset(), waiting, [prefilling, handing_off])
    assert load["prefill"].requests_waiting == 1 and load["prefill"].prefill_tokens_waiting == 30 + 34
    assert load["decode"].requests_waiting == 2 and load["decode"].prefill_tokens_waiting == 10
    assert load["decode"].kv_utilization == pytest.approx(16 / 64) and load["prefill"].kv_utilization == 0.5


# ----------------------------------------------------------------------------------------------- in process
@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    # short (below a chunk), one chunk and a bit, many chunks
    return [[rng.randrange(256) for _ in range(n)] for n in (5, 21, 70, 113)]


@pytest.fixture(scope="module")
def engines(ckpt):
    colocated = build_local_engine(ckpt, prefill_chunk=CHUNK)
    split = build_local_engine(ckpt, prefill_chunk=CHUNK, prefill_workers=1)
    yield colocated, split
    colocated.close()
    split.close()


def run(engine, prompts, params):
    reqs = [engine.submit(p, params) for p in prompts]
    return [(r.wait(120).output, [(lp.token, lp.logprob) for lp in r.logprobs]) for r in reqs]


def test_disaggregated_tokens_equal_colocated_and_the_decode_pool_computes_no_prompt(ckpt, engines, prompts):
    colocated, split = engines
    decode, prefill = (a._client for a in split.attention)
    assert (decode.pool_role, prefill.pool_role) == ("decode", "prefill")
    model = ckpt.load_model()
    greedy = SamplingParams(max_tokens=10, stop_token_ids=(EOS,))
    want = [generate(model, p, greedy, prefill_chunk=CHUNK).tokens for p in prompts]
    assert [out for out, _ in run(split, prompts, greedy)] == want
    for params in (
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, logprobs=2),
        SamplingParams(max_tokens=10, temperature=0.7, frequency_penalty=0.8, seed=8),
    ):
        assert run(split, prompts, params) == run(colocated, prompts, params)
    assert decode.prompt_tokens_computed == 0 and prefill.prompt_tokens_computed >= sum(map(len, prompts))
    assert decode.handoffs["received"] == prefill.handoffs["sent"] >= 3 * len(prompts)
    assert decode.handoff_bytes["received"] == prefill.handoff_bytes["sent"] > 0
    assert split.metrics.handoffs.labels("moved")._value.get() == prefill.handoffs["sent"]
    deadline = time.monotonic() + 5  # a handed-off copy is closed once its worker's step in progress ends
    while (decode.sequences or prefill.sequences) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not decode.sequences and not prefill.sequences


def test_a_follow_up_turn_hits_the_prefix_saved_in_the_prefill_pool(engines, prompts):
    colocated, split = engines
    params = SamplingParams(max_tokens=8)
    first = prompts[2] + run(split, [prompts[2]], params)[0][0] + [9, 8, 7, 6]
    before = split.stats.cached_tokens
    req = split.submit(first, params).wait(120)
    assert req.cached_tokens >= 64 and split.stats.cached_tokens - before == req.cached_tokens
    assert req.output == colocated.generate(first, params).output
    assert split.attention[0]._client.prompt_tokens_computed == 0


def test_a_sequence_the_decode_pool_has_no_room_for_decodes_where_it_was_prefilled(ckpt, prompts):
    """A decode worker too small for a sequence's reservation never gets it: the sequence finishes on its prefill
    worker with the same tokens; one that fits is handed off."""
    from expertmesh.entry.cluster import make_placement
    from expertmesh.router.engine import Engine
    from expertmesh.router.engine_config import EngineConfig
    from expertmesh.worker.expert import ExpertWorker

    placement = make_placement(ckpt.cfg, 1, 0)
    decode = AttentionWorker(ckpt, kv_blocks=3, name="attention-0", pool="decode")  # 48 tokens
    prefill = AttentionWorker(ckpt, kv_blocks=64, name="prefill-0", pool="prefill")
    engine = Engine(
        ckpt.cfg,
        [decode],
        [ExpertWorker(ckpt, placement.experts_of(0))],
        placement,
        EngineConfig(prefill_chunk=CHUNK),
        prefill=[prefill],
    ).start()
    try:
        model = ckpt.load_model()
        greedy = SamplingParams(max_tokens=10, stop_token_ids=(EOS,))
        long, short = prompts[2], prompts[1]  # 70 + 10 tokens: no room there; 21 + 10: room
        assert engine.generate(long, greedy).output == generate(model, long, greedy, prefill_chunk=CHUNK).tokens
        assert decode.handoffs["received"] == 0 and prefill.handoffs["sent"] == 0
        assert engine.generate(short, greedy).output == generate(model, short, greedy, prefill_chunk=CHUNK).tokens
        assert decode.handoffs["received"] == 1 and decode.prompt_tokens_computed == 0
    finally:
        engine.close()


def test_a_handed_off_sequence_is_bit_identical_and_a_bad_one_is_refused(ckpt):
    src = AttentionWorker(ckpt, kv_blocks=16, name="prefill-0", pool="prefill", lease_seconds=0)
    dst = AttentionWorker(ckpt, kv_blocks=4, name="attention-0", pool="decode", lease_seconds=0)
    prompt = [random.Random(4).randrange(256) for _ in range(20)]
    src.connect_experts(*local_experts(ckpt))
    dst.connect_experts(*local_experts(ckpt))
    src.open_sequence("a", SamplingParams(max_tokens=4, temperature=1.0, seed=1), reserve_tokens=24)
    with pytest.raises(WorkerError, match="prompt is not done"):
        src.export_sequence("a")
    src.run_step(1, [StepSegment("a", prompt, True)])
    _, before, state, _ = src.export_sequence("a")
    with pytest.raises(OutOfBlocks):  # 4 blocks of 16 cannot hold 24 + 70 tokens
        src.hand_off("a", dst, "b", reserve_tokens=94)
    assert "a" in src.sequences and not dst.sequences  # refused: it stays where it was
    done = src.hand_off("a", dst, "b", reserve_tokens=24)
    assert "a" not in src.sequences and done.bytes == before.nbytes > 0
    _, after, state_b, _ = dst.export_sequence("b")
    for (name, x), (_, y) in zip(before.named_tensors(), after.named_tensors()):
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name
    assert state == state_b
    bad = PrefixSnapshot.from_named(before.length, {n: t for n, t in before.named_tensors()})
    layer = min(bad.latent)
    bad.latent[layer] = bad.latent[layer][:, :-1]
    with pytest.raises(WorkerError, match=f"latent.{layer} expected"):
        dst.import_sequence("c", SamplingParams(), bad, state, [], reserve_tokens=24)
    bad.latent.pop(layer)
    with pytest.raises(WorkerError, match=f"latent.{layer} missing"):
        dst.import_sequence("c", SamplingParams(), bad, state, [], reserve_tokens=24)
    with pytest.raises(WorkerError, match="sampler_state"):
        dst.import_sequence("c", SamplingParams(), before, b"\x00" * 7, [], reserve_tokens=24)
    with pytest.raises(WorkerError, match="already open"):
        dst.import_sequence("b", SamplingParams(), before, state, [], reserve_tokens=24)
    with pytest.raises(WorkerError, match="--pool"):
        AttentionWorker(ckpt, kv_blocks=4, pool="both")


def test_import_over_grpc_streams_the_cache_in_pieces_and_refuses_a_bad_stream(ckpt, monkeypatch):
    from expertmesh.protos import worker_pb2
    from expertmesh.wire import clients as worker_clients
    from expertmesh.wire.clients import RemoteAttention
    from expertmesh.wire.kv_snapshot import encode
    from expertmesh.wire.sampling_params import sampling_to_proto
    from expertmesh.worker.server import serve, shutdown

    src = AttentionWorker(ckpt, kv_blocks=16, lease_seconds=0)
    src.connect_experts(*local_experts(ckpt))
    src.open_sequence("a", SamplingParams(max_tokens=4), reserve_tokens=40)
    src.run_step(1, [StepSegment("a", [random.Random(6).randrange(256) for _ in range(37)], True)])
    params, snap, state, observed = src.export_sequence("a")
    server = serve("attention", ckpt, 0, kv_blocks=8)
    client = RemoteAttention(f"127.0.0.1:{server.port}", timeout=30)
    try:
        monkeypatch.setattr(worker_clients, "HANDOFF_PIECE_BYTES", 1000)  # many pieces
        client.import_sequence("b", params, snap, state, observed, reserve_tokens=40, identity=src.handoff_identity)
        assert client.bytes_sent > 10 * 1000
        _, got, got_state, _ = server.attention.export_sequence("b")
        for (name, x), (_, y) in zip(snap.named_tensors(), got.named_tensors()):
            assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name
        assert got_state == state

        cache = encode("c", src.handoff_identity, snap)
        header = worker_pb2.ImportSequenceRequest(
            seq_id="c", params=sampling_to_proto(params), reserve_tokens=40, cache_bytes=len(cache), sampler_state=state
        )

        def send(*parts):
            return client._call(client.stub.ImportSequence, iter(parts))

        flipped = bytearray(cache)
        flipped[-3] ^= 1
        for parts, error in (
            ([worker_pb2.ImportSequencePart(cache=cache)], "parts\\[0\\]: expected the header"),
            (
                [worker_pb2.ImportSequencePart(header=header), worker_pb2.ImportSequencePart(cache=cache[:-1])],
                "bytes arrived",
            ),
            (
                [worker_pb2.ImportSequencePart(header=header), worker_pb2.ImportSequencePart(cache=cache + b"x")],
                "within cache_bytes",
            ),
            (
                [worker_pb2.ImportSequencePart(header=header), worker_pb2.ImportSequencePart(cache=bytes(flipped))],
                "checksum",
            ),
        ):
            with pytest.raises(WorkerError, match=error):
                send(*parts)
        foreign = encode("c", "kv-v1-another-model", snap)
        with pytest.raises(WorkerError, match="foreign"):
            send(
                worker_pb2.ImportSequencePart(
                    header=worker_pb2.ImportSequenceRequest(
                        seq_id="c", params=sampling_to_proto(params), reserve_tokens=40, cache_bytes=len(foreign)
                    )
                ),
                worker_pb2.ImportSequencePart(cache=foreign),
            )
        assert client.info()["sequences"] == 1  # refused ones left nothing; still serving
    finally:
        client.close()
        shutdown(server, 1)


def local_experts(ckpt):
    from expertmesh.entry.cluster import make_placement
    from expertmesh.placement.replica_table import ReplicaTable
    from expertmesh.worker.expert import ExpertWorker

    placement = make_placement(ckpt.cfg, 1, 0)
    table = ReplicaTable.from_placement(placement, ckpt.cfg.moe_layers, ckpt.cfg.moe.n_routed_experts)
    return [ExpertWorker(ckpt, placement.experts_of(0))], table


# ----------------------------------------------------------------------------------------------- processes
def generate_grpc(address: str, prompt: list[int], on_token=None) -> list[int]:
    """Greedy tokens from the router's gRPC Generate stream (`on_token()` after each)."""
    with grpc.insecure_channel(address) as ch:
        req = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=prompt),
            params=sampling_pb2.SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[EOS]),
        )
        tokens = []
        for ev in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=180):
            if ev.HasField("token"):
                tokens.append(ev.token.token_id)
                if on_token is not None:
                    on_token()
        return tokens


def scrape(url: str, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith(name)}


@pytest.mark.slow
def test_up_with_a_prefill_pool_gives_colocated_texts_and_survives_a_killed_prefill_worker(ckpt, prompts, tmp_path):
    """Workers under mutual TLS, as `expertmesh up` runs them: the prefill worker hands off with its client key."""
    from expertmesh.runtime.tls import ephemeral_pki

    model = ckpt.load_model()
    greedy = SamplingParams(max_tokens=10, stop_token_ids=(EOS,))
    want = {tuple(p): generate(model, p, greedy, prefill_chunk=CHUNK).tokens for p in prompts}
    grpc_port = free_port()
    address = f"127.0.0.1:{grpc_port}"
    with LocalCluster(
        ckpt.path,
        attention_workers=1,
        expert_workers=1,
        prefill_workers=1,
        http_port=free_port(),
        grpc_port=grpc_port,
        attention_metrics=True,
        worker_tls_dir=ephemeral_pki(tmp_path),
    ) as c:
        decode_metrics, _ = c.metrics_urls
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda p: generate_grpc(address, p), prompts)) == [want[tuple(p)] for p in prompts]
        assert scrape(decode_metrics, "expertmesh_prefill_tokens_total") == {
            'expertmesh_prefill_tokens_total{pool="decode",worker="attention-0"}': 0.0
        }
        moved = scrape(decode_metrics, "expertmesh_kv_transfer_bytes_total")
        assert moved['expertmesh_kv_transfer_bytes_total{direction="received",worker="attention-0"}'] > 0
        # a follow-up turn (the first turn + its answer + more) hits the prefix the first turn saved in the prefill pool
        follow = prompts[2] + want[tuple(prompts[2])] + [11, 12, 13]
        hits = scrape(c.http_url, "expertmesh_prefix_hit_tokens_total")
        assert generate_grpc(address, follow) == generate(model, follow, greedy, prefill_chunk=CHUNK).tokens
        assert scrape(c.http_url, "expertmesh_prefix_hit_tokens_total") != hits
        assert scrape(decode_metrics, "expertmesh_prefill_tokens_total") == {
            'expertmesh_prefill_tokens_total{pool="decode",worker="attention-0"}': 0.0
        }
        router = scrape(c.http_url, "expertmesh_")
        assert router['expertmesh_kv_handoffs_total{outcome="moved"}'] == len(prompts) + 1
        assert router['expertmesh_pool_live_workers{pool="prefill"}'] == 1.0
        assert 'expertmesh_prefill_tokens_total{pool="decode"}' not in router

        # SIGKILL the prefill worker while requests are in flight: each finishes with the colocated text (those on
        # it replay on the decode pool, which prefills while the prefill pool is down)
        many = [prompts[i % len(prompts)][:-1] + [i] for i in range(8)]
        want_many = [generate(model, p, greedy, prefill_chunk=CHUNK).tokens for p in many]
        first_token = threading.Event()

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(generate_grpc, address, p, first_token.set) for p in many]
            assert first_token.wait(120)
            c.kill("prefill-0")
            assert [f.result() for f in futures] == want_many
        assert scrape(c.http_url, "expertmesh_pool_live_workers")['expertmesh_pool_live_workers{pool="prefill"}'] == 0

        # back: taken again, and the decode pool stops computing prompts
        c.restart("prefill-0")
        deadline = time.monotonic() + 60
        while scrape(c.http_url, "expertmesh_pool_live_workers")['expertmesh_pool_live_workers{pool="prefill"}'] < 1:
            assert time.monotonic() < deadline, "the restarted prefill worker was not taken back"
            time.sleep(0.5)
        before = scrape(decode_metrics, "expertmesh_prefill_tokens_total")
        assert generate_grpc(address, prompts[3]) == want[tuple(prompts[3])]
        assert scrape(decode_metrics, "expertmesh_prefill_tokens_total") == before


@pytest.mark.slow
def test_hand_offs_over_collective_pairs_and_over_grpc_without_one(ckpt, prompts):
    """`--transport collective`: the decode worker serves a store (`--collective-port`), each hand-off goes over a
    gloo pair with it — same tokens; to a worker with no store the same client hands off over gRPC."""
    from expertmesh.wire.clients import RemoteAttention
    from expertmesh.worker.collective import CollectiveAttention
    from expertmesh.worker.server import serve, shutdown

    model = ckpt.load_model()
    greedy = SamplingParams(max_tokens=10, stop_token_ids=(EOS,))
    grpc_port = free_port()
    with LocalCluster(
        ckpt.path,
        attention_workers=1,
        expert_workers=1,
        prefill_workers=1,
        http_port=free_port(),
        grpc_port=grpc_port,
        attention_metrics=True,
        transport="collective",
    ) as c:
        decode_metrics, _ = c.metrics_urls
        got = [generate_grpc(f"127.0.0.1:{grpc_port}", p) for p in prompts]
        assert got == [generate(model, p, greedy, prefill_chunk=CHUNK).tokens for p in prompts]
        imports = scrape(decode_metrics, "expertmesh_collective_calls_total")
        received = scrape(decode_metrics, "expertmesh_kv_handoffs_total")
        # the first hand-off may go over gRPC while the pair forms; the others over the pair
        assert imports['expertmesh_collective_calls_total{op="import"}'] >= len(prompts) - 1
        assert received['expertmesh_kv_handoffs_total{direction="received",worker="attention-0"}'] == len(prompts)

    src = AttentionWorker(ckpt, kv_blocks=16, lease_seconds=0)
    src.connect_experts(*local_experts(ckpt))
    src.open_sequence("a", SamplingParams(max_tokens=4), reserve_tokens=40)
    src.run_step(1, [StepSegment("a", prompts[2][:30], True)])
    plain = serve("attention", ckpt, 0, kv_blocks=8)  # no --collective-port: no pair
    peer = CollectiveAttention(RemoteAttention(f"127.0.0.1:{plain.port}", timeout=10))
    try:
        done = src.hand_off("a", peer, "b", reserve_tokens=40)
        assert done.bytes > 0 and "b" in plain.attention.sequences and not peer.formed
        assert peer.grpc_calls == 1 and peer.collective_calls == 0
    finally:
        peer.close()
        shutdown(plain, 1)
