"""The gRPC servicers of the two worker roles (`expertmesh.v1`): they only translate — messages → the local
objects' arguments, results → messages, and the workers' exceptions → status codes (the message, which names the
field, goes along as the details):
  WorkerError / ExpertRequestError / ValueError → INVALID_ARGUMENT,  NotFound / UnknownExpert → NOT_FOUND,
  NotConnected → FAILED_PRECONDITION,  OutOfBlocks → RESOURCE_EXHAUSTED,  HandOffFailed → ABORTED,  anything
  else → INTERNAL (logged with its traceback).
"""

import dataclasses
import functools
import logging
import threading
import time

import grpc
import torch

from expertmesh.placement.replica_table import ReplicaTable
from expertmesh.protos import worker_pb2, worker_pb2_grpc
from expertmesh.runtime import telemetry
from expertmesh.wire.clients import RemoteAttention, RemoteExpert
from expertmesh.wire.kv_snapshot import CorruptFile, decode
from expertmesh.wire.sampling_params import sampling_from_proto, thinking_from_proto
from expertmesh.wire.tensors import from_proto, to_proto
from expertmesh.wire.worker_api import (
    HandOffFailed,
    ImageSpan,
    NotConnected,
    NotFound,
    OutOfBlocks,
    StepSegment,
    UnknownExpert,
)
from expertmesh.worker.collective import (
    CollectiveAttention,
    CollectiveExpert,
)
from expertmesh.worker.metrics import METRICS
from expertmesh.worker.step_channel import StepChannelServer
from expertmesh.worker.transfer_engine import TRANSPORT as ENGINE_TRANSPORT
from expertmesh.worker.transfer_engine import EngineAttention

log = logging.getLogger("expertmesh.worker")


OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ATTENTION_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["AttentionWorker"].full_name
EXPERT_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["ExpertWorker"].full_name


def _status_of(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, (NotFound, UnknownExpert)):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, NotConnected):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, OutOfBlocks):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, HandOffFailed):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, ValueError):  # WorkerError, ExpertRequestError, tensor / params decoding
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def served(name: str, metadata, call):
    """Run `call()` as the served method `name`: timed and counted (Prometheus) and, when the caller sent a W3C
    traceparent (in `metadata`: gRPC's, or the step channel's), recorded as a server span joined to the router's
    trace. Raises what `call` raises."""
    start = time.perf_counter()
    parent = telemetry.extract_context(metadata)
    span = None
    if parent is not None:
        from opentelemetry.trace import SpanKind

        span = telemetry.tracer().start_span(
            f"worker.{name}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": name},
        )
    code = "OK"
    try:
        if span is None:
            return call()
        from opentelemetry import trace

        with trace.use_span(span, end_on_exit=False):  # calls made from here (the expert exchange) join it
            return call()
    except Exception as e:
        code = _status_of(e).name
        if span is not None:
            span.record_exception(e)
        raise
    finally:
        METRICS.calls.labels(name, code).inc()
        METRICS.call_seconds.labels(name).observe(time.perf_counter() - start)
        if span is not None:
            span.end()


def failure(name: str, e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a failed call answers (an INTERNAL one logged with its traceback)."""
    status = _status_of(e)
    if status == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", name)
        return status, f"{type(e).__name__}: {e}"
    return status, str(e)


def _rpc(method):
    """A servicer method (`served`); a raised exception becomes the matching status code with its message."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return served(method.__name__, context.invocation_metadata(), lambda: method(self, request, context))
        except Exception as e:
            context.abort(*failure(method.__name__, e))

    return wrapper


class AttentionServicer(worker_pb2_grpc.AttentionWorkerServicer):
    def __init__(
        self,
        worker,
        expert_tls=None,
        handoff_timeout: float = 60.0,
        max_handoff_bytes: int = 64 * 2**30,
        collective=None,
    ):
        """`expert_tls`: expertmesh.runtime.tls.ClientTLS for the calls to expert workers, and to the attention workers
        this one hands sequences off to; `handoff_timeout`: the deadline of one such hand-off; `max_handoff_bytes`:
        the largest sequence cache this worker takes; `collective`: worker/collective.CollectiveServer (with
        --collective-port): hand-offs sent to this worker over torch.distributed pairs."""
        self.worker = worker
        self.collective = collective
        self.max_handoff_bytes = max_handoff_bytes
        self.expert_tls = expert_tls
        self.handoff_timeout = handoff_timeout
        self._peers: dict[tuple[str, str], object] = {}  # (address, transport) → client of a worker handed off to
        self._peers_lock = threading.Lock()
        self.step_channels = StepChannelServer(self.step_frame)  # the routers' step channels (OpenStepChannel)

    @_rpc
    def Info(self, request, context):
        i = self.worker.info(request.owner)
        return worker_pb2.AttentionInfo(
            name=i["name"],
            model=i["model"],
            block_size=i["block_size"],
            total_blocks=i["total_blocks"],
            free_blocks=i["free_blocks"],
            sequences=i["sequences"],
            prefixes=i["prefixes"],
            experts_down=i["experts_down"],
            pool=i["pool"],
            speculative_tokens=i["speculative_tokens"],
            speculative_method=i["speculative_method"],
        )

    @_rpc
    def OpenSequence(self, request, context):
        if not request.HasField("params"):
            raise ValueError("params: required")
        images = [
            ImageSpan(i.position, from_proto(i.pixels, f"images[{n}].pixels")) for n, i in enumerate(request.images)
        ]
        params = sampling_from_proto(request.params)
        if request.HasField("thinking"):
            params = dataclasses.replace(params, thinking=thinking_from_proto(request.thinking))
        cached = self.worker.open_sequence(
            request.seq_id,
            params,
            reserve_tokens=request.reserve_tokens,
            prefix_key=request.prefix_key if request.HasField("prefix_key") else None,
            owner=request.owner,
            images=images or None,
        )
        return worker_pb2.OpenSequenceResponse(cached_tokens=cached)

    @_rpc
    def ExtendSequence(self, request, context):
        return worker_pb2.FreeBlocks(free_blocks=self.worker.extend_sequence(request.seq_id, request.reserve_tokens))

    @_rpc
    def CloseSequence(self, request, context):
        return worker_pb2.FreeBlocks(free_blocks=self.worker.close_sequence(request.seq_id))

    @_rpc
    def SavePrefix(self, request, context):
        return worker_pb2.FreeBlocks(free_blocks=self.worker.save_prefix(request.seq_id, request.key))

    @_rpc
    def DropPrefix(self, request, context):
        return worker_pb2.FreeBlocks(free_blocks=self.worker.drop_prefix(request.key))

    @_rpc
    def DemotePrefix(self, request, context):
        free, dropped = self.worker.demote_prefix(request.key)
        return worker_pb2.DemotedPrefix(free_blocks=free, dropped=dropped)

    @_rpc
    def ListPrefixes(self, request, context):
        return worker_pb2.PrefixList(
            prefixes=[worker_pb2.CachedPrefix(key=k, length=n, tier=t) for k, n, t in self.worker.list_prefixes()]
        )

    @_rpc
    def ConnectExperts(self, request, context):
        if not request.HasField("replicas"):
            raise ValueError("replicas: required")
        if request.call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s: expected a positive number of seconds, found {request.call_timeout_s}")
        replicas = from_proto(request.replicas, "replicas")
        if replicas.dim() != 3 or replicas.dtype != torch.int64:
            raise ValueError(f"replicas: expected int64 [L, E, R], found {replicas.dtype} {list(replicas.shape)}")
        table = ReplicaTable(tuple(request.moe_layers), replicas.numpy())
        if request.transport not in ("", "grpc", "collective"):
            raise ValueError(f"transport: expected grpc or collective, found {request.transport!r}")
        clients = [
            RemoteExpert(a, timeout=request.call_timeout_s, name=f"expert-{i}", tls=self.expert_tls)
            for i, a in enumerate(request.addresses)
        ]
        if request.transport == "collective":
            clients = [CollectiveExpert(c) for c in clients]
        try:
            self.worker.connect_experts(clients, table)
        except Exception:
            for c in clients:
                c.close()
            raise
        return worker_pb2.ConnectExpertsResponse()

    @_rpc
    def RunStep(self, request, context):
        return self._run_step(request)

    def step_frame(self, raw: bytes, metadata) -> tuple[int, bytes]:
        """RunStep over the step channel (worker/step_channel.py): a RunStepRequest's bytes and the caller's trace
        metadata → (0, the StepDone's bytes), or on a failure (the status gRPC would answer, its message)."""
        from google.protobuf.message import DecodeError

        try:
            request = worker_pb2.RunStepRequest.FromString(raw)
        except DecodeError:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], b"RunStep: the request is not a valid RunStepRequest"
        try:
            return 0, served("RunStep", metadata, lambda: self._run_step(request)).SerializeToString()
        except Exception as e:
            status, message = failure("RunStep", e)
            return status.value[0], message.encode()

    def _run_step(self, request) -> worker_pb2.StepDone:
        segments = [
            StepSegment(s.seq_id, list(s.token_ids), s.sample, s.max_new or 1, s.hold_at) for s in request.segments
        ]
        snapshots = {s.seq_id: (s.key, s.length) if s.length else s.key for s in request.snapshot_keys} or None
        return done_to_proto(self.worker.run_step(request.step_id, segments, snapshots))

    @_rpc
    def HandOff(self, request, context):
        if not request.to_address:
            raise ValueError("to_address: required (host:port of the receiving attention worker)")
        if request.transport not in ("", "grpc", "collective", ENGINE_TRANSPORT):
            raise ValueError(f"transport: expected grpc, collective or mooncake, found {request.transport!r}")
        transport = request.transport or "grpc"
        with self._peers_lock:
            peer = self._peers.get((request.to_address, transport))
            if peer is None:
                peer = RemoteAttention(request.to_address, timeout=self.handoff_timeout, tls=self.expert_tls)
                if transport == "collective":
                    peer = CollectiveAttention(peer)
                elif transport == ENGINE_TRANSPORT:
                    peer = EngineAttention(peer, self.worker.transfer_link())
                self._peers[request.to_address, transport] = peer
        done = self.worker.hand_off(
            request.seq_id, peer, request.to_seq_id, reserve_tokens=request.reserve_tokens, owner=request.owner
        )
        return worker_pb2.HandOffDone(free_blocks=done.free_blocks, bytes=done.bytes, seconds=done.seconds)

    @_rpc
    def ImportSequence(self, parts, context):
        first = next(parts, None)
        if first is None or first.WhichOneof("part") != "header":
            raise ValueError("parts[0]: expected the header (ImportSequenceRequest)")
        request = first.header
        self._check_size(request.cache_bytes)
        cache = bytearray()
        for n, part in enumerate(parts, 1):
            if n == 1 and part.WhichOneof("part") == "engine":  # the cache waits in the sender's transfer engine
                if part.engine.length != request.cache_bytes or next(parts, None) is not None:
                    raise ValueError("parts[1]: expected the only part after the header, of cache_bytes bytes")
                cache = self.worker.transfer_link().fetch(part.engine.session, part.engine.address, part.engine.length)
                break
            if part.WhichOneof("part") != "cache" or len(cache) + len(part.cache) > request.cache_bytes:
                raise ValueError(f"parts[{n}]: expected a piece of the cache within cache_bytes={request.cache_bytes}")
            cache += part.cache
        return worker_pb2.FreeBlocks(free_blocks=self._import(request, cache))

    def import_cache(self, header: bytes, cache: bytes) -> int:
        """A hand-off that came over a collective pair (worker/collective.py): the ImportSequenceRequest's bytes and
        the cache's → the free blocks after."""
        request = worker_pb2.ImportSequenceRequest.FromString(header)
        self._check_size(request.cache_bytes)
        return self._import(request, cache)

    def _check_size(self, cache_bytes: int) -> None:
        if not 0 < cache_bytes <= self.max_handoff_bytes:
            raise ValueError(f"cache_bytes={cache_bytes}: expected 1..{self.max_handoff_bytes}")

    def _import(self, request, cache) -> int:
        if not request.HasField("params"):
            raise ValueError("params: required")
        params = sampling_from_proto(request.params)
        if request.HasField("thinking"):
            params = dataclasses.replace(params, thinking=thinking_from_proto(request.thinking))
        if len(cache) != request.cache_bytes:
            raise ValueError(f"cache: {len(cache)} bytes arrived, cache_bytes says {request.cache_bytes}")
        try:
            snap = decode(cache, key=request.seq_id, identity=self.worker.handoff_identity)
        except CorruptFile as e:
            raise ValueError(f"cache: {e}") from None
        return self.worker.import_sequence(
            request.seq_id,
            params,
            snap,
            request.sampler_state,
            list(request.observed),
            reserve_tokens=request.reserve_tokens,
            owner=request.owner,
        )

    @_rpc
    def OpenCollective(self, request, context):
        return open_collective(self.collective, self.worker.name, request, context)

    @_rpc
    def OpenStepChannel(self, request, context):
        host, port = self.step_channels.open(request.channel_id, peer_host(context), request.timeout_s)
        return worker_pb2.OpenStepChannelResponse(host=host, port=port)

    @_rpc
    def ExpertLoad(self, request, context):
        load = self.worker.expert_load()
        layers = sorted(load)
        tokens = (
            torch.tensor([load[l] for l in layers], dtype=torch.int64)
            if layers
            else torch.zeros(0, 0, dtype=torch.int64)
        )
        return worker_pb2.ExpertLoadResponse(moe_layers=layers, tokens=to_proto(tokens, "tokens"))


def done_to_proto(result) -> worker_pb2.StepDone:
    return worker_pb2.StepDone(
        step_id=result.step_id,
        free_blocks=result.free_blocks,
        tokens=[
            worker_pb2.SampledToken(
                seq_id=s, token=t, more=result.more_tokens.get(s, []), drafted=result.drafted.get(s, 0)
            )
            for s, t in result.tokens.items()
        ],
        logprobs=[
            worker_pb2.TokenLogprobs(
                seq_id=lp.seq_id,
                position=lp.position,
                token_ids=to_proto(lp.token_ids, "token_ids"),
                logprobs=to_proto(lp.logprobs, "logprobs"),
                top_ids=to_proto(lp.top_ids, "top_ids"),
                top_logprobs=to_proto(lp.top_logprobs, "top_logprobs"),
            )
            for lp in result.logprobs
        ],
        failed=[worker_pb2.SequenceFailure(seq_id=s, reason=r) for s, r in result.failed.items()],
        experts_down=result.experts_down,
        exchange_bytes=result.exchange_bytes,
        image_encodes=[
            worker_pb2.ImageEncode(seq_id=e.seq_id, tokens=e.tokens, seconds=e.seconds) for e in result.image_encodes
        ],
    )


class ExpertServicer(worker_pb2_grpc.ExpertWorkerServicer):
    def __init__(self, worker, collective=None):
        self.worker = worker
        self.collective = collective  # worker/collective.CollectiveServer, with --collective-port
        self.grpc_calls = 0

    @_rpc
    def Info(self, request, context):
        return self._info()

    def _info(self) -> worker_pb2.ExpertInfo:
        c = self.collective
        return worker_pb2.ExpertInfo(
            name=self.worker.name,
            model=self.worker.cfg.name,
            experts=[worker_pb2.ExpertKey(layer=l, expert=e) for l, e in self.worker.assignment],
            grpc_calls=self.grpc_calls,
            collective_calls=c.calls if c else 0,
            collective_pairs=c.pairs if c else 0,
        )

    @_rpc
    def RunExperts(self, request, context):
        for field in ("hidden", "expert_ids", "weights"):
            if not request.HasField(field):
                raise ValueError(f"{field}: required")
        hidden = from_proto(request.hidden, "hidden")
        ids = from_proto(request.expert_ids, "expert_ids")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"expert_ids.dtype: expected int64 (or int32), found {request.expert_ids.dtype}")
        weights = from_proto(request.weights, "weights")
        out_dtype = OUTPUT_DTYPES.get(request.output_dtype or "float32")
        if out_dtype is None:
            raise ValueError(f"output_dtype: expected one of {sorted(OUTPUT_DTYPES)}, found {request.output_dtype!r}")
        out = self.worker.run(request.layer, hidden, ids, weights, out_dtype)
        self.grpc_calls += 1
        return worker_pb2.RunExpertsResponse(output=to_proto(out, "output"))

    @_rpc
    def SetShards(self, request, context):
        pairs = [(k.layer, k.expert) for k in request.experts]
        if request.gpus and len(request.gpus) != len(pairs):
            raise ValueError(f"gpus: expected one per entry of experts ({len(pairs)}), found {len(request.gpus)}")
        gpu_of = dict(zip(pairs, request.gpus)) if request.gpus else None
        r = self.worker.set_shards(pairs, gpu_of, drop_others=request.drop_others)
        log.info(
            "set shards (drop_others=%s): %d loaded, %d dropped, %d held",
            request.drop_others,
            r["loaded"],
            r["dropped"],
            len(r["experts"]),
        )
        return self._info()

    @_rpc
    def OpenCollective(self, request, context):
        return open_collective(self.collective, self.worker.name, request, context)


def open_collective(collective, name: str, request, context) -> worker_pb2.OpenCollectiveResponse:
    """Start this worker's rank of the caller's pair (OpenCollective, both services)."""
    if collective is None:
        raise NotConnected(f"{name}: no collective transport (started without --collective-port)")
    if not 0 < request.timeout_s <= 600:
        raise ValueError(f"timeout_s: expected seconds in (0, 600], found {request.timeout_s}")
    collective.open(request.group_id, peer_host(context), request.timeout_s)
    return worker_pb2.OpenCollectiveResponse(store_port=collective.port, backend=collective.backend)


def peer_host(context) -> str:
    """The calling host's address: where a pair or a step channel goes."""
    peer = context.peer()  # "ipv4:10.0.0.5:41234" / "ipv6:[::1]:41234"
    return peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]") if ":" in peer else "127.0.0.1"


def add_servicer(server: grpc.Server, service: str, servicer) -> None:
    """Register `servicer`'s methods for `service` (full name) as the generated add_*_to_server would, except
    that requests arrive as bytes and are parsed here: a request that is not a valid message gets
    INVALID_ARGUMENT naming the method and message type (gRPC's own deserializer answers INTERNAL)."""
    from google.protobuf.message import DecodeError

    descriptor = worker_pb2.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[-1]]

    def handler(method):
        request_cls = getattr(worker_pb2, method.input_type.name)
        call = getattr(servicer, method.name)

        def parse(raw: bytes, context):
            try:
                return request_cls.FromString(raw)
            except DecodeError:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method.name}: the request is not a valid {request_cls.DESCRIPTOR.full_name} message",
                )

        def parse_then_call(raw: bytes, context):
            return call(parse(raw, context), context)

        def parse_stream_then_call(raws, context):
            return call((parse(raw, context) for raw in raws), context)

        serialize = getattr(worker_pb2, method.output_type.name).SerializeToString
        if method.client_streaming:
            return grpc.stream_unary_rpc_method_handler(
                parse_stream_then_call, request_deserializer=None, response_serializer=serialize
            )
        return grpc.unary_unary_rpc_method_handler(
            parse_then_call, request_deserializer=None, response_serializer=serialize
        )

    handlers = {m.name: handler(m) for m in descriptor.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
