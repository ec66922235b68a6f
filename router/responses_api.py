"""OpenAI Responses API: `POST /v1/responses` (streamed with the documented events, or not), `GET` / `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.

A conversation is the stored segments of `previous_response_id` (router/response_store.py) and the input items
(router/messages.py), rendered token-exactly where the format allows (router/conversation.py), so a follow-up
recomputes only its new tokens. The run is the chat endpoints' (router/serving.py): thinking budgets, tool-call
parsing, usage with cached and reasoning tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from expertmesh.router.chat_prep import ChatInput, PreparedChat, ThinkingAsk, prepare_chat_off_loop
from expertmesh.router.constraints import RESPONSES_FIELDS, answer_grammar, compile_off_loop
from expertmesh.router.conversation import answer_segment, system_and_rest
from expertmesh.router.dependencies import Served, caller, openai_key, served, served_model
from expertmesh.router.errors import APIError
from expertmesh.router.messages import RESPONSES, new_item_id, remote_image_urls, responses_input, responses_tools
from expertmesh.router.prefix_scope import PrefixScope
from expertmesh.router.protocol import ResponsesBody
from expertmesh.router.response_store import Segment, StoredResponse
from expertmesh.router.serving import ChatRequest, ChatResult, ChatRun, start_chat

router = APIRouter(dependencies=[Depends(openai_key)])
INCLUDABLE = ("reasoning.encrypted_content",)  # accepted: reasoning comes back as plain reasoning_text content
TEXT_FORMATS = ("text", "json_object", "json_schema")


# ----------------------------------------------------------------------------------------------- conversation
@dataclass
class Conversation:
    """A Responses request read: the whole conversation (stored turns, then the input), what it asks of the chat,
    the input items it adds, the constrained decoding from tool_choice / text.format."""

    segments: list[Segment]
    chat: ChatInput
    input_items: list[dict] = field(default_factory=list)
    grammar: str | None = None


def check_options(body: ResponsesBody) -> None:
    """The options that only select among what this server does: refused naming them when they ask otherwise."""
    for key, value in (body.reasoning or {}).items():
        if key in ("summary", "generate_summary") and value not in (None, "auto"):
            raise APIError(
                f"reasoning.{key}: {value!r} is not supported (no summaries are generated; the reasoning "
                f"comes back whole as reasoning_text content)",
                param=f"reasoning.{key}",
            )
        if key not in ("effort", "summary", "generate_summary"):
            raise APIError(f"reasoning.{key}: not supported by this server", param=f"reasoning.{key}")


def check_include(include: list[str] | None) -> None:
    """`include` values are honoured (reasoning.encrypted_content: the reasoning comes back as plain text) or
    refused naming them."""
    for i, inc in enumerate(include or []):
        if inc not in INCLUDABLE:
            raise APIError(
                f"include[{i}]: {inc!r} is not supported (only {', '.join(INCLUDABLE)})", param=f"include[{i}]"
            )


def check_output_options(body: ResponsesBody) -> None:
    check_include(body.include)
    if set(body.text or {}) - {"format"}:
        raise APIError(f"text: only `format` is supported, not {sorted(set(body.text) - {'format'})}", param="text")
    for key, value in (body.stream_options or {}).items():
        if key != "include_obfuscation" or value is not False:
            raise APIError(
                f"stream_options.{key}: only include_obfuscation: false is supported (events are not padded)",
                param=f"stream_options.{key}",
            )


def text_format(body: ResponsesBody) -> dict:
    return (body.text or {}).get("format") or {"type": "text"}


def chat_response_format(text_format: dict) -> dict:
    """Responses `text.format` (text / json_object / json_schema {name, schema, strict}) in chat's
    response_format shape; a 400 names a type that is none of them."""
    kind = text_format.get("type", "text")
    if kind not in TEXT_FORMATS:
        raise APIError(f"text.format.type: {kind!r} is not one of {', '.join(TEXT_FORMATS)}", param="text.format.type")
    return (
        {"type": kind, "json_schema": {"schema": text_format.get("schema")}}
        if kind == "json_schema"
        else {"type": kind}
    )


async def conversation(body: ResponsesBody, s: Served, images, owner: str = "") -> Conversation:
    check_options(body)
    check_output_options(body)
    tools = responses_tools(body.tools)
    response_format = chat_response_format(text_format(body))
    grammar = await compile_off_loop(
        answer_grammar,
        s.fmt,
        body.tool_choice,
        tools,
        response_format,
        RESPONSES_FIELDS,
        param="text.format" if body.text else "tool_choice",
    )
    prior: list[Segment] = []
    if body.previous_response_id is not None:
        stored = s.store.get(body.previous_response_id, owner)
        if stored is None:
            owner = s.store.replica_of(body.previous_response_id)
            where = (
                f" (it belongs to router replica {owner!r}; this is {s.store.replica!r})"
                if owner is not None and owner != s.store.replica
                else " (unknown, expired or evicted)"
            )
            raise APIError(
                f"previous_response_id: response {body.previous_response_id!r} not found{where}",
                param="previous_response_id",
                code="previous_response_not_found",
                kind="not_found",
            )
        prior = list(stored.segments)
    segments, listed = responses_input(body.input, s.store, images, owner)
    if not segments and not prior:
        raise APIError("input: expected at least one item", param="input")
    segments = prior + segments
    system, rest = system_and_rest(segments, body.instructions)
    chat = ChatInput(
        system,
        rest,
        ThinkingAsk(reasoning_effort=(body.reasoning or {}).get("effort"), effort_param="reasoning.effort"),
        tools=tools,
        tool_choice=body.tool_choice,
        response_format=response_format,
        truncation=body.truncation,
        max_tokens=body.max_output_tokens,
        max_tokens_param="max_output_tokens",
        param="input",
    )
    return Conversation(segments, chat, listed, grammar)


def reasoning_item(rid: str, text: str) -> dict:
    return {
        "id": rid,
        "type": "reasoning",
        "summary": [],
        "status": "completed",
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(mid: str, text: str) -> dict:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


# ----------------------------------------------------------------------------------------------- one response
class ResponseRun:
    """One POST /v1/responses over its run: the Response object, its output items, what is stored."""

    def __init__(
        self,
        body: ResponsesBody,
        s: Served,
        conv: Conversation,
        chat: PreparedChat,
        run: ChatRun,
        owner: str = "",
    ):
        self.body, self.s, self.conv, self.chat, self.run = body, s, conv, chat, run
        self.report = chat.truncation_report
        # what a follow-up continues: a system / developer message sent as an input item stays in the
        # conversation; `instructions` belong to this request only (as OpenAI documents them)
        lead = conv.segments[:1] if conv.segments and conv.segments[0].role == "system" else []
        self.kept = lead + chat.turns
        self.owner = owner
        self.id, self.created = s.store.new_id(), time.time()
        self.rs_id, self.msg_id = new_item_id("rs"), new_item_id("msg")

    def obj(self, status: str, output: list[dict], usage: dict | None, incomplete: str | None = None) -> dict:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.s.name,
            "output": output,
            "instructions": body.instructions,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": True,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": text_format(body)},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "truncation": body.truncation,
            "truncation_report": self.report,
            "usage": usage,
            "user": body.user,
        }

    @staticmethod
    def usage(r: ChatResult) -> dict:
        u = r.usage
        return {
            "input_tokens": u.prompt,
            "input_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": 0},
            "output_tokens": u.completion,
            "output_tokens_details": {"reasoning_tokens": u.reasoning},
            "total_tokens": u.total,
        }

    def items(self, r: ChatResult) -> tuple[list[dict], list[dict]]:
        """The output items (reasoning, message, function calls) and the function-call items alone."""
        out = []
        if self.chat.thinking.on and (r.reasoning or r.usage.reasoning):
            out.append(reasoning_item(self.rs_id, r.reasoning))
        if r.content or not r.tool_calls:
            out.append(message_item(self.msg_id, r.content))
        calls = [
            {
                "id": new_item_id("fc"),
                "type": "function_call",
                "status": "completed",
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments,
            }
            for c in r.tool_calls
        ]
        return out + calls, calls

    def finish(self, r: ChatResult, output: list[dict]) -> dict:
        """The completed (or incomplete: out of tokens) Response, stored when `store`."""
        incomplete = r.finish_reason == "length"
        obj = self.obj(
            "incomplete" if incomplete else "completed",
            output,
            self.usage(r),
            "max_output_tokens" if incomplete else None,
        )
        if self.body.store:
            seg = answer_segment(
                self.s.fmt, self.run.req.output, r.parsed, tuple(i["id"] for i in output), self.chat.thinking.on
            )
            self.s.store.put(StoredResponse(self.id, obj, self.conv.input_items, self.kept + [seg], owner=self.owner))
        return obj

    def events(self):
        return ResponseEvents(self).stream()


class ResponseEvents:
    """A Response streamed as the documented events: items opened, given deltas and closed in output order."""

    def __init__(self, rr: ResponseRun):
        self.rr = rr
        self.seq = 0
        self.output: list[dict] = []  # items opened so far, in order
        self.open_kind: str | None = None  # "reasoning" | "content" of the last item while open
        self.text = ""  # that item's text so far

    def event(self, kind: str, **data) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **data})}\n\n"

    def _at(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def open(self, kind: str):
        rr = self.rr
        item = reasoning_item(rr.rs_id, "") if kind == "reasoning" else message_item(rr.msg_id, "")
        self.output.append({**item, "content": [], "status": "in_progress"})
        self.open_kind, self.text = kind, ""
        yield self.event("response.output_item.added", output_index=len(self.output) - 1, item=self.output[-1])
        part = (
            {"type": "reasoning_text", "text": ""}
            if kind == "reasoning"
            else {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        )
        yield self.event("response.content_part.added", **self._at(), part=part)

    def delta(self, piece: str):
        self.text += piece
        if self.open_kind == "reasoning":
            yield self.event("response.reasoning_text.delta", **self._at(), delta=piece)
        else:
            yield self.event("response.output_text.delta", **self._at(), delta=piece, logprobs=[])

    def close(self):
        item, text = self.output[-1], self.text
        if self.open_kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            yield self.event("response.reasoning_text.done", **self._at(), text=text)
        else:
            item["content"] = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            yield self.event("response.output_text.done", **self._at(), text=text, logprobs=[])
        yield self.event("response.content_part.done", **self._at(), part=item["content"][0])
        item["status"] = "completed"
        yield self.event("response.output_item.done", output_index=len(self.output) - 1, item=item)

    def switch(self, kind: str):
        if self.open_kind is not None:
            yield from self.close()
        yield from self.open(kind)

    def function_call(self, call: dict):
        self.output.append({**call, "arguments": "", "status": "in_progress"})
        index = len(self.output) - 1
        yield self.event("response.output_item.added", output_index=index, item=self.output[-1])
        yield self.event(
            "response.function_call_arguments.delta", item_id=call["id"], output_index=index, delta=call["arguments"]
        )
        yield self.event(
            "response.function_call_arguments.done",
            item_id=call["id"],
            output_index=index,
            arguments=call["arguments"],
            name=call["name"],
        )
        self.output[-1] = call
        yield self.event("response.output_item.done", output_index=index, item=call)

    async def stream(self):
        rr, run = self.rr, self.rr.run
        started = rr.obj("in_progress", [], None)
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)
        try:
            async for kind, piece in run.events():
                if kind == "content" and rr.chat.thinking.on and not self.output:
                    for e in self.open("reasoning"):  # thinking that produced no text: its item still first
                        yield e
                if kind != self.open_kind:
                    for e in self.switch(kind):
                        yield e
                for e in self.delta(piece):
                    yield e
            r = run.finish()
            final, calls = rr.items(r)
            streamed = {o["id"] for o in self.output}
            for item in final:  # what the stream did not open: held back, or empty
                if item["type"] == "function_call" or item["id"] in streamed:
                    continue
                kind = "reasoning" if item["type"] == "reasoning" else "content"
                for e in self.switch(kind):
                    yield e
                text = r.reasoning if kind == "reasoning" else r.content
                for e in self.delta(text) if text else ():
                    yield e
            if self.open_kind is not None:
                if self.open_kind == "content" and rr.msg_id in streamed and r.unsent:
                    for e in self.delta(r.unsent):  # held-back malformed tool call, as text
                        yield e
                for e in self.close():
                    yield e
            for call in calls:
                for e in self.function_call(call):
                    yield e
            obj = rr.finish(r, self.output)
            yield self.event(
                "response.completed" if obj["status"] == "completed" else "response.incomplete", response=obj
            )
        except Exception as e:
            err = run.fail(e)
            failed = rr.obj("failed", self.output, None)
            failed["error"] = {"code": err.code or "server_error", "message": err.message}
            yield self.event("error", code=err.code, message=err.message, param=err.param)
            yield self.event("response.failed", response=failed)
        finally:
            run.close()


# ----------------------------------------------------------------------------------------------- routes
@router.post("/v1/responses")
async def create(
    http_request: Request,
    body: ResponsesBody = served_model(ResponsesBody),
    s: Served = Depends(served),
    owner: str = Depends(caller),
    tenant: str = Depends(openai_key),
):
    engine, fmt = s.engine, s.fmt
    images = await s.images(remote_image_urls(body.input, RESPONSES, field="input"))
    conv = await conversation(body, s, images, owner)
    await images.decode()  # every image's cost checked from its header first
    chat = await prepare_chat_off_loop(fmt, conv.chat, budgets=s.budgets, context=engine.cfg.max_context)
    run = start_chat(
        engine,
        fmt,
        ChatRequest(
            chat,
            temperature=body.temperature,
            top_p=body.top_p,
            sampling=body.sampling_kwargs(),
            grammar=conv.grammar,
            api="openai.responses",
            scope=PrefixScope(tenant, body.cache_salt, body.prompt_cache_key),
        ),
    )
    rr = ResponseRun(body, s, conv, chat, run, owner)
    headers = chat.headers()
    if body.stream:
        return StreamingResponse(rr.events(), media_type="text/event-stream", headers=headers)
    r = await run.complete(http_request.is_disconnected)
    return JSONResponse(rr.finish(r, rr.items(r)[0]), headers=headers)


def stored_or_404(s: Served, response_id: str, owner: str) -> StoredResponse:
    stored = s.store.get(response_id, owner)
    if stored is None:
        raise APIError(
            f"response {response_id!r} not found (unknown, expired, evicted, or stored on another router replica)",
            param="response_id",
            code="not_found",
            kind="not_found",
        )
    return stored


@router.get("/v1/responses/{response_id}")
async def retrieve(
    response_id: str,
    include: list[str] | None = Query(default=None),
    stream: bool = False,
    s: Served = Depends(served),
    owner: str = Depends(caller),
):
    if stream:
        raise APIError("stream: replaying a stored response as a stream is not supported", param="stream")
    check_include(include)
    return stored_or_404(s, response_id, owner).response


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, s: Served = Depends(served), owner: str = Depends(caller)):
    if not s.store.delete(response_id, owner):
        stored_or_404(s, response_id, owner)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    include: list[str] | None = Query(default=None),
    s: Served = Depends(served),
    owner: str = Depends(caller),
):
    """The items this request added (a follow-up's history lives in the responses it names). `include`: as on
    the response, honoured or refused."""
    check_include(include)
    items = list(stored_or_404(s, response_id, owner).input_items)
    items = items[::-1] if order == "desc" else items
    if after is not None:
        at = next((i for i, it in enumerate(items) if it.get("id") == after), None)
        if at is None:
            raise APIError(f"after: no input item {after!r} in this response", param="after")
        items = items[at + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
