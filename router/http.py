"""The router's HTTP app: the routes of router/openai_api.py, anthropic_api.py and responses_api.py, model listing,
health, load and metrics; the error handlers; the body-size limit; the uvicorn server.

Errors come back in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` — Anthropic's
`{"type": "error", "error": {"type", "message"}}` on its paths — with the status router/errors.py's table gives their
kind: 400 for a bad body (naming the field), 401 for a missing or wrong API key (before anything of the body is
judged), 404 for an unknown model, 413 for a body over the limit, 429 when the queue is full, 503 when the needed
experts or workers are unavailable.
"""

from __future__ import annotations

import json
import ssl
import threading
import time

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from expertmesh.chat.format import BuiltinChat, ChatFormat
from expertmesh.chat.thinking import ThinkingBudgets, default_budgets
from expertmesh.router import anthropic_api, openai_api, responses_api
from expertmesh.router.dependencies import Served, given_key, served
from expertmesh.router.engine import Engine
from expertmesh.router.errors import APIError, as_api_error
from expertmesh.router.http_timeouts import REQUEST_TIMEOUT, WRITE_TIMEOUT, deadline_protocol
from expertmesh.router.image_decode import ImageDecoder
from expertmesh.router.response_store import ReasoningMemory, ResponseStore, default_replica
from expertmesh.router.serving import check_key

MAX_BODY_BYTES = 4 * 2**20
ANTHROPIC_PATHS = "/v1/messages"


class BodyLimit:
    """Pure ASGI middleware bounding request bodies, declared (Content-Length) or streamed (chunked): past the
    limit the app stops receiving and the client gets 413. (Pure ASGI, not BaseHTTPMiddleware, so that client
    disconnects still reach the handlers.)"""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _refuse(self, send, size: str) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"request body of {size} bytes exceeds the limit of {self.limit}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "body_too_large",
                }
            }
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
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
                    return {"type": "http.disconnect"}  # stop reading: the app gives up on the body
            return message

        async def guarded_send(message):
            if state["too_big"] and not state["started"]:
                return  # our 413 replaces whatever the app answers
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


def error_response(request: Request, error: APIError) -> JSONResponse:
    """`error` in the shape of the API the request was for."""
    anthropic = request.url.path.startswith(ANTHROPIC_PATHS)
    return JSONResponse(status_code=error.status, content=error.anthropic_body() if anthropic else error.openai_body())


def authorized(request: Request) -> bool:
    """Before a body is judged: an unauthenticated client learns nothing of the schema (401 first)."""
    try:
        check_key(
            served(request).api_key, given_key(request.headers.get("x-api-key"), request.headers.get("authorization"))
        )
    except APIError:
        return False
    return True


def unauthorized(request: Request) -> JSONResponse:
    return error_response(
        request, APIError("invalid or missing API key", code="invalid_api_key", kind="authentication")
    )


async def on_api_error(request: Request, e: APIError) -> JSONResponse:
    return error_response(request, e)


async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """The framework's own refusals (no such route, wrong method, a body it could not read), in the API's shape."""
    if e.status_code == 400 and not authorized(request):
        return unauthorized(request)
    detail = str(e.detail)
    if e.status_code == 400 and "parsing the body" in detail:
        detail = "body: not valid JSON (it could not be decoded: invalid UTF-8, nesting too deep or a number too large)"
    elif e.status_code == 404:
        detail = f"{request.method} {request.url.path}: no such endpoint"
    elif e.status_code == 405:
        detail = f"{request.method} {request.url.path}: method not allowed"
    return error_response(request, APIError.of_status(e.status_code, detail))


async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    """A body that does not fit its schema: a 400 naming the first field wrong (401 first without the key)."""
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
    return error_response(request, APIError(f"{field or 'body'}: {err.get('msg')}", param=field))


async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
    """Anything else a handler raised: a 500 in the API's shape (the server logs the exception)."""
    return error_response(request, as_api_error(e))


async def health(s: Served = Depends(served)):
    engine = s.engine
    down_experts, down_attention = engine.experts_down, sorted(engine.attention_down)
    status = "ok" if not down_experts and not down_attention else "degraded"
    waiting = engine.num_waiting()
    return {
        "status": status,
        "model": s.name,
        "replica": s.store.replica,  # the name in this replica's response ids (the endpoint picker routes by it)
        "running": engine.num_running(),
        "waiting": waiting,
        "shedding": waiting >= engine.config.max_waiting,  # a new request would be refused (429)
        "expert_workers_down": down_experts,
        "attention_workers_down": down_attention,
    }


async def metrics(s: Served = Depends(served)):
    return Response(s.engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def models(s: Served = Depends(served)):
    return {
        "object": "list",
        "data": [
            {
                "id": s.name,
                "object": "model",
                "created": s.created,
                "owned_by": "expertmesh",
                "max_model_len": s.engine.cfg.max_context,
            }
        ],
    }


async def load(s: Served = Depends(served)):
    """Per-(layer, expert) token counts since start: what the operator reads to rebalance."""
    engine = s.engine
    return {
        "model": s.name,
        "moe_layers": engine.plan.layers,  # the MTP layers too where speculation places them
        "tokens": engine.load_stats(),
        "plan_hash": getattr(engine, "plan_hash", None),
    }


def build_app(
    engine: Engine,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    chat: ChatFormat | None = None,
    response_store=None,
    reasoning_memory: bool = True,
    image_decoder: ImageDecoder | None = None,
    thinking_budgets: ThinkingBudgets | None = None,
) -> FastAPI:
    """`chat`: the checkpoint's tokenizer and chat format (`expertmesh.chat.load.load_chat(dir)`); default: the
    built-in format over the byte tokenizer. `response_store`: the Responses API's stored responses
    (router/response_store.ResponseStore; default: this replica's, bounded). `reasoning_memory`: give chat
    histories that drop the reasoning of answers generated here their reasoning back. `image_decoder`: the pool
    images are decoded in (default: two decoder processes, started with the first image). `thinking_budgets`: the
    reasoning-token limits of the thinking tiers (default: the model preset's, chat.thinking.default_budgets)."""
    try:  # our own GenAI spans are the API's spans: turn FastAPI's built-in HTTP telemetry off
        app = FastAPI(
            title="expertmesh router",
            version="0.1.0",
            telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
        )
    except TypeError:  # FastAPI releases without built-in telemetry
        app = FastAPI(title="expertmesh router", version="0.1.0")
    chat = chat or BuiltinChat()
    store = response_store if response_store is not None else ResponseStore(replica=default_replica())
    app.state.served = Served(
        engine,
        chat,
        model_name or engine.model_name,
        api_key,
        store,
        ReasoningMemory() if reasoning_memory else None,
        int(time.time()),
        image_decoder or (ImageDecoder() if engine.cfg.vision is not None else None),
        thinking_budgets or default_budgets(engine.cfg.name),
    )
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    app.get("/v1/models")(models)
    app.get("/v1/load")(load)
    for api in (openai_api, anthropic_api, responses_api):
        app.include_router(api.router)
    return app


def serve_http(
    app: FastAPI,
    host: str,
    port: int,
    tls=None,
    request_timeout: float = REQUEST_TIMEOUT,
    write_timeout: float = WRITE_TIMEOUT,
):
    """Run uvicorn in a background thread; returns the server (call `.should_exit = True` to stop).
    `tls` (expertmesh.runtime.tls.ServerTLS) serves HTTPS, requiring client certificates when it has a client CA.
    Slow clients are cut off (router/http_timeouts.py): a request must arrive within `request_timeout` seconds, and
    a client that stops reading for `write_timeout` seconds is disconnected."""
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
