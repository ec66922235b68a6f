"""The one error type of the public APIs and the one table that says what it becomes on each wire.

An `APIError` carries its kind, a message naming what is wrong, the field it is about (`param`, dotted as the
API spells it: `messages[1].content[2]`, `tools.0.function.parameters`) and a machine-readable `code`
(`context_length_exceeded`, `queue_full`, ...). `KINDS` maps each kind to its HTTP status, OpenAI error type,
Anthropic error type and gRPC status code; `as_api_error` turns what the engine and the chat format raise into
one. Plain data: the HTTP app and the gRPC service shape the bodies and statuses from it.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from expertmesh.chat.format import ChatError
from expertmesh.router.request import (
    ContextLengthExceeded,
    EngineClosed,
    ExpertsUnavailable,
    QueueFull,
    RequestError,
)


@dataclass(frozen=True)
class Kind:
    status: int  # HTTP
    openai: str  # OpenAI error `type`
    anthropic: str  # Anthropic error `type`
    grpc: str  # grpc.StatusCode name


KINDS: dict[str, Kind] = {
    "invalid_request": Kind(400, "invalid_request_error", "invalid_request_error", "INVALID_ARGUMENT"),
    "authentication": Kind(401, "authentication_error", "authentication_error", "UNAUTHENTICATED"),
    "not_found": Kind(404, "invalid_request_error", "not_found_error", "NOT_FOUND"),
    "method_not_allowed": Kind(405, "invalid_request_error", "api_error", "UNIMPLEMENTED"),
    "request_too_large": Kind(413, "invalid_request_error", "request_too_large", "INVALID_ARGUMENT"),
    "rate_limit": Kind(429, "rate_limit_error", "rate_limit_error", "RESOURCE_EXHAUSTED"),
    "internal": Kind(500, "server_error", "api_error", "INTERNAL"),
    "unavailable": Kind(503, "service_unavailable", "overloaded_error", "UNAVAILABLE"),
    "deadline": Kind(504, "timeout_error", "api_error", "DEADLINE_EXCEEDED"),
}
_BY_STATUS = {k.status: name for name, k in KINDS.items()}


class APIError(Exception):
    """A refusal or failure a client sees: `kind` (a key of KINDS), the message, the field and the code."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request"
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.kind = message, param, code, kind
        self._status: int | None = None

    @classmethod
    def of_status(cls, status: int, message: str) -> APIError:
        """The error for an HTTP status the web framework answered with (404 no such route, 405, ...): its kind
        from the table, the status kept as it was."""
        e = cls(message, kind=_BY_STATUS.get(status, "invalid_request" if status < 500 else "internal"))
        e._status = status
        return e

    @property
    def status(self) -> int:
        return self._status or KINDS[self.kind].status

    @property
    def type(self) -> str:
        return KINDS[self.kind].openai

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": KINDS[self.kind].anthropic, "message": self.message}}

    @property
    def grpc_code(self) -> str:
        return KINDS[self.kind].grpc


def leading_field(message: str) -> str | None:
    """The field a ValueError's message starts with (`prompt: …`, `max_tokens=0: …`): the engine's RequestError
    and the chat format's ChatError name their field this way and carry no attribute for it."""
    head = message.split(":", 1)[0].split("=", 1)[0].strip()
    return head if head != message.strip() and head and " " not in head else None


def as_api_error(e: Exception) -> APIError:
    """What a client is told of `e`: the engine's and the chat format's errors by their kind, any other ValueError
    as a bad request (the project's errors a user can cause), the rest as an internal error."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthExceeded):
        return APIError(str(e), param=e.param, code="context_length_exceeded")
    if isinstance(e, (RequestError, ChatError, ValueError)):
        return APIError(str(e), param=getattr(e, "param", None) or leading_field(str(e)))
    if isinstance(e, QueueFull):
        return APIError(str(e), code="queue_full", kind="rate_limit")
    if isinstance(e, (ExpertsUnavailable, EngineClosed, ConnectionError)):
        return APIError(str(e), code="unavailable", kind="unavailable")
    if isinstance(e, queue.Empty):  # Request.stream(timeout) ran past the client's deadline
        return APIError("deadline exceeded while generating", kind="deadline")
    return APIError(f"internal error: {type(e).__name__}: {e}", kind="internal")
