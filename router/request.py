"""A request as the engine sees it (prompt, sampling, its stream of events, runtime state), its log-prob
entries, and the errors the engine answers with (each maps to one HTTP / gRPC status in the API layers)."""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from expertmesh.router.kv import PrefixHasher
from expertmesh.router.prepared_image import hash_view
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import TokenLogprobs


class RequestError(ValueError):
    """Bad request (→ 400 / INVALID_ARGUMENT), naming the field."""


class ContextLengthExceeded(RequestError):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context (OpenAI's
    `context_length_exceeded`); carries the counts."""

    def __init__(self, message: str, *, prompt_tokens: int, max_tokens: int, context: int, param: str):
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.context, self.param = prompt_tokens, max_tokens, context, param


class ExpertsUnavailable(RuntimeError):
    """Some chosen expert has no live replica (→ UNAVAILABLE / HTTP 503, naming the experts)."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound (→ 429 / RESOURCE_EXHAUSTED)."""


class EngineClosed(RuntimeError):
    pass


@dataclass
class TokenLogprob:
    """One token's log-probability under the model (before temperature / top-k / top-p) and its position's top
    alternatives, most likely first."""

    token: int
    logprob: float | None  # None: a token forced by the server (thinking budget) outside `top`
    top: list[tuple[int, float]]

    @staticmethod
    def entries(run: TokenLogprobs) -> list[TokenLogprob]:
        return [
            TokenLogprob(t, lp, list(zip(ids, lps)))
            for t, lp, ids, lps in zip(
                run.token_ids.tolist(), run.logprobs.tolist(), run.top_ids.tolist(), run.top_logprobs.tolist()
            )
        ]

    def forced(self, token: int) -> TokenLogprob:
        """The entry for `token` fed instead of this sampled one (same position, same alternatives)."""
        return TokenLogprob(token, dict(self.top).get(token), self.top)


@dataclass(eq=False)  # a request is itself: `in running`, `remove` compare identity, not prompts
class Request:
    prompt: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    # called with each sampled token; may return a different token to force (thinking budgets)
    token_filter: Callable[[Request, int], int] | None = None
    # runtime state
    worker: int = -1
    seq_id: str = ""
    computed: int = 0  # tokens of prompt + output already fed to the model
    reserved: int = 0  # tokens of KV reserved on its worker (grows as it decodes)
    cached_tokens: int = 0
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    arrived: float = field(default_factory=time.monotonic)
    queued_at: float = field(default_factory=time.monotonic)  # entered the waiting queue (again, after a failover)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    events: queue.Queue = field(default_factory=queue.Queue)  # ("token", id) / ("done", None)
    cancelled: bool = False
    notify: Callable[[], None] | None = None  # called after each event (wakes an async consumer)
    trace_ctx: object | None = None  # OpenTelemetry context of the request's root span
    queue_span: object | None = None
    hasher: PrefixHasher | None = None  # hash chain of tokens fed so far (prefix-cache keys)
    cache_scope: bytes = b""  # whom its prefixes are shared with (router/prefix_scope.py; b"": everyone)
    last_key: str | None = None  # the prefix key of the last chunk boundary it reached (or hit)
    held_mark: int = 0  # speculation: a chunk boundary a verified run crossed, its state held by the worker to save
    # what session-aware eviction reads (router/eviction.py), set by the API layer
    tools_offered: bool = False  # the request carried tool definitions (an agent's turn)
    awaiting_tool: bool = False  # it ended with tool calls: the client will be back with results
    # params.prompt_logprobs: position (1..len(prompt)-1) → entry; params.logprobs: one entry per output token,
    # set before the token's event
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    images: list = field(default_factory=list)  # (position, router.images.PreparedImage) of the prompt's images
    hash_prompt: list[int] | None = None  # the prompt as the prefix cache hashes it (images by their pixels)
    # its prefix-cache keys (KVManager.prefix_keys of hash_prompt in cache_scope), hashed once: the scheduler
    # looks a waiting prompt up on every pass
    prompt_keys: list[tuple[int, str]] | None = field(default=None, repr=False)
    # speculation (router/step_calls.py): drafts its worker verified, how many were accepted, in how many steps
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0

    def __post_init__(self) -> None:
        if self.hash_prompt is None:
            self.hash_prompt = hash_view(self.prompt, self.images)

    def _emit(self, kind: str, value) -> None:
        self.events.put((kind, value))
        if self.notify is not None:
            self.notify()

    def drain(self) -> list[tuple[str, object]]:
        """Events so far, without blocking."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def hash_tokens(self) -> list[int]:
        """prompt + output as the prefix-cache keys read them."""
        return self.hash_prompt + self.output

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def stream(self, timeout: float | None = None):
        """Yield tokens as they come; raises the request's error if it failed."""
        while True:
            kind, value = self.events.get(timeout=timeout)
            if kind == "token":
                yield value
            elif kind == "error":
                raise value
            else:
                return

    def wait(self, timeout: float | None = None) -> Request:
        for _ in self.stream(timeout):
            pass
        return self
