"""An attention worker's side of the router's step channel (expertmesh/wire/step_channel.py: why, the frames, the
faults): RunStep over one plain TCP connection, served on the connection's own thread by the same code as the gRPC
RunStep (worker/servicers.py's `AttentionServicer.step_frame`: the span under the router's traceparent, the call
metrics, the status of a failure).

`open(channel_id, peer_host, timeout)` — what OpenStepChannel does — listens once, on an ephemeral port of the
address that routes to the caller, for one connection within `timeout`; the connection's first bytes must be the
channel's id (sent over the mutual-TLS gRPC call, so only that caller knows it), which the worker acknowledges.
Then the thread serves frames until the router closes the connection. It waits for the next request without a
deadline (an idle router is no fault); a request's rest and the answer have `timeout`. The connection is not
encrypted (like the expert exchange's pairs): keep it on a trusted network.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time

from expertmesh.wire.step_channel import (
    ACK,
    ANSWER,
    MAX_FRAME_BYTES,
    REQUEST,
    decode_trace,
    recv_exact,
    send_frame,
)
from expertmesh.worker.collective import local_address_towards

log = logging.getLogger("expertmesh.worker")

MAX_CHANNELS = 64  # channels served or awaited at once (one per router replica is the use)


class StepChannelServer:
    """Serves step channels: `step(raw RunStepRequest, trace metadata)` → (status, StepDone bytes or message)."""

    def __init__(self, step):
        self.step = step
        self.lock = threading.Lock()
        self.channels = 0  # served or awaited now
        self.steps = 0  # steps served over channels since start

    def open(self, channel_id: str, peer_host: str, timeout: float) -> tuple[str, int]:
        """Listen for the channel `channel_id` → (host, port) the caller connects to within `timeout`."""
        if not 16 <= len(channel_id) <= 64 or not channel_id.isalnum() or not channel_id.isascii():
            raise ValueError(f"channel_id: expected 16 to 64 letters or digits, found {len(channel_id)} characters")
        if not 0 < timeout <= 600:
            raise ValueError(f"timeout_s: expected seconds in (0, 600], found {timeout}")
        with self.lock:
            if self.channels >= MAX_CHANNELS:
                raise ValueError(f"OpenStepChannel: {MAX_CHANNELS} step channels are open already")
            self.channels += 1
        try:
            address = local_address_towards(peer_host)
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            listener = socket.create_server((address, 0), family=family, backlog=1)
        except BaseException:
            self._closed()
            raise
        host, port = listener.getsockname()[:2]
        threading.Thread(
            target=self._serve, args=(listener, channel_id.encode(), timeout), name="step-channel", daemon=True
        ).start()
        return host, port

    def _closed(self) -> None:
        with self.lock:
            self.channels -= 1

    def _serve(self, listener: socket.socket, secret: bytes, timeout: float) -> None:
        conn = None
        try:
            with listener:
                listener.settimeout(timeout)
                conn, peer = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not hmac.compare_digest(recv_exact(conn, len(secret), time.monotonic() + timeout), secret):
                raise ConnectionError(f"a connection from {peer[0]} without the channel's id")
            send_frame(conn, ACK, [], time.monotonic() + timeout)
            log.info("step channel from %s formed", peer[0])
            while True:
                conn.settimeout(None)
                head = recv_exact(conn, REQUEST.size, None)  # the next step, however long that takes
                trace_len, raw_len = REQUEST.unpack(head)
                if trace_len > 4096 or raw_len > MAX_FRAME_BYTES:
                    raise ConnectionError(f"a request frame of {trace_len} + {raw_len} bytes")
                deadline = time.monotonic() + timeout
                trace = recv_exact(conn, trace_len, deadline)
                raw = recv_exact(conn, raw_len, deadline)
                status, body = self.step(raw, decode_trace(trace))
                self.steps += 1
                send_frame(conn, ANSWER.pack(status, len(body)), [body], time.monotonic() + timeout)
        except Exception as e:  # the router closed the channel (dropped it, restarted, shut down), or never came
            log.info("step channel closed: %s", str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        finally:
            if conn is not None:
                conn.close()
            self._closed()
