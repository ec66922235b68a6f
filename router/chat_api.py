"""OpenAI chat completions and Anthropic messages over the engine, sharing one chat run.

A chat run renders the conversation with the chat template, submits it with a thinking-budget token
filter, and turns the generated tokens into reasoning / content / tool-call events as they arrive.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.chat import (
    BuiltinChat,
    ChatError,
    ChatFormat,
    Message,
    Phase,
    ThinkingBudget,
    ToolCall,
    message_images,
    tier_from_request,
)
from expertmesh.router.engine import Engine, Request as EngineRequest
from expertmesh.router.http import (
    AcceptedNoOps,
    APIError,
    SamplingFields,
    cancel_on_disconnect,
    error_from_exception,
    iterate_events,
)
from expertmesh.router.images import ImageBudget, ImageError, fetch_remote
from expertmesh.router.tracing import RequestSpan
from expertmesh.sampling_params import MAX_LOGPROBS, SamplingParams


# ----------------------------------------------------------------------------------------------- the run
class ChatDecoder:
    """Generated tokens → ("reasoning" | "content", text) pieces: incremental detokenization (never half a
    character), the thinking section apart from the answer, tool-call markup held back (the format's parse_output
    turns it into structured calls). For a format that strips the whitespace around reasoning and content, the
    pieces do too: leading whitespace is dropped, trailing whitespace waits for more text."""

    def __init__(self, fmt: ChatFormat, phase: Phase):
        self.tok, self.m, self.trim = fmt.tokenizer, fmt.markers, fmt.trim_whitespace
        self.phase = phase
        self.in_call = False
        self.done = False
        self.text = self.tok.stream_decoder()
        self.started, self.held = False, ""      # this section has emitted text; whitespace not yet emitted

    def _emit(self, kind: str, piece: str, out: list) -> None:
        if not self.trim:
            out += [(kind, piece)] if piece else []
            return
        piece = piece if self.started else piece.lstrip()
        body = piece.rstrip()
        if body:
            out.append((kind, self.held + body))
            self.held, self.started = "", True
        if self.started:
            self.held += piece[len(body):]

    def feed(self, token: int) -> list[tuple[str, str]]:
        m, out = self.m, []
        if token in m.stop:
            self.done = True
            return out
        if self.phase == "maybe":               # the model may open thinking with its first token
            self.phase = "reasoning" if token == m.think_start else "content"
            if self.phase == "reasoning":
                return out
        if self.phase == "reasoning":
            if token == m.think_end:
                self._emit("reasoning", self.text.flush(), out)
                self.text = self.tok.stream_decoder()
                self.phase, self.started, self.held = "content", False, ""
            else:
                self._emit("reasoning", self.text.feed(token), out)
            return out
        if token == m.tool_open:
            self.in_call = True
        elif m.tool_close is not None and token == m.tool_close:
            self.in_call = False
        elif not self.in_call:
            self._emit("content", self.text.feed(token), out)
        return out

    def flush(self) -> list[tuple[str, str]]:
        out: list = []
        self._emit(self.phase, self.text.flush(), out)
        return out


class StopCut:
    """Stop strings over the content pieces (never the reasoning): text before the first match goes out, a piece
    that could be the start of a stop string waits for the next one, and after a match nothing more."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        self.buf, self.hit = "", None

    def feed(self, kind: str, text: str) -> list[tuple[str, str]]:
        if kind != "content" or not self.stops:
            return [(kind, text)]
        self.buf += text
        found = [(i, s) for s in self.stops if (i := self.buf.find(s)) >= 0]
        if found:
            i, self.hit = min(found)
            out, self.buf = self.buf[:i], ""
        else:
            cut = max(0, len(self.buf) - self.hold)
            out, self.buf = self.buf[:cut], self.buf[cut:]
        return [("content", out)] if out else []

    def flush(self) -> list[tuple[str, str]]:
        out, self.buf = self.buf, ""
        return [("content", out)] if out else []


@dataclass
class ChatRun:
    engine: Engine
    fmt: ChatFormat
    prompt: list[int]
    phase: Phase
    budget: ThinkingBudget
    thinking: bool
    tier: str
    req: EngineRequest | None = None
    consumed: int = 0            # generated tokens `events()` has decoded so far
    stops: list[str] = field(default_factory=list)
    stop_hit: str | None = None  # the stop string that ended the content
    salt: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    span: RequestSpan | None = None
    images: list = field(default_factory=list)   # router.images.PreparedImage, in prompt order

    def start(self, params: SamplingParams, api: str) -> None:
        self.span = RequestSpan("chat", self.engine.model_name, max_tokens=params.max_tokens,
                                temperature=params.temperature, api=api, tier=self.tier if self.thinking else None)
        try:
            with self.span.current():
                self.req = self.engine.submit(self.prompt, params, token_filter=self.budget,
                                              **({"images": self.images} if self.images else {}))
        except Exception as e:
            self.span.finish(input_tokens=len(self.prompt), output_tokens=0, finish_reason=None, error=e)
            raise error_from_exception(e)

    def fail(self, error: Exception) -> None:
        if self.span is not None:
            self.span.finish(input_tokens=len(self.prompt), output_tokens=len(self.req.output) if self.req else 0,
                             finish_reason=None, error=error)

    def _pieces(self, decoder: ChatDecoder, cut: StopCut, token: int | None) -> list[tuple[str, str]]:
        """The events of one token (None: the end), through the stop strings; a match cancels the request."""
        raw = decoder.flush() if token is None else [] if decoder.done else decoder.feed(token)
        out = [piece for ev in raw for piece in cut.feed(*ev)]
        if cut.hit is not None and self.stop_hit is None:
            self.stop_hit = cut.hit
            self.engine.cancel(self.req)
        elif token is None:
            out += cut.flush()
        return out

    async def events(self):
        """Yield ("reasoning"|"content", text) as tokens arrive; tool-call markup is held back; content ends
        before the first stop string."""
        decoder, cut = ChatDecoder(self.fmt, self.phase), StopCut(self.stops)
        async for token in iterate_events(self.req):
            self.consumed += 1
            for ev in self._pieces(decoder, cut, token):
                yield ev
            if self.stop_hit is not None:
                return
        for ev in self._pieces(decoder, cut, None):
            yield ev

    def events_sync(self, timeout: float | None = None):
        """The same events for a blocking caller (the gRPC servicer)."""
        decoder, cut = ChatDecoder(self.fmt, self.phase), StopCut(self.stops)
        for token in self.req.stream(timeout):
            yield from self._pieces(decoder, cut, token)
            if self.stop_hit is not None:
                return
        yield from self._pieces(decoder, cut, None)

    async def wait(self) -> None:
        async for _ in self.events():
            pass

    async def answer(self, http_request: Request):
        """The whole answer of an unstreamed request, parsed (cancelled if the client goes away), or the API
        error it failed with."""
        watcher = cancel_on_disconnect(http_request, self.engine, self.req)
        try:
            await self.wait()
        except Exception as e:
            self.fail(e)
            raise error_from_exception(e)
        finally:
            watcher.cancel()
        return self.result()

    def result(self):
        parsed = self.fmt.parse_output(self.req.output, phase=self.phase, salt=self.salt)
        if self.stop_hit is not None:             # the answer ends before the stop string; nothing after counts
            at = parsed.content.find(self.stop_hit)
            parsed.content = parsed.content[:at] if at >= 0 else parsed.content
            parsed.tool_calls = []
        return parsed

    def finish_reason(self, parsed) -> str:
        if self.stop_hit is not None:
            return "stop"
        if parsed.tool_calls:
            return "tool_calls"
        out = self.req.output
        if out and out[-1] in self.fmt.markers.stop:
            return "stop"
        return "length"

    def record(self, parsed=None) -> None:
        """Count this run's reasoning tokens and close its span, once, when it is over."""
        if getattr(self, "_recorded", False):
            return
        self._recorded = True
        reasoning = self.budget.reasoning_tokens
        self.engine.metrics.reasoning_tokens.inc(reasoning)
        if self.span is not None:
            self.span.finish(input_tokens=len(self.prompt), output_tokens=len(self.req.output),
                             finish_reason=self.finish_reason(parsed) if parsed is not None else None,
                             reasoning_tokens=reasoning, cached_tokens=self.req.cached_tokens)

    def usage_counts(self, parsed) -> dict:
        self.record(parsed)
        return {"prompt": len(self.prompt), "completion": len(self.req.output), "cached": self.req.cached_tokens,
                "reasoning": self.budget.reasoning_tokens}


def render_prompt(fmt: ChatFormat, messages: list[Message], tools, thinking: bool):
    """The chat format's rendering of a request (what the model is fed), a 400 naming what is wrong."""
    try:
        return fmt.render(messages, tools=tools, thinking=thinking)
    except ValueError as e:          # ChatError, or text that is not valid Unicode
        raise APIError(400, str(e) if isinstance(e, ChatError) else f"messages: {e}", param="messages")


def start_chat(engine: Engine, fmt: ChatFormat, messages: list[Message], tools, *, tier: str, thinking: bool,
               max_tokens: int, temperature: float, top_p: float, seed: int | None, api: str = "openai",
               logprobs: int | None = None, stop: list[str] | None = None, sampling: dict | None = None,
               thinking_limit: int | None = None, grammar: str | None = None) -> ChatRun:
    """Render with the model's chat format and submit. A model that thinks although the request did not ask it to
    (a template that cannot turn thinking off) gets the low tier's limit."""
    return submit_chat(engine, fmt, render_prompt(fmt, messages, tools, thinking), tier=tier, thinking=thinking,
                       max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, api=api,
                       logprobs=logprobs, stop=stop, sampling=sampling, thinking_limit=thinking_limit, grammar=grammar,
                       images=message_images(messages))


def submit_chat(engine: Engine, fmt: ChatFormat, rendered, *, tier: str, thinking: bool, max_tokens: int,
                temperature: float, top_p: float, seed: int | None, api: str = "openai", logprobs: int | None = None,
                stop: list[str] | None = None, sampling: dict | None = None,
                thinking_limit: int | None = None, images: list | None = None, grammar: str | None = None) -> ChatRun:
    """Submit an already rendered prompt (RenderedPrompt: ids and the phase generation starts in) and the images
    its messages hold, in order (chat.message_images). `grammar` (constraint_grammar) applies to the answer: after
    the end-of-thinking marker when generation starts in the reasoning section."""
    if images and not isinstance(fmt, BuiltinChat):
        raise APIError(400, "messages: image input needs the built-in chat format (a checkpoint's own chat template "
                            "does not render images yet)", param="messages")
    limit = thinking_limit if thinking and thinking_limit is not None else \
        engine.cfg.thinking.limit(tier if thinking else "low")
    run = ChatRun(engine, fmt, rendered.ids, rendered.phase, ThinkingBudget(fmt.markers, limit, phase=rendered.phase),
                  thinking, tier, stops=list(stop or []), images=list(images or []))
    if max_tokens <= 0:
        raise APIError(400, f"max_tokens={max_tokens}: expected a positive integer", param="max_tokens")
    run.start(SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                             stop_token_ids=fmt.markers.stop, logprobs=logprobs, **(sampling or {}),
                             grammar=grammar, grammar_after_token=None if grammar is None or rendered.phase == "content"
                             else fmt.markers.think_end), api)
    return run


def _openai_parts(content: list, images, where: str) -> tuple[str, list]:
    """A user message's content list with image parts → (its text, its parts in order: str and PreparedImage)."""
    text, parts = [], []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            text.append(p["text"])
            parts.append(p["text"])
        elif kind == "image_url":
            spec = p.get("image_url")
            url, detail = (spec.get("url"), spec.get("detail") or "auto") if isinstance(spec, dict) else (spec, "auto")
            parts.append(images.from_url(url, f"{where}.content[{j}]", detail))
        else:
            raise APIError(400, f"content[{j}]: expected a text or image_url part", param=f"{where}.content[{j}]")
    return "".join(text), parts


def openai_image_urls(raw: list) -> dict[str, str]:
    """{part: url} of the remote (http/https) image URLs in chat messages (fetched before parsing, off the loop)."""
    from expertmesh.router.images import is_remote
    out = {}
    for i, m in enumerate(raw):
        content = m.get("content") if isinstance(m, dict) else None
        for j, p in enumerate(content if isinstance(content, list) else ()):
            spec = p.get("image_url") if isinstance(p, dict) and p.get("type") == "image_url" else None
            url = spec.get("url") if isinstance(spec, dict) else spec
            if is_remote(url):
                out[f"messages[{i}].content[{j}]"] = url
    return out


def _text(content) -> str:
    """OpenAI content: a string or a list of {type: text, text} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise APIError(400, f"content[{i}]: only text parts are supported", param="messages")
            parts.append(p["text"])
        return "".join(parts)
    raise APIError(400, "content: expected a string or a list of text parts", param="messages")


# ----------------------------------------------------------------------------------------------- OpenAI
class ChatBody(SamplingFields):
    model: str
    messages: list[dict] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    reasoning_effort: str | None = None
    thinking_budget: str | None = None
    n: int = Field(default=1, ge=1, le=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)      # needs logprobs
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None
    truncation: Literal["auto", "disabled"] = "disabled"     # the context-overflow policy (router/truncation.py)


def thinking_wanted(body: ChatBody) -> bool:
    """Thinking is on unless `reasoning_effort: "none"` or `chat_template_kwargs` turns it off (`enable_thinking`
    as Qwen / vLLM name it, `thinking` as DeepSeek V3.1 does); other template kwargs are refused."""
    on = body.reasoning_effort != "none"
    for key, value in (body.chat_template_kwargs or {}).items():
        if key not in ("enable_thinking", "thinking") or not isinstance(value, bool):
            raise APIError(400, f"chat_template_kwargs.{key}: only enable_thinking / thinking (true or false) are "
                                f"supported", param=f"chat_template_kwargs.{key}")
        on = on and value
    if not on and body.thinking_budget is not None:
        raise APIError(400, "thinking_budget: given while thinking is turned off", param="thinking_budget")
    return on


def constraint_grammar(fmt: ChatFormat, choice, tools, response_format: dict | None = None) -> str | None:
    """The grammar (router/constraints.py) a request's forcing `tool_choice` ("required", a named function; chat-
    shaped `tools`) or `response_format` (json_object / json_schema) puts on the answer; None for neither. A tool
    or schema the engine cannot compile is a 400 naming it, before anything is scheduled."""
    from expertmesh.router.constraints import (
        forced_tools,
        openai_function_name,
        response_format_grammar,
        tool_call_grammar,
        where_of,
    )
    try:
        forced = forced_tools(choice, tools, named=openai_function_name)
        if forced is None:
            return response_format_grammar(response_format)
        m = fmt.markers
        if m.tool_open is None or m.tool_close is None:
            raise ValueError("tool_choice: forcing a tool call needs a chat format with tool-call marker tokens")
        return tool_call_grammar(forced, m.tool_open, m.tool_close)
    except ValueError as e:             # GrammarError included
        raise APIError(400, str(e), param=where_of(e))


def chat_logprobs(tok, tokens: list[int], entries) -> dict:
    """OpenAI chat `logprobs` for generated tokens (all of them: reasoning, content and tool-call markup, as vLLM
    reports them). A token the server forced (thinking budget) outside the top alternatives has logprob null."""
    raw = getattr(tok, "decode_bytes", None)    # the byte tokenizer's exact bytes (b"" for a special token)

    def item(token: int, logprob) -> dict:
        text = tok.decode([token], skip_special=False)
        # `bytes` carries what `token` cannot: a piece of a UTF-8 sequence (its text is U+FFFD)
        exact = raw([token]) if raw is not None else b""
        return {"token": text, "logprob": logprob, "bytes": list(exact or text.encode("utf-8"))}
    return {"content": [{**item(t, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for t, e in zip(tokens, entries)], "refusal": None}


class TokenizeBody(BaseModel):
    """vLLM's `POST /tokenize`: a completions prompt, or a chat conversation rendered as the chat endpoint does."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[dict] | None = Field(default=None, min_length=1)
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # as on /v1/chat/completions, so the count matches a request that turns thinking off
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None
    thinking_budget: None = None      # no effect on the prompt: only there for thinking_wanted


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def openai_messages(raw: list[dict], images=None) -> list[Message]:
    """`images` (router.images.ImageBudget): where user image parts go; None: image parts are refused."""
    out = []
    for i, m in enumerate(raw):
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role: {role!r} is not one of system, user, assistant, tool",
                           param=f"messages[{i}].role")
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}]: expected an object", param=f"messages[{i}]")
        for field_name in ("reasoning_content", "reasoning", "tool_call_id"):
            if m.get(field_name) is not None and not isinstance(m.get(field_name), str):
                raise APIError(400, f"messages[{i}].{field_name}: expected a string",
                               param=f"messages[{i}].{field_name}")
        raw_calls = m.get("tool_calls")
        if raw_calls is not None and not isinstance(raw_calls, list):
            raise APIError(400, f"messages[{i}].tool_calls: expected a list of tool calls",
                           param=f"messages[{i}].tool_calls")
        calls = []
        for j, c in enumerate(raw_calls or []):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not c.get("id"):
                raise APIError(400, f"messages[{i}].tool_calls[{j}]: expected {{id, type: function, function: "
                                    f"{{name, arguments}}}}", param=f"messages[{i}].tool_calls[{j}]")
            args = fn.get("arguments", "{}")
            if not isinstance(c["id"], str):
                raise APIError(400, f"messages[{i}].tool_calls[{j}].id: expected a string",
                               param=f"messages[{i}].tool_calls[{j}].id")
            calls.append(ToolCall(c["id"], fn["name"], args if isinstance(args, str) else json.dumps(args)))
        parts = None
        try:
            raw_content = m.get("content")
            if role == "user" and images is not None and isinstance(raw_content, list) and any(
                    isinstance(p, dict) and p.get("type") == "image_url" for p in raw_content):
                content, parts = _openai_parts(raw_content, images, f"messages[{i}]")
            else:
                content = _text(raw_content)
            content.encode("utf-8")
        except ImageError:
            raise
        except APIError as e:
            raise APIError(400, f"messages[{i}].{e.message}", param=f"messages[{i}].content")
        except UnicodeEncodeError as e:
            raise APIError(400, f"messages[{i}].content: not valid Unicode ({e.reason} at character {e.start})",
                           param=f"messages[{i}].content")
        reasoning = m.get("reasoning_content") if m.get("reasoning_content") is not None else m.get("reasoning")
        out.append(Message(role, content, reasoning=reasoning, tool_calls=calls,
                           tool_call_id=m.get("tool_call_id"), parts=parts))
    return out


def openai_router(engine: Engine, fmt: ChatFormat, name: str, check_model, check_key,
                  reasoning_memory=None) -> APIRouter:
    """`reasoning_memory` (router/response_store.ReasoningMemory): gives answers this router generated their
    reasoning back when a client's history drops it; None turns that off."""
    api = APIRouter()
    tok = fmt.tokenizer

    @api.post("/tokenize")
    async def tokenize(body: TokenizeBody, authorization: str | None = Header(default=None)):
        """The ids /v1/completions (prompt) or /v1/chat/completions (messages, tools) would feed: `count`
        equals that request's usage.prompt_tokens."""
        check_key(authorization)
        if body.model is not None:
            check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt / messages: expected exactly one of them", param="prompt")
        if body.messages is not None:
            if not body.add_generation_prompt:
                raise APIError(400, "add_generation_prompt: only true is supported (the chat endpoint always adds "
                                    "it)", param="add_generation_prompt")
            from expertmesh.router.responses_api import chat_prompt
            ids = chat_prompt(fmt, openai_messages(body.messages), body.tools, thinking_wanted(body),
                              reasoning_memory).ids
        else:
            if body.tools is not None:
                raise APIError(400, "tools: only with messages", param="tools")
            try:
                ids = tok.encode_prompt(body.prompt) if body.add_special_tokens else tok.encode(body.prompt)
            except ValueError as e:
                raise APIError(400, f"prompt: {e}", param="prompt")
        strs = [tok.decode([i], skip_special=False) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.cfg.max_context, "tokens": ids, "token_strs": strs}

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeBody, authorization: str | None = Header(default=None)):
        check_key(authorization)
        if body.model is not None:
            check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.cfg.vocab_size]
        if bad:
            raise APIError(400, f"tokens: id {bad[0]} outside [0, {engine.cfg.vocab_size})", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    @api.post("/v1/chat/completions")
    async def chat(body: ChatBody, http_request: Request, authorization: str | None = Header(default=None)):
        check_key(authorization)
        check_model(body.model)
        grammar = constraint_grammar(fmt, body.tool_choice, body.tools, body.response_format)
        thinking = thinking_wanted(body)
        try:
            effort = None if body.reasoning_effort == "none" else body.reasoning_effort
            tier = tier_from_request(thinking_budget=body.thinking_budget, reasoning_effort=effort)
        except ChatError as e:
            raise APIError(400, str(e), param="reasoning_effort" if body.reasoning_effort else "thinking_budget")
        if body.tool_choice == "none":
            tools = None
        else:
            tools = body.tools
        # unset: whatever the context leaves after the prompt (vLLM, OpenAI), resolved once the prompt is rendered
        max_tokens = next((v for v in (body.max_completion_tokens, body.max_tokens) if v is not None), None)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs={body.top_logprobs}: expected an integer in [0, {MAX_LOGPROBS}]",
                           param="top_logprobs")
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        from expertmesh.router.responses_api import answer_segment, chat_prompt, truncate_messages
        images = ImageBudget(engine.cfg.vision, engine.image_limits,
                             await fetch_remote(openai_image_urls(body.messages), engine.image_limits))
        history = openai_messages(body.messages, images)   # what the client sent (reasoning filled in): the answer's key
        rendered = chat_prompt(fmt, history, tools, thinking, reasoning_memory)
        report, headers = None, {}
        if body.truncation == "auto":
            kept, report = truncate_messages(fmt, history, tools, thinking,
                                             limit=engine.cfg.max_context - (max_tokens or 1))
            if report:
                rendered = render_prompt(fmt, kept, tools, thinking)
                headers = {"x-expertmesh-truncation": json.dumps(report, separators=(",", ":"))}
        if max_tokens is None:   # an over-long prompt keeps 1, so the engine answers context_length_exceeded
            max_tokens = max(engine.cfg.max_context - len(rendered.ids), 1)
        run = submit_chat(engine, fmt, rendered, tier=tier, thinking=thinking,
                          max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                          logprobs=n_top, stop=[body.stop] if isinstance(body.stop, str) else body.stop,
                          sampling=body.sampling_kwargs(), images=message_images(kept if report else history),
                          grammar=grammar)

        def logprobs(start: int, end: int) -> dict | None:
            if n_top is None:
                return None
            return chat_logprobs(fmt.tokenizer, run.req.output[start:end], run.req.logprobs[start:end])
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())

        def usage(parsed) -> dict:
            u = run.usage_counts(parsed)
            return {"prompt_tokens": u["prompt"], "completion_tokens": u["completion"],
                    "total_tokens": u["prompt"] + u["completion"],
                    "prompt_tokens_details": {"cached_tokens": u["cached"]},
                    "completion_tokens_details": {"reasoning_tokens": u["reasoning"]}}

        def remember(parsed) -> None:
            if reasoning_memory is not None and run.stop_hit is None:
                answer = answer_segment(fmt, run, parsed, (), thinking)
                reasoning_memory.remember(history, answer.message, answer.ids)

        def tool_calls_json(parsed) -> list[dict]:
            return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parsed.tool_calls]

        if not body.stream:
            parsed = await run.answer(http_request)
            remember(parsed)
            message = {"role": "assistant", "content": parsed.content or None,
                       "reasoning_content": parsed.reasoning or None}
            if parsed.tool_calls:
                message["tool_calls"] = tool_calls_json(parsed)
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": name,
                                 "choices": [{"index": 0, "message": message,
                                              "finish_reason": run.finish_reason(parsed),
                                              "logprobs": logprobs(0, len(run.req.output))}],
                                 "usage": usage(parsed), "thinking_budget": run.tier,
                                 **({"truncation_report": report} if report else {})}, headers=headers)

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        scored = 0      # generated tokens whose logprobs went out in a chunk

        def chunk(delta: dict, reason: str | None = None, upto: int | None = None) -> str:
            nonlocal scored
            lp = None
            if upto is not None and upto > scored:
                lp, scored = logprobs(scored, upto), upto
            return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                          "model": name, "choices": [{"index": 0, "delta": delta,
                                                                      "finish_reason": reason,
                                                                      "logprobs": lp}]}) + "\n\n"

        async def sse():
            yield chunk({"role": "assistant", "content": ""})
            sent = ""
            try:
                async for kind, text in run.events():
                    if kind == "content":
                        sent += text
                    yield chunk({"reasoning_content": text} if kind == "reasoning" else {"content": text},
                                upto=run.consumed)
                parsed = run.result()
                remember(parsed)
                run.record(parsed)
                if parsed.content.startswith(sent) and len(parsed.content) > len(sent):
                    yield chunk({"content": parsed.content[len(sent):]})   # held-back malformed tool call
                for i, call in enumerate(tool_calls_json(parsed)):
                    yield chunk({"tool_calls": [{"index": i, **call}]})
                yield chunk({}, run.finish_reason(parsed), upto=len(run.req.output))
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                                 "model": name, "choices": [], "usage": usage(parsed)}) + "\n\n"
            except Exception as e:
                run.fail(e)
                err = error_from_exception(e)
                yield "data: " + json.dumps({"error": {"message": err.message, "type": err.type,
                                                       "code": err.code}}) + "\n\n"
            finally:
                if run.req is not None and not run.req.done:
                    engine.cancel(run.req)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    return api


# ----------------------------------------------------------------------------------------------- Anthropic
class CountTokensBody(AcceptedNoOps):
    """What decides a messages request's prompt (Anthropic `POST /v1/messages/count_tokens`)."""
    model: str
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    thinking_budget: str | None = None


class MessagesBody(CountTokensBody):
    max_tokens: int
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stop_sequences: list[str] | None = None


class AnthropicError(APIError):
    def response(self) -> JSONResponse:
        kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
        return JSONResponse(status_code=self.status, content={"type": "error", "error": {
            "type": kinds.get(self.status, "api_error"), "message": self.message}})


def _as_anthropic(e: Exception) -> AnthropicError:
    err = error_from_exception(e)
    return AnthropicError(err.status, err.message, err.type, err.param, err.code)


def _block_text(b: dict, key: str, where: str) -> str:
    value = b.get(key, "")
    if not isinstance(value, str):
        raise AnthropicError(400, f"{where}.{key}: expected a string, found {type(value).__name__}")
    return value


def anthropic_image(b: dict, images, where: str):
    """An `image` block (source base64, or url when the server allows remote hosts) → PreparedImage."""
    if images is None:
        raise AnthropicError(400, f"{where}.type: 'image' is not supported here")
    source = b.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return images.from_base64(source.get("media_type"), source.get("data"), where)
    if kind == "url":
        return images.from_url(source.get("url"), where)
    raise AnthropicError(400, f"{where}.source.type: {kind!r} is not one of base64, url")


def anthropic_image_urls(raw: list) -> dict[str, str]:
    """{block: url} of the remote image URLs in Anthropic messages (fetched before parsing)."""
    from expertmesh.router.images import is_remote
    out = {}
    for i, m in enumerate(raw):
        content = m.get("content") if isinstance(m, dict) else None
        for j, b in enumerate(content if isinstance(content, list) else ()):
            source = b.get("source") if isinstance(b, dict) and b.get("type") == "image" else None
            if isinstance(source, dict) and source.get("type") == "url" and is_remote(source.get("url")):
                out[f"messages.{i}.content.{j}"] = source["url"]
    return out


def anthropic_messages(body: MessagesBody, images=None) -> list[Message]:
    """`images` (router.images.ImageBudget): where image blocks go; None: they are refused."""
    out: list[Message] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(
            b.get("text", "") for b in body.system if isinstance(b, dict))
        out.append(Message("system", system))
    for i, m in enumerate(body.messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise AnthropicError(400, f"messages.{i}.role: {role!r} is not one of user, assistant")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise AnthropicError(400, f"messages.{i}.content: expected a string or a list of content blocks")
        if role == "user":
            texts, parts = [], []
            for j, b in enumerate(blocks):
                kind = b.get("type") if isinstance(b, dict) else None
                if kind == "tool_result":
                    result = b.get("content", "")
                    if isinstance(result, list):
                        result = "".join(x.get("text", "") for x in result if isinstance(x, dict))
                    out.append(Message("tool", str(result), tool_call_id=b.get("tool_use_id")))
                elif kind == "text":
                    texts.append(_block_text(b, "text", f"messages.{i}.content.{j}"))
                    parts.append(texts[-1])
                elif kind == "image":
                    parts.append(anthropic_image(b, images, f"messages.{i}.content.{j}"))
                else:
                    raise AnthropicError(400, f"messages.{i}.content.{j}.type: {kind!r} is not supported in a "
                                              f"user turn (text, image, tool_result)")
            if len(parts) > len(texts):
                out.append(Message("user", "".join(texts), parts=parts))
            elif texts:
                out.append(Message("user", "".join(texts)))
        else:
            msg = Message("assistant")
            for j, b in enumerate(blocks):
                kind = b.get("type") if isinstance(b, dict) else None
                if kind == "thinking":
                    msg.reasoning = (msg.reasoning or "") + _block_text(b, "thinking", f"messages.{i}.content.{j}")
                elif kind == "text":
                    msg.content += _block_text(b, "text", f"messages.{i}.content.{j}")
                elif kind == "tool_use":
                    msg.tool_calls.append(ToolCall(b.get("id", ""), b.get("name", ""),
                                                   json.dumps(b.get("input", {}))))
                else:
                    raise AnthropicError(400, f"messages.{i}.content.{j}.type: {kind!r} is not supported in an "
                                              f"assistant turn (text, thinking, tool_use)")
            out.append(msg)
    return out


@dataclass
class AnthropicPrompt:
    messages: list[Message]
    tools: list[dict] | None
    thinking: bool
    tier: str
    thinking_limit: int | None = None    # budget_tokens: an exact limit on thinking tokens
    grammar: str | None = None           # tool_choice any / tool: the forced call's grammar


ADAPTIVE_TIER = "high"   # thinking.type "adaptive": the model decides, within this tier's limit


def anthropic_prompt(body: CountTokensBody, budgets, images=None, fmt: ChatFormat | None = None) -> AnthropicPrompt:
    """The conversation, tools and thinking of a messages request, as the chat format renders them."""
    kind = (body.thinking or {}).get("type", "disabled")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise AnthropicError(400, f"thinking.type: {kind!r} is not one of enabled, disabled, adaptive",
                             param="thinking.type")
    thinking = kind != "disabled"
    budget_tokens = body.thinking.get("budget_tokens") if kind == "enabled" else None
    if kind == "enabled" and (not isinstance(budget_tokens, int) or isinstance(budget_tokens, bool)):
        raise AnthropicError(400, f"thinking.budget_tokens: expected an integer, found {budget_tokens!r}")
    tier = tier_from_request(thinking_budget=body.thinking_budget or (ADAPTIVE_TIER if kind == "adaptive" else None),
                             budget_tokens=budget_tokens, budgets=budgets)
    kind = (body.tool_choice or {}).get("type", "auto")
    if kind not in ("auto", "none", "any", "tool"):
        raise AnthropicError(400, f"tool_choice.type: {kind!r} is not one of auto, none, any, tool",
                             param="tool_choice")
    if kind == "none":
        body = body.model_copy(update={"tools": None})
    tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                               "parameters": t.get("input_schema", {})}}
             for t in (body.tools or [])] or None
    exact = budget_tokens if body.thinking_budget is None else None
    # any / tool force a call (the same grammar as OpenAI's required / named); 400s name Anthropic's fields
    choice = "required" if kind == "any" else \
        {"type": "function", "function": {"name": body.tool_choice.get("name")}} if kind == "tool" else None
    try:
        grammar = constraint_grammar(fmt, choice, tools) if fmt is not None and choice else None
    except APIError as e:
        where = (e.param or "tool_choice").replace("function.parameters", "input_schema")
        raise AnthropicError(400, e.message.replace("function.parameters", "input_schema"), param=where) from None
    return AnthropicPrompt(anthropic_messages(body, images), tools, thinking, tier, exact, grammar)


def anthropic_router(engine: Engine, fmt: ChatFormat, name: str, check_model, check_key) -> APIRouter:
    api = APIRouter()

    async def anthropic_images(body) -> ImageBudget:
        limits = engine.image_limits
        return ImageBudget(engine.cfg.vision, limits, await fetch_remote(anthropic_image_urls(body.messages), limits))

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensBody, x_api_key: str | None = Header(default=None),
                           authorization: str | None = Header(default=None)):
        """The prompt tokens /v1/messages would feed for this request (= its usage's input_tokens +
        cache_read_input_tokens)."""
        try:
            check_key(f"Bearer {x_api_key}" if x_api_key else authorization)
            check_model(body.model)
            p = anthropic_prompt(body, engine.cfg.thinking, await anthropic_images(body))
            return {"input_tokens": len(render_prompt(fmt, p.messages, p.tools, p.thinking).ids)}
        except AnthropicError:
            raise
        except Exception as e:
            raise _as_anthropic(e)

    @api.post("/v1/messages")
    async def messages(body: MessagesBody, x_api_key: str | None = Header(default=None),
                       authorization: str | None = Header(default=None)):
        try:
            check_key(f"Bearer {x_api_key}" if x_api_key else authorization)
            check_model(body.model)
            p = anthropic_prompt(body, engine.cfg.thinking, await anthropic_images(body), fmt)
            thinking = p.thinking
            run = start_chat(engine, fmt, p.messages, p.tools, tier=p.tier, thinking=thinking,
                             max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, seed=None,
                             api="anthropic", stop=body.stop_sequences, sampling={"top_k": body.top_k},
                             thinking_limit=p.thinking_limit, grammar=p.grammar)
        except AnthropicError:
            raise
        except Exception as e:
            raise _as_anthropic(e)
        mid = f"msg_{uuid.uuid4().hex[:24]}"

        def stop_reason(parsed) -> str:
            if run.stop_hit is not None:
                return "stop_sequence"
            return {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}[run.finish_reason(parsed)]

        def usage(parsed) -> dict:
            u = run.usage_counts(parsed)
            return {"input_tokens": u["prompt"] - u["cached"], "cache_read_input_tokens": u["cached"],
                    "cache_creation_input_tokens": 0, "output_tokens": u["completion"]}

        def blocks(parsed) -> list[dict]:
            out = []
            if thinking:
                out.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
            if parsed.content or not parsed.tool_calls:
                out.append({"type": "text", "text": parsed.content})
            for c in parsed.tool_calls:
                out.append({"type": "tool_use", "id": c.id.replace("call_", "toolu_"), "name": c.name,
                            "input": json.loads(c.arguments)})
            return out

        if not body.stream:
            try:
                await run.wait()
            except Exception as e:
                run.fail(e)
                raise _as_anthropic(e)
            parsed = run.result()
            return {"id": mid, "type": "message", "role": "assistant", "model": name, "content": blocks(parsed),
                    "stop_reason": stop_reason(parsed), "stop_sequence": run.stop_hit, "usage": usage(parsed)}

        def event(kind: str, data: dict) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        async def sse():
            yield event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": name, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(run.prompt), "output_tokens": 0}}})
            index, open_kind = -1, None
            sent = ""
            try:
                async for kind, text in run.events():
                    block = "thinking" if kind == "reasoning" else "text"
                    if block == "text":
                        sent += text
                    if block != open_kind:
                        if open_kind is not None:
                            if open_kind == "thinking":
                                yield event("content_block_delta", {"index": index, "delta": {
                                    "type": "signature_delta", "signature": ""}})
                            yield event("content_block_stop", {"index": index})
                        index += 1
                        open_kind = block
                        start = {"type": "thinking", "thinking": "", "signature": ""} if block == "thinking" \
                            else {"type": "text", "text": ""}
                        yield event("content_block_start", {"index": index, "content_block": start})
                    delta = {"type": "thinking_delta", "thinking": text} if block == "thinking" \
                        else {"type": "text_delta", "text": text}
                    yield event("content_block_delta", {"index": index, "delta": delta})
                parsed = run.result()
                run.record(parsed)
                if index == -1:                 # nothing streamed: still one (empty) block, as Anthropic sends
                    index, open_kind = 0, "thinking" if thinking else "text"
                    start = {"type": "thinking", "thinking": "", "signature": ""} if thinking \
                        else {"type": "text", "text": ""}
                    yield event("content_block_start", {"index": 0, "content_block": start})
                rest = parsed.content[len(sent):] if parsed.content.startswith(sent) else ""
                if rest:                                   # held-back malformed tool call, as text
                    if open_kind != "text":
                        if open_kind is not None:
                            yield event("content_block_stop", {"index": index})
                        index += 1
                        open_kind = "text"
                        yield event("content_block_start", {"index": index,
                                                            "content_block": {"type": "text", "text": ""}})
                    yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta",
                                                                                  "text": rest}})
                if open_kind is not None:
                    yield event("content_block_stop", {"index": index})
                for c in parsed.tool_calls:
                    index += 1
                    yield event("content_block_start", {"index": index, "content_block": {
                        "type": "tool_use", "id": c.id.replace("call_", "toolu_"), "name": c.name, "input": {}}})
                    yield event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": c.arguments}})
                    yield event("content_block_stop", {"index": index})
                yield event("message_delta", {"delta": {"stop_reason": stop_reason(parsed),
                                                        "stop_sequence": run.stop_hit},
                                              "usage": usage(parsed)})      # cache reads known by now
                yield event("message_stop", {})
            except Exception as e:
                run.fail(e)
                err = _as_anthropic(e)
                yield f"event: error\ndata: {json.dumps({'type': 'error', 'error': {'type': 'api_error', 'message': err.message}})}\n\n"
            finally:
                if run.req is not None and not run.req.done:
                    engine.cancel(run.req)

        return StreamingResponse(sse(), media_type="text/event-stream")

    return api
