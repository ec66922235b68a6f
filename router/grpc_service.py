"""The router's public gRPC service (`expertmesh.v1.Router`): streaming Generate and Chat, model listing.

Status codes: INVALID_ARGUMENT naming the field, UNAUTHENTICATED (metadata `authorization: Bearer KEY` or
`x-api-key`), NOT_FOUND (unknown model), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE (experts or workers down),
DEADLINE_EXCEEDED (the client's deadline passed; the request is cancelled in the engine).
"""
from __future__ import annotations

import dataclasses
import hmac
import json
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.chat import BuiltinChat, ChatFormat
from expertmesh.protos import chat_pb2, router_pb2, router_pb2_grpc
from expertmesh.reflection import enable_reflection
from expertmesh.router.engine import Engine, EngineClosed, ExpertsUnavailable, QueueFull
from expertmesh.sampling_params import SamplingParams, check_sampling, sampling_from_proto


def _status_for(e: Exception) -> grpc.StatusCode:
    if isinstance(e, ValueError):          # RequestError, ChatError, decoding
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, (ExpertsUnavailable, EngineClosed, ConnectionError)):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _client_timeout(context) -> float | None:
    """Seconds left before the client's deadline; None without one (gRPC then reports a time_remaining so large
    that a queue wait on it overflows)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 10 ** 7 else None


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, engine: Engine, api_key: str | None = None, chat: ChatFormat | None = None):
        self.engine = engine
        self.api_key = api_key
        self.chat = chat or BuiltinChat()     # the checkpoint's tokenizer and chat format
        self.tok = self.chat.tokenizer

    def _auth(self, context) -> None:
        if self.api_key is None:
            return
        md = dict(context.invocation_metadata())
        given = md.get("x-api-key") or md.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")

    def _check_model(self, model: str, context) -> None:
        if model and model != self.engine.model_name:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model {model!r} not found; this router serves "
                                                     f"{self.engine.model_name!r}")

    def _params(self, p, context) -> SamplingParams:
        for name in ("logprobs", "prompt_logprobs"):      # GenerateEvent has no place for them
            if p.HasField(name):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"params.{name}: not supported by this gRPC API "
                                                                f"(use /v1/completions)")
        params = dataclasses.replace(
            sampling_from_proto(p), max_tokens=p.max_tokens if p.HasField("max_tokens") else 16,
            temperature=p.temperature if p.HasField("temperature") else 0.0,
            stop_token_ids=tuple(p.stop_token_ids) or tuple(self.tok.eos_ids))
        if params.max_tokens <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"params.max_tokens={params.max_tokens}: expected > 0")
        try:
            check_sampling(params)
            if params.grammar is not None:       # compiled here first: a bad grammar never reaches a worker
                from expertmesh.router.constraints import check_grammar
                check_grammar(params.grammar, "grammar")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"params.{e}")
        return params

    def _stream(self, req, context, request_id: str, return_text: bool):
        """Yield GenerateEvents for an engine request; cancels it when the client goes away. A token's text is what
        it completes: empty while a character spans several tokens, then the whole character."""
        context.add_callback(lambda: self.engine.cancel(req))
        remaining = _client_timeout(context)
        index = 0
        decoder = self.tok.stream_decoder()
        try:
            for token in req.stream(timeout=remaining):
                text = decoder.feed(token) if return_text else ""
                yield router_pb2.GenerateEvent(request_id=request_id, token=router_pb2.TokenEvent(
                    index=index, token_id=token, text=text))
                index += 1
        except Exception as e:  # the engine failed the request
            if type(e).__name__ == "Empty":
                self.engine.cancel(req)
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while generating")
            context.abort(_status_for(e), str(e))
        usage = router_pb2.Usage(prompt_tokens=len(req.prompt), completion_tokens=len(req.output),
                                 cached_tokens=req.cached_tokens, total_tokens=len(req.prompt) + len(req.output))
        yield router_pb2.GenerateEvent(request_id=request_id, finish=router_pb2.Finish(
            finish_reason=req.finish_reason or "stop", usage=usage))

    def Generate(self, request, context):
        self._auth(context)
        self._check_model(request.model, context)
        which = request.WhichOneof("prompt")
        if which is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set text or token_ids")
        if which == "text":
            if not request.text:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt.text: expected a non-empty string")
            try:
                prompt = self.tok.encode_prompt(request.text)
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt.text: {e}")
        else:
            prompt = list(request.token_ids.ids)
        params = self._params(request.params, context)
        try:
            req = self.engine.submit(prompt, params, **({"request_id": request.request_id}
                                                        if request.request_id else {}))
        except Exception as e:
            context.abort(_status_for(e), str(e))
        yield from self._stream(req, context, req.request_id, request.return_text)

    def Chat(self, request, context):
        """Streaming chat: reasoning and content deltas, structured tool calls, then usage."""
        from expertmesh.chat import ChatError, Message, ToolCall, tier_from_request
        from expertmesh.router.chat_api import start_chat
        from expertmesh.router.http import APIError
        self._auth(context)
        self._check_model(request.model, context)
        codes = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                 429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
        try:
            tier = tier_from_request(thinking_budget=request.thinking_budget or None)
            messages = [Message(m.role, m.content, reasoning=m.reasoning or None,
                                tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls],
                                tool_call_id=m.tool_call_id or None) for m in request.messages]
            tools = []
            for i, t in enumerate(request.tools):
                try:
                    params = json.loads(t.parameters_json) if t.parameters_json else {}
                except ValueError:
                    raise ChatError(f"tools[{i}].parameters_json: not valid JSON")
                tools.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": params}})
            p = self._params(request.params, context)
            run = start_chat(self.engine, self.chat, messages, tools or None, tier=tier,
                             thinking=not request.disable_thinking, max_tokens=p.max_tokens,
                             temperature=p.temperature, top_p=p.top_p, seed=p.seed, api="grpc")
        except ChatError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except APIError as e:
            context.abort(codes.get(e.status, grpc.StatusCode.INTERNAL), e.message)
        context.add_callback(lambda: self.engine.cancel(run.req))
        sent = ""
        try:
            for kind, text in run.events_sync(timeout=_client_timeout(context)):
                if kind == "reasoning":
                    yield chat_pb2.ChatEvent(reasoning_delta=text)
                else:
                    sent += text
                    yield chat_pb2.ChatEvent(content_delta=text)
        except Exception as e:
            run.fail(e)
            if type(e).__name__ == "Empty":
                self.engine.cancel(run.req)
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while generating")
            context.abort(_status_for(e), str(e))
        parsed = run.result()
        run.record(parsed)
        if parsed.content.startswith(sent) and len(parsed.content) > len(sent):
            yield chat_pb2.ChatEvent(content_delta=parsed.content[len(sent):])
        for c in parsed.tool_calls:
            yield chat_pb2.ChatEvent(tool_call=chat_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments))
        u = run.usage_counts(parsed)
        yield chat_pb2.ChatEvent(finish=chat_pb2.ChatFinish(
            finish_reason=run.finish_reason(parsed), thinking_budget=run.tier if run.thinking else "",
            usage=chat_pb2.ChatUsage(prompt_tokens=u["prompt"], completion_tokens=u["completion"],
                                     cached_tokens=u["cached"], reasoning_tokens=u["reasoning"],
                                     total_tokens=u["prompt"] + u["completion"])))

    def ListModels(self, request, context):
        self._auth(context)
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
        from expertmesh.health_port import serve_health_only
        server.health_server, server.health_port = serve_health_only(health_servicer, host, health_port)
    return server

