"""The gRPC transport: real servers on loopback against the local worker objects (bitwise equal results),
the tensor codec, status-code mapping, health, reflection, the `expertmesh worker` process and the protos'
generated code."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.expert_calls import SUBSET, expert_call, same

from expertmesh.protos import sampling_pb2, tensor_pb2, worker_pb2, worker_pb2_grpc
from expertmesh.wire.sampling_params import SamplingParams, sampling_from_proto, sampling_to_proto
from expertmesh.wire.tensors import DTYPES, from_proto, to_proto

KV_BLOCKS, BLOCK_SIZE = 16, 8


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.fixture(scope="module")
def servers(ckpt):
    """One 'both' server (all experts) and one expert server holding SUBSET, plus the same objects locally."""
    from expertmesh.worker.attention import AttentionWorker
    from expertmesh.worker.expert import ExpertWorker
    from expertmesh.worker.server import all_experts, serve, shutdown

    both = serve("both", ckpt, 0, kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE, name="w")
    shard = serve("expert", ckpt, 0, assignment=SUBSET, name="shard")
    local = {
        "attention": AttentionWorker(ckpt, kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE, name="w"),
        "expert": ExpertWorker(ckpt, all_experts(ckpt.cfg), name="w"),
        "shard": ExpertWorker(ckpt, SUBSET, name="shard"),
    }
    local["attention"].connect_experts([local["expert"]], all_on_one(ckpt.cfg))
    yield {"both": both, "shard": shard, "local": local}
    shutdown(both, 1.0)
    shutdown(shard, 1.0)


@pytest.fixture(scope="module")
def clients(servers):
    from expertmesh.wire.clients import RemoteAttention, RemoteExpert

    addr = f"127.0.0.1:{servers['both'].port}"
    c = {
        "attention": RemoteAttention(addr, timeout=30.0, name="w"),
        "expert": RemoteExpert(addr, timeout=30.0, name="w"),
        "shard": RemoteExpert(f"127.0.0.1:{servers['shard'].port}", timeout=30.0),
    }
    # the remote attention worker calls the experts of its own process over gRPC, as it would another pod's
    c["attention"].connect_experts([c["expert"]], all_on_one(servers["local"]["attention"].cfg))
    yield c
    for client in c.values():
        client.close()


def all_on_one(cfg):
    """A replica table with every expert on expert worker 0."""
    import numpy as np

    from expertmesh.placement.replica_table import ReplicaTable

    return ReplicaTable(
        tuple(cfg.moe_layers), np.zeros((len(cfg.moe_layers), cfg.moe.n_routed_experts, 1), dtype=np.int64)
    )


def same_result(local, remote) -> None:
    """StepDone: step_id, tokens (seq → id), free_blocks, failures, log-probs (the exchange bytes differ by design:
    the remote side counts the same tensors)."""
    assert type(local) is type(remote)
    if True:
        assert (local.step_id, local.tokens, local.free_blocks) == (remote.step_id, remote.tokens, remote.free_blocks)
        assert (local.failed, local.experts_down) == (remote.failed, remote.experts_down) == ({}, [])
        assert local.exchange_bytes == remote.exchange_bytes > 0
        assert list(local.tokens) == list(remote.tokens)
        assert [(a.seq_id, a.position) for a in local.logprobs] == [(b.seq_id, b.position) for b in remote.logprobs]
        for a, b in zip(local.logprobs, remote.logprobs):
            for f in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
                same(getattr(a, f), getattr(b, f))


# ---------------------------------------------------------------------------------------------- tensor codec
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_tensor_round_trip(dtype):
    g = torch.Generator().manual_seed(7)
    if dtype.is_floating_point:
        t = torch.randn(3, 5, 4, generator=g).to(dtype)
        t[0, 0, 0], t[0, 0, 1], t[0, 0, 2] = float("nan"), float("-inf"), -0.0
    elif dtype == torch.bool:
        t = torch.rand(3, 5, 4, generator=g) > 0.5
    else:
        lo, hi = (0, 256) if dtype == torch.uint8 else (-(2**31), 2**31 - 1)
        t = torch.randint(lo, hi, (3, 5, 4), generator=g, dtype=torch.int64).to(dtype)
    for x in (t, t.transpose(0, 2), t[1:, ::2], t[0, 0, 3], t[:0]):  # strided, scalar, empty
        msg = tensor_pb2.Tensor.FromString(to_proto(x).SerializeToString())
        assert msg.dtype == next(k for k, v in DTYPES.items() if v == dtype)
        assert list(msg.shape) == list(x.shape)
        y = from_proto(msg)
        same(x, y)
        y.add_(1) if dtype != torch.bool else y.logical_not_()  # a writable tensor of its own


def test_tensor_bytes_are_little_endian_c_order():
    t = torch.tensor([[1.0, -2.5], [3.0, 0.125]])
    assert to_proto(t).data == struct.pack("<4f", 1.0, -2.5, 3.0, 0.125)
    assert to_proto(t.T).data == struct.pack("<4f", 1.0, 3.0, -2.5, 0.125)
    assert to_proto(torch.tensor([258], dtype=torch.int32)).data == b"\x02\x01\x00\x00"
    assert to_proto(torch.tensor([1.0], dtype=torch.bfloat16)).data == b"\x80\x3f"


def test_tensor_decode_validates():
    with pytest.raises(ValueError, match=r"delta\.data: expected 24 bytes .* found 20"):
        from_proto(tensor_pb2.Tensor(dtype="float32", shape=[2, 3], data=b"\0" * 20), "delta")
    with pytest.raises(ValueError, match=r"hidden\.dtype: expected one of .* found 'float64'"):
        from_proto(tensor_pb2.Tensor(dtype="float64", shape=[1], data=b"\0" * 8), "hidden")
    with pytest.raises(ValueError, match=r"x\.shape: expected non-negative"):
        from_proto(tensor_pb2.Tensor(dtype="uint8", shape=[-1], data=b""), "x")
    with pytest.raises(ValueError, match=r"out: dtype torch\.float64 cannot go on the wire"):
        to_proto(torch.zeros(2, dtype=torch.float64), "out")
    assert from_proto(tensor_pb2.Tensor(dtype="bool", shape=[3], data=b"\x00\x07\x01")).tolist() == [False, True, True]


def test_sampling_params_round_trip():
    p = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=2**40 + 3,
        stop_token_ids=(3, 7),
        logprobs=4,
        prompt_logprobs=0,
        grammar='start: "a"',
        grammar_after_token=11,
    )
    assert sampling_from_proto(sampling_pb2.SamplingParams.FromString(sampling_to_proto(p).SerializeToString())) == p
    assert sampling_from_proto(sampling_to_proto(SamplingParams())) == SamplingParams()
    assert sampling_from_proto(sampling_pb2.SamplingParams()) == SamplingParams()  # unset → defaults


# ---------------------------------------------------------------------------------------------- remote == local
def test_remote_matches_local(servers, clients, ckpt):
    """Every remote method returns exactly what the local object returns for the same calls."""
    from expertmesh.wire.worker_api import StepSegment

    cfg = ckpt.cfg
    local, remote = servers["local"]["attention"], clients["attention"]
    lexp, rexp = servers["local"]["expert"], clients["expert"]
    both = (local, remote)
    assert local.info() == remote.info()
    g = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, cfg.vocab_size, (19,), generator=g).tolist()
    prompt_b = torch.randint(0, cfg.vocab_size, (6,), generator=g).tolist()
    greedy = SamplingParams(max_tokens=8, logprobs=3, prompt_logprobs=2)  # log-probs travel too
    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=20, seed=11, stop_token_ids=(3,))
    for w in both:
        assert w.open_sequence("a", greedy, reserve_tokens=32) == 0
        assert w.open_sequence("b", sampled, reserve_tokens=8) == 0
    assert local.extend_sequence("b", 16) == remote.extend_sequence("b", 16)  # grows as it decodes
    assert local.info() == remote.info()

    def run_step(step_id, segments, snapshots=None):
        calls = lexp.calls
        results = [w.run_step(step_id, segments, snapshots) for w in both]
        same_result(*results)
        return results[0], lexp.calls - calls

    h, ids, weights = expert_call(cfg, 7, 4, seed=9)  # the expert call itself: bitwise equal
    for layer in cfg.moe_layers:
        same(lexp.run(layer, h, ids, weights), rexp.run(layer, h, ids, weights))
        same(lexp.run(layer, h, ids, weights, torch.bfloat16), rexp.run(layer, h, ids, weights, torch.bfloat16))
    done, moe_calls = run_step(
        1, [StepSegment("a", prompt_a, True), StepSegment("b", prompt_b, True)], {"a": "prefix-a"}
    )
    assert moe_calls == len(cfg.moe_layers) and set(done.tokens) == {"a", "b"}
    assert [(lp.seq_id, lp.position, len(lp.token_ids)) for lp in done.logprobs] == [
        ("a", 1, len(prompt_a) - 1),
        ("a", len(prompt_a), 1),
    ]
    toks = dict(done.tokens)
    for step in range(2, 5):  # decode
        done, _ = run_step(step, [StepSegment(s, [t], True) for s, t in toks.items()])
        toks = dict(done.tokens)
    assert local.info() == remote.info() and local.info()["prefixes"] == 1

    assert local.save_prefix("b", "prefix-b") == remote.save_prefix("b", "prefix-b")
    for w in both:  # start from a cached prefix
        assert w.open_sequence("c", greedy, reserve_tokens=24, prefix_key="prefix-a") == len(prompt_a)
    run_step(5, [StepSegment("c", prompt_b[:3], True)])
    assert local.expert_load() == remote.expert_load() and sum(local.expert_load()[cfg.moe_layers[0]]) > 0
    listed = local.list_prefixes()
    assert listed == remote.list_prefixes() and [(k, t) for k, _, t in listed] == [
        ("prefix-a", "device"),
        ("prefix-b", "device"),
    ]
    demoted = local.demote_prefix("prefix-b")  # no lower tier on these workers: dropped, and said so
    assert demoted == remote.demote_prefix("prefix-b") and demoted[1] == ["prefix-b"]
    for key in ("prefix-a", "prefix-b", "never-saved"):
        assert local.drop_prefix(key) == remote.drop_prefix(key)
    for s in ("a", "b", "c"):
        assert local.close_sequence(s) == remote.close_sequence(s)
    assert local.info() == remote.info() and remote.info()["free_blocks"] == KV_BLOCKS


def test_two_steps_on_one_sequence_at_once_run_one_after_the_other(servers, clients, ckpt):
    """Two RunStep calls naming the same sequence at the same moment (two routers, or a retry racing its original)
    are serialized by the worker: the sequence advances by both, as two steps in a row do on the local worker,
    and the next step agrees token for token (before steps were one call under the worker lock, a second step
    on a sequence corrupted its cache)."""
    from expertmesh.wire.worker_api import StepSegment

    local, remote = servers["local"]["attention"], clients["attention"]
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, ckpt.cfg.vocab_size, (9,), generator=g).tolist()
    fed = torch.randint(0, ckpt.cfg.vocab_size, (2,), generator=g).tolist()
    params = SamplingParams(max_tokens=8, logprobs=3)  # each step's position and distribution come back

    def step(w, step_id, token):
        done = w.run_step(step_id, [StepSegment("twice", [token], True)])
        (lp,) = done.logprobs
        return lp.position, done.tokens["twice"], lp.top_ids.tolist(), lp.top_logprobs.tolist()

    for w in (local, remote):
        w.open_sequence("twice", params, reserve_tokens=16)
        w.run_step(60, [StepSegment("twice", prompt, True)])
    in_a_row = [step(local, 61 + i, fed[0]) for i in range(2)]
    start = threading.Barrier(2)

    def racing_step(step_id):
        start.wait()
        return step(remote, step_id, fed[0])

    with futures.ThreadPoolExecutor(2) as pool:
        at_once = list(pool.map(racing_step, (61, 62)))
    try:
        assert in_a_row[0][0] + 1 == in_a_row[1][0]
        assert sorted(at_once) == in_a_row
        assert step(local, 63, fed[1]) == step(remote, 63, fed[1])
        assert local.info() == remote.info()
    finally:
        for w in (local, remote):
            w.close_sequence("twice")


def test_expert_info_and_shard(servers, clients, ckpt):
    shard_local, shard_remote = servers["local"]["shard"], clients["shard"]
    assert shard_remote.info() == {"name": "shard", "model": "tiny", "experts": sorted(SUBSET)}
    assert clients["expert"].info()["experts"] == servers["local"]["expert"].assignment
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, ckpt.cfg.hidden_size, generator=g)
    ids = torch.tensor([[0, -1], [1, 5], [-1, -1], [0, 5], [-1, 1]])  # tiny: groups of 4 experts
    w = torch.rand(5, 2, generator=g)
    out = shard_remote.run(1, hidden, ids, w)
    assert out.shape == (6, ckpt.cfg.hidden_size)  # one row per (row, group): {0}, {0, 1}, {}, {0, 1}, {0}
    same(shard_local.run(1, hidden, ids, w), out)
    one = torch.tensor([[3], [3]])
    same(shard_local.run(2, hidden[:2], one, w[:2, :1]), shard_remote.run(2, hidden[:2], one, w[:2, :1]))


# ---------------------------------------------------------------------------------------------- errors
def _code(call, *args):
    with pytest.raises(grpc.RpcError) as e:
        call(*args, timeout=10)
    return e.value.code(), e.value.details()


def test_attention_errors_map_to_status_codes(servers, clients, ckpt):
    from expertmesh.wire.worker_api import NotConnected, NotFound, OutOfBlocks, StepSegment, WorkerError
    from expertmesh.worker.attention import AttentionWorker
    from expertmesh.worker.server import serve, shutdown

    local, remote = servers["local"]["attention"], clients["attention"]
    stub = worker_pb2_grpc.AttentionWorkerStub(remote.channel)
    params = SamplingParams(max_tokens=4)

    def both_raise(exc, call):
        with pytest.raises(exc) as lerr:
            call(local)
        with pytest.raises(exc) as rerr:
            call(remote)
        assert str(lerr.value) == str(rerr.value)  # the worker's own message, naming the field

    both_raise(NotFound, lambda w: w.close_sequence("missing"))
    assert _code(stub.CloseSequence, worker_pb2.CloseSequenceRequest(seq_id="missing"))[0] == grpc.StatusCode.NOT_FOUND
    both_raise(NotFound, lambda w: w.open_sequence("x", params, reserve_tokens=8, prefix_key="nope"))
    both_raise(WorkerError, lambda w: w.open_sequence("x", params, reserve_tokens=0))
    both_raise(OutOfBlocks, lambda w: w.open_sequence("x", params, reserve_tokens=(KV_BLOCKS + 1) * BLOCK_SIZE))
    req = worker_pb2.OpenSequenceRequest(seq_id="x", params=sampling_to_proto(params), reserve_tokens=10**3)
    assert _code(stub.OpenSequence, req)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _code(stub.OpenSequence, worker_pb2.OpenSequenceRequest(seq_id="x", reserve_tokens=8)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "params: required",
    )
    both_raise(NotFound, lambda w: w.run_step(50, [StepSegment("missing", [1], True)]))
    for w in (local, remote):
        w.open_sequence("e", params, reserve_tokens=8)
    both_raise(WorkerError, lambda w: w.run_step(51, [StepSegment("e", [5, 6, 7] * 3, True)]))  # past its reserve
    both_raise(WorkerError, lambda w: w.run_step(52, [StepSegment("e", [1], True), StepSegment("e", [2], True)]))
    # a prefix inside the step: the length travels (SnapshotKey.length) and this KDA model refuses it, naming it
    both_raise(WorkerError, lambda w: w.run_step(53, [StepSegment("e", [5, 6, 7], True)], {"e": ("k", 2)}))
    for w in (local, remote):
        w.close_sequence("e")
    assert local.info() == remote.info()
    # a table that does not fit the model is INVALID_ARGUMENT naming it; a step before any table, FAILED_PRECONDITION
    import numpy as np

    from expertmesh.placement.replica_table import ReplicaTable

    bad = ReplicaTable((1,), np.zeros((1, ckpt.cfg.moe.n_routed_experts, 1), dtype=np.int64))
    both_raise(WorkerError, lambda w: w.connect_experts([clients["expert"]], bad))
    fresh_local = AttentionWorker(ckpt, kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE, name="fresh")
    fresh = serve("attention", ckpt, 0, kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE, name="fresh")
    try:
        from expertmesh.wire.clients import RemoteAttention

        with RemoteAttention(f"127.0.0.1:{fresh.port}", timeout=10.0) as fresh_remote:
            for w in (fresh_local, fresh_remote):
                w.open_sequence("s", params, reserve_tokens=8)
            with pytest.raises(NotConnected) as lerr:
                fresh_local.run_step(1, [StepSegment("s", [1], True)])
            with pytest.raises(NotConnected) as rerr:
                fresh_remote.run_step(1, [StepSegment("s", [1], True)])
            assert str(lerr.value) == str(rerr.value) == "fresh: no expert workers connected yet"
    finally:
        shutdown(fresh, 1.0)


def test_expert_errors_map_to_status_codes(servers, clients, ckpt):
    from expertmesh.wire.worker_api import ExpertRequestError, UnknownExpert

    local, remote = servers["local"]["shard"], clients["shard"]
    stub = worker_pb2_grpc.ExpertWorkerStub(remote.channel)
    h = ckpt.cfg.hidden_size
    hidden = torch.randn(2, h, generator=torch.Generator().manual_seed(4))
    w1, w2 = torch.ones(2, 1), torch.ones(2, 2)
    cases = [
        (UnknownExpert, (1, hidden, torch.tensor([[0, 7], [1, -1]]), w2)),  # expert 7 of layer 1: elsewhere
        (UnknownExpert, (3, hidden, torch.tensor([[0], [1]]), w1)),  # no experts of layer 3 here
        (ExpertRequestError, (1, hidden[:, :8], torch.tensor([[0], [1]]), w1)),
        (ExpertRequestError, (1, hidden, torch.tensor([[0, 99], [1, 0]]), w2)),
        (ExpertRequestError, (1, hidden, torch.tensor([[5, 0], [0, 1]]), w2)),  # not ascending
        (ExpertRequestError, (1, hidden, torch.tensor([[0, 5], [0, 1]]), w1)),
    ]  # weights of another shape
    for exc, args in cases:
        with pytest.raises(exc) as lerr:
            local.run(*args)
        with pytest.raises(exc) as rerr:
            remote.run(*args)
        assert str(lerr.value) == str(rerr.value)
    wp = to_proto(w1)
    req = worker_pb2.RunExpertsRequest(
        layer=1, hidden=to_proto(hidden), expert_ids=to_proto(torch.tensor([[7], [0]])), weights=wp
    )
    assert _code(stub.RunExperts, req)[0] == grpc.StatusCode.NOT_FOUND
    req = worker_pb2.RunExpertsRequest(
        layer=1, hidden=to_proto(hidden), expert_ids=to_proto(torch.zeros(2, 1)), weights=wp
    )
    assert _code(stub.RunExperts, req) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "expert_ids.dtype: expected int64 (or int32), found float32",
    )
    req = worker_pb2.RunExpertsRequest(layer=1, hidden=to_proto(hidden), expert_ids=to_proto(torch.tensor([[5], [0]])))
    assert _code(stub.RunExperts, req) == (grpc.StatusCode.INVALID_ARGUMENT, "weights: required")
    req.weights.CopyFrom(wp)
    req.output_dtype = "float16"
    assert _code(stub.RunExperts, req) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "output_dtype: expected one of ['bfloat16', 'float32'], found 'float16'",
    )
    assert _code(stub.RunExperts, worker_pb2.RunExpertsRequest(layer=1))[0] == grpc.StatusCode.INVALID_ARGUMENT
    same(local.run(1, hidden, torch.tensor([[5], [0]]), w1), remote.run(1, hidden, torch.tensor([[5], [0]]), w1))


def test_unreachable_and_deadline_raise_worker_unavailable(servers):
    from expertmesh.wire.clients import RemoteAttention, RemoteExpert
    from expertmesh.wire.worker_api import WorkerUnavailable

    assert issubclass(WorkerUnavailable, ConnectionError)
    from expertmesh.entry.cluster import free_port

    with RemoteAttention(f"127.0.0.1:{free_port()}", timeout=5.0) as dead:
        with pytest.raises(WorkerUnavailable, match="UNAVAILABLE"):
            dead.info()

    class Stuck(worker_pb2_grpc.ExpertWorkerServicer):  # answers after the client's deadline
        def Info(self, request, context):
            release.wait(10)
            return worker_pb2.ExpertInfo()

    release = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_ExpertWorkerServicer_to_server(Stuck(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with RemoteExpert(f"127.0.0.1:{port}", timeout=0.3) as hurried:
            with pytest.raises(WorkerUnavailable, match="DEADLINE_EXCEEDED"):
                hurried.info()
    finally:
        release.set()
        server.stop(None)


# ---------------------------------------------------------------------------------------------- health, reflection
def test_health_serving(servers, clients):
    from expertmesh.worker.servicers import ATTENTION_SERVICE, EXPERT_SERVICE

    for service in ("", ATTENTION_SERVICE, EXPERT_SERVICE):
        assert clients["attention"].health(service) == "SERVING"
    assert clients["shard"].health(EXPERT_SERVICE) == "SERVING"
    stub = health_pb2_grpc.HealthStub(clients["shard"].channel)
    assert _code(stub.Check, health_pb2.HealthCheckRequest(service=ATTENTION_SERVICE))[0] == grpc.StatusCode.NOT_FOUND


def _services_v1(channel) -> set[str]:
    """The services listed by reflection v1 (its messages are v1alpha's, field for field)."""
    from grpc_reflection.v1alpha import reflection_pb2

    info = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    reply = next(iter(info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)))
    return {s.name for s in reply.list_services_response.service}


def test_reflection_lists_services(servers, clients):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    reflection = {"grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}
    db = ProtoReflectionDescriptorDatabase(clients["attention"].channel)
    assert (
        set(db.get_services())
        == _services_v1(clients["attention"].channel)
        == {"expertmesh.v1.AttentionWorker", "expertmesh.v1.ExpertWorker", "grpc.health.v1.Health", *reflection}
    )
    service = DescriptorPool(db).FindServiceByName("expertmesh.v1.AttentionWorker")
    assert [m.name for m in service.methods] == [
        "Info",
        "OpenSequence",
        "CloseSequence",
        "ExtendSequence",
        "SavePrefix",
        "DropPrefix",
        "DemotePrefix",
        "ListPrefixes",
        "ConnectExperts",
        "RunStep",
        "ExpertLoad",
        "HandOff",
        "ImportSequence",
        "OpenCollective",
        "OpenStepChannel",
    ]
    assert (
        set(ProtoReflectionDescriptorDatabase(clients["shard"].channel).get_services())
        == _services_v1(clients["shard"].channel)
        == {"expertmesh.v1.ExpertWorker", "grpc.health.v1.Health", *reflection}
    )


def test_shutdown_refuses_new_calls(ckpt):
    from expertmesh.wire.clients import RemoteExpert
    from expertmesh.wire.worker_api import WorkerUnavailable
    from expertmesh.worker.server import serve, shutdown

    server = serve("expert", ckpt, 0, assignment=[(1, 0)])
    with RemoteExpert(f"127.0.0.1:{server.port}", timeout=5.0) as c:
        assert c.health() == "SERVING" and c.info()["experts"] == [(1, 0)]
        with pytest.raises(OSError, match="cannot listen"):  # the port is taken: fail, never share it
            serve("expert", ckpt, server.port, assignment=[(1, 0)])
        shutdown(server, grace=1.0)
        with pytest.raises(WorkerUnavailable):
            c.info()


# ---------------------------------------------------------------------------------------------- the process
def test_main_prints_ready_and_exits_0_on_sigterm(ckpt, tmp_path):
    from expertmesh.wire.clients import RemoteExpert

    cmd = [
        sys.executable,
        "-m",
        "expertmesh.worker.cli",
        "--role",
        "expert",
        "--checkpoint",
        str(ckpt.path),
        "--port",
        "0",
        "--experts",
        "1:0-2,3:4",
        "--name",
        "expert-7",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "EXPERTMESH_TORCH_THREADS": "1"},
    )
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=50)
        assert line and line[0].startswith("READY expert 127.0.0.1:"), (line, proc.poll())
        address = line[0].split()[-1]
        with RemoteExpert(address, timeout=10.0) as c:
            assert c.health() == "SERVING"
            assert c.info() == {"name": "expert-7", "model": "tiny", "experts": [(1, 0), (1, 1), (1, 2), (3, 4)]}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_main_rejects_bad_arguments(ckpt, capsys):
    from expertmesh.worker.cli import main, parse_experts

    base = ["--checkpoint", str(ckpt.path), "--port", "0"]
    for argv, needle in [
        (["--role", "expert", *base], "--experts or --plan"),
        (["--role", "expert", *base, "--experts", "1:x"], "--experts: expected LAYER:EXPERT"),
        (["--role", "expert", *base, "--plan", "p.json"], "--ordinal: required with --plan"),
        (["--role", "both", *base, "--experts", "1:0", "--plan", "p.json", "--ordinal", "0"], "give one of them"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err
    assert parse_experts("1:0, 2:3-5") == [(1, 0), (2, 3), (2, 4), (2, 5)]


def test_plan_assignment(ckpt, tmp_path):
    pytest.importorskip("expertmesh.placement.plan")
    pytest.importorskip("expertmesh.placement.planner")
    from expertmesh.entry.cluster import make_placement
    from expertmesh.worker.cli import plan_assignment

    plan = make_placement(ckpt.cfg, 2)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    for ordinal in (0, 1):
        assert plan_assignment(str(path), ordinal) == [(int(l), int(e)) for l, e in plan.experts_of(ordinal)]


def test_generated_code_is_up_to_date(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "expertmesh.protos.generate", "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def test_garbage_request_bytes_are_invalid_argument(servers):
    """Bytes that are not the method's message: INVALID_ARGUMENT naming it (gRPC's default would be INTERNAL)."""
    with grpc.insecure_channel(f"127.0.0.1:{servers['both'].port}") as ch:
        for method, message in (
            ("AttentionWorker/RunStep", "RunStepRequest"),
            ("ExpertWorker/RunExperts", "RunExpertsRequest"),
        ):
            call = ch.unary_unary(f"/expertmesh.v1.{method}", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as e:
                call(b"\xff\xff\xff\xff garbage", timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                e.value.details()
                == f"{method.split('/')[1]}: the request is not a valid expertmesh.v1.{message} message"
            )
