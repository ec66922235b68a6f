"""The router's HTTP front: OpenAI-compatible completions, model listing, health and metrics.

Errors come back in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with the status that
fits: 400 for a bad body (naming the field), 404 for an unknown model, 429 when the queue is full, 503 when
the needed experts or workers are unavailable.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Annotated, Literal

from fastapi import FastAPI, Header, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from expertmesh.chat import BuiltinChat, ChatFormat
from expertmesh.router.engine import (
    ContextLengthExceeded,
    Engine,
    EngineClosed,
    ExpertsUnavailable,
    QueueFull,
    Request,
    RequestError,
    TokenLogprob,
)
from expertmesh.router.http_timeouts import REQUEST_TIMEOUT, WRITE_TIMEOUT, deadline_protocol
from expertmesh.sampling_params import MAX_LOGPROBS, SamplingParams
from expertmesh.tokenizer import AnyTokenizer

MAX_BODY_BYTES = 4 * 2 ** 20


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.type, "param": self.param, "code": self.code}})


class AcceptedNoOps(BaseModel):
    """Parameters accepted although they change nothing here, each for a stated reason. Request bodies forbid any
    other unknown field (a 400 naming it, never silently ignored). Numbers must be finite: NaN / inf are a 400
    saying so (not a misleading range message)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    user: str | None = None                  # an end-user id for a provider's abuse monitoring: no per-user state
    metadata: dict | None = None             # tags a provider stores with a request: nothing is stored here
    store: Literal[False] | None = None      # store: false is what this server does anyway
    parallel_tool_calls: Literal[True] | None = None   # several calls in one turn are parsed and returned
    service_tier: Literal["auto", "default", "standard_only"] | None = None


TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,12}$")]


class SamplingFields(AcceptedNoOps):
    """Sampling parameters beyond OpenAI's core ones (vLLM's names), shared by completions and chat; the vocabulary
    and everything else is checked with the rest (expertmesh.sampling.check_sampling), a 400 naming the field."""
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100, le=100)]] | None = None

    def sampling_kwargs(self) -> dict:
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        return {"top_k": self.top_k, "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "logit_bias": bias}


class CompletionBody(SamplingFields):
    model: str
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(default=1, ge=1, le=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v


def error_from_exception(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    from expertmesh.chat import ChatError
    if isinstance(e, ChatError):
        return APIError(400, str(e), param=str(e).split(":", 1)[0] if ":" in str(e) else None)
    if isinstance(e, ContextLengthExceeded):
        return APIError(400, str(e), param=e.param, code="context_length_exceeded")
    if isinstance(e, RequestError):
        param = str(e).split(":", 1)[0].split("=", 1)[0] if ":" in str(e) or "=" in str(e) else None
        return APIError(400, str(e), param=param)
    if isinstance(e, QueueFull):
        return APIError(429, str(e), "rate_limit_error", code="queue_full")
    if isinstance(e, (ExpertsUnavailable, EngineClosed, ConnectionError)):
        return APIError(503, str(e), "service_unavailable", code="unavailable")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


class BodyLimit:
    """Pure ASGI middleware bounding request bodies, declared (Content-Length) or streamed (chunked): past the
    limit the app stops receiving and the client gets 413. (Pure ASGI, not BaseHTTPMiddleware, so that client
    disconnects still reach the handlers.)"""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _refuse(self, send, size: str) -> None:
        body = json.dumps({"error": {"message": f"request body of {size} bytes exceeds the limit of {self.limit}",
                                     "type": "invalid_request_error", "param": None, "code": "body_too_large"}})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body.encode()})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, declared.decode())
        state = {"total": 0, "too_big": False, "started": False}

        async def limited_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["total"] += len(message.get("body", b""))
                if state["total"] > self.limit:
                    state["too_big"] = True
                    return {"type": "http.disconnect"}      # stop reading: the app gives up on the body
            return message

        async def guarded_send(message):
            if state["too_big"] and not state["started"]:
                return                                      # our 413 replaces whatever the app answers
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not state["too_big"]:
                raise
        if state["too_big"] and not state["started"]:
            await self._refuse(send, f"more than {state['total']}")


def cancel_on_disconnect(http_request: HTTPRequest, engine: Engine, req: Request) -> "asyncio.Task":
    """A non-streaming request whose client went away is cancelled, freeing its batch slot and KV."""
    async def watch():
        while not req.done:
            if await http_request.is_disconnected():
                engine.cancel(req)
                return
            await asyncio.sleep(0.25)
    return asyncio.get_running_loop().create_task(watch())


class StopMatcher:
    """Incremental detokenization (never half a character) with stop-string detection."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.decoder = None        # the tokenizer's stream decoder, made with the first token
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def feed(self, token: int, tok: AnyTokenizer) -> str:
        """Add a token; returns the newly safe-to-emit text (held back while it could start a stop string)."""
        if self.decoder is None:
            self.decoder = tok.stream_decoder()
        self.text += self.decoder.feed(token)
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                self.text = self.text[:i]
                self.stopped = True
        if self.stopped:
            out = self.text[self.emitted:]
            self.emitted = len(self.text)
            return out
        hold = max((len(s) - 1 for s in self.stops), default=0)
        safe = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted:safe]
        self.emitted = safe
        return out

    def flush(self) -> str:
        if not self.stopped and self.decoder is not None:
            self.text += self.decoder.flush()
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built piece by piece (a stream sends one per chunk): token
    strings, their log-probabilities (None for the prompt's first token, which nothing predicts), top
    alternatives (the N most likely plus the chosen token, as OpenAI documents) and character offsets of the
    token strings, counted from the start of the returned text."""

    def __init__(self, tok: AnyTokenizer, offset: int = 0):
        self.tok, self.offset = tok, offset

    def _text(self, token: int) -> str:
        return self.tok.decode([token], skip_special=False)

    def block(self, tokens: list[int], entries: list[TokenLogprob | None]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, e in zip(tokens, entries):
            text = self._text(token)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            out["token_logprobs"].append(None if e is None else e.logprob)
            if e is None:
                out["top_logprobs"].append(None)
                continue
            top = {}
            for t, lp in e.top:
                top.setdefault(self._text(t), lp)      # two ids with one string: the likelier one's value
            if e.logprob is not None:
                top.setdefault(text, e.logprob)
            out["top_logprobs"].append(top)
        return out

    @staticmethod
    def join(a: dict, b: dict) -> dict:
        return {k: a[k] + b[k] for k in a}


async def iterate_events(req: Request):
    """Async iteration over a request's events, woken by the engine thread."""
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


def build_app(engine: Engine, *, model_name: str | None = None, api_key: str | None = None,
              chat: ChatFormat | None = None, response_store=None, reasoning_memory: bool = True) -> FastAPI:
    """`chat`: the checkpoint's tokenizer and chat format (`expertmesh.chat.load_chat(dir)`); default: the
    built-in format over the byte tokenizer. `response_store`: the Responses API's stored responses
    (router/response_store.ResponseStore; default: this replica's, bounded). `reasoning_memory`: give chat
    histories that drop the reasoning of answers generated here their reasoning back."""
    try:   # our own GenAI spans are the API's spans: turn FastAPI's built-in HTTP telemetry off
        app = FastAPI(title="expertmesh router", version="0.1.0",
                      telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})
    except TypeError:  # FastAPI releases without built-in telemetry
        app = FastAPI(title="expertmesh router", version="0.1.0")
    chat = chat or BuiltinChat()
    tok = chat.tokenizer
    name = model_name or engine.model_name
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    def _shaped(request: HTTPRequest, error: APIError) -> APIError:
        if request.url.path.startswith("/v1/messages"):
            from expertmesh.router.chat_api import AnthropicError
            return AnthropicError(error.status, error.message, error.type, error.param, error.code)
        return error

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, e: StarletteHTTPException):
        if e.status_code == 400 and not authorized(request):
            return unauthorized(request)
        detail = str(e.detail)
        if e.status_code == 400 and "parsing the body" in detail:
            detail = ("body: not valid JSON (it could not be decoded: invalid UTF-8, nesting too deep or a "
                      "number too large)")
        elif e.status_code == 404:
            detail = f"{request.method} {request.url.path}: no such endpoint"
        elif e.status_code == 405:
            detail = f"{request.method} {request.url.path}: method not allowed"
        return _shaped(request, APIError(e.status_code, detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: HTTPRequest, e: RequestValidationError):
        if not authorized(request):
            return unauthorized(request)
        err = e.errors()[0] if e.errors() else {"loc": [], "msg": "invalid body"}
        loc = [str(x) for x in err.get("loc", []) if x != "body"]
        field = ".".join(loc) or None
        if err.get("type") == "json_invalid":
            field = None
            err = {"msg": f"not valid JSON ({(err.get('ctx') or {}).get('error', 'decode error')})"}
        elif err.get("type") == "extra_forbidden":
            err = {"msg": "not supported by this server"}
        elif err.get("type") == "model_attributes_type" and not loc:
            err = {"msg": "expected a JSON object (send it with Content-Type: application/json)"}
        error = APIError(400, f"{field or 'body'}: {err.get('msg')}", param=field)
        if request.url.path.startswith("/v1/messages"):
            from expertmesh.router.chat_api import AnthropicError
            error = AnthropicError(400, error.message, param=field)
        return error.response()

    def key_ok(authorization: str | None) -> bool:
        """Constant-time API-key check (the key never reaches logs or errors); the scheme is case-insensitive
        (RFC 7235: "bearer" is "Bearer")."""
        if api_key is None:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else ""
        return hmac.compare_digest(given.encode(), api_key.encode())

    def check_key(authorization: str | None) -> None:
        if not key_ok(authorization):
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    def authorized(request: HTTPRequest) -> bool:
        """Before a body is judged: an unauthenticated client learns nothing of the schema (401 first)."""
        x_api_key = request.headers.get("x-api-key")
        return key_ok(f"Bearer {x_api_key}" if x_api_key else request.headers.get("authorization"))

    def unauthorized(request: HTTPRequest):
        return _shaped(request, APIError(401, "invalid or missing API key", "authentication_error",
                                         code="invalid_api_key")).response()

    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.get("/health")
    async def health():
        down_experts = engine.experts_down
        down_attention = sorted(engine.attention_down)
        status = "ok" if not down_experts and not down_attention else "degraded"
        return {"status": status, "model": name, "running": engine.num_running(), "waiting": engine.num_waiting(),
                "expert_workers_down": down_experts, "attention_workers_down": down_attention}

    @app.get("/metrics")
    async def metrics():
        from fastapi.responses import Response
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "expertmesh", "max_model_len": engine.cfg.max_context}]}

    @app.get("/v1/load")
    async def load():
        """Per-(layer, expert) token counts since start: what the operator reads to rebalance."""
        return {"model": name, "moe_layers": engine.cfg.moe_layers, "tokens": engine.load_stats(),
                "plan_hash": getattr(engine, "plan_hash", None)}

    def check_model(model: str) -> None:
        if model != name:
            raise APIError(404, f"model {model!r} not found; this router serves {name!r}", param="model",
                           code="model_not_found")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http_request: HTTPRequest,
                          authorization: str | None = Header(default=None)):
        check_key(authorization)
        check_model(body.model)
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
            if len(body.prompt) != 1:
                raise APIError(400, "prompt: only one prompt per request is supported", param="prompt")
            body.prompt = body.prompt[0]
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise APIError(400, "prompt: expected a non-empty string", param="prompt")
            try:
                prompt_ids = tok.encode_prompt(body.prompt)
            except ValueError as e:
                raise APIError(400, f"prompt: {e}", param="prompt")
            echo_text = body.prompt
        else:
            prompt_ids = list(body.prompt)
            if not prompt_ids:
                raise APIError(400, "prompt: expected at least one token", param="prompt")
            try:
                echo_text = tok.decode(prompt_ids) if body.echo else ""
            except ValueError as e:
                raise APIError(400, f"prompt: {e}", param="prompt")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens < 0 or (max_tokens == 0 and not body.echo):
            raise APIError(400, f"max_tokens={max_tokens}: expected a positive integer (0 only with echo: score "
                                f"the prompt)", param="max_tokens")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        # echo + logprobs scores the prompt too (vLLM's prompt_logprobs); max_tokens=0 with echo only scores
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, stop_token_ids=tuple(tok.eos_ids), logprobs=body.logprobs,
                                prompt_logprobs=prompt_logprobs, **body.sampling_kwargs())
        from expertmesh.router.tracing import RequestSpan
        span = RequestSpan("text_completion", name, max_tokens=max_tokens, temperature=body.temperature)
        try:
            with span.current():
                req = engine.submit(prompt_ids, params)
        except Exception as e:
            span.finish(input_tokens=len(prompt_ids), output_tokens=0, finish_reason=None, error=e)
            raise error_from_exception(e)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"

        def end_span(error: Exception | None = None) -> None:
            span.finish(input_tokens=len(prompt_ids), output_tokens=len(req.output),
                        finish_reason=None if error else finish_reason(), cached_tokens=req.cached_tokens,
                        error=error)
        matcher = StopMatcher(stops)

        def usage() -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(req.output),
                    "total_tokens": len(prompt_ids) + len(req.output),
                    "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}

        def finish_reason() -> str:
            return "stop" if matcher.stopped or req.finish_reason == "stop" else "length"

        def chunk(text: str, reason: str | None, logprobs: dict | None = None) -> dict:
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}]}

        lp = CompletionLogprobs(tok)
        fed = 0          # output tokens given to the matcher (a stop string ends the text, and the logprobs)

        def echo_logprobs() -> dict | None:
            if body.logprobs is None:
                return None
            return lp.block(prompt_ids, [None] + [req.prompt_logprobs.get(i) for i in range(1, len(prompt_ids))])

        def output_logprobs(start: int) -> dict | None:
            if body.logprobs is None:
                return None
            return lp.block(req.output[start:fed], req.logprobs[start:fed])

        if not body.stream:
            watcher = cancel_on_disconnect(http_request, engine, req)
            try:
                async for token in iterate_events(req):
                    fed += 1
                    matcher.feed(token, tok)
                    if matcher.stopped:
                        engine.cancel(req)
                        break
            except Exception as e:
                end_span(e)
                raise error_from_exception(e)
            finally:
                watcher.cancel()
            end_span()
            text = matcher.text if matcher.stopped else matcher.text + matcher.flush()
            logprobs = None
            if body.echo:
                text = echo_text + text
                logprobs = echo_logprobs()
            if body.logprobs is not None:
                logprobs = lp.join(logprobs, output_logprobs(0)) if logprobs else output_logprobs(0)
            out = chunk(text, finish_reason(), logprobs)
            out["usage"] = usage()
            return out

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        async def sse():
            nonlocal fed
            sent = 0       # output tokens whose logprobs went out
            echoed = not body.echo

            def echo_chunk() -> str:      # once the prompt is scored (with the first event)
                return f"data: {json.dumps(chunk(echo_text, None, echo_logprobs()))}\n\n"
            try:
                async for token in iterate_events(req):
                    if not echoed:
                        echoed = True
                        yield echo_chunk()
                    fed += 1
                    piece = matcher.feed(token, tok)
                    if piece:
                        yield f"data: {json.dumps(chunk(piece, None, output_logprobs(sent)))}\n\n"
                        sent = fed
                    if matcher.stopped:
                        engine.cancel(req)
                        break
                if not echoed:
                    yield echo_chunk()
                tail = matcher.flush()
                end_span()
                yield f"data: {json.dumps(chunk(tail, finish_reason(), output_logprobs(sent)))}\n\n"
                if include_usage:
                    final = chunk("", None)
                    final["choices"] = []
                    final["usage"] = usage()
                    yield f"data: {json.dumps(final)}\n\n"
            except Exception as e:
                end_span(e)
                err = error_from_exception(e)
                yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.type, 'code': err.code}})}\n\n"
            finally:
                if not req.done:
                    engine.cancel(req)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    from expertmesh.router.chat_api import anthropic_router, openai_router
    from expertmesh.router.response_store import ReasoningMemory, ResponseStore, default_replica
    from expertmesh.router.responses_api import responses_router
    memory = ReasoningMemory() if reasoning_memory else None
    app.include_router(openai_router(engine, chat, name, check_model, check_key, reasoning_memory=memory))
    app.include_router(anthropic_router(engine, chat, name, check_model, check_key))
    store = response_store if response_store is not None else ResponseStore(replica=default_replica())
    app.include_router(responses_router(engine, chat, name, check_model, check_key, store))
    app.state.response_store = store
    app.state.engine = engine
    app.state.tokenizer = tok
    app.state.chat = chat
    return app


def serve_http(app: FastAPI, host: str, port: int, tls=None, request_timeout: float = REQUEST_TIMEOUT,
               write_timeout: float = WRITE_TIMEOUT):
    """Run uvicorn in a background thread; returns the server (call `.should_exit = True` to stop).
    `tls` (expertmesh.tls.ServerTLS) serves HTTPS, requiring client certificates when it has a client CA.
    Slow clients are cut off (router/http_timeouts.py): a request must arrive within `request_timeout` seconds, and
    a client that stops reading for `write_timeout` seconds is disconnected."""
    import ssl
    import threading

    import uvicorn
    extra = {"http": deadline_protocol(request_timeout, write_timeout)}
    if tls is not None:
        extra.update(ssl_certfile=tls.cert, ssl_keyfile=tls.key)
        if tls.client_ca:
            extra.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, **extra)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"HTTP server on {host}:{port} did not start")
        time.sleep(0.02)
    return server, thread
