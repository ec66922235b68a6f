"""`expertmesh worker`: the attention / expert worker objects behind gRPC (`expertmesh.v1`), with the standard
grpc.health.v1 health service and server reflection (v1 and v1alpha).

The servicers only translate: messages → the local objects' arguments, results → messages, and the workers'
exceptions → status codes (the message, which names the field, goes along as the details):
  WorkerError / ExpertRequestError / ValueError → INVALID_ARGUMENT,  NotFound / UnknownExpert → NOT_FOUND,
  OutOfBlocks → RESOURCE_EXHAUSTED,  HandOffFailed → ABORTED,  anything else → INTERNAL (logged with its
  traceback).
Shutdown (SIGTERM / SIGINT): health goes NOT_SERVING, new calls are refused, in-flight ones get `--grace` seconds;
the process ends `--grace` + 5 s after the signal whatever is still running (expertmesh/runtime/shutdown.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.kernels.dsa import cpu_kernel as dsa_cpu_kernel
from expertmesh.kernels.moe import cpu_kernel
from expertmesh.model import memory
from expertmesh.model.config import ModelConfig, preset
from expertmesh.placement.plan import PlacementPlan
from expertmesh.placement.replica_table import ReplicaTable
from expertmesh.placement.sizing import WorkerMemory
from expertmesh.protos import worker_pb2, worker_pb2_grpc
from expertmesh.runtime import telemetry
from expertmesh.runtime.argtypes import check_kv_tiers, positive_int
from expertmesh.runtime.health_port import serve_health_only
from expertmesh.runtime.reflection import enable_reflection
from expertmesh.runtime.shutdown import exit_after, stop_on_signals
from expertmesh.runtime.tls import ClientTLS, ServerTLS
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
from expertmesh.worker.attention import POOLS, AttentionWorker
from expertmesh.worker.collective import (
    BACKENDS,
    CollectiveAttention,
    CollectiveExpert,
    CollectiveServer,
    backend_for,
)
from expertmesh.worker.expert import ExpertWorker
from expertmesh.worker.metrics import METRICS, serve_metrics

log = logging.getLogger("expertmesh.worker")

ROLES = ("attention", "expert", "both")
SHUTDOWN_SLACK_S = 5.0  # after the grace: closing the health port, the pairs, the exit handlers
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
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


def _rpc(method):
    """Run a servicer method; a raised exception becomes the matching status code with its message.
    Each call is timed and counted (Prometheus) and, when the caller sent a W3C traceparent, recorded as a
    server span joined to the router's trace."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        start = time.perf_counter()
        parent = telemetry.extract_context(context.invocation_metadata())
        span = None
        if parent is not None:
            from opentelemetry.trace import SpanKind

            span = telemetry.tracer().start_span(
                f"worker.{method.__name__}",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.method": method.__name__},
            )
        code = "OK"
        try:
            if span is None:
                return method(self, request, context)
            from opentelemetry import trace

            with trace.use_span(span, end_on_exit=False):  # calls made from here (the expert exchange) join it
                return method(self, request, context)
        except Exception as e:
            status = _status_of(e)
            code = status.name
            if span is not None:
                span.record_exception(e)
            if status == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method.__name__)
                context.abort(status, f"{type(e).__name__}: {e}")
            context.abort(status, str(e))
        finally:
            METRICS.calls.labels(method.__name__, code).inc()
            METRICS.call_seconds.labels(method.__name__).observe(time.perf_counter() - start)
            if span is not None:
                span.end()

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
        segments = [StepSegment(s.seq_id, list(s.token_ids), s.sample) for s in request.segments]
        snapshots = {s.seq_id: (s.key, s.length) if s.length else s.key for s in request.snapshot_keys} or None
        return done_to_proto(self.worker.run_step(request.step_id, segments, snapshots))

    @_rpc
    def HandOff(self, request, context):
        if not request.to_address:
            raise ValueError("to_address: required (host:port of the receiving attention worker)")
        if request.transport not in ("", "grpc", "collective"):
            raise ValueError(f"transport: expected grpc or collective, found {request.transport!r}")
        transport = request.transport or "grpc"
        with self._peers_lock:
            peer = self._peers.get((request.to_address, transport))
            if peer is None:
                peer = RemoteAttention(request.to_address, timeout=self.handoff_timeout, tls=self.expert_tls)
                if transport == "collective":
                    peer = CollectiveAttention(peer)
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
        tokens=[worker_pb2.SampledToken(seq_id=s, token=t) for s, t in result.tokens.items()],
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


# ---------------------------------------------------------------------------------------------- server
def open_collective(collective, name: str, request, context) -> worker_pb2.OpenCollectiveResponse:
    """Start this worker's rank of the caller's pair (OpenCollective, both services)."""
    if collective is None:
        raise NotConnected(f"{name}: no collective transport (started without --collective-port)")
    if not 0 < request.timeout_s <= 600:
        raise ValueError(f"timeout_s: expected seconds in (0, 600], found {request.timeout_s}")
    peer = context.peer()  # "ipv4:10.0.0.5:41234" / "ipv6:[::1]:41234": where the pair goes
    host = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]") if ":" in peer else "127.0.0.1"
    collective.open(request.group_id, host, request.timeout_s)
    return worker_pb2.OpenCollectiveResponse(store_port=collective.port, backend=collective.backend)


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


def all_experts(cfg) -> list[tuple[int, int]]:
    return [(layer, e) for layer in cfg.moe_layers for e in range(cfg.moe.n_routed_experts)]


def build_workers(
    role: str,
    checkpoint,
    *,
    assignment=None,
    gpu_of=None,
    kv_blocks: int | None = 512,
    block_size: int = 16,
    name: str | None = None,
    device: str | None = None,
    dtype=None,
    gpu_memory_utilization: float | None = None,
    device_memory_bytes: int | None = None,
    lease_seconds: float = 30.0,
    kv_tiers: dict | None = None,
    pool: str = "mixed",
    decode_threads: int | None = None,
):
    """The (attention, expert) worker objects of `role` (None where the role has none), on `device` (see
    expertmesh/model/memory.py: devices, dtypes, the process model). `checkpoint`: a directory, a Checkpoint, or on
    --device meta a ModelConfig (nothing read). `gpu_of`: the plan's GPU of each (layer, expert) held.
    `kv_tiers`: the attention role's lower KV tiers (AttentionWorker's kv_host_bytes, kv_disk_dir, kv_disk_bytes).
    `decode_threads`: torch threads for decode-sized work that overlaps the other role's (worker/threads.py)."""

    if role not in ROLES:
        raise ValueError(f"role: expected one of {list(ROLES)}, found {role!r}")
    device = memory.check_device(device)
    if not isinstance(checkpoint, (Checkpoint, ModelConfig)):
        checkpoint = Checkpoint(checkpoint)
    cfg = checkpoint if isinstance(checkpoint, ModelConfig) else checkpoint.cfg
    attention = expert = None
    if role in ("attention", "both"):
        attention = AttentionWorker(
            checkpoint,
            kv_blocks=kv_blocks,
            block_size=block_size,
            name=name or "attention-0",
            device=device,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            device_memory_bytes=device_memory_bytes,
            lease_seconds=lease_seconds,
            pool=pool,
            decode_threads=decode_threads,
            **(kv_tiers or {}),
        )
    if role in ("expert", "both"):
        pairs = all_experts(cfg) if assignment is None else [(int(l), int(e)) for l, e in assignment]
        if device == "cuda" and gpu_of:
            need, have = max(gpu_of.values()) + 1, torch.cuda.device_count()
            if need > have:
                raise ValueError(f"--plan: this worker's experts are placed on {need} GPUs, torch sees {have}")
        expert = ExpertWorker(
            checkpoint, pairs, name=name or "expert-0", device=device, gpu_of=gpu_of, decode_threads=decode_threads
        )
    return attention, expert


def dry_run(attention, expert, kv_tiers: dict | None = None) -> str:
    """The one JSON line of `--dry-run`: resident bytes of the built worker(s), per device; with `kv_tiers`, the
    lower KV tiers' bounds (host memory beside the device's, disk) as given."""
    total = WorkerMemory()
    for w in (attention, expert):
        if w is None:
            continue
        m = w.memory()
        for dev, n in m.devices.items():
            total.devices[dev] = total.devices.get(dev, 0) + n
        total.weights_bytes += m.weights_bytes
        total.kv_bytes += m.kv_bytes
        total.workspace_bytes += m.workspace_bytes
    extra = {}
    if attention is not None:
        extra["kv_blocks"] = attention.pool.num_blocks
        for name in ("kv_host_bytes", "kv_disk_bytes"):
            if (kv_tiers or {}).get(name):
                extra[name] = kv_tiers[name]
    if expert is not None:
        extra["experts"] = len(expert.assignment)
    return total.to_json(**extra)


def serve(
    role: str,
    checkpoint,
    port: int,
    host: str = "127.0.0.1",
    *,
    assignment=None,
    kv_blocks: int = 512,
    block_size: int = 16,
    name: str | None = None,
    max_workers: int = 16,
    tls=None,
    device: str | None = None,
    dtype=None,
    gpu_of=None,
    gpu_memory_utilization: float | None = None,
    device_memory_bytes: int | None = None,
    expert_tls=None,
    lease_seconds: float = 30.0,
    collective_port: int | None = None,
    collective_backend: str = "auto",
    health_port: int | None = None,
    kv_tiers: dict | None = None,
    pool: str = "mixed",
    decode_threads: int | None = None,
) -> grpc.Server:
    """Load the worker(s) of `role` from `checkpoint` (a directory or a Checkpoint) and serve them on host:port
    (0 → a free port). `assignment`: the (layer, expert) pairs an expert role holds; None → all of them.
    `collective_port`: also serve the collective transport (worker/collective.py: expert calls, hand-offs), its
    rendezvous store on this port (0: any free one); `collective_backend`: its pairs' backend (worker/collective.py's
    `backend_for`: auto = tcp on cpu, nccl on cuda).
    `health_port`: also serve grpc.health.v1 alone, plaintext, on this port (0: any free one) — what Kubernetes
    gRPC probes reach when the real port requires mutual TLS; `.health_server` / `.health_port` are set.
    Returns the started server, with `.port` (the bound port), `.health`, `.attention` / `.expert` (the local
    workers, or None), `.collective` (CollectiveServer or None) and `.role` set."""
    attention, expert = build_workers(
        role,
        checkpoint,
        assignment=assignment,
        gpu_of=gpu_of,
        kv_blocks=kv_blocks,
        block_size=block_size,
        name=name,
        device=device,
        dtype=dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        device_memory_bytes=device_memory_bytes,
        lease_seconds=lease_seconds,
        kv_tiers=kv_tiers,
        pool=pool,
        decode_threads=decode_threads,
    )
    if expert is not None and expert.device_kind == "cpu":
        # build (or load) the fused CPU MXFP4 kernel before serving: a first build takes ~12 s, which inside the
        # first RunExperts call would overrun the caller's deadline and mark this worker down
        if cpu_kernel.enabled():
            cpu_kernel.load()
    if attention is not None and attention.device_kind == "cpu" and attention.cfg.latent_kv_layers:
        dsa_cpu_kernel.available()  # the paged-attention kernel, likewise built before the first RunStep

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"grpc-{role}"),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],  # a taken port must fail, not be shared
        maximum_concurrent_rpcs=16 * max_workers,
    )  # the queue of calls waiting for a thread has a bound
    services = []
    attention_servicer = AttentionServicer(attention, expert_tls) if attention is not None else None
    collective = None
    if collective_port is not None:
        collective = CollectiveServer(
            host,
            collective_port,
            backend_for((expert or attention).device_kind, collective_backend),
            expert=expert,
            attention=attention,
            import_cache=attention_servicer.import_cache if attention_servicer else None,
        )
    if attention_servicer is not None:
        attention_servicer.collective = collective
        add_servicer(server, ATTENTION_SERVICE, attention_servicer)
        services.append(ATTENTION_SERVICE)
    if expert is not None:
        add_servicer(server, EXPERT_SERVICE, ExpertServicer(expert, collective))
        services.append(EXPERT_SERVICE)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(services + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)

    address = f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, tls.credentials()) if tls is not None else server.add_insecure_port(address)
        )
    except RuntimeError as e:
        raise OSError(f"--host/--port {address}: cannot listen ({e})") from None
    if bound == 0:
        raise OSError(f"--host/--port {address}: cannot listen (address in use?)")
    server.start()
    for s in services + [""]:
        health_servicer.set(s, health_pb2.HealthCheckResponse.SERVING)
    server.port, server.role, server.health = bound, role, health_servicer
    server.health_server, server.health_port = None, None
    if health_port is not None:
        server.health_server, server.health_port = serve_health_only(health_servicer, host, health_port)
    server.attention, server.expert, server.collective = attention, expert, collective
    log.info("%s worker serving %s on %s:%d", role, ", ".join(services), host, bound)
    return server


def shutdown(server: grpc.Server, grace: float = 10.0) -> None:
    """Health NOT_SERVING first (balancers stop sending), then refuse new calls and let in-flight ones finish."""
    server.health.enter_graceful_shutdown()
    server.stop(grace).wait()
    if getattr(server, "health_server", None) is not None:
        server.health_server.stop(0).wait()


# ---------------------------------------------------------------------------------------------- CLI
def parse_experts(spec: str) -> list[tuple[int, int]]:
    """ "L:E,L:E,..." (E may be a range A-B, inclusive) → [(layer, expert), ...]."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        layer, sep, experts = item.partition(":")
        try:
            if not sep:
                raise ValueError
            lo, _, hi = experts.partition("-")
            lo_i, hi_i = int(lo), int(hi or lo)
            layer_i = int(layer)
            if layer_i < 0 or lo_i < 0 or hi_i < lo_i:
                raise ValueError
        except ValueError:
            raise ValueError(f"--experts: expected LAYER:EXPERT or LAYER:FIRST-LAST items, found {item!r}") from None
        out += [(layer_i, e) for e in range(lo_i, hi_i + 1)]
    if not out:
        raise ValueError(f"--experts: no LAYER:EXPERT item in {spec!r}")
    return out


def plan_assignment(path: str, ordinal: int, gpu_of: dict | None = None) -> list[tuple[int, int]]:
    """The (layer, expert) pairs of expert worker `ordinal` of the plan at `path`; fills `gpu_of` (when given)
    with each pair's GPU index in the plan."""
    plan = PlacementPlan.from_json(Path(path).read_text())
    pairs = [(int(l), int(e)) for l, e in plan.experts_of(ordinal)]
    if gpu_of is not None:
        gpu_of.update({(int(l), int(e)): g.gpu for g in plan.workers[ordinal].gpus for l, e in g.shards})
    if not pairs:  # a spare replica slot (e.g. scaled up before the plan): serve, holding nothing yet
        log.warning("--ordinal %d: the plan %s assigns no experts to this worker", ordinal, path)
    return pairs


def kv_tier_options(args) -> dict:
    """--kv-host-gib / --kv-disk-dir / --kv-disk-gib → AttentionWorker's tier arguments (ValueError naming the flag:
    argtypes.check_kv_tiers, or tiers on a worker without the attention role)."""
    check_kv_tiers(args.kv_host_gib, args.kv_disk_dir, args.kv_disk_gib)
    if (args.kv_host_gib or args.kv_disk_gib) and args.role == "expert":
        raise ValueError("--kv-host-gib/--kv-disk-gib: only for --role attention or both")
    return {
        "kv_host_bytes": int(args.kv_host_gib * 2**30),
        "kv_disk_dir": args.kv_disk_dir,
        "kv_disk_bytes": int(args.kv_disk_gib * 2**30),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expertmesh worker", description="an attention / expert worker (gRPC)")
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--checkpoint", help="checkpoint directory (required, except --dry-run with --preset)")
    p.add_argument("--preset", help="model preset, for --device meta --dry-run without a checkpoint")
    p.add_argument(
        "--device",
        default=None,
        help="cuda|cpu|meta (default: cuda when torch sees one, else cpu). cuda: bf16, expert pod's "
        "GPU g of the plan on cuda:g; cpu: the fp32 reference; meta: built as on a GPU, no memory "
        "(with --dry-run)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="weights and activations (default: bfloat16 on cuda/meta, float32 on cpu)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="attention role: size the KV pool to fill this fraction of the device after weights and "
        "workspace (overrides --kv-blocks)",
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="the device's memory for --gpu-memory-utilization (default: the CUDA device's; needed on meta)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with --device meta: build the worker, print one JSON line of resident bytes, exit",
    )
    p.add_argument(
        "--port", type=int, default=None, help="port to listen on (0: any free port; required unless --dry-run)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 / [::] in a pod)")
    p.add_argument("--experts", help="the (layer, expert) pairs held: L:E,L:E,... (E may be FIRST-LAST)")
    p.add_argument("--plan", help="placement plan JSON; this worker holds experts_of(--ordinal)")
    p.add_argument("--ordinal", type=int, help="this expert worker's ordinal in --plan")
    p.add_argument("--kv-blocks", type=int, default=512, help="KV blocks of the attention role")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-host-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="attention role: host-memory tier for prefixes demoted off the device pool, at most this "
        "many GiB (pinned on cuda; 0: none — a demoted prefix is dropped)",
    )
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="attention role: local-disk tier below the host tier, one checksummed file per prefix "
        "(reused after a restart when the files match this model and layout)",
    )
    p.add_argument(
        "--kv-disk-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="attention role: at most this many GiB in --kv-disk-dir (needed with --kv-disk-dir)",
    )
    p.add_argument(
        "--pool",
        choices=POOLS,
        default="mixed",
        help="attention role: the pool this worker serves in — prefill (runs prompts, hands each sequence "
        "to a decode worker), decode, or mixed (both: one pool); the router decides what runs where, "
        "this labels Info and /metrics",
    )
    p.add_argument("--name", help="worker name (default: <role>-<ordinal>, or <role>-0)")
    p.add_argument("--threads", type=int, default=16, help="gRPC handler threads")
    p.add_argument(
        "--decode-threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch threads for decode-sized work (at most 16 token rows) that overlaps the other role's: "
        "an expert worker's calls, an attention worker's shared experts. For workers sharing cores "
        "(expertmesh up sets it there); default: all ($EXPERTMESH_TORCH_THREADS)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help=f"seconds in-flight calls get on shutdown; the process ends {SHUTDOWN_SLACK_S:g} s after "
        "that, done or not",
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve grpc.health.v1 alone, plaintext, on this port (Kubernetes probes under mTLS)",
    )
    p.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", help="private key of --tls-cert (PEM)")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument(
        "--collective-port",
        type=int,
        default=int(os.environ["EXPERTMESH_COLLECTIVE_PORT"]) if os.environ.get("EXPERTMESH_COLLECTIVE_PORT") else None,
        help="also serve the collective transport (point-to-point pairs: TCP on cpu, NCCL on cuda) — the "
        "expert exchange's calls (expert role) and hand-offs sent to this worker (attention role) — its "
        "rendezvous store on this port (default: $EXPERTMESH_COLLECTIVE_PORT; none: gRPC only)",
    )
    p.add_argument(
        "--collective-backend",
        choices=BACKENDS,
        default="auto",
        help="the collective pairs' backend: tcp (one TCP connection per pair), gloo (torch.distributed), "
        "nccl (torch.distributed on GPUs); auto: nccl on cuda, tcp on cpu",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=30.0,
        help="attention role: close the sequences of a router silent this long (it heartbeats every second); 0 = never",
    )
    p.add_argument("--expert-tls-ca", help="attention role: call expert workers over TLS, verifying them with this CA")
    p.add_argument("--expert-tls-cert", help="client certificate for mutual TLS with the expert workers")
    p.add_argument("--expert-tls-key", help="private key of --expert-tls-cert")
    p.add_argument("--expert-tls-server-name", help="name expected in the expert workers' certificates")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if os.environ.get("EXPERTMESH_TORCH_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["EXPERTMESH_TORCH_THREADS"]))
    assignment, gpu_of, cfg_only = None, {}, None
    try:
        device = memory.check_device(args.device)
        memory.compute_dtype(device, args.dtype)
        if args.dry_run and device != "meta":
            raise ValueError(f"--dry-run: needs --device meta (found --device {device})")
        if device == "meta" and not args.dry_run:
            raise ValueError("--device meta: only with --dry-run (a meta worker holds no weights to serve)")
        if args.checkpoint is None:
            if not (args.dry_run and args.preset):
                raise ValueError("--checkpoint: required (or --preset with --device meta --dry-run)")
            cfg_only = preset(args.preset)
        elif args.preset:
            raise ValueError("--preset: only without --checkpoint (the checkpoint has its config)")
        if args.port is None and not args.dry_run:
            raise ValueError("--port: required")
        if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization: expected a fraction in (0, 1], found {args.gpu_memory_utilization}"
            )
        if args.experts and args.plan:
            raise ValueError("--experts and --plan: give one of them, not both")
        if args.plan:
            if args.ordinal is None:
                raise ValueError("--ordinal: required with --plan")
            assignment = plan_assignment(args.plan, args.ordinal, gpu_of)
        elif args.experts:
            assignment = parse_experts(args.experts)
        elif args.role == "expert":
            raise ValueError("--experts or --plan/--ordinal: required for --role expert")
        tls = None
        if args.tls_cert or args.tls_key:
            if not (args.tls_cert and args.tls_key):
                raise ValueError("--tls-cert and --tls-key: give both")
            tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)
        elif args.tls_client_ca:
            raise ValueError("--tls-client-ca: needs --tls-cert and --tls-key")
        expert_tls = None
        if args.expert_tls_ca:
            expert_tls = ClientTLS(
                args.expert_tls_ca, args.expert_tls_cert, args.expert_tls_key, args.expert_tls_server_name
            )
        elif args.expert_tls_cert or args.expert_tls_key:
            raise ValueError("--expert-tls-cert/--expert-tls-key: need --expert-tls-ca")
        if args.kv_blocks <= 0 or args.block_size <= 0:
            raise ValueError(f"--kv-blocks {args.kv_blocks} / --block-size {args.block_size}: expected positive")
        kv_tiers = kv_tier_options(args)
        if args.pool != "mixed" and args.role == "expert":
            raise ValueError(f"--pool {args.pool}: only for --role attention or both (expert workers serve every pool)")
    except (ValueError, OSError) as e:
        parser.error(str(e))
    name = args.name
    if name is None and args.role != "both" and args.ordinal is not None:
        name = f"{args.role}-{args.ordinal}"
    device_memory = None if args.device_memory_gib is None else int(args.device_memory_gib * 2**30)
    kv_blocks = None if args.gpu_memory_utilization is not None else args.kv_blocks
    if args.dry_run:
        try:
            source = cfg_only if cfg_only is not None else Checkpoint(args.checkpoint).cfg
            attention, expert = build_workers(
                args.role,
                source,
                assignment=assignment,
                gpu_of=gpu_of or None,
                kv_blocks=kv_blocks,
                block_size=args.block_size,
                name=name,
                device="meta",
                dtype=args.dtype,
                gpu_memory_utilization=args.gpu_memory_utilization,
                device_memory_bytes=device_memory,
            )
        except ValueError as e:
            print(f"expertmesh worker: error: {e}", file=sys.stderr)
            return 2
        print(dry_run(attention, expert, kv_tiers), flush=True)
        return 0

    stop = stop_on_signals()
    try:
        server = serve(
            args.role,
            args.checkpoint,
            args.port,
            args.host,
            assignment=assignment,
            kv_blocks=kv_blocks,
            block_size=args.block_size,
            name=name,
            max_workers=args.threads,
            tls=tls,
            device=device,
            dtype=args.dtype,
            gpu_of=gpu_of or None,
            gpu_memory_utilization=args.gpu_memory_utilization,
            device_memory_bytes=device_memory,
            expert_tls=expert_tls,
            lease_seconds=args.lease_seconds,
            collective_port=args.collective_port,
            collective_backend=args.collective_backend,
            health_port=args.health_port,
            kv_tiers=kv_tiers,
            pool=args.pool,
            decode_threads=args.decode_threads,
        )
    except (OSError, ValueError) as e:  # port taken, bad checkpoint, experts it lacks: one clear line
        print(f"expertmesh worker: error: {e}", file=sys.stderr)
        return 2
    telemetry.setup_tracing(
        "expertmesh-worker", {"expertmesh.role": args.role, "expertmesh.worker": name, "expertmesh.shard": args.ordinal}
    )
    if args.metrics_port is not None:
        serve_metrics(server, args.host, args.metrics_port)
    print(f"READY {args.role} {args.host}:{server.port}", flush=True)
    while not stop.wait(0.5):
        pass
    log.info("shutting down: NOT_SERVING, finishing in-flight calls (grace %.1fs)", args.grace)
    exit_after(args.grace + SHUTDOWN_SLACK_S, f"expertmesh worker {name or args.role}")
    shutdown(server, args.grace)
    log.info("stopped")
    exchange = getattr(server.attention, "exchange", None)
    if server.collective is not None or any(hasattr(c, "run_grpc") for c in getattr(exchange, "clients", ())):
        # torch.distributed pairs may hold threads in C++ waits (a hung peer): run the exit handlers (telemetry
        # flush), then leave without joining those threads
        import atexit

        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
