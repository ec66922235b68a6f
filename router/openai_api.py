"""OpenAI-compatible endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streamed or not), and vLLM's
`POST /tokenize` / `POST /detokenize`. The bodies are router/protocol.py's; what a parameter means is decided in
router/serving.py; here a body becomes a serving request, and a run becomes OpenAI's JSON or SSE chunks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from expertmesh.chat.format import Message
from expertmesh.router.chat_prep import ChatInput, ThinkingAsk, max_tokens_for, prepare_chat, prepare_chat_off_loop
from expertmesh.router.constraints import CHAT_FIELDS, answer_grammar, compile_off_loop
from expertmesh.router.conversation import answer_segment
from expertmesh.router.decoding import TextStream
from expertmesh.router.dependencies import Served, openai_key, served, served_model
from expertmesh.router.errors import APIError, as_api_error
from expertmesh.router.messages import OPENAI, openai_messages, remote_image_urls
from expertmesh.router.prefix_scope import PrefixScope
from expertmesh.router.protocol import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from expertmesh.router.request import TokenLogprob
from expertmesh.router.serving import (
    ChatRequest,
    ChatResult,
    ChatRun,
    CompletionRun,
    cancel_when_gone,
    start_chat,
    start_samples,
)
from expertmesh.router.text_bounds import check_ids, check_text, off_loop
from expertmesh.wire.sampling_params import MAX_LOGPROBS, SamplingParams

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
                top.setdefault(self._text(t), lp)  # two ids with one string: the likelier one's value
            if e.logprob is not None:
                top.setdefault(text, e.logprob)
            out["top_logprobs"].append(top)
        return out

    @staticmethod
    def join(a: dict, b: dict) -> dict:
        return {k: a[k] + b[k] for k in a}


def completion_prompt(body: CompletionBody, tok, context: int) -> tuple[list[int], str]:
    """The prompt's ids and the text `echo` returns (one prompt: a string, a one-string list or token ids); a text
    that cannot fit `context` refused before it is encoded (router/text_bounds.py). Encodes: call it off the loop."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError("prompt: only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    try:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("prompt: expected a non-empty string", param="prompt")
            check_text(prompt, tok, context, "prompt")
            return tok.encode_prompt(prompt), prompt
        if not prompt:
            raise APIError("prompt: expected at least one token", param="prompt")
        return list(prompt), tok.decode(prompt) if body.echo else ""
    except ValueError as e:
        raise APIError(f"prompt: {e}", param="prompt") from None


class TextCompletion:
    """One choice of a /v1/completions request over its run: the text through the stop strings, logprobs, the
    choice. `return_token_ids` (vLLM's): the prompt's ids (the choice's first chunk) and the generated ids (each
    chunk: the ids since the last one)."""

    def __init__(
        self,
        body: CompletionBody,
        run: CompletionRun,
        tok,
        name: str,
        echo_text: str,
        *,
        index: int = 0,
        rid: str | None = None,
        created: int | None = None,
    ):
        self.body, self.run, self.tok, self.name, self.echo_text = body, run, tok, name, echo_text
        self.index = index
        self.text = TextStream(tok, [body.stop] if isinstance(body.stop, str) else list(body.stop or []))
        self.lp = CompletionLogprobs(tok)
        self.rid = rid or f"cmpl-{uuid.uuid4().hex[:24]}"
        self.created = created or int(time.time())
        self.fed = 0  # output tokens given to the text stream (a stop string ends the text, and the logprobs)
        self.ided = 0  # output tokens whose ids went out in a chunk
        self.prompted = False

    def feed(self, token: int) -> str:
        self.fed += 1
        piece = self.text.feed(token)
        if self.text.stopped:
            self.run.engine.cancel(self.run.req)
        return piece

    def finish_reason(self) -> str:
        return "stop" if self.text.stopped or self.run.req.finish_reason == "stop" else "length"

    @staticmethod
    def usage(choices: list[TextCompletion]) -> dict:
        """The prompt once (the samples share it), every sample's output."""
        u = choices[0].run.usage()
        completion = sum(c.run.usage().completion for c in choices)
        return {
            "prompt_tokens": u.prompt,
            "completion_tokens": completion,
            "total_tokens": u.prompt + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached},
        }

    def choice(self, text: str, reason: str | None, logprobs: dict | None = None, upto: int | None = None) -> dict:
        ids = {}
        if self.body.return_token_ids:
            if not self.prompted:
                ids["prompt_token_ids"], self.prompted = list(self.run.prompt), True
            end = self.fed if upto is None else upto
            ids["token_ids"], self.ided = list(self.run.req.output[self.ided : end]), max(self.ided, end)
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason, **ids}

    def chunk(self, choices: list[dict]) -> dict:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.name,
            "choices": choices,
        }

    def echo_logprobs(self) -> dict | None:
        if self.body.logprobs is None:
            return None
        req, n = self.run.req, len(self.run.prompt)
        return self.lp.block(self.run.prompt, [None] + [req.prompt_logprobs.get(i) for i in range(1, n)])

    def output_logprobs(self, start: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        req = self.run.req
        return self.lp.block(req.output[start : self.fed], req.logprobs[start : self.fed])


async def complete_text(c: TextCompletion, is_disconnected) -> dict:
    """One choice, whole."""
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
    return c.choice(text, c.finish_reason(), logprobs)


async def stream_text(c: TextCompletion):
    """One choice's chunks."""
    run = c.run
    sent = 0  # output tokens whose logprobs went out
    echoed = not c.body.echo

    def echo_chunk() -> str:  # once the prompt is scored (with the first event)
        return sse(c.chunk([c.choice(c.echo_text, None, c.echo_logprobs(), upto=0)]))

    try:
        async for token in run.tokens():
            if not echoed:
                echoed = True
                yield echo_chunk()
            piece = c.feed(token)
            if piece:
                yield sse(c.chunk([c.choice(piece, None, c.output_logprobs(sent))]))
                sent = c.fed
            if c.text.stopped:
                break
        if not echoed:
            yield echo_chunk()
        tail = c.text.flush()
        run.finish(c.finish_reason())
        yield sse(c.chunk([c.choice(tail, c.finish_reason(), c.output_logprobs(sent))]))
    except Exception as e:
        raise run.finish(None, e) from e


async def stream_texts(choices: list[TextCompletion]):
    try:
        async for chunk in merged([stream_text(c) for c in choices]):
            yield chunk
        body = choices[0].body
        if body.stream_options and body.stream_options.get("include_usage"):
            yield sse({**choices[0].chunk([]), "usage": TextCompletion.usage(choices)})
    except Exception as e:
        yield sse_error(e)
    finally:
        for c in choices:
            c.run.close()
    yield sse("[DONE]")


@router.post("/v1/completions")
async def completions(
    http_request: Request,
    body: CompletionBody = served_model(CompletionBody),
    s: Served = Depends(served),
    tenant: str = Depends(openai_key),
):
    tok = s.fmt.tokenizer
    prompt, echo_text = await off_loop(completion_prompt, body, tok, s.engine.cfg.max_context)
    scope = PrefixScope(tenant, body.cache_salt)
    max_tokens = max_tokens_for(body.max_tokens, chat=False, scoring=body.echo)
    # echo + logprobs scores the prompt too (vLLM's prompt_logprobs); max_tokens=0 with echo only scores
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop_token_ids=() if body.ignore_eos else tuple(tok.eos_ids),
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
        **body.sampling_kwargs(),
    )
    runs = await start_samples(
        lambda seed: CompletionRun(s.engine, prompt, replace(params, seed=seed), model=s.name, scope=scope),
        body.n,
        body.seed,
    )
    rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    choices = [
        TextCompletion(body, run, tok, s.name, echo_text, index=i, rid=rid, created=created)
        for i, run in enumerate(runs)
    ]
    if body.stream:
        return StreamingResponse(stream_texts(choices), media_type="text/event-stream")
    try:
        done = await asyncio.gather(*(complete_text(c, http_request.is_disconnected) for c in choices))
    finally:
        for c in choices:
            c.run.close()
    return {**choices[0].chunk(list(done)), "usage": TextCompletion.usage(choices)}


# ----------------------------------------------------------------------------------------------- chat
def chat_logprobs(tok, tokens: list[int], entries) -> dict:
    """OpenAI chat `logprobs` for generated tokens (all of them: reasoning, content and tool-call markup, as vLLM
    reports them). A token the server forced (thinking budget) outside the top alternatives has logprob null."""
    raw = getattr(tok, "decode_bytes", None)  # the byte tokenizer's exact bytes (b"" for a special token)

    def item(token: int, logprob) -> dict:
        text = tok.decode([token], skip_special=False)
        # `bytes` carries what `token` cannot: a piece of a UTF-8 sequence (its text is U+FFFD)
        exact = raw([token]) if raw is not None else b""
        return {"token": text, "logprob": logprob, "bytes": list(exact or text.encode("utf-8"))}

    return {
        "content": [
            {**item(t, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]} for t, e in zip(tokens, entries)
        ],
        "refusal": None,
    }


def top_logprobs(body: ChatBody) -> int | None:
    """Alternatives per token to report (None: no logprobs)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs: requires logprobs: true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(
            f"top_logprobs={body.top_logprobs}: expected an integer in [0, {MAX_LOGPROBS}]", param="top_logprobs"
        )
    return (body.top_logprobs or 0) if body.logprobs else None


async def merged(streams):
    """Items of several async iterators as they come, in one stream (a task per iterator, a queue between); the
    first error ends it. Each stream's own order is kept."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(e)

    tasks = [asyncio.create_task(pump(st)) for st in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


class ChatCompletion:
    """One /v1/chat/completions request over its runs (one per choice, `n`): the response, or its chunks.
    `return_token_ids` (vLLM's): the prompt's ids (top level; the first chunk) and each choice's generated ids
    (each chunk: the ids since the last one)."""

    def __init__(
        self,
        body: ChatBody,
        runs: list[ChatRun],
        s: Served,
        history: list[Message],
        n_top: int | None,
        report: dict | None,
    ):
        self.body, self.runs, self.s, self.history, self.n_top, self.report = body, runs, s, history, n_top, report
        self.rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.scored = [0] * len(runs)  # per choice: generated tokens whose logprobs went out in a chunk
        self.ided = [0] * len(runs)  # per choice: generated tokens whose ids went out in a chunk

    def logprobs(self, i: int, start: int, end: int) -> dict | None:
        if self.n_top is None:
            return None
        req = self.runs[i].req
        return chat_logprobs(self.s.fmt.tokenizer, req.output[start:end], req.logprobs[start:end])

    @staticmethod
    def usage(results: list[ChatResult]) -> dict:
        """The prompt once (the samples share it), every sample's output."""
        u = results[0].usage
        completion = sum(r.usage.completion for r in results)
        return {
            "prompt_tokens": u.prompt,
            "completion_tokens": completion,
            "total_tokens": u.prompt + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached},
            "completion_tokens_details": {"reasoning_tokens": sum(r.usage.reasoning for r in results)},
        }

    def remember(self, i: int, r: ChatResult) -> None:
        """What the reasoning memory keeps of this answer (a client may send it back without its reasoning)."""
        run = self.runs[i]
        if self.s.memory is not None and r.stop_hit is None:
            answer = answer_segment(self.s.fmt, run.req.output, r.parsed, (), run.thinking.on)
            self.s.memory.remember(self.history, answer.message, answer.ids)

    @staticmethod
    def tool_calls(r: ChatResult) -> list[dict]:
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in r.tool_calls
        ]

    def response(self, results: list[ChatResult]) -> dict:
        choices = []
        for i, r in enumerate(results):
            message = {"role": "assistant", "content": r.content or None, "reasoning_content": r.reasoning or None}
            if r.tool_calls:
                message["tool_calls"] = self.tool_calls(r)
            out = self.runs[i].req.output
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": r.finish_reason,
                    "logprobs": self.logprobs(i, 0, len(out)),
                    **({"token_ids": list(out)} if self.body.return_token_ids else {}),
                }
            )
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.s.name,
            "choices": choices,
            "usage": self.usage(results),
            "thinking_budget": self.runs[0].tier,
            **({"prompt_token_ids": list(self.runs[0].prompt)} if self.body.return_token_ids else {}),
            **({"truncation_report": self.report} if self.report else {}),
        }

    def chunk(self, i: int, delta: dict, reason: str | None = None, upto: int | None = None) -> str:
        lp, ids = None, {}
        if upto is not None and upto > self.scored[i]:
            lp, self.scored[i] = self.logprobs(i, self.scored[i], upto), upto
        if self.body.return_token_ids and upto is not None:
            ids = {"token_ids": list(self.runs[i].req.output[self.ided[i] : upto])}
            self.ided[i] = max(self.ided[i], upto)
        return sse(
            {
                "id": self.rid,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.s.name,
                "choices": [{"index": i, "delta": delta, "finish_reason": reason, "logprobs": lp, **ids}],
            }
        )

    async def choice_chunks(self, i: int):
        """One choice's chunks; its result last (a ChatResult, not a chunk)."""
        run = self.runs[i]
        async for kind, text in run.events():
            yield self.chunk(
                i, {"reasoning_content": text} if kind == "reasoning" else {"content": text}, upto=run.consumed
            )
        r = run.finish()
        self.remember(i, r)
        if r.unsent:
            yield self.chunk(i, {"content": r.unsent})  # held-back malformed tool call
        for k, call in enumerate(self.tool_calls(r)):
            yield self.chunk(i, {"tool_calls": [{"index": k, **call}]})
        yield self.chunk(i, {}, r.finish_reason, upto=len(run.req.output))
        yield (i, r)

    async def chunks(self):
        first = {"role": "assistant", "content": ""}
        for i in range(len(self.runs)):
            head = sse(
                {
                    "id": self.rid,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.s.name,
                    "choices": [{"index": i, "delta": first, "finish_reason": None, "logprobs": None}],
                    **(
                        {"prompt_token_ids": list(self.runs[0].prompt)} if self.body.return_token_ids and i == 0 else {}
                    ),
                }
            )
            yield head
        results: dict[int, ChatResult] = {}
        try:
            async for item in merged([self.choice_chunks(i) for i in range(len(self.runs))]):
                if isinstance(item, tuple):
                    results[item[0]] = item[1]
                else:
                    yield item
            if (self.body.stream_options or {}).get("include_usage"):
                yield sse(
                    {
                        "id": self.rid,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.s.name,
                        "choices": [],
                        "usage": self.usage([results[i] for i in range(len(self.runs))]),
                    }
                )
        except Exception as e:
            yield sse_error(self.runs[0].fail(e))
        finally:
            for run in self.runs:
                run.close()
        yield sse("[DONE]")


def chat_input(body: ChatBody | TokenizeBody, messages: list[Message], s: Served, **kw) -> ChatInput:
    """What /v1/chat/completions and /tokenize ask of a chat, alike (their token counts are one)."""
    return ChatInput.of_messages(
        messages,
        s.memory,
        thinking=ThinkingAsk(body.thinking_budget, body.reasoning_effort, template_kwargs=body.chat_template_kwargs),
        tools=body.tools,
        tool_choice=body.tool_choice,
        response_format=body.response_format,
        **kw,
    )


@router.post("/v1/chat/completions")
async def chat(
    http_request: Request,
    body: ChatBody = served_model(ChatBody),
    s: Served = Depends(served),
    tenant: str = Depends(openai_key),
):
    engine, fmt = s.engine, s.fmt
    grammar = await compile_off_loop(
        answer_grammar,
        fmt,
        body.tool_choice,
        body.tools,
        body.response_format,
        CHAT_FIELDS,
        param="response_format" if body.response_format else "tool_choice",
    )
    max_tokens = next((v for v in (body.max_completion_tokens, body.max_tokens) if v is not None), None)
    n_top = top_logprobs(body)
    images = await s.images(remote_image_urls(body.messages, OPENAI))
    history = openai_messages(body.messages, images)  # what the client sent (reasoning filled in): the answer's key
    await images.decode()  # every image's cost checked from its header first
    prepared = await prepare_chat_off_loop(
        fmt,
        chat_input(body, history, s, truncation=body.truncation, max_tokens=max_tokens),
        budgets=s.budgets,
        context=engine.cfg.max_context,
    )
    request = ChatRequest(
        prepared,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        sampling={**body.sampling_kwargs(), "logprobs": n_top},
        grammar=grammar,
        stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
        ignore_eos=body.ignore_eos,
        scope=PrefixScope(tenant, body.cache_salt, body.prompt_cache_key),
    )
    runs = await start_samples(lambda seed: start_chat(engine, fmt, replace(request, seed=seed)), body.n, body.seed)
    reply = ChatCompletion(body, runs, s, history, n_top, prepared.truncation_report)
    headers = prepared.headers()
    if body.stream:
        return StreamingResponse(reply.chunks(), media_type="text/event-stream", headers=headers)
    try:
        results = await asyncio.gather(*(run.complete(http_request.is_disconnected) for run in runs))
    finally:
        for run in runs:
            run.close()
    for i, r in enumerate(results):
        reply.remember(i, r)
    return JSONResponse(reply.response(results), headers=headers)


# ----------------------------------------------------------------------------------------------- tokens
@router.post("/tokenize")
async def tokenize(body: TokenizeBody = served_model(TokenizeBody), s: Served = Depends(served)):
    """The ids /v1/completions (prompt) or /v1/chat/completions (messages, tools) would feed: `count` equals that
    request's usage.prompt_tokens. Text that cannot fit the context is refused before it is encoded, and ids past
    it after (router/text_bounds.py); the encoding and the answer's JSON are made off the event loop."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError("prompt / messages: expected exactly one of them", param="prompt")
    context = s.engine.cfg.max_context
    if body.messages is not None:
        if not body.add_generation_prompt:
            raise APIError(
                "add_generation_prompt: only true is supported (the chat endpoint always adds it)",
                param="add_generation_prompt",
            )
        images = await s.images(remote_image_urls(body.messages, OPENAI))  # as the chat endpoint counts them
        chat = chat_input(body, openai_messages(body.messages, images), s)
        await images.decode()
        encode, param = (lambda: prepare_chat(s.fmt, chat, budgets=s.budgets, context=context).prompt), "messages"
    else:
        if body.tools is not None:
            raise APIError("tools: only with messages", param="tools")
        encode, param = (lambda: encode_text(body, s.fmt.tokenizer, context)), "prompt"
    return await off_loop(tokenized, s, encode, param, body.return_token_strs)


def encode_text(body: TokenizeBody, tok, context: int) -> list[int]:
    check_text(body.prompt, tok, context, "prompt")
    try:
        return tok.encode_prompt(body.prompt) if body.add_special_tokens else tok.encode(body.prompt)
    except ValueError as e:
        raise APIError(f"prompt: {e}", param="prompt") from None


def tokenized(s: Served, encode, param: str, strs: bool) -> JSONResponse:
    """/tokenize's answer (in a worker thread): the ids `encode()` gives, held to the context."""
    ids = encode()
    context = s.engine.cfg.max_context
    check_ids(len(ids), context, param)
    tok = s.fmt.tokenizer
    token_strs = [tok.decode([i], skip_special=False) for i in ids] if strs else None
    return JSONResponse({"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": token_strs})


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody = served_model(DetokenizeBody), s: Served = Depends(served)):
    vocab = s.engine.cfg.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(f"tokens: id {bad[0]} outside [0, {vocab})", param="tokens")
    return {"prompt": await off_loop(s.fmt.tokenizer.decode, body.tokens)}
