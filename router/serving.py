"""The transport-neutral serving layer: a request in → an engine submission → a stream of events and a final result,
used alike by the HTTP APIs (openai_api.py, anthropic_api.py, responses_api.py) and the gRPC service.

- Access: `check_key` (one or several keys; returns whose prefix cache a request uses), `check_model` (each
  transport reads the key and the model from its own wire).
- A chat run (`start_chat` → `ChatRun`): a chat prepared once (router/chat_prep.py: thinking, tier, tools,
  rendering, truncation, limits) submitted with its sampling and its thinking control (the worker's sampler counts
  reasoning, cuts it at the limit and starts the grammar where it ends); its events are ("reasoning" | "content",
  text) pieces as tokens arrive (tool-call markup held back, content ending before a stop string); `finish()`
  parses the output into a `ChatResult` (reasoning, content, tool calls, the content the stream held back, finish
  reason, usage) and records metrics and the span once.
- A completion run (`CompletionRun`): prompt ids in, tokens out, usage.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from dataclasses import dataclass, field

from expertmesh.chat.format import BuiltinChat, ChatFormat, ParsedOutput, thinking_control
from expertmesh.chat.k3 import K3Chat
from expertmesh.chat.thinking import ThinkingState
from expertmesh.router.chat_prep import PreparedChat
from expertmesh.router.decoding import StopCut, TokenDecoder, decoder_for
from expertmesh.router.engine import Engine
from expertmesh.router.errors import APIError, as_api_error
from expertmesh.router.prefix_scope import PrefixScope
from expertmesh.router.request import Request
from expertmesh.router.tracing import RequestSpan
from expertmesh.wire.sampling_params import SamplingParams


# ----------------------------------------------------------------------------------------------- access
def api_keys(expected: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The keys a deployment accepts (one, several — `--api-key-file`, one a line — or none: anyone)."""
    return () if expected is None else (expected,) if isinstance(expected, str) else tuple(expected)


def check_key(expected: str | tuple[str, ...] | None, given: str | None) -> str:
    """Constant-time API-key check against every configured key (the key never reaches logs or errors); no key
    configured: anyone. Returns the request's tenant (router/prefix_scope.py): its key when keys are configured,
    "" (the one tenant) when none is."""
    keys = api_keys(expected)
    presented = (given or "").encode()
    if keys and not sum(hmac.compare_digest(presented, key.encode()) for key in keys):
        raise APIError("invalid or missing API key", code="invalid_api_key", kind="authentication")
    return (given or "") if keys else ""


def check_model(served: str, asked: str | None) -> None:
    """`asked` None: the request names no model (optional there), which means the served one."""
    if asked is not None and asked != served:
        raise APIError(
            f"model {asked!r} not found; this router serves {served!r}",
            param="model",
            code="model_not_found",
            kind="not_found",
        )


# ----------------------------------------------------------------------------------------------- requests
async def request_tokens(req: Request):
    """Async iteration over a request's tokens, woken by the engine thread; raises the request's error."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    req.notify = lambda: loop.call_soon_threadsafe(wake.set)
    while True:
        events = req.drain()
        for kind, value in events:
            if kind == "token":
                yield value
            elif kind == "error":
                raise value
            else:
                return
        if not events:
            await wake.wait()
            wake.clear()


def cancel_when_gone(is_disconnected, engine: Engine, req: Request) -> asyncio.Task:
    """Cancel `req` (freeing its batch slot and KV) once `is_disconnected()` (a coroutine function: the client went
    away) says so; the caller cancels the returned task when the request is over."""

    async def watch():
        while not req.done:
            if await is_disconnected():
                engine.cancel(req)
                return
            await asyncio.sleep(0.25)

    return asyncio.get_running_loop().create_task(watch())


def submit(engine: Engine, prompt: list[int], params: SamplingParams, span: RequestSpan, **kw) -> Request:
    """engine.submit inside the request's span; a refusal ends the span and is raised as an APIError."""
    try:
        with span.current():
            return engine.submit(prompt, params, **kw)
    except Exception as e:
        span.finish(input_tokens=len(prompt), output_tokens=0, finish_reason=None, error=e)
        raise as_api_error(e) from e


# ----------------------------------------------------------------------------------------------- chat
@dataclass
class ChatRequest:
    """A chat request as every API ends up asking it: the chat prepared once (prompt, thinking, tools, limits:
    router/chat_prep.py) and how to sample. `sampling`: further SamplingParams fields (top_k, min_p, penalties,
    logit_bias, logprobs). `grammar` (router/constraints.py) applies to the answer: after the end-of-thinking marker
    when generation starts in the reasoning section."""

    chat: PreparedChat
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    sampling: dict = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    grammar: str | None = None
    api: str = "openai"
    ignore_eos: bool = False  # generate to max_tokens: the format's stop tokens do not end the answer
    scope: PrefixScope = PrefixScope()  # whom its cached prompt prefixes are shared with


@dataclass
class Usage:
    prompt: int
    completion: int
    cached: int
    reasoning: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion


@dataclass
class ChatResult:
    """A chat run's answer, parsed: `unsent` is the content the stream held back (a malformed tool call, kept as
    text) that a streaming transport still owes its client."""

    parsed: ParsedOutput
    finish_reason: str  # stop | length | tool_calls
    stop_hit: str | None  # the stop string that ended the content
    usage: Usage
    unsent: str = ""

    @property
    def reasoning(self) -> str:
        return self.parsed.reasoning

    @property
    def content(self) -> str:
        return self.parsed.content

    @property
    def tool_calls(self) -> list:
        return self.parsed.tool_calls


class ChatRun:
    def __init__(self, engine: Engine, fmt: ChatFormat, request: ChatRequest):
        self.engine, self.fmt, self.request = engine, fmt, request
        chat = request.chat
        self.prompt, self.phase = chat.rendered.ids, chat.rendered.phase
        self.thinking, self.tools = chat.thinking, chat.tools
        self.control = thinking_control(fmt.markers, self.phase, chat.reasoning_limit)
        self.req: Request | None = None
        self.consumed = 0  # generated tokens `events()` has decoded so far
        self.sent = ""  # content the events gave out
        self.stop_hit: str | None = None
        self.salt = uuid.uuid4().hex[:8]
        self.span: RequestSpan | None = None
        self._result: ChatResult | None = None

    @property
    def tier(self) -> str:
        return self.thinking.tier

    def start(self, params: SamplingParams) -> None:
        t = self.thinking
        self.span = RequestSpan(
            "chat",
            self.engine.model_name,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            api=self.request.api,
            tier=t.tier if t.on else None,
            auto_tier=t.auto,
        )
        images = self.request.chat.images
        self.req = submit(
            self.engine,
            self.prompt,
            params,
            self.span,
            tools_offered=bool(self.tools),
            scope=self.request.scope,
            **({"images": images} if images else {}),
        )

    def fail(self, error: Exception) -> APIError:
        """End the span with `error`; what the client is told of it."""
        if self.span is not None:
            self.span.finish(
                input_tokens=len(self.prompt),
                output_tokens=len(self.req.output) if self.req else 0,
                finish_reason=None,
                error=error,
            )
        return as_api_error(error)

    def close(self) -> None:
        """The client is done with the run (a stream ended or broke off): cancel what is still generating."""
        if self.req is not None and not self.req.done:
            self.engine.cancel(self.req)

    def _pieces(self, decoder: TokenDecoder, cut: StopCut, token: int | None) -> list[tuple[str, str]]:
        """The events of one token (None: the end), through the stop strings; a match cancels the request."""
        raw = decoder.flush() if token is None else [] if decoder.done else decoder.feed(token)
        out = [piece for ev in raw for piece in cut.feed(*ev)]
        if cut.hit is not None and self.stop_hit is None:
            self.stop_hit = cut.hit
            self.engine.cancel(self.req)
        elif token is None:
            out += cut.flush()
        self.sent += "".join(text for kind, text in out if kind == "content")
        return out

    def _decoders(self) -> tuple[TokenDecoder, StopCut]:
        return decoder_for(self.fmt, self.phase, self.salt, self.tools), StopCut(self.request.stop)

    async def events(self):
        """Yield ("reasoning"|"content", text) as tokens arrive; tool-call markup is held back; content ends
        before the first stop string."""
        decoder, cut = self._decoders()
        async for token in request_tokens(self.req):
            self.consumed += 1
            for ev in self._pieces(decoder, cut, token):
                yield ev
            if self.stop_hit is not None:
                return
        for ev in self._pieces(decoder, cut, None):
            yield ev

    def events_sync(self, timeout: float | None = None):
        """The same events for a blocking caller (the gRPC servicer)."""
        decoder, cut = self._decoders()
        for token in self.req.stream(timeout):
            self.consumed += 1
            yield from self._pieces(decoder, cut, token)
            if self.stop_hit is not None:
                return
        yield from self._pieces(decoder, cut, None)

    async def complete(self, is_disconnected=None) -> ChatResult:
        """The whole answer of an unstreamed request (cancelled once `is_disconnected()` says the client went
        away), or the APIError it failed with."""
        watcher = cancel_when_gone(is_disconnected, self.engine, self.req) if is_disconnected else None
        try:
            async for _ in self.events():
                pass
        except Exception as e:
            raise self.fail(e) from e
        finally:
            if watcher is not None:
                watcher.cancel()
        return self.finish()

    def finish(self) -> ChatResult:
        """The parsed answer, once generation is over; counts the reasoning tokens and ends the span (once)."""
        if self._result is not None:
            return self._result
        parsed = self.fmt.parse_output(self.req.output, phase=self.phase, salt=self.salt, tools=self.tools)
        if self.stop_hit is not None:  # the answer ends before the stop string; nothing after counts
            at = parsed.content.find(self.stop_hit)
            parsed.content = parsed.content[:at] if at >= 0 else parsed.content
            parsed.tool_calls = []
        # after a stop string, only the tokens up to the one completing it count: more may have come before the
        # cancel took effect (a verify step's accepted run, or a step in flight)
        out = self.req.output if self.stop_hit is None else self.req.output[: self.consumed]
        self.req.awaiting_tool = bool(parsed.tool_calls)  # its cached prefix is kept warm longest
        reason = (
            "stop"
            if self.stop_hit is not None
            else "tool_calls"
            if parsed.tool_calls
            else "stop"
            if out and out[-1] in self.fmt.markers.stop
            else "length"
        )
        counted = ThinkingState(self.control)  # the sampler's count, replayed over the tokens it gave
        for t in out:
            counted.observe(t)
        reasoning = counted.reasoning_tokens
        usage = Usage(len(self.prompt), len(out), self.req.cached_tokens, reasoning)
        unsent = parsed.content[len(self.sent) :] if parsed.content.startswith(self.sent) else ""
        self._result = ChatResult(parsed, reason, self.stop_hit, usage, unsent)
        self.engine.metrics.reasoning_tokens.inc(reasoning)
        if self.span is not None:
            self.span.finish(
                input_tokens=usage.prompt,
                output_tokens=usage.completion,
                finish_reason=reason,
                reasoning_tokens=reasoning,
                cached_tokens=usage.cached,
                req=self.req,
            )
        return self._result


def start_chat(engine: Engine, fmt: ChatFormat, request: ChatRequest) -> ChatRun:
    """Submit a chat request, its grammar after the thinking section."""
    if request.chat.images and not isinstance(fmt, (BuiltinChat, K3Chat)):  # the formats that render images
        raise APIError(
            "messages: image input needs the built-in or Kimi K3 chat format (a checkpoint's own chat template "
            "does not render images yet)",
            param="messages",
        )
    run = ChatRun(engine, fmt, request)
    run.start(
        SamplingParams(
            max_tokens=request.chat.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop_token_ids=() if request.ignore_eos else fmt.markers.stop,
            **request.sampling,
            grammar=request.grammar,
            thinking=run.control,
        )
    )
    return run


async def after_prefill(req: Request) -> None:
    """Wait until `req`'s prompt is computed (its first token, or its end): its prefix is then in the cache."""
    while req.first_token_at is None and not req.done:
        await asyncio.sleep(0.005)


async def start_samples(start, n: int, seed: int | None) -> list:
    """`n` parallel samples of one request: `start(seed)` submits one. The first is submitted alone; once its
    prompt is prefilled the others follow, starting from the prompt's cached prefix (its KV pages shared, only
    the tail past the last cached chunk recomputed). Each has its own seeded generator: seed + i, or each a fresh
    random seed when the request sets none."""
    runs = [start(seed)]
    try:
        if n > 1:
            await after_prefill(runs[0].req)
            for i in range(1, n):
                runs.append(start(None if seed is None else seed + i))
        return runs
    except BaseException:
        for run in runs:
            run.close()
        raise


# ----------------------------------------------------------------------------------------------- completions
class CompletionRun:
    """A text completion: prompt ids submitted as they are, its tokens as they arrive."""

    def __init__(
        self,
        engine: Engine,
        prompt: list[int],
        params: SamplingParams,
        *,
        api: str = "openai",
        model: str | None = None,
        **kw,
    ):
        self.engine, self.prompt, self.params = engine, prompt, params
        self.span = RequestSpan(
            "text_completion",
            model or engine.model_name,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            api=api,
        )
        self.req = submit(engine, prompt, params, self.span, **kw)

    def tokens(self):
        """The tokens as they arrive (async); raises the request's error."""
        return request_tokens(self.req)

    def usage(self) -> Usage:
        return Usage(len(self.prompt), len(self.req.output), self.req.cached_tokens)

    def finish(self, finish_reason: str | None, error: Exception | None = None) -> APIError | None:
        """End the span; with `error`, what the client is told of it."""
        self.span.finish(
            input_tokens=len(self.prompt),
            output_tokens=len(self.req.output),
            finish_reason=None if error else finish_reason,
            cached_tokens=self.req.cached_tokens,
            error=error,
            req=self.req,
        )
        return as_api_error(error) if error is not None else None

    def close(self) -> None:
        if not self.req.done:
            self.engine.cancel(self.req)
