"""The router's public gRPC service (`expertmesh.v1.Router`): streaming Generate and Chat, model listing — a thin
transport over router/serving.py, the same runs and the same checks as the HTTP APIs.

Status codes come from router/errors.py's table: INVALID_ARGUMENT naming the field, UNAUTHENTICATED (metadata
`authorization: Bearer KEY` or `x-api-key`), NOT_FOUND (unknown model), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE
(experts or workers down), DEADLINE_EXCEEDED (the client's deadline passed; the request is cancelled in the engine).

Bounds (the server runs one thread per call: a client must not be able to hold them all): a request that is not a
valid message (invalid UTF-8 in a string field included) is INVALID_ARGUMENT naming the method, never INTERNAL;
`request_id`, echoed in every event, is at most 128 bytes; one connection has at most `max_streams_per_connection`
calls at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: the client queues the rest), one client address at most
`max_calls_per_client` (RESOURCE_EXHAUSTED beyond), the server at most `max_workers` (RESOURCE_EXHAUSTED beyond,
never a queue); and a stream whose client stops reading — its write blocked on flow control for `write_timeout`
seconds — is cancelled (`StreamGuard`), which frees its thread and its request's KV.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from concurrent import futures

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.chat.format import BuiltinChat, ChatFormat
from expertmesh.chat.thinking import ThinkingBudgets, default_budgets
from expertmesh.protos import chat_pb2, router_pb2, router_pb2_grpc
from expertmesh.router.chat_prep import ChatInput, ThinkingAsk, max_tokens_for, prepare_chat
from expertmesh.router.constraints import check_grammar
from expertmesh.router.engine import Engine
from expertmesh.router.errors import APIError, as_api_error, leading_field
from expertmesh.router.messages import grpc_messages, grpc_tools
from expertmesh.router.prefix_scope import PrefixScope
from expertmesh.router.serving import ChatRequest, CompletionRun, check_key, check_model, start_chat
from expertmesh.runtime.health_port import serve_health_only
from expertmesh.runtime.reflection import enable_reflection
from expertmesh.wire.sampling_params import SamplingParams, check_sampling, sampling_from_proto

CHAT_SAMPLING = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "logit_bias")
MAX_REQUEST_ID_BYTES = 128
WRITE_TIMEOUT = 60.0
log = logging.getLogger("expertmesh.router.grpc")


def abort(context, e: Exception):
    """End the call with what the client is told of `e` (context.abort raises)."""
    err = as_api_error(e)
    context.abort(grpc.StatusCode[err.grpc_code], err.message)


def client_timeout(context) -> float | None:
    """Seconds left before the client's deadline; None without one (gRPC then reports a time_remaining so large
    that a queue wait on it overflows)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 10**7 else None


def sampling(p, tokenizer, *, chat: bool) -> tuple[SamplingParams, int | None]:
    """expertmesh.v1.SamplingParams → SamplingParams (an unset field: the dataclass default; stop ids: the
    tokenizer's EOS) checked as on HTTP, naming `params.FIELD`, and the max_tokens asked for (None: unset)."""
    refused = {"logprobs": "use /v1/completions", "prompt_logprobs": "use /v1/completions"}
    if chat:
        refused |= {
            "stop_token_ids": "the chat format's end-of-turn tokens end the answer",
            "grammar_after_token": "the grammar applies to the answer, after the thinking section",
        }
    for name, why in refused.items():
        if len(p.stop_token_ids) if name == "stop_token_ids" else p.HasField(name):
            raise APIError(f"params.{name}: not supported by this gRPC API ({why})", param=f"params.{name}")
    requested = p.max_tokens if p.HasField("max_tokens") else None
    params = dataclasses.replace(
        sampling_from_proto(p), stop_token_ids=tuple(p.stop_token_ids) or tuple(tokenizer.eos_ids)
    )
    if not chat:
        params.max_tokens = max_tokens_for(requested, chat=False, param="params.max_tokens")
    try:
        check_sampling(params)
        if params.grammar is not None:  # compiled here first: a bad grammar never reaches a worker
            check_grammar(params.grammar, "grammar", tokenizer)
    except ValueError as e:
        raise APIError(f"params.{e}", param=f"params.{getattr(e, 'param', None) or leading_field(str(e))}") from None
    return params, requested


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        engine: Engine,
        api_key: str | None = None,
        chat: ChatFormat | None = None,
        budgets: ThinkingBudgets | None = None,
    ):
        self.engine = engine
        self.budgets = budgets or default_budgets(engine.cfg.name)  # reasoning-token limits of the tiers
        self.api_key = api_key
        self.chat = chat or BuiltinChat()  # the checkpoint's tokenizer and chat format
        self.tok = self.chat.tokenizer

    def _admit(self, model: str, context) -> PrefixScope:
        """The API key (x-api-key, or authorization with or without "Bearer ") and the model (empty: the served).
        Returns the request's prefix-cache scope: its key's own, as on HTTP (router/prefix_scope.py)."""
        md = dict(context.invocation_metadata())
        key = md.get("x-api-key") or md.get("authorization", "").removeprefix("Bearer ").strip()
        tenant = check_key(self.api_key, key)
        check_model(self.engine.model_name, model or None)
        return PrefixScope(tenant)

    def _prompt(self, request) -> list[int]:
        which = request.WhichOneof("prompt")
        if which is None:
            raise APIError("prompt: set text or token_ids", param="prompt")
        if which == "token_ids":
            return list(request.token_ids.ids)
        if not request.text:
            raise APIError("prompt.text: expected a non-empty string", param="prompt.text")
        try:
            return self.tok.encode_prompt(request.text)
        except ValueError as e:
            raise APIError(f"prompt.text: {e}", param="prompt.text") from None

    def Generate(self, request, context):
        try:
            scope = self._admit(request.model, context)
            if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
                raise APIError(
                    f"request_id: {len(request.request_id.encode())} bytes, more than the "
                    f"{MAX_REQUEST_ID_BYTES} allowed (it is echoed in every event)",
                    param="request_id",
                )
            prompt = self._prompt(request)
            params, _ = sampling(request.params, self.tok, chat=False)
            run = CompletionRun(
                self.engine,
                prompt,
                params,
                api="grpc",
                scope=scope,
                **({"request_id": request.request_id} if request.request_id else {}),
            )
        except Exception as e:
            abort(context, e)
        context.add_callback(run.close)
        req, index = run.req, 0
        decoder = self.tok.stream_decoder()
        try:
            for token in req.stream(timeout=client_timeout(context)):
                # a token's text is what it completes: empty while a character spans several tokens
                text = decoder.feed(token) if request.return_text else ""
                yield router_pb2.GenerateEvent(
                    request_id=req.request_id, token=router_pb2.TokenEvent(index=index, token_id=token, text=text)
                )
                index += 1
        except Exception as e:  # the engine failed the request, or the client's deadline passed
            run.close()
            abort(context, run.finish(None, e))
        run.finish(req.finish_reason)
        u = run.usage()
        yield router_pb2.GenerateEvent(
            request_id=req.request_id,
            finish=router_pb2.Finish(
                finish_reason=req.finish_reason or "stop",
                usage=router_pb2.Usage(
                    prompt_tokens=u.prompt, completion_tokens=u.completion, cached_tokens=u.cached, total_tokens=u.total
                ),
            ),
        )

    def Chat(self, request, context):
        """Streaming chat: reasoning and content deltas, structured tool calls, then usage."""
        try:
            scope = self._admit(request.model, context)
            p, max_tokens = sampling(request.params, self.tok, chat=True)
            chat = ChatInput.of_messages(
                grpc_messages(request.messages),
                thinking=ThinkingAsk(request.thinking_budget or None, disable=request.disable_thinking),
                tools=grpc_tools(request.tools),
                max_tokens=max_tokens,
                max_tokens_param="params.max_tokens",
            )
            run = start_chat(
                self.engine,
                self.chat,
                ChatRequest(
                    prepare_chat(self.chat, chat, budgets=self.budgets, context=self.engine.cfg.max_context),
                    temperature=p.temperature,
                    top_p=p.top_p,
                    seed=p.seed,
                    sampling={k: getattr(p, k) for k in CHAT_SAMPLING},
                    grammar=p.grammar,
                    api="grpc",
                    scope=scope,
                ),
            )
        except Exception as e:
            abort(context, e)
        context.add_callback(run.close)
        try:
            for kind, text in run.events_sync(timeout=client_timeout(context)):
                yield (
                    chat_pb2.ChatEvent(reasoning_delta=text)
                    if kind == "reasoning"
                    else chat_pb2.ChatEvent(content_delta=text)
                )
        except Exception as e:
            run.close()
            abort(context, run.fail(e))
        r = run.finish()
        if r.unsent:  # held-back malformed tool call, as text
            yield chat_pb2.ChatEvent(content_delta=r.unsent)
        for c in r.tool_calls:
            yield chat_pb2.ChatEvent(tool_call=chat_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments))
        u = r.usage
        yield chat_pb2.ChatEvent(
            finish=chat_pb2.ChatFinish(
                finish_reason=r.finish_reason,
                thinking_budget=run.tier if run.thinking.on else "",
                usage=chat_pb2.ChatUsage(
                    prompt_tokens=u.prompt,
                    completion_tokens=u.completion,
                    cached_tokens=u.cached,
                    reasoning_tokens=u.reasoning,
                    total_tokens=u.total,
                ),
            )
        )

    def ListModels(self, request, context):
        try:
            self._admit("", context)
        except Exception as e:
            abort(context, e)
        cfg = self.engine.cfg
        return router_pb2.ListModelsResponse(
            models=[
                router_pb2.ModelInfo(
                    id=self.engine.model_name,
                    max_context=cfg.max_context,
                    vocab_size=cfg.vocab_size,
                    owned_by="expertmesh",
                )
            ]
        )


class StreamGuard:
    """What bounds the service's calls: at most `max_per_client` at once from one client address, and no stream
    left blocked on a client that stopped reading — a stream whose last message has waited `write_timeout`
    seconds to be written (HTTP/2 flow control: the client reads nothing) is cancelled by a watchdog thread."""

    def __init__(self, write_timeout: float = WRITE_TIMEOUT, max_per_client: int = 32, tick: float = 0.5):
        self.write_timeout, self.max_per_client, self.tick = write_timeout, max_per_client, tick
        self._lock = threading.Lock()
        self._writing: dict[int, tuple[float, object]] = {}  # stream → (since when its write waits, context)
        self._clients: Counter[str] = Counter()
        self.cancelled = 0
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="grpc-write-deadline", daemon=True).start()

    @staticmethod
    def client_of(context) -> str:
        """The client's address without its port ("ipv4:10.0.0.5:41234" → "ipv4:10.0.0.5")."""
        peer = context.peer() or ""
        return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer

    def admit(self, context) -> str:
        client = self.client_of(context)
        with self._lock:
            if self._clients[client] >= self.max_per_client:
                raise APIError(
                    f"more than {self.max_per_client} calls at once from this client; retry later",
                    code="too_many_calls",
                    kind="rate_limit",
                )
            self._clients[client] += 1
        return client

    def release(self, client: str) -> None:
        with self._lock:
            self._clients[client] -= 1
            if self._clients[client] <= 0:
                del self._clients[client]

    def stream(self, context, events):
        """`events` (a servicer's generator) as the stream gRPC writes: each message yielded is being written
        until gRPC asks for the next one; past the write deadline the call is cancelled."""
        key = id(events)
        try:
            for event in events:
                with self._lock:
                    self._writing[key] = (time.monotonic(), context)
                yield event
                with self._lock:
                    self._writing.pop(key, None)
        finally:
            with self._lock:
                self._writing.pop(key, None)

    def _watch(self) -> None:
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            with self._lock:
                stalled = [(k, ctx) for k, (since, ctx) in self._writing.items() if now - since > self.write_timeout]
                for k, _ in stalled:
                    del self._writing[k]
            for _, ctx in stalled:
                self.cancelled += 1
                log.warning("gRPC stream cancelled: its client read nothing for %g s", self.write_timeout)
                ctx.cancel()

    def close(self) -> None:
        self._stop.set()


def _guarded(guard: StreamGuard, call, streaming: bool):
    """A servicer method behind the guard: the per-client bound (and, streaming, the write deadline)."""

    def unary(request, context):
        try:
            client = guard.admit(context)
        except APIError as e:
            abort(context, e)
        try:
            return call(request, context)
        finally:
            guard.release(client)

    def stream(request, context):
        try:
            client = guard.admit(context)
        except APIError as e:
            abort(context, e)
        released = threading.Event()

        def release():  # once, when the call ends however it ends (a cancel included)
            if not released.is_set():
                released.set()
                guard.release(client)

        if not context.add_callback(release):
            release()
        try:
            yield from guard.stream(context, call(request, context))
        finally:
            release()

    return stream if streaming else unary


def add_router_service(server: grpc.Server, service: RouterService, guard: StreamGuard) -> None:
    """Register the Router service as router_pb2_grpc would, except that requests arrive as bytes and are parsed
    here (a request that is not a valid message — invalid UTF-8 in a string field — is INVALID_ARGUMENT naming the
    method: gRPC's own deserializer answers INTERNAL) and every method runs behind `guard`."""
    descriptor = router_pb2.DESCRIPTOR.services_by_name["Router"]

    def handler(method):
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        call = _guarded(guard, getattr(service, method.name), method.server_streaming)

        def parse(raw: bytes, context):
            try:
                return request_cls.FromString(raw)
            except DecodeError:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method.name}: the request is not a valid "
                    f"{method.input_type.full_name} message (invalid "
                    f"UTF-8 in a string field, or not protobuf)",
                )

        if method.server_streaming:

            def stream(raw, context):
                yield from call(parse(raw, context), context)

            return grpc.unary_stream_rpc_method_handler(stream, response_serializer=response_cls.SerializeToString)

        def unary(raw, context):
            return call(parse(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary, response_serializer=response_cls.SerializeToString)

    handlers = {m.name: handler(m) for m in descriptor.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))


def serve_router_grpc(
    engine: Engine,
    host: str,
    port: int,
    *,
    api_key: str | None = None,
    max_workers: int = 64,
    tls=None,
    chat: ChatFormat | None = None,
    health_port: int | None = None,
    max_streams_per_connection: int = 16,
    max_calls_per_client: int | None = None,
    write_timeout: float = WRITE_TIMEOUT,
    thinking_budgets: ThinkingBudgets | None = None,
):
    """`health_port`: also serve grpc.health.v1 alone, plaintext, there (Kubernetes probes when the port is TLS).
    The bounds (module docstring): `max_workers` calls at once (threads), `max_streams_per_connection`,
    `max_calls_per_client` (default: half the threads), `write_timeout` seconds for a stream's write.
    `thinking_budgets`: the thinking tiers' reasoning-token limits (default: the model preset's)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="router-grpc"),
        maximum_concurrent_rpcs=max_workers,
        options=[("grpc.max_concurrent_streams", max_streams_per_connection)],
    )
    service = RouterService(engine, api_key, chat, thinking_budgets)
    guard = StreamGuard(write_timeout, max_calls_per_client or max(1, max_workers // 2))
    add_router_service(server, service, guard)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", "expertmesh.v1.Router"):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    enable_reflection([router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, health.SERVICE_NAME], server)
    bound = (
        server.add_secure_port(f"{host}:{port}", tls.credentials())
        if tls is not None
        else server.add_insecure_port(f"{host}:{port}")
    )
    if bound == 0:
        raise RuntimeError(f"router gRPC: cannot bind {host}:{port}")
    server.start()
    server.bound_port = bound
    server.guard = guard
    server.health = health_servicer
    server.health_server = server.health_port = None
    if health_port is not None:
        server.health_server, server.health_port = serve_health_only(health_servicer, host, health_port)
    return server
