"""The router as the Gateway API Inference Extension's Endpoint Picker (router/endpoint_picker.py), driven by a real
gRPC ext_proc client playing Envoy's part (one bidirectional Process stream per request, messages sent in the order
Envoy sends them, the next only once Envoy would) against the picker's real gRPC server, choosing among real router
HTTP apps (three replicas over one in-process engine, each its own /health, plus one over an engine whose queue is
always full: it sheds load). Checked: the destination header and `envoy.lb` metadata name a ready replica; the next
turn of the same conversation goes to the same replica, in both body modes and for both APIs; the subset hint is
honoured; 503 with no ready replica, 429 when every one sheds; the body chunks come back unchanged; gRPC health."""

from __future__ import annotations

import json
import queue
from types import SimpleNamespace

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.protos import ext_proc_pb2 as pb
from expertmesh.protos import ext_proc_pb2_grpc as pb_grpc
from expertmesh.router.endpoint_picker import (
    SERVICE,
    ReplicaState,
    choose,
    rendezvous_order,
    serve_endpoint_picker,
    session_key,
)
from expertmesh.router.http import build_app, serve_http
from expertmesh.router.replica_set import ReplicaSet
from expertmesh.router.response_store import ResponseStore

Mode = pb.ProcessingMode
DEST = "x-gateway-destination-endpoint"


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def replicas(tiny_checkpoint_dir):
    """Three ready replicas (r-a, r-b, r-c) and one that sheds load (r-full), as ip:port → replica name."""
    engine = build_local_engine(Checkpoint(tiny_checkpoint_dir), attention_workers=1, expert_workers=1)
    full = build_local_engine(Checkpoint(tiny_checkpoint_dir), attention_workers=1, expert_workers=1, max_waiting=0)
    servers, names = [], {}
    for name, eng in (("r-a", engine), ("r-b", engine), ("r-c", engine), ("r-full", full)):
        port = free_port()
        servers.append(serve_http(build_app(eng, response_store=ResponseStore(replica=name)), "127.0.0.1", port))
        names[f"127.0.0.1:{port}"] = name
    yield names
    for srv, thread in servers:
        srv.should_exit = True
        thread.join(timeout=10)
    engine.close()
    full.close()


def picker_over(addresses: list[str]):
    seeds = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in addresses]
    server = serve_endpoint_picker(ReplicaSet(seeds, interval=0.5), "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return server, channel


@pytest.fixture(scope="module")
def picker(replicas):
    """The picker over the three ready replicas (r-full reached only through a subset hint)."""
    ready = [a for a, n in replicas.items() if n != "r-full"]
    server, channel = picker_over(ready)
    yield SimpleNamespace(stub=pb_grpc.ExternalProcessorStub(channel), channel=channel, ready=ready, names=replicas)
    channel.close()
    server.stop(0)
    server.replicas.close()


# ----------------------------------------------------------------------------------------------- Envoy's part
class Envoy:
    """One ext_proc stream as Envoy drives it: `send` a ProcessingRequest, `recv` the next ProcessingResponse."""

    def __init__(self, stub):
        self._out: queue.Queue = queue.Queue()
        self._responses = stub.Process(iter(self._out.get, None), timeout=20)

    def send(self, **request) -> Envoy:
        self._out.put(pb.ProcessingRequest(**request))
        return self

    def recv(self) -> pb.ProcessingResponse:
        return next(self._responses)

    def close(self) -> list[pb.ProcessingResponse]:
        self._out.put(None)
        return list(self._responses)


def headers(path: str = "/v1/chat/completions", *, end_of_stream: bool = False) -> pb.HttpHeaders:
    pairs = [(":method", "POST"), (":path", path), (":authority", "gateway"), ("content-type", "application/json")]
    hmap = pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    return pb.HttpHeaders(headers=hmap, end_of_stream=end_of_stream)


def protocol(mode: int) -> pb.ProtocolConfiguration:
    return pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode)


def subset(addresses: list[str]) -> pb.Metadata:
    meta = pb.Metadata()
    json_format.ParseDict(
        {"x-gateway-destination-endpoint-subset": addresses}, meta.filter_metadata["envoy.lb.subset_hint"]
    )
    return meta


def destination_of(common: pb.CommonResponse, response: pb.ProcessingResponse) -> str:
    """The endpoint the answer names, checked to be the same in the header and the envoy.lb metadata."""
    (option,) = [o for o in common.header_mutation.set_headers if o.header.key == DEST]
    header = option.header.raw_value.decode()
    assert option.append_action == pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    metadata = json_format.MessageToDict(response.dynamic_metadata)
    assert metadata == {"envoy.lb": {DEST: header}}
    assert common.clear_route_cache
    return header


def pick_duplex(stub, body: dict, *, chunks: int = 3, metadata: pb.Metadata | None = None, path=None) -> str:
    """A FULL_DUPLEX_STREAMED exchange: the headers, the body in `chunks` pieces (no answer before the last), then
    the headers' answer and the chunks back unchanged; returns the endpoint named."""
    data = json.dumps(body).encode()
    size = -(-len(data) // chunks)
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    envoy = Envoy(stub)
    extra = {"metadata_context": metadata} if metadata is not None else {}
    envoy.send(
        request_headers=headers(path or "/v1/chat/completions"),
        protocol_config=protocol(Mode.FULL_DUPLEX_STREAMED),
        **extra,
    )
    for i, piece in enumerate(pieces):
        envoy.send(request_body=pb.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1))
    first = envoy.recv()
    if first.HasField("immediate_response"):
        assert envoy.close() == []
        return first
    assert first.WhichOneof("response") == "request_headers"
    endpoint = destination_of(first.request_headers.response, first)
    echoed = [envoy.recv() for _ in pieces]
    streamed = [r.request_body.response.body_mutation.streamed_response for r in echoed]
    assert [s.body for s in streamed] == pieces
    assert [s.end_of_stream for s in streamed] == [False] * (len(pieces) - 1) + [True]
    # the response direction passes unchanged
    envoy.send(response_headers=headers(end_of_stream=False))
    assert envoy.recv().WhichOneof("response") == "response_headers"
    envoy.send(response_body=pb.HttpBody(body=b'{"ok": true}', end_of_stream=True))
    out = envoy.recv().response_body.response.body_mutation.streamed_response
    assert (out.body, out.end_of_stream) == (b'{"ok": true}', True)
    assert envoy.close() == []
    return endpoint


def pick_buffered(stub, body: dict) -> str:
    """A BUFFERED exchange: the headers answered at once (Envoy sends the body only then), the body's answer
    naming the endpoint."""
    envoy = Envoy(stub)
    envoy.send(request_headers=headers(), protocol_config=protocol(Mode.BUFFERED))
    first = envoy.recv()
    assert (
        first.WhichOneof("response") == "request_headers"
        and not first.request_headers.response.header_mutation.set_headers
    )
    envoy.send(request_body=pb.HttpBody(body=json.dumps(body).encode(), end_of_stream=True))
    second = envoy.recv()
    assert second.WhichOneof("response") == "request_body"
    endpoint = destination_of(second.request_body.response, second)
    assert envoy.close() == []
    return endpoint


def chat(session: int, turns: int) -> dict:
    """An OpenAI chat body: conversation `session` after `turns` user turns (each resending the history)."""
    messages = [{"role": "system", "content": f"You help with case {session}."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} of case {session}"})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {t}"})
    return {"model": "m", "messages": messages, "max_tokens": 4}


# ----------------------------------------------------------------------------------------------- tests
def test_a_chat_request_names_a_ready_replica_and_its_next_turn_the_same(picker):
    first = pick_duplex(picker.stub, chat(1, 1))
    assert first in picker.ready
    assert pick_duplex(picker.stub, chat(1, 2)) == first
    assert pick_duplex(picker.stub, chat(1, 3), chunks=1) == first
    assert pick_buffered(picker.stub, chat(1, 4)) == first  # either body mode: the same choice


def test_sessions_spread_over_the_replicas_in_both_body_modes(picker):
    duplex = [pick_duplex(picker.stub, chat(s, 1)) for s in range(12)]
    buffered = [pick_buffered(picker.stub, chat(s, 2)) for s in range(12)]
    assert duplex == buffered
    assert len(set(duplex)) >= 2 and set(duplex) <= set(picker.ready)


def test_anthropic_and_responses_bodies(picker):
    def messages(turns: int) -> dict:
        msgs = [{"role": "user", "content": "tell me about tides"}]
        for t in range(1, turns):
            msgs += [{"role": "assistant", "content": f"part {t}"}, {"role": "user", "content": "more"}]
        return {"model": "m", "system": "be brief", "messages": msgs, "max_tokens": 8}

    first = pick_duplex(picker.stub, messages(1), path="/v1/messages")
    assert pick_duplex(picker.stub, messages(3), path="/v1/messages") == first
    # a Responses API follow-up goes to the replica its previous response's id names
    for address, name in picker.names.items():
        if address in picker.ready:
            follow_up = {"model": "m", "input": "and then?", "previous_response_id": f"resp_{name}_{'0' * 24}"}
            assert pick_buffered(picker.stub, follow_up) == address


def test_subset_hint_is_honoured(picker):
    body = chat(7, 1)
    chosen = pick_duplex(picker.stub, body)
    others = [a for a in picker.ready if a != chosen]
    assert pick_duplex(picker.stub, body, metadata=subset(others)) in others
    (only,) = others[:1]
    assert pick_duplex(picker.stub, body, metadata=subset([only])) == only


def test_503_when_no_hinted_replica_is_ready_and_429_when_every_one_sheds(picker):
    dead = f"127.0.0.1:{free_port()}"
    refused = pick_duplex(picker.stub, chat(2, 1), metadata=subset([dead]))
    assert refused.immediate_response.status.code == 503
    assert json.loads(refused.immediate_response.body)["error"]["code"] == "unavailable"
    empty = pick_duplex(picker.stub, chat(2, 1), metadata=subset([]))
    assert empty.immediate_response.status.code == 503
    (full,) = [a for a, n in picker.names.items() if n == "r-full"]
    shed = pick_duplex(picker.stub, chat(2, 1), metadata=subset([full]))
    assert shed.immediate_response.status.code == 429
    assert json.loads(shed.immediate_response.body)["error"]["type"] == "rate_limit_error"
    # a shedding replica in the hint is passed over for a ready one
    assert pick_duplex(picker.stub, chat(2, 1), metadata=subset([full, picker.ready[0]])) == picker.ready[0]


def test_503_with_no_replica_ready_and_health():
    server, channel = picker_over([f"127.0.0.1:{free_port()}"])
    try:
        envoy = Envoy(pb_grpc.ExternalProcessorStub(channel))
        envoy.send(request_headers=headers(end_of_stream=True))  # a request without a body: chosen on its headers
        assert envoy.recv().immediate_response.status.code == 503
        assert envoy.close() == []
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("liveness", "readiness", SERVICE):
            status = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING, name
    finally:
        channel.close()
        server.stop(0)
        server.replicas.close()


def test_a_body_that_is_not_json_goes_by_load_and_passes_unchanged(picker):
    envoy = Envoy(picker.stub)
    envoy.send(request_headers=headers(), protocol_config=protocol(Mode.FULL_DUPLEX_STREAMED))
    envoy.send(request_body=pb.HttpBody(body=b"{not json", end_of_stream=True))
    first, echo = envoy.recv(), envoy.recv()
    assert destination_of(first.request_headers.response, first) in picker.ready
    assert echo.request_body.response.body_mutation.streamed_response.body == b"{not json"
    envoy.close()


def test_rendezvous_moves_only_the_leaving_replicas_sessions():
    states = [ReplicaState(f"10.0.0.{i}:8000", ready=True) for i in range(1, 6)]
    bodies = [chat(s, 1) for s in range(200)]
    before = [choose(b, states).address for b in bodies]
    gone = states[2].address
    after = [choose(b, [s for s in states if s.address != gone]).address for b in bodies]
    for b, a in zip(before, after):
        assert a == b or b == gone
    assert gone in before and len(set(before)) == 5
    # a prompt_cache_key is the session: the same replica whatever the conversation
    keyed = [choose({"prompt_cache_key": "tenant-7", **b}, states).address for b in bodies[:20]]
    assert len(set(keyed)) == 1
    assert keyed[0] == rendezvous_order(session_key({"prompt_cache_key": "tenant-7"}), states)[0].address


# Field numbers as envoyproxy/envoy declares them (api/envoy/service/ext_proc/v3/external_processor.proto,
# config/core/v3/base.proto, type/v3/http_status.proto, extensions/filters/http/ext_proc/v3/processing_mode.proto):
# the trimmed protos/ext_proc.proto must keep every one, or Envoy's bytes would not parse.
UPSTREAM_FIELDS = {
    "ProcessingRequest": dict(
        request_headers=2, response_headers=3, request_body=4, response_body=5, request_trailers=6,
        response_trailers=7, metadata_context=8, attributes=9, observability_mode=10, protocol_config=11,
    ),
    "ProcessingResponse": dict(
        request_headers=1, response_headers=2, request_body=3, response_body=4, request_trailers=5,
        response_trailers=6, immediate_response=7, dynamic_metadata=8, mode_override=9,
    ),
    "ProtocolConfiguration": dict(
        request_body_mode=1, response_body_mode=2, send_body_without_waiting_for_header_response=3
    ),
    "HttpHeaders": dict(headers=1, end_of_stream=3),
    "HttpBody": dict(body=1, end_of_stream=2),
    "HttpTrailers": dict(trailers=1),
    "HeadersResponse": dict(response=1),
    "BodyResponse": dict(response=1),
    "TrailersResponse": dict(header_mutation=1),
    "CommonResponse": dict(status=1, header_mutation=2, body_mutation=3, trailers=4, clear_route_cache=5),
    "ImmediateResponse": dict(status=1, headers=2, body=3, grpc_status=4, details=5),
    "GrpcStatus": dict(status=1),
    "HeaderMutation": dict(set_headers=1, remove_headers=2),
    "StreamedBodyResponse": dict(body=1, end_of_stream=2),
    "BodyMutation": dict(body=1, clear_body=2, streamed_response=3),
    "Metadata": dict(filter_metadata=1),
    "HeaderValue": dict(key=1, value=2, raw_value=3),
    "HeaderValueOption": dict(header=1, append_action=3, keep_empty_value=4),
    "HeaderMap": dict(headers=1),
    "HttpStatus": dict(code=1),
    "ProcessingMode": dict(
        request_header_mode=1, response_header_mode=2, request_body_mode=3, response_body_mode=4,
        request_trailer_mode=5, response_trailer_mode=6,
    ),
}  # fmt: skip


def test_the_trimmed_proto_keeps_envoys_names_and_numbers():
    assert SERVICE == "envoy.service.ext_proc.v3.ExternalProcessor"
    method = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].methods_by_name["Process"]
    assert method.client_streaming and method.server_streaming
    for message, fields in UPSTREAM_FIELDS.items():
        have = {f.name: f.number for f in pb.DESCRIPTOR.message_types_by_name[message].fields}
        assert have == fields, message
    modes = {v.name: v.number for v in Mode.DESCRIPTOR.enum_types_by_name["BodySendMode"].values}
    assert modes == dict(NONE=0, STREAMED=1, BUFFERED=2, BUFFERED_PARTIAL=3, FULL_DUPLEX_STREAMED=4)
    assert pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD == 2
    assert (pb.ServiceUnavailable, pb.TooManyRequests) == (503, 429)


def test_a_body_past_the_routers_limit_is_not_held(picker):
    """Past 4 MiB the picker answers (by load: the router refuses such a body itself) and streams the rest."""
    piece = b"x" * 2**20
    envoy = Envoy(picker.stub)
    envoy.send(request_headers=headers(), protocol_config=protocol(Mode.FULL_DUPLEX_STREAMED))
    for _ in range(5):
        envoy.send(request_body=pb.HttpBody(body=piece))
    first = envoy.recv()
    assert destination_of(first.request_headers.response, first) in picker.ready
    echoed = [envoy.recv().request_body.response.body_mutation.streamed_response for _ in range(5)]
    assert all(e.body == piece and not e.end_of_stream for e in echoed)
    envoy.send(request_body=pb.HttpBody(body=b"end", end_of_stream=True))
    last = envoy.recv().request_body.response.body_mutation.streamed_response
    assert (last.body, last.end_of_stream) == (b"end", True)
    assert envoy.close() == []


def test_epp_replicas_flag_is_checked_naming_it():
    from expertmesh.router.replica_set import parse_replicas

    assert parse_replicas("10.0.0.1:8000, router-pods.ns.svc:8000,[::1]:9") == [
        ("10.0.0.1", 8000),
        ("router-pods.ns.svc", 8000),
        ("::1", 9),
    ]
    for bad in ("10.0.0.1", "host:http", "host:0", ":8000"):
        with pytest.raises(ValueError, match=r"--epp-replicas: .*expected HOST:PORT"):
            parse_replicas(bad)
