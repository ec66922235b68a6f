"""OpenAI-compatible endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streamed or not), and vLLM's
`POST /tokenize` / `POST /detokenize`. The bodies are router/protocol.py's; what a parameter means is decided in
router/serving.py; here a body becomes a serving request, and a run becomes OpenAI's JSON or SSE chunks."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from expertmesh.chat import Message, message_images
from expertmesh.router.constraints import CHAT_FIELDS, answer_grammar
from expertmesh.router.conversation import (
    answer_segment,
    chat_prompt,
    prompt_tools,
    render_prompt,
    truncate_messages,
)
from expertmesh.router.decoding import TextStream
from expertmesh.router.dependencies import Served, openai_key, served, served_model
from expertmesh.router.errors import APIError, as_api_error
from expertmesh.router.images import request_images
from expertmesh.router.messages import OPENAI, openai_messages, remote_image_urls
from expertmesh.router.protocol import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from expertmesh.router.request import TokenLogprob
from expertmesh.router.serving import (
    ChatRequest,
    ChatResult,
    ChatRun,
    CompletionRun,
    cancel_when_gone,
    decide_thinking,
    max_tokens_for,
    prompt_options,
    prompt_room,
    start_chat,
    thinking_headers,
)
from expertmesh.sampling_params import MAX_LOGPROBS, SamplingParams

router = APIRouter(dependencies=[Depends(openai_key)])


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def sse_error(e: Exception) -> str:
    err = as_api_error(e)
    return sse({"error": {"message": err.message, "type": err.type, "code": err.code}})


# ----------------------------------------------------------------------------------------------- completions
class CompletionLogprobs:
    """The legacy completions `logprobs` object, built piece by piece (a stream sends one per chunk): token
    strings, their log-probabilities (None for the prompt's first token, which nothing predicts), top
    alternatives (the N most likely plus the chosen token, as OpenAI documents) and character offsets of the
    token strings, counted from the start of the returned text."""

    def __init__(self, tok, offset: int = 0):
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


def completion_prompt(body: CompletionBody, tok) -> tuple[list[int], str]:
    """The prompt's ids and the text `echo` returns (one prompt: a string, a one-string list or token ids)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError("prompt: only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    try:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("prompt: expected a non-empty string", param="prompt")
            return tok.encode_prompt(prompt), prompt
        if not prompt:
            raise APIError("prompt: expected at least one token", param="prompt")
        return list(prompt), tok.decode(prompt) if body.echo else ""
    except ValueError as e:
        raise APIError(f"prompt: {e}", param="prompt") from None


class TextCompletion:
    """One /v1/completions request over its run: the text through the stop strings, logprobs, the response."""

    def __init__(self, body: CompletionBody, run: CompletionRun, tok, name: str, echo_text: str):
        self.body, self.run, self.tok, self.name, self.echo_text = body, run, tok, name, echo_text
        self.text = TextStream(tok, [body.stop] if isinstance(body.stop, str) else list(body.stop or []))
        self.lp = CompletionLogprobs(tok)
        self.rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        self.fed = 0       # output tokens given to the text stream (a stop string ends the text, and the logprobs)

    def feed(self, token: int) -> str:
        self.fed += 1
        piece = self.text.feed(token)
        if self.text.stopped:
            self.run.engine.cancel(self.run.req)
        return piece

    def finish_reason(self) -> str:
        return "stop" if self.text.stopped or self.run.req.finish_reason == "stop" else "length"

    def usage(self) -> dict:
        u = self.run.usage()
        return {"prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.total,
                "prompt_tokens_details": {"cached_tokens": u.cached}}

    def chunk(self, text: str, reason: str | None, logprobs: dict | None = None) -> dict:
        return {"id": self.rid, "object": "text_completion", "created": int(time.time()), "model": self.name,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}]}

    def echo_logprobs(self) -> dict | None:
        if self.body.logprobs is None:
            return None
        req, n = self.run.req, len(self.run.prompt)
        return self.lp.block(self.run.prompt, [None] + [req.prompt_logprobs.get(i) for i in range(1, n)])

    def output_logprobs(self, start: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        req = self.run.req
        return self.lp.block(req.output[start:self.fed], req.logprobs[start:self.fed])


async def complete_text(c: TextCompletion, is_disconnected) -> dict:
    run = c.run
    watcher = cancel_when_gone(is_disconnected, run.engine, run.req)
    try:
        async for token in run.tokens():
            c.feed(token)
            if c.text.stopped:
                break
    except Exception as e:
        raise run.finish(None, e) from e
    finally:
        watcher.cancel()
    run.finish(c.finish_reason())
    text = c.text.text + c.text.flush()
    logprobs = None
    if c.body.echo:
        text = c.echo_text + text
        logprobs = c.echo_logprobs()
    if c.body.logprobs is not None:
        out = c.output_logprobs(0)
        logprobs = c.lp.join(logprobs, out) if logprobs else out
    return {**c.chunk(text, c.finish_reason(), logprobs), "usage": c.usage()}


async def stream_text(c: TextCompletion):
    run = c.run
    sent = 0                   # output tokens whose logprobs went out
    echoed = not c.body.echo

    def echo_chunk() -> str:   # once the prompt is scored (with the first event)
        return sse(c.chunk(c.echo_text, None, c.echo_logprobs()))
    try:
        async for token in run.tokens():
            if not echoed:
                echoed = True
                yield echo_chunk()
            piece = c.feed(token)
            if piece:
                yield sse(c.chunk(piece, None, c.output_logprobs(sent)))
                sent = c.fed
            if c.text.stopped:
                break
        if not echoed:
            yield echo_chunk()
        tail = c.text.flush()
        run.finish(c.finish_reason())
        yield sse(c.chunk(tail, c.finish_reason(), c.output_logprobs(sent)))
        if c.body.stream_options and c.body.stream_options.get("include_usage"):
            yield sse({**c.chunk("", None), "choices": [], "usage": c.usage()})
    except Exception as e:
        yield sse_error(run.finish(None, e))
    finally:
        run.close()
    yield sse("[DONE]")


@router.post("/v1/completions")
async def completions(http_request: Request, body: CompletionBody = served_model(CompletionBody),
                      s: Served = Depends(served)):
    tok = s.fmt.tokenizer
    prompt, echo_text = completion_prompt(body, tok)
    max_tokens = max_tokens_for(body.max_tokens, chat=False, scoring=body.echo)
    # echo + logprobs scores the prompt too (vLLM's prompt_logprobs); max_tokens=0 with echo only scores
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                            stop_token_ids=tuple(tok.eos_ids), logprobs=body.logprobs,
                            prompt_logprobs=prompt_logprobs, **body.sampling_kwargs())
    c = TextCompletion(body, CompletionRun(s.engine, prompt, params, model=s.name), tok, s.name, echo_text)
    if not body.stream:
        return await complete_text(c, http_request.is_disconnected)
    return StreamingResponse(stream_text(c), media_type="text/event-stream")


# ----------------------------------------------------------------------------------------------- chat
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


def top_logprobs(body: ChatBody) -> int | None:
    """Alternatives per token to report (None: no logprobs)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs: requires logprobs: true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(f"top_logprobs={body.top_logprobs}: expected an integer in [0, {MAX_LOGPROBS}]",
                       param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


class ChatCompletion:
    """One /v1/chat/completions request over its run: the response, or its chunks."""

    def __init__(self, body: ChatBody, run: ChatRun, s: Served, history: list[Message], n_top: int | None,
                 report: dict | None):
        self.body, self.run, self.s, self.history, self.n_top, self.report = body, run, s, history, n_top, report
        self.rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.scored = 0      # generated tokens whose logprobs went out in a chunk

    def logprobs(self, start: int, end: int) -> dict | None:
        if self.n_top is None:
            return None
        req = self.run.req
        return chat_logprobs(self.s.fmt.tokenizer, req.output[start:end], req.logprobs[start:end])

    @staticmethod
    def usage(r: ChatResult) -> dict:
        u = r.usage
        return {"prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.total,
                "prompt_tokens_details": {"cached_tokens": u.cached},
                "completion_tokens_details": {"reasoning_tokens": u.reasoning}}

    def remember(self, r: ChatResult) -> None:
        """What the reasoning memory keeps of this answer (a client may send it back without its reasoning)."""
        if self.s.memory is not None and r.stop_hit is None:
            answer = answer_segment(self.s.fmt, self.run.req.output, r.parsed, (), self.run.thinking.on)
            self.s.memory.remember(self.history, answer.message, answer.ids)

    @staticmethod
    def tool_calls(r: ChatResult) -> list[dict]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in r.tool_calls]

    def response(self, r: ChatResult) -> dict:
        message = {"role": "assistant", "content": r.content or None, "reasoning_content": r.reasoning or None}
        if r.tool_calls:
            message["tool_calls"] = self.tool_calls(r)
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.s.name,
                "choices": [{"index": 0, "message": message, "finish_reason": r.finish_reason,
                             "logprobs": self.logprobs(0, len(self.run.req.output))}],
                "usage": self.usage(r), "thinking_budget": self.run.tier,
                **({"truncation_report": self.report} if self.report else {})}

    def chunk(self, delta: dict, reason: str | None = None, upto: int | None = None) -> str:
        lp = None
        if upto is not None and upto > self.scored:
            lp, self.scored = self.logprobs(self.scored, upto), upto
        return sse({"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.s.name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": lp}]})

    async def chunks(self):
        run = self.run
        yield self.chunk({"role": "assistant", "content": ""})
        try:
            async for kind, text in run.events():
                yield self.chunk({"reasoning_content": text} if kind == "reasoning" else {"content": text},
                                 upto=run.consumed)
            r = run.finish()
            self.remember(r)
            if r.unsent:
                yield self.chunk({"content": r.unsent})          # held-back malformed tool call
            for i, call in enumerate(self.tool_calls(r)):
                yield self.chunk({"tool_calls": [{"index": i, **call}]})
            yield self.chunk({}, r.finish_reason, upto=len(run.req.output))
            if (self.body.stream_options or {}).get("include_usage"):
                yield sse({"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                           "model": self.s.name, "choices": [], "usage": self.usage(r)})
        except Exception as e:
            yield sse_error(run.fail(e))
        finally:
            run.close()
        yield sse("[DONE]")


@router.post("/v1/chat/completions")
async def chat(http_request: Request, body: ChatBody = served_model(ChatBody), s: Served = Depends(served)):
    engine, fmt = s.engine, s.fmt
    grammar = _grammar(answer_grammar, fmt, body.tool_choice, body.tools, body.response_format, CHAT_FIELDS)
    thinking = decide_thinking(thinking_budget=body.thinking_budget, reasoning_effort=body.reasoning_effort,
                               template_kwargs=body.chat_template_kwargs)
    max_tokens = next((v for v in (body.max_completion_tokens, body.max_tokens) if v is not None), None)
    n_top = top_logprobs(body)
    images = await request_images(engine.cfg.vision, engine.image_limits, remote_image_urls(body.messages, OPENAI))
    history = openai_messages(body.messages, images)   # what the client sent (reasoning filled in): the answer's key
    thinking = thinking.for_round([m.role for m in history])
    options = prompt_options(thinking, body.tool_choice, body.response_format)
    tools = prompt_tools(fmt, body.tools, options.tool_choice)
    rendered = chat_prompt(fmt, history, tools, thinking.on, s.memory, options)
    kept, report, headers = history, None, thinking_headers(thinking)
    if body.truncation == "auto":
        kept, report = truncate_messages(fmt, history, tools, thinking.on, options=options,
                                         limit=prompt_room(engine.cfg.max_context, max_tokens))
        if report:
            rendered = render_prompt(fmt, kept, tools, thinking.on, options)
            headers["x-expertmesh-truncation"] = json.dumps(report, separators=(",", ":"))
    run = start_chat(engine, fmt, ChatRequest(
        rendered, thinking, tools=body.tools, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        seed=body.seed,
        sampling={**body.sampling_kwargs(), "logprobs": n_top}, grammar=grammar, images=message_images(kept),
        stop=[body.stop] if isinstance(body.stop, str) else body.stop or []))
    reply = ChatCompletion(body, run, s, history, n_top, report)
    if body.stream:
        return StreamingResponse(reply.chunks(), media_type="text/event-stream", headers=headers)
    r = await run.complete(http_request.is_disconnected)
    reply.remember(r)
    return JSONResponse(reply.response(r), headers=headers)


def _grammar(fn, *args):
    """A grammar function's GrammarError as the 400 naming its field."""
    try:
        return fn(*args)
    except ValueError as e:
        raise as_api_error(e) from None


# ----------------------------------------------------------------------------------------------- tokens
@router.post("/tokenize")
async def tokenize(body: TokenizeBody = served_model(TokenizeBody), s: Served = Depends(served)):
    """The ids /v1/completions (prompt) or /v1/chat/completions (messages, tools) would feed: `count` equals that
    request's usage.prompt_tokens."""
    tok = s.fmt.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError("prompt / messages: expected exactly one of them", param="prompt")
    if body.messages is not None:
        if not body.add_generation_prompt:
            raise APIError("add_generation_prompt: only true is supported (the chat endpoint always adds it)",
                           param="add_generation_prompt")
        thinking = decide_thinking(thinking_budget=body.thinking_budget, reasoning_effort=body.reasoning_effort,
                                   template_kwargs=body.chat_template_kwargs)
        messages = openai_messages(body.messages)
        thinking = thinking.for_round([m.role for m in messages])
        options = prompt_options(thinking, body.tool_choice, body.response_format)
        tools = prompt_tools(s.fmt, body.tools, options.tool_choice)
        ids = chat_prompt(s.fmt, messages, tools, thinking.on, s.memory, options).ids
    else:
        if body.tools is not None:
            raise APIError("tools: only with messages", param="tools")
        try:
            ids = tok.encode_prompt(body.prompt) if body.add_special_tokens else tok.encode(body.prompt)
        except ValueError as e:
            raise APIError(f"prompt: {e}", param="prompt") from None
    strs = [tok.decode([i], skip_special=False) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": s.engine.cfg.max_context, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody = served_model(DetokenizeBody), s: Served = Depends(served)):
    vocab = s.engine.cfg.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(f"tokens: id {bad[0]} outside [0, {vocab})", param="tokens")
    return {"prompt": s.fmt.tokenizer.decode(body.tokens)}
