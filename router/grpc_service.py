"""The router's public gRPC service (`expertmesh.v1.Router`): streaming Generate and Chat, model listing — a thin
transport over router/serving.py, the same runs and the same checks as the HTTP APIs.

Status codes come from router/errors.py's table: INVALID_ARGUMENT naming the field, UNAUTHENTICATED (metadata
`authorization: Bearer KEY` or `x-api-key`), NOT_FOUND (unknown model), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE
(experts or workers down), DEADLINE_EXCEEDED (the client's deadline passed; the request is cancelled in the engine).
"""
from __future__ import annotations

import dataclasses
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.chat import BuiltinChat, ChatFormat
from expertmesh.health_port import serve_health_only
from expertmesh.protos import chat_pb2, router_pb2, router_pb2_grpc
from expertmesh.reflection import enable_reflection
from expertmesh.router.constraints import check_grammar
from expertmesh.router.conversation import render_prompt
from expertmesh.router.engine import Engine
from expertmesh.router.errors import APIError, as_api_error, leading_field
from expertmesh.router.messages import grpc_messages, grpc_tools
from expertmesh.router.serving import (
    ChatRequest,
    CompletionRun,
    check_key,
    check_model,
    decide_thinking,
    max_tokens_for,
    prompt_options,
    start_chat,
)
from expertmesh.sampling_params import SamplingParams, check_sampling, sampling_from_proto

CHAT_SAMPLING = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "logit_bias")


def abort(context, e: Exception):
    """End the call with what the client is told of `e` (context.abort raises)."""
    err = as_api_error(e)
    context.abort(grpc.StatusCode[err.grpc_code], err.message)


def client_timeout(context) -> float | None:
    """Seconds left before the client's deadline; None without one (gRPC then reports a time_remaining so large
    that a queue wait on it overflows)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 10 ** 7 else None


def sampling(p, tokenizer, *, chat: bool) -> tuple[SamplingParams, int | None]:
    """expertmesh.v1.SamplingParams → SamplingParams (an unset field: the dataclass default; stop ids: the
    tokenizer's EOS) checked as on HTTP, naming `params.FIELD`, and the max_tokens asked for (None: unset)."""
    refused = {"logprobs": "use /v1/completions", "prompt_logprobs": "use /v1/completions"}
    if chat:
        refused |= {"stop_token_ids": "the chat format's end-of-turn tokens end the answer",
                    "grammar_after_token": "the grammar applies to the answer, after the thinking section"}
    for name, why in refused.items():
        if len(p.stop_token_ids) if name == "stop_token_ids" else p.HasField(name):
            raise APIError(f"params.{name}: not supported by this gRPC API ({why})", param=f"params.{name}")
    requested = p.max_tokens if p.HasField("max_tokens") else None
    params = dataclasses.replace(sampling_from_proto(p), stop_token_ids=tuple(p.stop_token_ids) or
                                 tuple(tokenizer.eos_ids))
    if not chat:
        params.max_tokens = max_tokens_for(requested, chat=False, param="params.max_tokens")
    try:
        check_sampling(params)
        if params.grammar is not None:       # compiled here first: a bad grammar never reaches a worker
            check_grammar(params.grammar, "grammar")
    except ValueError as e:
        raise APIError(f"params.{e}", param=f"params.{getattr(e, 'param', None) or leading_field(str(e))}") from None
    return params, requested


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, engine: Engine, api_key: str | None = None, chat: ChatFormat | None = None):
        self.engine = engine
        self.api_key = api_key
        self.chat = chat or BuiltinChat()     # the checkpoint's tokenizer and chat format
        self.tok = self.chat.tokenizer

    def _admit(self, model: str, context) -> None:
        """The API key (x-api-key, or authorization with or without "Bearer ") and the model (empty: the served)."""
        md = dict(context.invocation_metadata())
        check_key(self.api_key, md.get("x-api-key") or md.get("authorization", "").removeprefix("Bearer ").strip())
        check_model(self.engine.model_name, model or None)

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
            self._admit(request.model, context)
            prompt = self._prompt(request)
            params, _ = sampling(request.params, self.tok, chat=False)
            run = CompletionRun(self.engine, prompt, params, api="grpc",
                                **({"request_id": request.request_id} if request.request_id else {}))
        except Exception as e:
            abort(context, e)
        context.add_callback(run.close)
        req, index = run.req, 0
        decoder = self.tok.stream_decoder()
        try:
            for token in req.stream(timeout=client_timeout(context)):
                # a token's text is what it completes: empty while a character spans several tokens
                text = decoder.feed(token) if request.return_text else ""
                yield router_pb2.GenerateEvent(request_id=req.request_id, token=router_pb2.TokenEvent(
                    index=index, token_id=token, text=text))
                index += 1
        except Exception as e:  # the engine failed the request, or the client's deadline passed
            run.close()
            abort(context, run.finish(None, e))
        run.finish(req.finish_reason)
        u = run.usage()
        yield router_pb2.GenerateEvent(request_id=req.request_id, finish=router_pb2.Finish(
            finish_reason=req.finish_reason or "stop", usage=router_pb2.Usage(
                prompt_tokens=u.prompt, completion_tokens=u.completion, cached_tokens=u.cached, total_tokens=u.total)))

    def Chat(self, request, context):
        """Streaming chat: reasoning and content deltas, structured tool calls, then usage."""
        try:
            self._admit(request.model, context)
            thinking = decide_thinking(thinking_budget=request.thinking_budget or None,
                                       disable=request.disable_thinking, budgets=self.engine.cfg.thinking)
            messages, tools = grpc_messages(request.messages), grpc_tools(request.tools)
            thinking = thinking.for_round([m.role for m in messages])
            p, max_tokens = sampling(request.params, self.tok, chat=True)
            run = start_chat(self.engine, self.chat, ChatRequest(
                render_prompt(self.chat, messages, tools, thinking.on, prompt_options(thinking)), thinking,
                tools=tools, max_tokens=max_tokens,
                max_tokens_param="params.max_tokens", temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                sampling={k: getattr(p, k) for k in CHAT_SAMPLING}, grammar=p.grammar, api="grpc"))
        except Exception as e:
            abort(context, e)
        context.add_callback(run.close)
        try:
            for kind, text in run.events_sync(timeout=client_timeout(context)):
                yield chat_pb2.ChatEvent(reasoning_delta=text) if kind == "reasoning" else \
                    chat_pb2.ChatEvent(content_delta=text)
        except Exception as e:
            run.close()
            abort(context, run.fail(e))
        r = run.finish()
        if r.unsent:                                   # held-back malformed tool call, as text
            yield chat_pb2.ChatEvent(content_delta=r.unsent)
        for c in r.tool_calls:
            yield chat_pb2.ChatEvent(tool_call=chat_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments))
        u = r.usage
        yield chat_pb2.ChatEvent(finish=chat_pb2.ChatFinish(
            finish_reason=r.finish_reason, thinking_budget=run.tier if thinking.on else "",
            usage=chat_pb2.ChatUsage(prompt_tokens=u.prompt, completion_tokens=u.completion, cached_tokens=u.cached,
                                     reasoning_tokens=u.reasoning, total_tokens=u.total)))

    def ListModels(self, request, context):
        try:
            self._admit("", context)
        except Exception as e:
            abort(context, e)
        cfg = self.engine.cfg
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(
            id=self.engine.model_name, max_context=cfg.max_context, vocab_size=cfg.vocab_size,
            owned_by="expertmesh")])


def serve_router_grpc(engine: Engine, host: str, port: int, *, api_key: str | None = None, max_workers: int = 32,
                      tls=None, chat: ChatFormat | None = None, health_port: int | None = None):
    """`health_port`: also serve grpc.health.v1 alone, plaintext, there (Kubernetes probes when the port is TLS)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="router-grpc"))
    service = RouterService(engine, api_key, chat)
    router_pb2_grpc.add_RouterServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", "expertmesh.v1.Router"):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    enable_reflection([router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, health.SERVICE_NAME], server)
    bound = server.add_secure_port(f"{host}:{port}", tls.credentials()) if tls is not None \
        else server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"router gRPC: cannot bind {host}:{port}")
    server.start()
    server.bound_port = bound
    server.health = health_servicer
    server.health_server = server.health_port = None
    if health_port is not None:
        server.health_server, server.health_port = serve_health_only(health_servicer, host, health_port)
    return server
