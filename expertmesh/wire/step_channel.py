"""The router's step channel: RunStep and its answer over one plain TCP connection per (router, attention worker),
beside the worker's gRPC client, which keeps everything else (control, health) and carries the steps whenever the
channel is not formed.

Why: a gRPC call crosses the client channel's and the server's threads. Measured inside `expertmesh up` decoding one
request on the 2-core box, ~0.85 ms from the router's call to the worker's handler and ~0.8 ms back, every step. On a
socket the router's calling thread writes the request and reads the answer, and the worker's connection thread runs
the step itself — the way the expert exchange's pairs already go (worker/collective.py's SocketPair).

Forming (in the background; steps go over gRPC meanwhile): the router calls `OpenStepChannel(channel_id)` on the
worker over gRPC (mutual TLS: the random id is the channel's secret); the worker listens once, on an ephemeral port
of the address that routes to the router, and answers host and port; the router connects, sends the id first, and
the worker acknowledges with one byte (worker/step_channel.py). A channel that cannot form is counted
(`fallbacks`) and tried again later, backing off up to a minute; steps go over gRPC meanwhile.

Frames, sizes first: a request is header `<II` (trace-context length, message length), the W3C trace context (the
`traceparent` / `tracestate` lines of the caller's span, `key=value\\n`: the worker's span is the child of the
router's, as over gRPC) and the serialized RunStepRequest; an answer is header `<iI` (status, length) and the
serialized StepDone, or on an error the message (status: the grpc.StatusCode the gRPC servicer would answer).

Faults: every wait has the step's deadline (the RunStep deadline over gRPC). A call that fails or passes it drops the
channel and raises WorkerUnavailable — what a failed gRPC RunStep raises, so the router marks the worker down and
replays its sequences as ever. A channel the worker closed while idle (restarted, shut down) is seen before the
step is sent, and that step goes over gRPC. No torch here: the router's side.
"""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
import time

import grpc

from expertmesh.protos import worker_pb2
from expertmesh.runtime import telemetry
from expertmesh.wire.worker_api import StepDone, StepSegment, WorkerUnavailable

log = logging.getLogger("expertmesh.router")

REQUEST = struct.Struct("<II")  # trace-context bytes, RunStepRequest bytes
ANSWER = struct.Struct("<iI")  # status (0: OK, else a grpc.StatusCode's number), StepDone or message bytes
MAX_FRAME_BYTES = 256 * 1024 * 1024  # the gRPC clients' message bound
ACK = b"\x01"  # the worker's answer to a connection that sent the channel's id
TRANSPORTS = ("tcp", "grpc")
FORM_TIMEOUT_S = 10.0  # forming: the OpenStepChannel call, the connection and the acknowledgement, each
MAX_RETRY_S = 60.0  # the longest wait between two attempts to form a channel that failed
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def encode_trace(metadata: list[tuple[str, str]]) -> bytes:
    """The caller's W3C trace context (telemetry.inject_metadata) as the frame carries it."""
    return "".join(f"{k}={v}\n" for k, v in metadata).encode()


def decode_trace(raw: bytes) -> list[tuple[str, str]]:
    """A frame's trace context back as metadata pairs (what telemetry.extract_context reads)."""
    pairs = [line.split("=", 1) for line in raw.decode(errors="replace").splitlines() if "=" in line]
    return [(k, v) for k, v in pairs]


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    """Fill `view` from `sock`; every wait ends at `deadline` (time.monotonic; None: none)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the step channel's deadline passed")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the other side closed the step channel")
        got += n


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def send_frame(sock: socket.socket, header: bytes, parts: list[bytes], deadline: float | None) -> None:
    """Send a header and its parts in one system call where the socket takes them."""
    views = [memoryview(b) for b in (header, *parts) if len(b)]
    while views:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the step channel's deadline passed")
            sock.settimeout(left)
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle channel was closed (or broken) by the other side: a peek that does not wait."""
    try:
        sock.settimeout(0)
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True  # end of stream, or bytes nobody asked for (out of step): unusable either way


class StepChannelAttention:
    """An attention worker reached through its gRPC client (`remote`, a RemoteAttention) with `run_step` over the
    step channel whenever one is formed. Every other method and attribute is the gRPC client's."""

    def __init__(self, remote, *, retry_interval: float = 1.0):
        self.remote = remote
        self.retry_interval = retry_interval
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()  # one step on the channel at a time (the wire is a FIFO)
        self._state = threading.Lock()  # the channel and its forming (never held across a wait)
        self.forming = self.closed = False
        self.next_attempt = 0.0
        self.failed_forms = 0  # in a row: the back-off
        self.fallbacks = 0  # channels that could not form (gRPC carried the steps meanwhile)
        self.steps = {"tcp": 0, "grpc": 0}  # steps sent over each transport

    def __getattr__(self, name: str):
        return getattr(self.remote, name)

    @property
    def transport(self) -> str:
        """The transport the next step takes: "tcp" while the channel is formed, else "grpc"."""
        return "tcp" if self.sock is not None else "grpc"

    # -- control
    def form(self) -> None:
        """Form the channel in the background (no-op while one is formed, being formed, or tried recently)."""
        with self._state:
            if self.closed or self.sock is not None or self.forming or time.monotonic() < self.next_attempt:
                return
            self.forming = True
        threading.Thread(target=self._form, name=f"step-channel-{self.remote.name}", daemon=True).start()

    def _form(self) -> None:
        sock = None
        try:
            channel_id = secrets.token_hex(16)
            timeout = min(self.remote.timeout, FORM_TIMEOUT_S)
            host, port = self.remote.open_step_channel(channel_id, timeout)
            sock = socket.create_connection((host, port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(channel_id.encode())
            if recv_exact(sock, len(ACK), time.monotonic() + timeout) != ACK:
                raise ConnectionError("the worker did not acknowledge the channel")
        except Exception as e:
            if sock is not None:
                sock.close()
            with self._state:
                self.forming = False
                self.fallbacks += 1
                self.failed_forms += 1
                wait = min(MAX_RETRY_S, self.retry_interval * 2 ** (self.failed_forms - 1))
                self.next_attempt = time.monotonic() + wait
            log.warning(
                "%s: step channel not formed (steps over gRPC; next try in %.0f s): %s",
                self.remote.name,
                wait,
                str(e).splitlines()[0][:300] if str(e) else type(e).__name__,
            )
            return
        with self._state:
            self.forming = False
            if self.closed:
                sock.close()
                return
            self.sock, self.failed_forms = sock, 0
        log.info("%s: step channel formed", self.remote.name)

    def _drop(self, sock: socket.socket, reason) -> None:
        """Close `sock` and forget it if it is still the channel."""
        with self._state:
            current = self.sock is sock
            if current:
                self.sock, self.next_attempt = None, 0.0
        if current:
            log.warning("%s: step channel dropped: %s", self.remote.name, str(reason).splitlines()[0][:300])
        try:
            sock.close()
        except OSError:
            pass

    def info(self, owner: str = "") -> dict:
        info = self.remote.info(owner)
        if self.sock is None:
            self.form()  # it answers (the engine's start, the heartbeat): the channel is formed if it is not
        return info

    def health(self, service: str = "", timeout: float | None = None) -> str:
        status = self.remote.health(service, timeout)
        if status == "SERVING" and self.sock is None:
            self.form()  # up (again): the channel is formed (never waits for a step in flight)
        return status

    def close(self) -> None:
        with self._state:
            self.closed = True
            sock = self.sock
        if sock is not None:
            self._drop(sock, "closed")
        self.remote.close()

    # -- data
    def run_step(
        self, step_id: int, segments: list[StepSegment], snapshot_keys: dict[str, str | tuple[str, int]] | None = None
    ) -> StepDone:
        """AttentionWorker.run_step over the channel when it is formed, else over gRPC."""
        deadline = time.monotonic() + self.remote.step_timeout
        if not self.lock.acquire(timeout=self.remote.step_timeout):
            raise WorkerUnavailable(f"{self.remote.name} ({self.remote.address}): the step channel stayed busy")
        try:
            sock = self.sock
            if sock is not None and closed_by_peer(sock):
                self._drop(sock, "closed by the worker")
                sock = None
            if sock is not None:
                raw = self.remote.step_request(step_id, segments, snapshot_keys).SerializeToString()
                trace = encode_trace(telemetry.inject_metadata())
                try:
                    send_frame(sock, REQUEST.pack(len(trace), len(raw)), [trace, raw], deadline)
                    status, length = ANSWER.unpack(recv_exact(sock, ANSWER.size, deadline))
                    if length > MAX_FRAME_BYTES:
                        raise ConnectionError(f"an answer of {length} bytes, over {MAX_FRAME_BYTES}")
                    body = recv_exact(sock, length, deadline)
                except (OSError, struct.error) as e:  # ConnectionError, TimeoutError, socket errors
                    self._drop(sock, e)
                    raise WorkerUnavailable(
                        f"{self.remote.name} ({self.remote.address}): step channel: {e or type(e).__name__}"
                    ) from None
                self.steps["tcp"] += 1
                self.remote.bytes_sent += len(raw)
                self.remote.bytes_received += len(body)
        finally:
            self.lock.release()
        if sock is None:
            self.form()
            self.steps["grpc"] += 1
            return self.remote.run_step(step_id, segments, snapshot_keys)
        if status != 0:
            code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
            raise self.remote.status_error(code, body.decode(errors="replace"))
        return self.remote.step_done(worker_pb2.StepDone.FromString(body))
