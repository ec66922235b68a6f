"""The router as the Gateway API Inference Extension's Endpoint Picker (`expertmesh router --epp-port N`): an Envoy
ext_proc server (envoy.service.ext_proc.v3.ExternalProcessor/Process, protos/ext_proc.proto) that tells the
gateway which router replica serves each request.

Per request, on the stream Envoy opens for it:
  * the request headers and body are read — the body in FULL_DUPLEX_STREAMED mode (chunks accumulated until
    end_of_stream or the trailers; no answer to the headers before then, as the protocol requires) or BUFFERED mode
    (the headers answered at once, the whole body next); the mode is the one Envoy states in `protocol_config`
    (FULL_DUPLEX_STREAMED, the protocol's mode, when it states none). No body (a GET, NONE or STREAMED mode): the
    choice is made on the headers;
  * the replica: a Responses API follow-up (`previous_response_id`) goes to the replica that holds that response
    (its id names it); any other request by its session key (`session_key`: the conversation's opening, which
    every turn resends, or its `prompt_cache_key`), chosen by the same rendezvous hashing the replicas use to
    give a session its attention worker (router/scheduler.affinity_worker) over the ready replicas — so every
    turn of a conversation goes to the same replica, every picker instance agrees, and a replica leaving moves
    only its own sessions. A replica shedding load is passed over for the next in the same order; a request
    without a key (no body, not JSON, no conversation) goes to the least loaded ready replica;
  * the answer: the header `x-gateway-destination-endpoint: ip:port` and the same value in the dynamic metadata
    `envoy.lb` {`x-gateway-destination-endpoint`}; in FULL_DUPLEX_STREAMED mode the body chunks follow unchanged;
  * within the gateway's subset hint (`envoy.lb.subset_hint` {`x-gateway-destination-endpoint-subset`: [ip:port]})
    when it sends one; ImmediateResponse 503 when no replica there is ready, 429 when every ready one sheds load
    (its waiting queue is full: the router itself would answer 429).
The responses' headers and bodies pass unchanged. gRPC health: `liveness` (the process answers), `readiness` and
the ext_proc service (the replica set was read once). Replicas and their readiness: router/replica_set.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.protos import ext_proc_pb2 as pb
from expertmesh.protos import ext_proc_pb2_grpc as pb_grpc
from expertmesh.router.replica_set import ReplicaSet, ReplicaState
from expertmesh.router.response_store import ResponseStore
from expertmesh.router.scheduler import affinity_worker

log = logging.getLogger("expertmesh.router.epp")

DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVICE = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
MAX_BODY_BYTES = 4 * 2**20  # the router's request-body limit (router/http.py): a longer body is not held or read
PROMPT_OPENING_CHARS = 256  # a text completion's session: its prompt's first characters (a resent history's start)
Mode = pb.ProcessingMode


# ----------------------------------------------------------------------------------------------- the session
def conversation_opening(body: dict) -> list | None:
    """What every turn of a conversation resends first, from an OpenAI chat / Responses / completions or an
    Anthropic messages body: the system (developer, instructions) part and the first other message; None when
    the body holds no conversation."""
    system: list = [body[k] for k in ("system", "instructions") if body.get(k)]
    turns = body.get("messages")
    if turns is None:
        turns = body.get("input")
    if isinstance(turns, str):
        turns = [turns]
    if isinstance(turns, list):
        for turn in turns:
            if isinstance(turn, dict) and turn.get("role") in ("system", "developer"):
                system.append(turn)
            else:
                return [*system, turn]
        return system or None
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return [prompt[:PROMPT_OPENING_CHARS]]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt[:PROMPT_OPENING_CHARS]]
    return system or None


def session_key(body: dict) -> bytes | None:
    """A request's session key: its `prompt_cache_key` (OpenAI's explicit cache affinity) when it sets one, else
    the hash of its conversation's opening; None for neither. Unsalted: every picker computes the same key."""
    cache_key = body.get("prompt_cache_key")
    part = ["prompt_cache_key", cache_key] if isinstance(cache_key, str) and cache_key else conversation_opening(body)
    if part is None:
        return None
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(b"expertmesh-session-v1" + text.encode()).digest()


def replica_id(address: str) -> int:
    """A replica's stable 32-bit identity for rendezvous hashing: from its address, never from its position in a
    list (a replica leaving must not move the others' sessions)."""
    return int.from_bytes(hashlib.sha256(address.encode()).digest()[:4], "little")


def rendezvous_order(key: bytes, replicas: list[ReplicaState]) -> list[ReplicaState]:
    """`replicas` in the order rendezvous hashing prefers them for `key`: the first is affinity_worker's choice,
    the next its choice without the first, and so on."""
    by_id = {replica_id(r.address): r for r in replicas}
    order = []
    while by_id:
        best = affinity_worker(key, by_id)
        order.append(by_id.pop(best))
    return order


@dataclass(frozen=True)
class Choice:
    address: str | None = None  # the replica chosen, or None with the refusal's status and reason
    status: int = 200
    reason: str = ""


def choose(body: dict | None, replicas: list[ReplicaState]) -> Choice:
    """The replica for a request (`body`: its JSON object, None without one) among `replicas` (the candidates'
    states): see the module doc."""
    ready = [r for r in replicas if r.ready]
    if not ready:
        return Choice(status=503, reason="no ready router replica")
    serving = [r for r in ready if not r.shedding]
    if not serving:
        return Choice(status=429, reason="every ready router replica is shedding load (its waiting queue is full)")
    body = body or {}
    previous = body.get("previous_response_id")
    owner = ResponseStore.replica_of(previous) if isinstance(previous, str) else None
    if owner is not None:  # only that replica holds the response (others answer 404)
        for r in ready:
            if r.replica == owner:
                return Choice(r.address) if not r.shedding else Choice(status=429, reason=f"{owner} sheds load")
    key = session_key(body)
    if key is None:
        return Choice(min(serving, key=lambda r: (r.load, r.address)).address)
    return Choice(next(r for r in rendezvous_order(key, ready) if not r.shedding).address)


# ----------------------------------------------------------------------------------------------- the protocol
def header_value(h) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def subset_hint(metadata) -> list[str] | None:
    """The endpoints the gateway lets the picker choose from (None: it sent no hint: any replica)."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    hint = metadata.filter_metadata[SUBSET_NAMESPACE]
    if SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    return [a.strip() for a in value.string_value.split(",") if a.strip()]


def parse_body(data: bytes) -> dict | None:
    if not data or len(data) > MAX_BODY_BYTES:
        return None
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None  # the router answers a bad body itself, naming what is wrong
    return body if isinstance(body, dict) else None


def destination(address: str) -> tuple[pb.CommonResponse, struct_pb2.Struct]:
    """The header mutation and the dynamic metadata that name `address`."""
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(
            set_headers=[
                pb.HeaderValueOption(
                    header=pb.HeaderValue(key=DESTINATION, raw_value=address.encode()),
                    append_action=pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                )
            ]
        ),
        clear_route_cache=True,
    )
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: address}})
    return common, metadata


def refusal(choice: Choice) -> pb.ProcessingResponse:
    kind, code = ("rate_limit_error", "queue_full") if choice.status == 429 else ("service_unavailable", "unavailable")
    body = {"error": {"message": choice.reason, "type": kind, "param": None, "code": code}}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=pb.HttpStatus(code=choice.status),
            headers=pb.HeaderMutation(
                set_headers=[
                    pb.HeaderValueOption(
                        header=pb.HeaderValue(key="content-type", raw_value=b"application/json"),
                        append_action=pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                    )
                ]
            ),
            body=json.dumps(body).encode(),
            details=choice.reason.replace(" ", "_"),
        )
    )


@dataclass
class RequestStream:
    """One ext_proc stream's state: what Envoy said so far of its request."""

    body_mode: int = Mode.FULL_DUPLEX_STREAMED
    response_body_mode: int = Mode.NONE
    subset: list[str] | None = None
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    picked: bool = False


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas
        self.picks = 0  # answers given (a destination or a refusal), for tests and logs

    def pick(self, s: RequestStream, body: bytes | None) -> tuple[Choice, pb.CommonResponse | None, struct_pb2.Struct]:
        choice = choose(parse_body(body) if body else None, self.replicas.states(s.subset))
        s.picked = True
        self.picks += 1
        if choice.address is None:
            log.info("endpoint picker: %d (%s)", choice.status, choice.reason)
            return choice, None, struct_pb2.Struct()
        common, metadata = destination(choice.address)
        return choice, common, metadata

    def Process(self, request_iterator, context) -> Iterator[pb.ProcessingResponse]:
        s = RequestStream()
        for req in request_iterator:
            if req.HasField("protocol_config"):
                s.body_mode = req.protocol_config.request_body_mode
                s.response_body_mode = req.protocol_config.response_body_mode
            if req.HasField("metadata_context") and s.subset is None:
                s.subset = subset_hint(req.metadata_context)
            answers = list(self._answer(s, req))
            if not req.observability_mode:
                yield from answers
            if any(a.HasField("immediate_response") for a in answers):
                return  # Envoy answers the client itself and sends nothing more on this stream

    def _answer(self, s: RequestStream, req) -> Iterator[pb.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            streamed = s.body_mode == Mode.FULL_DUPLEX_STREAMED
            if req.request_headers.end_of_stream or s.body_mode in (Mode.NONE, Mode.STREAMED):
                yield from self._headers_answer(s, None)  # no body to wait for
            elif not streamed:  # BUFFERED: Envoy sends the body once the headers are answered
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            # FULL_DUPLEX_STREAMED: the headers are answered once the whole body is here
        elif kind == "request_body":
            chunk = req.request_body
            if s.picked:  # a body after the choice (STREAMED mode): passed on unchanged
                yield self._body_echo(s, chunk.body, chunk.end_of_stream)
            elif s.body_mode == Mode.FULL_DUPLEX_STREAMED:
                s.chunks.append(chunk.body)
                s.size += len(chunk.body)
                if chunk.end_of_stream or s.size > MAX_BODY_BYTES:  # past the limit: chosen by load, held no longer
                    yield from self._streamed_answer(s, end_of_stream=chunk.end_of_stream)
            else:  # BUFFERED (or BUFFERED_PARTIAL): the whole body at once
                choice, common, metadata = self.pick(s, chunk.body)
                if common is None:
                    yield refusal(choice)
                else:
                    yield pb.ProcessingResponse(
                        request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
                    )
        elif kind == "request_trailers":
            if not s.picked and s.body_mode == Mode.FULL_DUPLEX_STREAMED:
                yield from self._streamed_answer(s, end_of_stream=False)  # the trailers end the body
            yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        elif kind == "response_headers":
            yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        elif kind == "response_body":
            chunk = req.response_body
            if s.response_body_mode == Mode.FULL_DUPLEX_STREAMED:
                streamed = pb.StreamedBodyResponse(body=chunk.body, end_of_stream=chunk.end_of_stream)
                common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
            else:
                common = pb.CommonResponse()
            yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
        elif kind == "response_trailers":
            yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    def _headers_answer(self, s: RequestStream, body: bytes | None) -> Iterator[pb.ProcessingResponse]:
        choice, common, metadata = self.pick(s, body)
        if common is None:
            yield refusal(choice)
        else:
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)

    def _streamed_answer(self, s: RequestStream, *, end_of_stream: bool) -> Iterator[pb.ProcessingResponse]:
        """FULL_DUPLEX_STREAMED, the body complete: the headers' answer naming the replica, then the body's chunks
        back unchanged (the last one marked end_of_stream when the body ended with it, not with trailers)."""
        body = b"".join(s.chunks) if s.size <= MAX_BODY_BYTES else None
        answers = list(self._headers_answer(s, body))
        yield from answers
        if answers[0].HasField("immediate_response"):
            return
        chunks = s.chunks or [b""]
        for i, chunk in enumerate(chunks):
            yield self._body_echo(s, chunk, end_of_stream and i == len(chunks) - 1)
        s.chunks, s.size = [], 0

    @staticmethod
    def _body_echo(s: RequestStream, data: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
        if s.body_mode == Mode.FULL_DUPLEX_STREAMED:
            streamed = pb.StreamedBodyResponse(body=data, end_of_stream=end_of_stream)
            common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        else:
            common = pb.CommonResponse()
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def serve_endpoint_picker(replicas: ReplicaSet, host: str, port: int, *, max_workers: int = 64) -> grpc.Server:
    """The picker's gRPC server on host:port (plaintext: the gateway's ext_proc client), with gRPC health
    `liveness`, `readiness` and the ext_proc service's own name; started, the replica set followed. The server's
    `.port` is the port bound (0 asks for a free one), `.picker` the servicer."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="epp"))
    picker = EndpointPicker(replicas)
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    for name in ("readiness", SERVICE, ""):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    replicas.start()  # the first refresh, then the watch thread
    for name in ("readiness", SERVICE, ""):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.port, server.picker, server.health, server.replicas = bound, picker, health_servicer, replicas
    return server
