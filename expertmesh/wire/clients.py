"""gRPC clients of the workers, with the same methods, return types and exceptions as the in-process workers
(worker/attention.py's AttentionWorker, worker/expert.py's ExpertWorker), so the router's engine and the attention
workers' expert exchange use either without knowing which. The types are those of expertmesh/wire/worker_api.py.

Status codes map back to the workers' exceptions (the server sends the local message as the details):
  INVALID_ARGUMENT → WorkerError / ExpertRequestError,  NOT_FOUND → NotFound / UnknownExpert,
  RESOURCE_EXHAUSTED → OutOfBlocks (attention),  UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED → WorkerUnavailable,
  anything else → RemoteError. Every call carries a deadline (`timeout` seconds).

No torch here: arrays travel as numpy (wire/arrays.py). Only the expert data path (`RemoteExpert.run`, called by
attention workers) moves torch tensors, and imports the torch codec when it is called.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.protos import worker_pb2, worker_pb2_grpc
from expertmesh.runtime import telemetry
from expertmesh.wire.arrays import array_from_proto, array_to_proto
from expertmesh.wire.sampling_params import sampling_to_proto, thinking_to_proto
from expertmesh.wire.worker_api import (
    ExpertRequestError,
    HandOffFailed,
    HandOffResult,
    ImageEncode,
    NotConnected,
    NotFound,
    OutOfBlocks,
    RemoteError,
    StepDone,
    StepSegment,
    TokenLogprobs,
    UnknownExpert,
    WorkerError,
    WorkerUnavailable,
    snapshot_parts,
)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
HANDOFF_PIECE_BYTES = 4 * 1024 * 1024  # one message of a streamed hand-off
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class _Client:
    _errors: dict[grpc.StatusCode, type[Exception]] = {}

    def __init__(
        self, address: str, *, timeout: float = 30.0, name: str | None = None, wait_for_ready: bool = False, tls=None
    ):
        """`wait_for_ready`: a call to a worker that is not connected yet waits (up to the deadline) instead of
        failing at once with WorkerUnavailable."""
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: expected a positive number of seconds")
        self.address, self.timeout, self.name = address, timeout, name or address
        self.wait_for_ready = wait_for_ready
        self.bytes_sent = self.bytes_received = 0
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        if tls is not None:  # expertmesh.runtime.tls.ClientTLS: verify the worker, present our certificate
            self.channel = grpc.secure_channel(address, tls.credentials(), options=options + tls.options())
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _call(self, method, request, timeout: float | None = None, sizes: tuple[int, int] | None = None):
        """`sizes`: (bytes sent, received) to count for a streamed request (default: the messages' sizes)."""
        metadata = telemetry.inject_metadata() or None  # W3C traceparent of the current span, if any
        try:
            response = method(
                request, timeout=timeout or self.timeout, wait_for_ready=self.wait_for_ready, metadata=metadata
            )
        except grpc.RpcError as e:
            raise self._error(e) from None
        # serialized message bytes each way (what the data path costs on the wire, before HTTP/2 framing)
        sent, received = sizes or (request.ByteSize(), response.ByteSize())
        self.bytes_sent += sent
        self.bytes_received += received
        return response

    def _error(self, e: grpc.RpcError) -> Exception:
        return self.status_error(e.code(), e.details() or "")

    def status_error(self, code: grpc.StatusCode, details: str) -> Exception:
        """The exception a call that ended with `code` raises (the step channel's answers carry the same codes)."""
        if code in _UNAVAILABLE:
            return WorkerUnavailable(f"{self.name} ({self.address}): {code.name}: {details}")
        cls = self._errors.get(code)
        if cls is not None:
            return cls(details)  # the worker's own message, naming the field
        return RemoteError(f"{self.name} ({self.address}): {code.name}: {details}", code)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The grpc.health.v1 status of `service` ("" = the whole server): "SERVING", "NOT_SERVING", ...
        `timeout`: this call's deadline (default the client's)."""
        resp = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the channel is connected (raises WorkerUnavailable after `timeout`, default the deadline)."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=self.timeout if timeout is None else timeout)
        except grpc.FutureTimeoutError:
            raise WorkerUnavailable(f"{self.name} ({self.address}): not reachable") from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r}, name={self.name!r})"


class RemoteAttention(_Client):
    """An attention worker over gRPC: AttentionWorker's methods (info, open/close_sequence, save/drop/demote_prefix,
    list_prefixes, connect_experts, run_step, expert_load, hand_off, import_sequence)."""

    _errors = {
        grpc.StatusCode.INVALID_ARGUMENT: WorkerError,
        grpc.StatusCode.NOT_FOUND: NotFound,
        grpc.StatusCode.RESOURCE_EXHAUSTED: OutOfBlocks,
        grpc.StatusCode.FAILED_PRECONDITION: NotConnected,
        grpc.StatusCode.ABORTED: HandOffFailed,
    }

    def __init__(
        self,
        address: str,
        *,
        timeout: float = 30.0,
        name: str | None = None,
        wait_for_ready: bool = False,
        tls=None,
        step_timeout: float | None = None,
        handoff_timeout: float | None = None,
    ):
        """`step_timeout`: the deadline of RunStep (default `timeout`), which includes the step's expert calls —
        each with deadline `timeout`, and a hung expert worker costs one before it is failed over. `handoff_timeout`:
        the deadline of HandOff (default `step_timeout`; the router gives it the step floor, not the cap a long
        prefill step may need: a hand-off's work does not grow with the prompt's attention)."""
        super().__init__(address, timeout=timeout, name=name, wait_for_ready=wait_for_ready, tls=tls)
        self.step_timeout = step_timeout or timeout
        self.handoff_timeout = handoff_timeout or self.step_timeout
        self.stub = worker_pb2_grpc.AttentionWorkerStub(self.channel)

    def info(self, owner: str = "") -> dict:
        i = self._call(self.stub.Info, worker_pb2.InfoRequest(owner=owner))
        return {
            "name": i.name,
            "model": i.model,
            "block_size": i.block_size,
            "total_blocks": i.total_blocks,
            "free_blocks": i.free_blocks,
            "sequences": i.sequences,
            "prefixes": i.prefixes,
            "experts_down": list(i.experts_down),
            "pool": i.pool or "mixed",
            "speculative_tokens": i.speculative_tokens,
            "speculative_method": i.speculative_method,
        }

    def open_sequence(
        self,
        seq_id: str,
        params,
        *,
        reserve_tokens: int,
        prefix_key: str | None = None,
        owner: str = "",
        images: list | None = None,
    ) -> int:
        req = worker_pb2.OpenSequenceRequest(
            seq_id=seq_id,
            params=sampling_to_proto(params),
            reserve_tokens=reserve_tokens,
            owner=owner,
            images=[
                worker_pb2.ImageSpan(position=i.position, pixels=array_to_proto(i.pixels, "pixels"))
                for i in images or ()
            ],
        )
        if prefix_key is not None:
            req.prefix_key = prefix_key
        if getattr(params, "thinking", None) is not None:
            req.thinking.CopyFrom(thinking_to_proto(params.thinking))
        return self._call(self.stub.OpenSequence, req).cached_tokens

    def extend_sequence(self, seq_id: str, reserve_tokens: int) -> int:
        return self._call(
            self.stub.ExtendSequence, worker_pb2.ExtendSequenceRequest(seq_id=seq_id, reserve_tokens=reserve_tokens)
        ).free_blocks

    def close_sequence(self, seq_id: str) -> int:
        return self._call(self.stub.CloseSequence, worker_pb2.CloseSequenceRequest(seq_id=seq_id)).free_blocks

    def save_prefix(self, seq_id: str, key: str) -> int:
        return self._call(self.stub.SavePrefix, worker_pb2.SavePrefixRequest(seq_id=seq_id, key=key)).free_blocks

    def drop_prefix(self, key: str) -> int:
        return self._call(self.stub.DropPrefix, worker_pb2.DropPrefixRequest(key=key)).free_blocks

    def demote_prefix(self, key: str) -> tuple[int, list[str]]:
        r = self._call(self.stub.DemotePrefix, worker_pb2.DropPrefixRequest(key=key))
        return r.free_blocks, list(r.dropped)

    def list_prefixes(self) -> list[tuple[str, int, str]]:
        r = self._call(self.stub.ListPrefixes, worker_pb2.InfoRequest())
        return [(p.key, p.length, p.tier) for p in r.prefixes]

    def connect_experts(self, clients: list, table, *, probe_interval: float = 1.0, transport: str = "grpc") -> None:
        """Tell the worker to dispatch to these expert workers (RemoteExpert clients: their addresses and
        deadline go over) by `table` (worker/exchange.ReplicaTable), over `transport` (grpc | collective)."""
        addresses = [getattr(c, "address", None) for c in clients]
        if None in addresses:
            raise ValueError("experts: a remote attention worker needs expert workers with addresses")
        timeout = min(getattr(c, "timeout", self.timeout) for c in clients) if clients else self.timeout
        self._call(
            self.stub.ConnectExperts,
            worker_pb2.ConnectExpertsRequest(
                addresses=addresses,
                moe_layers=list(table.moe_layers),
                replicas=array_to_proto(table.table, "replicas"),
                call_timeout_s=timeout,
                transport=transport,
            ),
        )

    def run_step(
        self, step_id: int, segments: list[StepSegment], snapshot_keys: dict[str, str | tuple[str, int]] | None = None
    ) -> StepDone:
        """AttentionWorker.run_step (a snapshot: a key, or (key, length))."""
        return self.step_done(
            self._call(self.stub.RunStep, self.step_request(step_id, segments, snapshot_keys), self.step_timeout)
        )

    @staticmethod
    def step_request(
        step_id: int, segments: list[StepSegment], snapshot_keys: dict[str, str | tuple[str, int]] | None = None
    ) -> worker_pb2.RunStepRequest:
        """run_step's arguments as the RunStepRequest message (gRPC, or the step channel: wire/step_channel.py)."""
        snaps = [(s, *snapshot_parts(k)) for s, k in (snapshot_keys or {}).items()]
        return worker_pb2.RunStepRequest(
            step_id=step_id,
            segments=[
                worker_pb2.StepSegment(
                    seq_id=s.seq_id, token_ids=s.token_ids, sample=s.sample, max_new=s.max_new, hold_at=s.hold_at
                )
                for s in segments
            ],
            snapshot_keys=[worker_pb2.SnapshotKey(seq_id=s, key=k, length=n) for s, k, n in snaps],
        )

    @staticmethod
    def step_done(d: worker_pb2.StepDone) -> StepDone:
        """A StepDone message as run_step's result."""
        logprobs = [
            TokenLogprobs(
                lp.seq_id,
                lp.position,
                array_from_proto(lp.token_ids, "token_ids"),
                array_from_proto(lp.logprobs, "logprobs"),
                array_from_proto(lp.top_ids, "top_ids"),
                array_from_proto(lp.top_logprobs, "top_logprobs"),
            )
            for lp in d.logprobs
        ]
        return StepDone(
            d.step_id,
            {t.seq_id: t.token for t in d.tokens},
            d.free_blocks,
            logprobs,
            {f.seq_id: f.reason for f in d.failed},
            list(d.experts_down),
            d.exchange_bytes,
            [ImageEncode(e.seq_id, e.tokens, e.seconds) for e in d.image_encodes],
            {t.seq_id: list(t.more) for t in d.tokens if t.more},
            {t.seq_id: t.drafted for t in d.tokens if t.drafted},
        )

    def hand_off(
        self, seq_id: str, to, to_seq_id: str, *, reserve_tokens: int, owner: str = "", transport: str = "grpc"
    ) -> HandOffResult:
        """AttentionWorker.hand_off: `to` is a RemoteAttention (its address goes over; the worker sends the
        sequence there itself — the router never carries KV), over `transport` (grpc | collective)."""
        r = self._call(
            self.stub.HandOff,
            worker_pb2.HandOffRequest(
                seq_id=seq_id,
                to_address=to.address,
                to_seq_id=to_seq_id,
                reserve_tokens=reserve_tokens,
                owner=owner,
                transport=transport,
            ),
            self.handoff_timeout,
        )
        return HandOffResult(r.free_blocks, r.bytes, r.seconds)

    @staticmethod
    def import_header(
        seq_id: str,
        params,
        cache_bytes: int,
        sampler_state: bytes,
        observed: list[int],
        *,
        reserve_tokens: int,
        owner: str = "",
    ) -> worker_pb2.ImportSequenceRequest:
        """The first part of a hand-off (ImportSequence stream, or a collective pair's OP_IMPORT)."""
        header = worker_pb2.ImportSequenceRequest(
            seq_id=seq_id,
            params=sampling_to_proto(params),
            reserve_tokens=reserve_tokens,
            owner=owner,
            cache_bytes=cache_bytes,
            sampler_state=sampler_state,
            observed=observed,
        )
        if getattr(params, "thinking", None) is not None:
            header.thinking.CopyFrom(thinking_to_proto(params.thinking))
        return header

    def import_sequence(
        self,
        seq_id: str,
        params,
        snap,
        sampler_state: bytes,
        observed: list[int],
        *,
        reserve_tokens: int,
        owner: str = "",
        identity: str = "",
    ) -> int:
        """AttentionWorker.import_sequence over gRPC (called by a prefill worker: `snap` holds torch tensors),
        streamed: the header, then the cache as a KV-tier file (`identity`: the sender's model and dtype) in pieces
        of HANDOFF_PIECE_BYTES."""
        from expertmesh.wire.kv_snapshot import encode  # torch: the attention workers' path, never the router's

        cache = encode(seq_id, identity, snap)
        header = self.import_header(
            seq_id, params, len(cache), sampler_state, observed, reserve_tokens=reserve_tokens, owner=owner
        )

        def parts():  # one piece in memory at a time beside the cache
            yield worker_pb2.ImportSequencePart(header=header)
            view = memoryview(cache)
            for i in range(0, len(cache), HANDOFF_PIECE_BYTES):
                yield worker_pb2.ImportSequencePart(cache=bytes(view[i : i + HANDOFF_PIECE_BYTES]))

        return self._call(self.stub.ImportSequence, parts(), sizes=(len(cache), 0)).free_blocks

    def open_collective(self, group_id: str, timeout: float) -> tuple[int, str]:
        """Ask the worker to start its rank of the torch.distributed pair `group_id` (hand-offs sent to it)."""
        r = self._call(self.stub.OpenCollective, worker_pb2.OpenCollectiveRequest(group_id=group_id, timeout_s=timeout))
        return r.store_port, r.backend

    def open_step_channel(self, channel_id: str, timeout: float) -> tuple[str, int]:
        """Ask the worker to listen for the step channel `channel_id` (wire/step_channel.py) → (host, port)."""
        r = self._call(
            self.stub.OpenStepChannel, worker_pb2.OpenStepChannelRequest(channel_id=channel_id, timeout_s=timeout)
        )
        return r.host, r.port

    def expert_load(self) -> dict[int, list[int]]:
        r = self._call(self.stub.ExpertLoad, worker_pb2.InfoRequest())
        tokens = array_from_proto(r.tokens, "tokens").tolist()
        return {int(l): row for l, row in zip(r.moe_layers, tokens)}


class RemoteExpert(_Client):
    """An expert worker over gRPC: ExpertWorker.run, plus info() (name, model, (layer, expert) pairs held)."""

    _errors = {grpc.StatusCode.INVALID_ARGUMENT: ExpertRequestError, grpc.StatusCode.NOT_FOUND: UnknownExpert}
    # FAILED_PRECONDITION (OpenCollective on a worker without --collective-port) → RemoteError

    def __init__(
        self, address: str, *, timeout: float = 30.0, name: str | None = None, wait_for_ready: bool = False, tls=None
    ):
        super().__init__(address, timeout=timeout, name=name, wait_for_ready=wait_for_ready, tls=tls)
        self.stub = worker_pb2_grpc.ExpertWorkerStub(self.channel)

    def info(self) -> dict:
        i = self._call(self.stub.Info, worker_pb2.InfoRequest())
        return {"name": i.name, "model": i.model, "experts": [(k.layer, k.expert) for k in i.experts]}

    def transport_counts(self) -> dict:
        """RunExperts calls served over each transport since start, and the collective pairs open now."""
        i = self._call(self.stub.Info, worker_pb2.InfoRequest())
        return {
            "grpc_calls": i.grpc_calls,
            "collective_calls": i.collective_calls,
            "collective_pairs": i.collective_pairs,
        }

    def run(self, layer: int, hidden, expert_ids, weights, out_dtype=None):
        """ExpertWorker.run over gRPC (torch tensors in and out; out_dtype default float32): → [R, H] per-(row,
        group) partial sums."""
        # torch only here, the attention workers' data path: the router process never imports it
        from expertmesh.wire.tensors import from_proto, to_proto

        out = "float32" if out_dtype is None else str(out_dtype).removeprefix("torch.")
        req = worker_pb2.RunExpertsRequest(
            layer=layer,
            hidden=to_proto(hidden, "hidden"),
            expert_ids=to_proto(expert_ids, "expert_ids"),
            weights=to_proto(weights.float(), "weights"),
            output_dtype=out,
        )
        return from_proto(self._call(self.stub.RunExperts, req).output, "output")

    def set_shards(self, assignment, gpu_of: dict | None = None, *, drop_others: bool = False) -> dict:
        """ExpertWorker.set_shards over gRPC (a live re-plan's warm / drain) → {"experts": held now}."""
        pairs = [(int(l), int(e)) for l, e in assignment]
        req = worker_pb2.SetShardsRequest(
            experts=[worker_pb2.ExpertKey(layer=l, expert=e) for l, e in pairs],
            gpus=[int(gpu_of.get(p, 0)) for p in pairs] if gpu_of else [],
            drop_others=drop_others,
        )
        i = self._call(self.stub.SetShards, req)
        return {"experts": [(k.layer, k.expert) for k in i.experts]}

    def open_collective(self, group_id: str, timeout: float) -> tuple[int, str]:
        """Ask the worker to start its rank of the torch.distributed pair `group_id` → (store port, backend)."""
        r = self._call(self.stub.OpenCollective, worker_pb2.OpenCollectiveRequest(group_id=group_id, timeout_s=timeout))
        return r.store_port, r.backend
