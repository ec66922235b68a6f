"""Anthropic-compatible endpoints: `POST /v1/messages` (streamed with Anthropic's events, or not) and
`POST /v1/messages/count_tokens`. Errors on these paths come back in Anthropic's shape (router/http.py). Checked as
Anthropic checks them: thinking.budget_tokens below max_tokens, stop_sequences non-empty and at most
protocol.MAX_STOP_SEQUENCES. No cache_salt here (Anthropic has none: a 400 naming it, as any unknown field); a
request's cached prefixes are its API key's (router/prefix_scope.py)."""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from expertmesh.chat.format import Message
from expertmesh.router.chat_prep import ChatInput, PreparedChat, ThinkingAsk, prepare_chat_off_loop
from expertmesh.router.constraints import ANTHROPIC_FIELDS, answer_grammar, compile_off_loop
from expertmesh.router.dependencies import Served, anthropic_key, served, served_model
from expertmesh.router.errors import APIError
from expertmesh.router.images import ImageBudget
from expertmesh.router.messages import ANTHROPIC, anthropic_messages, anthropic_tools, remote_image_urls
from expertmesh.router.prefix_scope import PrefixScope
from expertmesh.router.protocol import CountTokensBody, MessagesBody
from expertmesh.router.serving import ChatRequest, ChatResult, ChatRun, start_chat
from expertmesh.router.text_bounds import check_ids

router = APIRouter(dependencies=[Depends(anthropic_key)])
TOOL_CHOICES = ("auto", "none", "any", "tool")
STOP_REASONS = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}


def forced_choice(body: CountTokensBody) -> str | dict | None:
    """tool_choice (checked): any / tool force a call, in chat's shape (the same grammar as OpenAI's required /
    named); None when nothing is forced."""
    kind = (body.tool_choice or {}).get("type", "auto")
    if kind not in TOOL_CHOICES:
        raise APIError(f"tool_choice.type: {kind!r} is not one of {', '.join(TOOL_CHOICES)}", param="tool_choice")
    if kind == "any":
        return "required"
    return {"type": "function", "function": {"name": body.tool_choice.get("name")}} if kind == "tool" else None


async def read_messages(body: CountTokensBody, s: Served) -> tuple[list[Message], ImageBudget]:
    """The conversation (system first) and its images, known from their headers (decoded when the request runs)."""
    forced_choice(body)
    images = await s.images(remote_image_urls(body.messages, ANTHROPIC))
    return anthropic_messages(body.system, body.messages, images), images


def check_budget(body: MessagesBody) -> None:
    """thinking.budget_tokens below max_tokens, as Anthropic requires (the answer needs room after the thinking)."""
    budget = (body.thinking or {}).get("budget_tokens")
    if (body.thinking or {}).get("type") == "enabled" and isinstance(budget, int) and not isinstance(budget, bool):
        if budget >= body.max_tokens:
            raise APIError(
                f"thinking.budget_tokens={budget}: must be less than max_tokens={body.max_tokens}",
                param="thinking.budget_tokens",
            )


async def prepare(body: CountTokensBody, messages: list[Message], s: Served) -> PreparedChat:
    """The chat of a messages request: its conversation, tools, tool choice and thinking, prepared (off the event
    loop: chat_prep.prepare_chat_off_loop)."""
    chat = ChatInput.of_messages(
        messages,
        thinking=ThinkingAsk(body.thinking_budget, anthropic=body.thinking or {}),
        tools=anthropic_tools(body.tools),
        tool_choice=body.tool_choice,
        max_tokens=getattr(body, "max_tokens", None),  # count_tokens has none
    )
    return await prepare_chat_off_loop(s.fmt, chat, budgets=s.budgets, context=s.engine.cfg.max_context)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensBody = served_model(CountTokensBody), s: Served = Depends(served)):
    """The prompt tokens /v1/messages would feed for this request (= its usage's input_tokens +
    cache_read_input_tokens); past the context, a 400 as /v1/messages would answer (router/text_bounds.py)."""
    messages, _ = await read_messages(body, s)
    count = len((await prepare(body, messages, s)).prompt)
    check_ids(count, s.engine.cfg.max_context, "messages")
    return {"input_tokens": count}


class AnthropicMessage:
    """One /v1/messages request over its run: the message, or its events."""

    def __init__(self, run: ChatRun, name: str):
        self.run, self.name = run, name
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    @staticmethod
    def stop_reason(r: ChatResult) -> str:
        return "stop_sequence" if r.stop_hit is not None else STOP_REASONS[r.finish_reason]

    @staticmethod
    def usage(r: ChatResult) -> dict:
        u = r.usage
        return {
            "input_tokens": u.prompt - u.cached,
            "cache_read_input_tokens": u.cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": u.completion,
        }

    def blocks(self, r: ChatResult) -> list[dict]:
        out = []
        if self.run.thinking.on:
            out.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
        if r.content or not r.tool_calls:
            out.append({"type": "text", "text": r.content})
        for c in r.tool_calls:
            out.append({"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": json.loads(c.arguments)})
        return out

    def message(self, r: ChatResult) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.name,
            "content": self.blocks(r),
            "stop_reason": self.stop_reason(r),
            "stop_sequence": r.stop_hit,
            "usage": self.usage(r),
        }

    async def events(self):
        run = self.run
        yield event(
            "message_start",
            {
                "message": {
                    "id": self.id,
                    "type": "message",
                    "role": "assistant",
                    "model": self.name,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": len(run.prompt), "output_tokens": 0},
                }
            },
        )
        blocks = Blocks()
        try:
            async for kind, text in run.events():
                for e in blocks.delta("thinking" if kind == "reasoning" else "text", text):
                    yield e
            r = run.finish()
            if blocks.index == -1:  # nothing streamed: still one (empty) block, as Anthropic sends
                for e in blocks.open("thinking" if run.thinking.on else "text"):
                    yield e
            if r.unsent:  # held-back malformed tool call, as text
                for e in blocks.delta("text", r.unsent, sign=False):
                    yield e
            for e in blocks.close():
                yield e
            for c in r.tool_calls:
                for e in blocks.tool_use(c):
                    yield e
            yield event(
                "message_delta",
                {"delta": {"stop_reason": self.stop_reason(r), "stop_sequence": r.stop_hit}, "usage": self.usage(r)},
            )  # cache reads known by now
            yield event("message_stop", {})
        except Exception as e:
            yield event("error", {"error": run.fail(e).anthropic_body()["error"]})
        finally:
            run.close()


def tool_use_id(call_id: str) -> str:
    return call_id.replace("call_", "toolu_")


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class Blocks:
    """The content blocks of a streamed message: one open at a time, each started, given deltas and stopped."""

    def __init__(self):
        self.index, self.open_kind = -1, None

    def open(self, kind: str):
        self.index += 1
        self.open_kind = kind
        start = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        yield event("content_block_start", {"index": self.index, "content_block": start})

    def close(self, sign: bool = False):
        if self.open_kind is None:
            return
        if sign and self.open_kind == "thinking":
            yield event(
                "content_block_delta", {"index": self.index, "delta": {"type": "signature_delta", "signature": ""}}
            )
        yield event("content_block_stop", {"index": self.index})
        self.open_kind = None

    def delta(self, kind: str, text: str, sign: bool = True):
        if kind != self.open_kind:
            yield from self.close(sign)
            yield from self.open(kind)
        delta = (
            {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        )
        yield event("content_block_delta", {"index": self.index, "delta": delta})

    def tool_use(self, call):
        self.index += 1
        yield event(
            "content_block_start",
            {
                "index": self.index,
                "content_block": {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}},
            },
        )
        yield event(
            "content_block_delta",
            {"index": self.index, "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
        )
        yield event("content_block_stop", {"index": self.index})


@router.post("/v1/messages")
async def messages(
    http_request: Request,
    body: MessagesBody = served_model(MessagesBody),
    s: Served = Depends(served),
    tenant: str = Depends(anthropic_key),
):
    check_budget(body)
    choice = forced_choice(body)
    grammar = (
        await compile_off_loop(
            answer_grammar, s.fmt, choice, anthropic_tools(body.tools), None, ANTHROPIC_FIELDS, param="tool_choice"
        )
        if choice
        else None
    )
    history, images = await read_messages(body, s)
    await images.decode()
    chat = await prepare(body, history, s)
    run = start_chat(
        s.engine,
        s.fmt,
        ChatRequest(
            chat,
            temperature=body.temperature,
            top_p=body.top_p,
            sampling={"top_k": body.top_k},
            stop=body.stop_sequences or [],
            grammar=grammar,
            api="anthropic",
            scope=PrefixScope(tenant),
        ),
    )
    reply = AnthropicMessage(run, s.name)
    if body.stream:
        return StreamingResponse(reply.events(), media_type="text/event-stream", headers=chat.headers())
    return JSONResponse(reply.message(await run.complete(http_request.is_disconnected)), headers=chat.headers())
