"""Deadlines for slow HTTP clients, as uvicorn's h11 protocol with two timers (uvicorn times out only idle
keep-alive connections: a client that trickles its headers or body, or stops reading a stream, would hold a
connection — and a stream's task — forever).

- request timeout: a request's line, headers and body must all arrive within `request_timeout` seconds of its first
  byte (of the connection, for the first request). Past it the client gets 408 and the connection is closed; a
  handler waiting on the body sees a disconnect.
- write timeout: when the client leaves the server's send buffer full for `write_timeout` seconds (it stopped
  reading), the connection is aborted — the buffer dropped, not flushed — so the streaming handler sees a disconnect
  and its request is cancelled (its KV freed) instead of waiting on the socket.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT = 30.0
WRITE_TIMEOUT = 60.0
_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
_BODY = (
    b'{"error": {"message": "the request did not arrive within %gs", "type": "invalid_request_error", '
    b'"param": null, "code": "request_timeout"}}'
)


def deadline_protocol(request_timeout: float = REQUEST_TIMEOUT, write_timeout: float = WRITE_TIMEOUT) -> type:
    """An H11Protocol class with these deadlines (for `uvicorn.Config(http=...)`)."""
    return type(
        "DeadlineH11Protocol",
        (DeadlineH11Protocol,),
        {"request_timeout": request_timeout, "write_timeout": write_timeout},
    )


class DeadlineH11Protocol(H11Protocol):
    request_timeout = REQUEST_TIMEOUT
    write_timeout = WRITE_TIMEOUT
    _request_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._request_timer = self.loop.call_later(self.request_timeout, self._request_too_slow)

    def data_received(self, data: bytes) -> None:
        if self._request_timer is None and self.conn.their_state is h11.IDLE:
            self._request_timer = self.loop.call_later(self.request_timeout, self._request_too_slow)  # next request
        super().data_received(data)
        if self._request_timer is not None and self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._cancel("_request_timer")  # the whole request is in (or the connection is ending)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout, self._reader_too_slow)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel("_write_timer")

    def connection_lost(self, exc) -> None:
        self._cancel("_request_timer")
        self._cancel("_write_timer")
        super().connection_lost(exc)

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _request_too_slow(self) -> None:
        self._request_timer = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE or self.cycle is None or not self.cycle.response_started:
            body = _BODY % self.request_timeout
            self.transport.write(_TIMED_OUT % (len(body), body))
        self.transport.close()

    def _reader_too_slow(self) -> None:
        self._write_timer = None
        self.transport.abort()
