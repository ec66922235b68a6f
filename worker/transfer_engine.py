"""Hand-offs on Mooncake's transfer engine (`--handoff-transport mooncake` on the router, #53): the prefill worker
leaves the sequence's cache — the KV-tier file bytes a gRPC hand-off streams (expertmesh/wire/kv_snapshot.py) — in
memory registered with its TransferEngine and sends the receiver, over the existing ImportSequence stream, only the
header and where the bytes are (its engine's session, the address, the length); the receiver reads them with one
`transfer_sync_read` into memory of its own and imports as ever. One control message, the bytes moved by the
engine (TCP here, RDMA where the engine finds devices), as NIXL-based disaggregation reads prefill KV from decode.

Trust. The engine itself is unauthenticated (like RDMA): what makes it safe is that the receiver reads only where an
authenticated sender (the mutual-TLS gRPC call) told it to, checks the bytes as a gRPC hand-off's (sha256, the
model's identity, every tensor's shape), and the sender's memory is registered only for the call.

Fallback. A worker without the Mooncake wheel, an engine that does not start, or a read that fails is answered
`NotConnected` by the receiver, and the sender hands the sequence off over gRPC instead (counted, never failed):
`transfer_sync_read` can be asked again; the sequence stays open on the sender until the receiver has it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np

from expertmesh.wire.worker_api import NotConnected

log = logging.getLogger("expertmesh.worker")

TRANSPORT = "mooncake"
HOST_ENV = "EXPERTMESH_TRANSFER_HOST"  # the address peers reach this worker's engine on (default: the host's)


def engine_host() -> str:
    """This worker's address for its engine's peers: $EXPERTMESH_TRANSFER_HOST, else $POD_IP, else the host name's."""
    return os.environ.get(HOST_ENV) or os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


class TransferLink:
    """This worker's TransferEngine (started on first use, P2P handshake: no metadata service) and its counters:
    `sent_bytes` the peers read from here, `received_bytes` read from peers, `fallbacks` hand-offs that went over
    gRPC instead."""

    def __init__(self, host: str | None = None):
        self.host = host
        self._engine = None
        self._failed_at = 0.0
        self._lock = threading.Lock()
        self.sent_bytes = self.received_bytes = self.transfers = self.fallbacks = 0

    def engine(self):
        """The started engine; NotConnected when it cannot start (no wheel, no library: tried again after 30 s)."""
        with self._lock:
            if self._engine is not None:
                return self._engine
            if time.monotonic() - self._failed_at < 30.0:
                raise NotConnected("transfer engine: unavailable (it failed to start recently)")
            try:
                from mooncake.engine import TransferEngine

                engine, host = TransferEngine(), self.host or engine_host()
                rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
                if rc != 0:
                    raise RuntimeError(f"initialize answered {rc}")
            except Exception as e:  # ImportError (no wheel / libibverbs), a failed start
                self._failed_at = time.monotonic()
                raise NotConnected(f"transfer engine: unavailable ({type(e).__name__}: {e})") from None
            self.host, self._engine = host, engine
            return engine

    @property
    def session(self) -> str:
        port = self.engine().get_rpc_port()  # the engine first: it settles `host`
        return f"{self.host}:{port}"

    def offer(self, data: bytes) -> Offer:
        """`data` registered with this worker's engine for a peer to read (`with` it: unregistered after)."""
        return Offer(self, data)

    def fetch(self, session: str, address: int, length: int) -> bytes:
        """`length` bytes at `address` of the engine at `session`, read into this worker's memory; NotConnected
        when the engine is unavailable or the read fails (the sender then falls back to gRPC)."""
        engine = self.engine()
        buf = np.empty(length, dtype=np.uint8)
        if engine.register_memory(buf.ctypes.data, length) != 0:
            raise NotConnected(f"transfer engine: could not register {length} bytes")
        try:
            rc = engine.transfer_sync_read(session, buf.ctypes.data, address, length)
        finally:
            engine.unregister_memory(buf.ctypes.data)
        if rc != 0:
            raise NotConnected(f"transfer engine: reading {length} bytes from {session} answered {rc}")
        with self._lock:
            self.received_bytes += length
            self.transfers += 1
        return buf.tobytes()


class Offer:
    """Bytes registered with the engine while the receiver reads them: (`session`, `address`, `length`)."""

    def __init__(self, link: TransferLink, data: bytes):
        self.link, self.length = link, len(data)
        self._buf = np.frombuffer(data, dtype=np.uint8)  # a view: the bytes stay where they are
        self.address = int(self._buf.ctypes.data)
        self.session = link.session

    def __enter__(self) -> Offer:
        if self.link.engine().register_memory(self.address, self.length) != 0:
            raise NotConnected(f"transfer engine: could not register {self.length} bytes")
        return self

    def __exit__(self, *exc) -> None:
        self.link.engine().unregister_memory(self.address)

    def taken(self) -> None:
        """The receiver read it (its import answered)."""
        with self.link._lock:
            self.link.sent_bytes += self.length


class EngineAttention:
    """An attention worker that takes hand-offs, reached through its gRPC client (`remote`, a RemoteAttention):
    `import_sequence` as RemoteAttention's, the cache read by the receiver's engine from `link`'s; over gRPC when
    this engine or the receiver's is unavailable."""

    def __init__(self, remote, link: TransferLink):
        self.remote, self.link = remote, link
        self.name, self.address = getattr(remote, "name", ""), getattr(remote, "address", "")

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
        from expertmesh.protos import worker_pb2
        from expertmesh.wire.kv_snapshot import encode

        cache = encode(seq_id, identity, snap)
        header = self.remote.import_header(
            seq_id, params, len(cache), sampler_state, observed, reserve_tokens=reserve_tokens, owner=owner
        )
        try:
            with self.link.offer(cache) as offer:
                where = worker_pb2.EngineTransfer(session=offer.session, address=offer.address, length=offer.length)
                parts = iter(
                    [worker_pb2.ImportSequencePart(header=header), worker_pb2.ImportSequencePart(engine=where)]
                )
                free = self.remote._call(self.remote.stub.ImportSequence, parts, sizes=(0, 0)).free_blocks
                offer.taken()
                return free
        except NotConnected as e:  # this engine, or the receiver's: the same hand-off over gRPC
            log.warning("%s: hand-off over gRPC instead: %s", self.name or self.address, e)
            with self.link._lock:
                self.link.fallbacks += 1
        return self.remote.import_sequence(
            seq_id, params, snap, sampler_state, observed, reserve_tokens=reserve_tokens, owner=owner, identity=identity
        )

    def close(self) -> None:
        close = getattr(self.remote, "close", None)
        if close is not None:
            close()
