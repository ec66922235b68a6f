"""OpenAI Responses API over the engine: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`.

A conversation is a list of segments (router/response_store.py): each message with its exact tokens. With the
built-in chat format the prompt is their concatenation between the header and the generation prompt, and a
generated turn's segment is the generation prompt plus exactly the tokens the model produced (reasoning and
tool-call markup included), so a follow-up (`previous_response_id`, or the history sent back with the output
item ids this server gave it) starts with exactly the previous prompt and output: the prefix cache recomputes
only the new tokens. A checkpoint's Jinja chat template cannot be rendered piece by piece; there the history is
rendered from its text (reasoning included) and the cache hits as far as the template keeps earlier turns.

One run is the chat endpoints' (router/chat_api.py: submit_chat, ChatRun): thinking budgets, tool-call parsing,
usage with cached and reasoning tokens.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from expertmesh.chat import (BuiltinChat, ChatError, ChatFormat, Message, RenderedPrompt, ToolCall, message_images,
                             generation_prompt, render_header, render_message, tier_from_request, validate_history)
from expertmesh.router.chat_api import ChatRun, constraint_grammar, render_prompt, submit_chat
from expertmesh.router.images import ImageBudget, fetch_remote
from expertmesh.router.engine import Engine
from expertmesh.router.http import APIError, SamplingFields, error_from_exception
from expertmesh.router.response_store import ResponseStore, Segment, StoredResponse
from expertmesh.router.truncation import PLACEHOLDER, Piece, TruncationPlan, plan_truncation

DEFAULT_MAX_OUTPUT_TOKENS = 256
INCLUDABLE = ("reasoning.encrypted_content",)     # accepted: reasoning comes back as plain reasoning_text content


class ResponsesBody(SamplingFields):
    """`POST /v1/responses`. Every field is honoured or refused (a 400 naming it); unknown fields are refused."""
    model: str
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    reasoning: dict | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    store: bool = True
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    include: list[str] | None = None
    text: dict | None = None
    background: Literal[False] | None = None
    prompt_cache_key: str | None = None       # the prefix cache is content-addressed: any key hits the same entries
    safety_identifier: str | None = None      # like `user`: no per-user state here
    stream_options: dict | None = None        # include_obfuscation: false (events are not padded)


# ----------------------------------------------------------------------------------------------- conversation
@dataclass
class Conversation:
    system: str | None
    tools: list[dict] | None              # chat-completions form (what the template renders)
    segments: list[Segment]
    thinking: bool
    tier: str
    input_items: list[dict] = field(default_factory=list)
    grammar: str | None = None            # constrained decoding from tool_choice / text.format
    text_format: dict = field(default_factory=lambda: {"type": "text"})


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def responses_grammar(fmt, tool_choice, tools, text_format: dict) -> str | None:
    """Responses `tool_choice` (required / {type: function, name}) and `text.format` (json_object / json_schema
    {name, schema, strict}) → the same grammar as chat's; a 400 names the Responses field."""
    kind = text_format.get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"text.format.type: {kind!r} is not one of text, json_object, json_schema",
                       param="text.format.type")
    chat_format = {"type": kind, "json_schema": {"schema": text_format.get("schema")}} if kind == "json_schema" \
        else {"type": kind}
    try:
        return constraint_grammar(fmt, tool_choice, tools, chat_format)
    except APIError as e:
        e.param = (e.param or "").replace("response_format.json_schema", "text.format").replace(
            "response_format", "text.format")
        e.message = e.message.replace("response_format.json_schema", "text.format").replace(
            "response_format", "text.format")
        raise


def _parts_text(content, where: str) -> str:
    """Message content: a string or a list of text parts (input_text / output_text / text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: expected a string or a list of text parts", param=where)
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text") \
                or not isinstance(p.get("text"), str):
            raise APIError(400, f"{where}.content[{j}].type: {kind!r} is not supported (only text parts)",
                           param=f"{where}.content[{j}].type")
        out.append(p["text"])
    return "".join(out)


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools ({type, name, description, parameters, strict}) → the chat form the template
    renders. `strict` is not rendered (no constrained decoding: arguments are checked to be a JSON object)."""
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(400, f"tools[{i}].type: {kind!r} is not supported (only 'function' tools)",
                           param=f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise APIError(400, f"tools[{i}].name: expected a non-empty string", param=f"tools[{i}].name")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                      "parameters": t.get("parameters") or {}}})
    return out or None


def _user_parts(content, images, where: str) -> tuple[str, list | None]:
    """A user message's content with `input_image` parts → (its text, its parts in order), else (text, None)."""
    if images is None or not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return _parts_text(content, where), None
    text, parts = [], []
    for j, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") == "input_image":
            if p.get("file_id") is not None:
                raise APIError(400, f"{where}.content[{j}].file_id: not supported (send image_url)",
                               param=f"{where}.content[{j}].file_id")
            parts.append(images.from_url(p.get("image_url"), f"{where}.content[{j}]", p.get("detail") or "auto"))
        else:
            text.append(_parts_text([p], f"{where}.content[{j}]"))
            parts.append(text[-1])
    return "".join(text), parts


def responses_image_urls(raw) -> dict[str, str]:
    """{part: url} of the remote image URLs among Responses input items (fetched before parsing)."""
    from expertmesh.router.images import is_remote
    out = {}
    for i, item in enumerate(raw if isinstance(raw, list) else ()):
        content = item.get("content") if isinstance(item, dict) else None
        for j, p in enumerate(content if isinstance(content, list) else ()):
            if isinstance(p, dict) and p.get("type") == "input_image" and is_remote(p.get("image_url")):
                out[f"input[{i}].content[{j}]"] = p["image_url"]
    return out


def parse_input(raw: str | list[dict], store: ResponseStore, images=None) -> tuple[list[Segment], list[dict]]:
    """Input items → segments (a generated turn sent back with this server's item ids keeps its exact tokens,
    and its reasoning even when the client dropped it) and the input items as listed (ids added)."""
    if isinstance(raw, str):
        item = {"id": _new_id("msg"), "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_text", "text": raw}]}
        return [Segment(Message("user", raw))], [item]
    segments: list[Segment] = []
    listed: list[dict] = []
    group: list[tuple[int, dict]] = []          # consecutive assistant-side items: one assistant turn

    def close_group() -> None:
        if not group:
            return
        msg = Message("assistant")
        ids = []
        for i, item in group:
            kind = item.get("type") or "message"
            ids.append(item.get("id"))
            if kind == "reasoning":
                parts = item.get("content") or []
                msg.reasoning = (msg.reasoning or "") + _parts_text(parts, f"input[{i}]")
            elif kind == "message":
                msg.content += _parts_text(item.get("content", ""), f"input[{i}]")
            else:
                for key in ("call_id", "name", "arguments"):
                    if not isinstance(item.get(key), str):
                        raise APIError(400, f"input[{i}].{key}: expected a string", param=f"input[{i}].{key}")
                msg.tool_calls.append(ToolCall(item["call_id"], item["name"], item["arguments"]))
        segments.append(_known_turn(store, tuple(ids), msg) or Segment(msg))
        group.clear()

    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}]: expected an object", param=f"input[{i}]")
        kind = item.get("type") or "message"
        role = item.get("role")
        if kind == "reasoning" and group:
            close_group()                                  # a new turn starts with its reasoning
        if kind in ("reasoning", "function_call") or (kind == "message" and role == "assistant"):
            if kind == "message" and any((it.get("type") or "message") == "message" for _, it in group):
                close_group()
            group.append((i, item))
            listed.append({"id": item.get("id") or _new_id("fc" if kind == "function_call" else "msg"), **item})
            continue
        close_group()
        if kind == "message":
            if role not in ("user", "system", "developer"):
                raise APIError(400, f"input[{i}].role: {role!r} is not one of user, assistant, system, developer",
                               param=f"input[{i}].role")
            text, parts = _user_parts(item.get("content", ""), images if role == "user" else None, f"input[{i}]")
            segments.append(Segment(Message("system" if role == "developer" else role, text, parts=parts)))
            listed.append({"id": item.get("id") or _new_id("msg"), "type": "message", "role": role,
                           "status": "completed", "content": [{"type": "input_text", "text": text}]})
            continue
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"input[{i}].output")
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"input[{i}].call_id: expected a string", param=f"input[{i}].call_id")
            segments.append(Segment(Message("tool", text, tool_call_id=item["call_id"])))
        else:
            raise APIError(400, f"input[{i}].type: {kind!r} is not supported (message, function_call, "
                                f"function_call_output, reasoning)", param=f"input[{i}].type")
        listed.append({"id": item.get("id") or _new_id("fco" if kind == "function_call_output" else "msg"),
                       "status": "completed", **item, "type": kind})
    close_group()
    return segments, listed


def _known_turn(store: ResponseStore, ids: tuple, msg: Message) -> Segment | None:
    """The stored segment of a generated turn sent back whole (same item ids, same answer): its exact tokens."""
    stored = store.by_output_item(ids[0]) if ids and ids[0] else None
    if stored is None:
        return None
    seg = stored.segments[-1]
    want = [i for i in seg.item_ids if not i.startswith("rs_")]
    got = [i for i in ids if i and not str(i).startswith("rs_")]
    same = seg.message.content == msg.content and \
        [(c.id, c.name, c.arguments) for c in seg.message.tool_calls] == \
        [(c.id, c.name, c.arguments) for c in msg.tool_calls]
    return seg if same and want == got else None


# ----------------------------------------------------------------------------------------------- rendering
def splices(fmt: ChatFormat) -> bool:
    """Whether the format renders message by message (the built-in one): exact tokens can be spliced in."""
    return isinstance(fmt, BuiltinChat)


def _system_and_rest(segments: list[Segment], instructions: str | None) -> tuple[str | None, list[Segment]]:
    """The system prompt (`instructions`, then a leading system / developer input message, one after the other)
    and the rest of the conversation."""
    system = instructions
    rest = segments
    if segments and segments[0].role == "system":
        first = segments[0].message.content
        system = first if instructions is None else f"{instructions}\n\n{first}"
        rest = segments[1:]
    for s in rest:
        if s.role == "system":
            raise APIError(400, "input: a system / developer message is only allowed first (use `instructions`)",
                           param="input")
    return system, rest


def segment_ids(fmt: ChatFormat, seg: Segment) -> list[int]:
    return seg.ids if seg.ids is not None else render_message(seg.message, fmt.tokenizer)


def render_conversation(fmt: ChatFormat, system: str | None, tools, segments: list[Segment],
                        thinking: bool, param: str = "input") -> RenderedPrompt:
    """The prompt of a conversation (segments after the system message), a 400 naming what is wrong."""
    messages = ([Message("system", system)] if system is not None else []) + [s.message for s in segments]
    try:
        if not splices(fmt):
            return fmt.render(messages, tools=tools, thinking=thinking)
        validate_history(messages)
        t = fmt.tokenizer
        ids = render_header(system, tools, t)
        for s in segments:
            ids += segment_ids(fmt, s)
        return RenderedPrompt(ids + generation_prompt(t, thinking), "reasoning" if thinking else "content")
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param)


def truncate(fmt: ChatFormat, system: str | None, tools, segments: list[Segment], thinking: bool, *,
             limit: int) -> tuple[list[Segment], TruncationPlan]:
    """`truncation: auto` over a conversation (router/truncation.py decides; this counts and applies)."""
    def count(seg: Segment) -> int:
        if splices(fmt):
            return len(segment_ids(fmt, seg))
        m = seg.message
        return len(fmt.tokenizer.encode(m.content + (m.reasoning or "") +
                                        "".join(c.name + c.arguments for c in m.tool_calls))) + 4

    def short(seg: Segment) -> Segment:
        return Segment(Message("tool", PLACEHOLDER, tool_call_id=seg.message.tool_call_id))

    pieces = [Piece(s.role, count(s), count(short(s)) if s.role == "tool" else None) for s in segments]
    total = len(render_conversation(fmt, system, tools, segments, thinking).ids)
    fixed = max(0, total - sum(p.tokens for p in pieces))
    plan = plan_truncation(pieces, fixed=fixed, limit=limit, target=fixed + (limit - fixed) // 2)
    if not plan.changed:
        return segments, plan
    shortened = set(plan.shortened)
    return [short(segments[i]) if i in shortened else segments[i] for i in plan.keep], plan


def chat_prompt(fmt: ChatFormat, messages: list[Message], tools, thinking: bool, memory) -> RenderedPrompt:
    """The chat endpoints' prompt. With a reasoning memory (router/response_store.ReasoningMemory), reasoning a
    client dropped is put back into the messages, and with the built-in format an answer generated here is
    rendered as exactly the tokens generated (the prefix cache then covers it whole)."""
    exact = memory.fill(messages) if memory is not None else []
    if not splices(fmt) or not any(exact):
        return render_prompt(fmt, messages, tools, thinking)
    system = messages[0].content if messages[0].role == "system" else None
    segments = [Segment(m, ids) for m, ids in zip(messages, exact)][0 if system is None else 1:]
    return render_conversation(fmt, system, tools, segments, thinking, param="messages")


def truncate_messages(fmt: ChatFormat, messages: list[Message], tools, thinking: bool, *,
                      limit: int) -> tuple[list[Message], dict | None]:
    """Chat completions' `truncation: auto`: the messages that fit and the report (None: nothing dropped)."""
    system = messages[0].content if messages and messages[0].role == "system" else None
    rest = [Segment(m) for m in (messages[1:] if system is not None else messages)]
    kept, plan = truncate(fmt, system, tools, rest, thinking, limit=limit)
    head = [messages[0]] if system is not None else []
    return head + [s.message for s in kept], plan.report() if plan.changed else None


def answer_segment(fmt: ChatFormat, run: ChatRun, parsed, item_ids: tuple[str, ...], thinking: bool) -> Segment:
    """The generated turn as a segment: the generation prompt and exactly the generated tokens, closed with the
    end-of-turn token when the model did not stop by itself (built-in format); its text otherwise."""
    msg = Message("assistant", parsed.content, reasoning=parsed.reasoning or None, tool_calls=parsed.tool_calls)
    if not splices(fmt):
        return Segment(msg, None, item_ids)
    out = list(run.req.output)
    if not out or out[-1] not in fmt.markers.stop:
        out.append(fmt.markers.end_of_turn)
    return Segment(msg, generation_prompt(fmt.tokenizer, thinking) + out, item_ids)


# ----------------------------------------------------------------------------------------------- the API
def responses_router(engine: Engine, fmt: ChatFormat, name: str, check_model, check_key,
                     store: ResponseStore) -> APIRouter:
    api = APIRouter()

    def conversation(body: ResponsesBody, images=None) -> Conversation:
        effort = (body.reasoning or {}).get("effort")
        for key, value in (body.reasoning or {}).items():
            if key in ("summary", "generate_summary") and value not in (None, "auto"):
                raise APIError(400, f"reasoning.{key}: {value!r} is not supported (no summaries are generated; "
                                    f"the reasoning comes back whole as reasoning_text content)",
                               param=f"reasoning.{key}")
            if key not in ("effort", "summary", "generate_summary"):
                raise APIError(400, f"reasoning.{key}: not supported by this server", param=f"reasoning.{key}")
        try:
            tier = tier_from_request(reasoning_effort=None if effort in (None, "none") else effort)
        except ChatError as e:
            raise APIError(400, f"reasoning.effort: {e}".replace("reasoning_effort: ", ""), param="reasoning.effort")
        for i, inc in enumerate(body.include or []):
            if inc not in INCLUDABLE:
                raise APIError(400, f"include[{i}]: {inc!r} is not supported (only {', '.join(INCLUDABLE)})",
                               param=f"include[{i}]")
        text_format = (body.text or {}).get("format") or {"type": "text"}
        if set(body.text or {}) - {"format"}:
            raise APIError(400, f"text: only `format` is supported, not {sorted(set(body.text) - {'format'})}",
                           param="text")
        for key, value in (body.stream_options or {}).items():
            if key != "include_obfuscation" or value is not False:
                raise APIError(400, f"stream_options.{key}: only include_obfuscation: false is supported (events "
                                    f"are not padded)", param=f"stream_options.{key}")
        tools = None if body.tool_choice == "none" else chat_tools(body.tools)
        grammar = responses_grammar(fmt, body.tool_choice, chat_tools(body.tools), text_format)
        prior: list[Segment] = []
        if body.previous_response_id is not None:
            stored = store.get(body.previous_response_id)
            if stored is None:
                owner = store.replica_of(body.previous_response_id)
                where = f" (it belongs to router replica {owner!r}; this is {store.replica!r})" \
                    if owner is not None and owner != store.replica else " (unknown, expired or evicted)"
                raise APIError(404, f"previous_response_id: response {body.previous_response_id!r} not found{where}",
                               param="previous_response_id", code="previous_response_not_found")
            prior = list(stored.segments)
        segments, listed = parse_input(body.input, store, images)
        if not segments and not prior:
            raise APIError(400, "input: expected at least one item", param="input")
        return Conversation(body.instructions, tools, prior + segments, effort != "none", tier, listed,
                            grammar, text_format)

    def response_object(body: ResponsesBody, rid: str, created: float, status: str, output: list[dict],
                        usage: dict | None, report: dict | None, incomplete: str | None = None) -> dict:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": name,
                "output": output, "instructions": body.instructions, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
                "parallel_tool_calls": True, "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
                "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
                "text": {"format": (body.text or {}).get("format") or {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
                "tools": body.tools or [], "truncation": body.truncation, "truncation_report": report,
                "usage": usage, "user": body.user}

    @api.post("/v1/responses")
    async def create(body: ResponsesBody, http_request: Request, authorization: str | None = Header(default=None)):
        check_key(authorization)
        check_model(body.model)
        limits = engine.image_limits
        conv = conversation(body, ImageBudget(engine.cfg.vision, limits,
                                              await fetch_remote(responses_image_urls(body.input), limits)))
        system, segments = _system_and_rest(conv.segments, body.instructions)
        max_out = body.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS
        report = None
        if body.truncation == "auto":
            segments, plan = truncate(fmt, system, conv.tools, segments, conv.thinking,
                                      limit=engine.cfg.max_context - max_out)
            report = plan.report() if plan.changed else None
        rendered = render_conversation(fmt, system, conv.tools, segments, conv.thinking)
        run = submit_chat(engine, fmt, rendered, tier=conv.tier, thinking=conv.thinking, max_tokens=max_out,
                          temperature=body.temperature, top_p=body.top_p, seed=None, api="openai.responses",
                          sampling=body.sampling_kwargs(),
                          images=message_images([seg.message for seg in segments]), grammar=conv.grammar)
        rid, created = store.new_id(), time.time()
        rs_id, msg_id = _new_id("rs"), _new_id("msg")
        # what a follow-up continues: a system / developer message sent as an input item stays in the
        # conversation; `instructions` belong to this request only (as OpenAI documents them)
        kept = conv.segments[:1] if conv.segments and conv.segments[0].role == "system" else []
        kept += segments
        headers = {"x-expertmesh-truncation": json.dumps(report, separators=(",", ":"))} if report else {}

        def usage(parsed) -> dict:
            u = run.usage_counts(parsed)
            return {"input_tokens": u["prompt"], "input_tokens_details": {"cached_tokens": u["cached"],
                                                                          "cache_write_tokens": 0},
                    "output_tokens": u["completion"], "output_tokens_details": {"reasoning_tokens": u["reasoning"]},
                    "total_tokens": u["prompt"] + u["completion"]}

        def items(parsed) -> tuple[list[dict], list[dict]]:
            """The output items (reasoning, message, function calls) and the function-call items alone."""
            out = []
            if conv.thinking and (parsed.reasoning or run.budget.reasoning_tokens):
                out.append(reasoning_item(rs_id, parsed.reasoning))
            if parsed.content or not parsed.tool_calls:
                out.append(message_item(msg_id, parsed.content))
            calls = [{"id": _new_id("fc"), "type": "function_call", "status": "completed", "call_id": c.id,
                      "name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]
            return out + calls, calls

        def finish(parsed, output: list[dict]) -> dict:
            reason = run.finish_reason(parsed)
            status = "incomplete" if reason == "length" else "completed"
            obj = response_object(body, rid, created, status, output, usage(parsed), report,
                                  "max_output_tokens" if status == "incomplete" else None)
            if body.store:
                seg = answer_segment(fmt, run, parsed, tuple(i["id"] for i in output), conv.thinking)
                store.put(StoredResponse(rid, obj, conv.input_items, kept + [seg]))
            return obj

        if not body.stream:
            parsed = await run.answer(http_request)
            return JSONResponse(finish(parsed, items(parsed)[0]), headers=headers)

        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        async def sse():
            started = response_object(body, rid, created, "in_progress", [], None, report)
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            output: list[dict] = []          # items opened so far, in order
            open_kind, text = None, ""

            def close():
                item = output[-1]
                if open_kind == "reasoning":
                    item["content"] = [{"type": "reasoning_text", "text": text}]
                    yield event("response.reasoning_text.done", item_id=item["id"], output_index=len(output) - 1,
                                content_index=0, text=text)
                    yield event("response.content_part.done", item_id=item["id"], output_index=len(output) - 1,
                                content_index=0, part={"type": "reasoning_text", "text": text})
                else:
                    item["content"] = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
                    yield event("response.output_text.done", item_id=item["id"], output_index=len(output) - 1,
                                content_index=0, text=text, logprobs=[])
                    yield event("response.content_part.done", item_id=item["id"], output_index=len(output) - 1,
                                content_index=0, part=item["content"][0])
                item["status"] = "completed"
                yield event("response.output_item.done", output_index=len(output) - 1, item=item)

            def open_(kind: str):
                item = {**reasoning_item(rs_id, ""), "content": [], "status": "in_progress"} if kind == "reasoning" \
                    else {**message_item(msg_id, ""), "content": [], "status": "in_progress"}
                output.append(item)
                yield event("response.output_item.added", output_index=len(output) - 1, item=item)
                part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                    {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield event("response.content_part.added", item_id=item["id"], output_index=len(output) - 1,
                            content_index=0, part=part)

            try:
                async for kind, piece in run.events():
                    if kind == "content" and conv.thinking and not output:
                        for e in open_("reasoning"):     # thinking that produced no text: its item still first
                            yield e
                        open_kind, text = "reasoning", ""
                    if kind != open_kind:
                        if open_kind is not None:
                            for e in close():
                                yield e
                        for e in open_(kind):
                            yield e
                        open_kind, text = kind, ""
                    text += piece
                    delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                    extra = {} if kind == "reasoning" else {"logprobs": []}
                    yield event(delta, item_id=output[-1]["id"], output_index=len(output) - 1, content_index=0,
                                delta=piece, **extra)
                parsed = run.result()
                final, calls = items(parsed)
                streamed = {o["id"] for o in output}
                for item in final:                       # what the stream did not open: held back, or empty
                    if item["type"] == "function_call" or item["id"] in streamed:
                        continue
                    if open_kind is not None:
                        for e in close():
                            yield e
                    kind = "reasoning" if item["type"] == "reasoning" else "content"
                    for e in open_(kind):
                        yield e
                    open_kind, text = kind, ""
                    body_text = parsed.reasoning if kind == "reasoning" else parsed.content
                    if body_text:
                        text = body_text
                        yield event("response.reasoning_text.delta" if kind == "reasoning" else
                                    "response.output_text.delta", item_id=item["id"], output_index=len(output) - 1,
                                    content_index=0, delta=body_text, **({} if kind == "reasoning" else
                                                                          {"logprobs": []}))
                if open_kind is not None:
                    if open_kind == "content" and parsed.content.startswith(text) and len(parsed.content) > len(text):
                        rest = parsed.content[len(text):]     # held-back malformed tool call, as text
                        text = parsed.content
                        yield event("response.output_text.delta", item_id=output[-1]["id"],
                                    output_index=len(output) - 1, content_index=0, delta=rest, logprobs=[])
                    for e in close():
                        yield e
                for call in calls:
                    output.append({**call, "arguments": "", "status": "in_progress"})
                    index = len(output) - 1
                    yield event("response.output_item.added", output_index=index, item=output[-1])
                    yield event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                                delta=call["arguments"])
                    yield event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                                arguments=call["arguments"], name=call["name"])
                    output[-1] = call
                    yield event("response.output_item.done", output_index=index, item=call)
                obj = finish(parsed, output)
                yield event("response.completed" if obj["status"] == "completed" else "response.incomplete",
                            response=obj)
            except Exception as e:
                run.fail(e)
                err = error_from_exception(e)
                failed = response_object(body, rid, created, "failed", output, None, report)
                failed["error"] = {"code": err.code or "server_error", "message": err.message}
                yield event("error", code=err.code, message=err.message, param=err.param)
                yield event("response.failed", response=failed)
            finally:
                if run.req is not None and not run.req.done:
                    engine.cancel(run.req)

        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    def stored_or_404(response_id: str) -> StoredResponse:
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"response {response_id!r} not found (unknown, expired, evicted, or stored on "
                                f"another router replica)", param="response_id", code="not_found")
        return stored

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, authorization: str | None = Header(default=None),
                       include: list[str] | None = Query(default=None), stream: bool = False):
        check_key(authorization)
        if stream:
            raise APIError(400, "stream: replaying a stored response as a stream is not supported", param="stream")
        for i, inc in enumerate(include or []):
            if inc not in INCLUDABLE:
                raise APIError(400, f"include[{i}]: {inc!r} is not supported", param=f"include[{i}]")
        return stored_or_404(response_id).response

    @api.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, authorization: str | None = Header(default=None)):
        check_key(authorization)
        if not store.delete(response_id):
            stored_or_404(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @api.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, authorization: str | None = Header(default=None),
                          limit: int = Query(default=20, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
                          after: str | None = None, include: list[str] | None = Query(default=None)):
        """The items this request added (a follow-up's history lives in the responses it names)."""
        check_key(authorization)
        items = list(stored_or_404(response_id).input_items)
        items = items[::-1] if order == "desc" else items
        if after is not None:
            at = next((i for i, it in enumerate(items) if it.get("id") == after), None)
            if at is None:
                raise APIError(400, f"after: no input item {after!r} in this response", param="after")
            items = items[at + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    return api


def reasoning_item(rid: str, text: str) -> dict:
    return {"id": rid, "type": "reasoning", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(mid: str, text: str) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
