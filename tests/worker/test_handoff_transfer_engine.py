"""Prefill → decode hand-offs on Mooncake's transfer engine (`--handoff-transport mooncake`, #53 item 2): the decode
worker reads the cache from the prefill worker's engine (TCP here), told where over the ImportSequence stream — the
same tokens as the colocated reference (what a gRPC hand-off gives), the bytes counted on both engines and none
over gRPC; with either worker's engine unavailable the same client hands off over gRPC instead, counted."""

import random
import time
import urllib.request

import grpc
import pytest

pytest.importorskip("mooncake.engine", reason="the Mooncake wheel (mooncake-transfer-engine-non-cuda)")

from support.router_client import EOS  # noqa: E402

from expertmesh.entry.cluster import LocalCluster, free_port  # noqa: E402
from expertmesh.model.transformer import generate  # noqa: E402
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2  # noqa: E402
from expertmesh.wire.clients import RemoteAttention  # noqa: E402
from expertmesh.wire.sampling_params import SamplingParams  # noqa: E402
from expertmesh.wire.worker_api import StepSegment  # noqa: E402
from expertmesh.worker.attention import AttentionWorker  # noqa: E402
from expertmesh.worker.transfer_engine import EngineAttention, TransferLink  # noqa: E402

CHUNK = 16
ANSWER = 8


def greedy_grpc(address: str, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        req = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=prompt),
            params=sampling_pb2.SamplingParams(max_tokens=ANSWER, temperature=0.0, stop_token_ids=[EOS]),
        )
        return [
            ev.token.token_id
            for ev in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=120)
            if ev.HasField("token")
        ]


def scrape(url: str, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith(name)}


def test_hand_offs_over_the_transfer_engine_give_the_reference_tokens(tiny_checkpoint):
    model = tiny_checkpoint.load_model()
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (21, 70)]
    params = SamplingParams(max_tokens=ANSWER, stop_token_ids=(EOS,))
    want = [generate(model, p, params, prefill_chunk=CHUNK).tokens for p in prompts]
    grpc_port = free_port()
    with LocalCluster(
        tiny_checkpoint.path,
        attention_workers=1,
        expert_workers=1,
        prefill_workers=1,
        http_port=free_port(),
        grpc_port=grpc_port,
        attention_metrics=True,
        router_args=["--handoff-transport", "mooncake"],
    ) as c:
        decode, prefill = c.metrics_urls
        assert [greedy_grpc(f"127.0.0.1:{grpc_port}", p) for p in prompts] == want
        received = scrape(decode, "expertmesh_kv_handoff_engine")
        sent = scrape(prefill, "expertmesh_kv_handoff_engine")
        handoffs = scrape(decode, "expertmesh_kv_handoffs_total")
    assert handoffs['expertmesh_kv_handoffs_total{direction="received",worker="attention-0"}'] == len(prompts)
    read = received['expertmesh_kv_handoff_engine_bytes_total{direction="received",worker="attention-0"}']
    assert read > 0
    assert sent['expertmesh_kv_handoff_engine_bytes_total{direction="sent",worker="prefill-0"}'] == read
    assert sent['expertmesh_kv_handoff_engine_fallbacks_total{worker="prefill-0"}'] == 0


def test_an_unavailable_engine_on_either_side_hands_off_over_grpc(tiny_checkpoint):
    from expertmesh.entry.cluster import make_placement
    from expertmesh.placement.replica_table import ReplicaTable
    from expertmesh.worker.expert import ExpertWorker
    from expertmesh.worker.server import serve, shutdown

    ckpt = tiny_checkpoint
    placement = make_placement(ckpt.cfg, 1, 0)
    table = ReplicaTable.from_placement(placement, ckpt.cfg.moe_layers, ckpt.cfg.moe.n_routed_experts)
    src = AttentionWorker(ckpt, kv_blocks=16, lease_seconds=0)
    src.connect_experts([ExpertWorker(ckpt, placement.experts_of(0))], table)
    prompt = [random.Random(4).randrange(256) for _ in range(30)]
    for seq in ("a", "b", "c"):
        src.open_sequence(seq, SamplingParams(max_tokens=4), reserve_tokens=40)
        src.run_step(1, [StepSegment(seq, prompt, True)])
    receiver = serve("attention", ckpt, 0, kv_blocks=16)
    link = TransferLink("127.0.0.1")
    peer = EngineAttention(RemoteAttention(f"127.0.0.1:{receiver.port}", timeout=10), link)
    try:
        assert src.hand_off("a", peer, "a2", reserve_tokens=40).bytes > 0  # over the engine
        assert link.sent_bytes > 0 and link.fallbacks == 0
        theirs = receiver.attention.transfer_link()
        theirs._engine, theirs._failed_at = None, time.monotonic()  # the receiver's engine stopped, does not start
        src.hand_off("b", peer, "b2", reserve_tokens=40)
        assert link.fallbacks == 1
        link._engine, link._failed_at = None, time.monotonic()  # nor does the sender's
        src.hand_off("c", peer, "c2", reserve_tokens=40)
        assert link.fallbacks == 2
        arrived = receiver.attention
        arrived._try_merge()
        assert {"a2", "b2", "c2"} <= set(arrived.sequences) | set(arrived._arrivals)
        states = [arrived.sequences.get(s) or arrived._arrivals[s] for s in ("a2", "b2", "c2")]
        assert {s.cache.length for s in states} == {len(prompt)}
    finally:
        peer.close()
        shutdown(receiver, 1)
