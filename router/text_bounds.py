"""How much text a request may bring before it is encoded, and encoding away from the event loop.

Encoding is linear in the text, and a request body may hold 4 MiB of it: on the event loop that would stop every
stream for seconds. So every endpoint that tokenizes user text (`/tokenize`, `/v1/completions`, and through
`prepare_chat` the chat completions, messages, count_tokens and Responses) encodes in a worker thread (`off_loop`),
and text that cannot fit the context is refused before it is encoded at all: a text of N characters is at least
N bytes, and no token covers more than the tokenizer's longest token (B bytes), so it encodes to at least N / B
tokens — beyond `SLACK` × B × the context, it cannot fit, whatever it says (400 `context_length_exceeded`, naming
the field). SLACK leaves room for normalizers that drop characters before encoding. What is encoded is then held
to the context too, by the engine (a prompt) or here (`check_ids`: /tokenize, count_tokens).
"""

from __future__ import annotations

import asyncio
import threading
import weakref

from expertmesh.router.errors import APIError

SLACK = 2
_longest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer → its longest token's bytes
_lock = threading.Lock()


def longest_token_bytes(tok) -> int:
    """The bytes of `tok`'s longest ordinary token (special tokens never come out of user text); 0 when the
    tokenizer cannot say (no bound before encoding then). Read once per tokenizer, off the loop by its callers."""
    with _lock:
        known = _longest.get(tok)
    if known is not None:
        return known
    decode_bytes = getattr(tok, "decode_bytes", None)
    size = getattr(tok, "vocab_size", None)
    longest = max((len(decode_bytes([i])) for i in range(size)), default=0) if decode_bytes and size else 0
    with _lock:
        _longest[tok] = longest
    return longest


def text_limit(tok, context: int) -> int | None:
    """Characters of text beyond which nothing can fit `context` tokens (None: no bound known)."""
    longest = longest_token_bytes(tok)
    return SLACK * longest * context if longest else None


def too_long(param: str, what: str, context: int) -> APIError:
    return APIError(
        f"{param}: {what}, more than the model's context of {context} tokens (max_model_len) can hold; shorten it",
        param=param,
        code="context_length_exceeded",
    )


def check_text(text: str, tok, context: int, param: str) -> None:
    """Refuse `text` before encoding it when it cannot fit `context` tokens."""
    limit = text_limit(tok, context)
    if limit is not None and len(text) > limit:
        least = -(-len(text) // (limit // context))
        raise too_long(param, f"{len(text)} characters of text (at least {least} tokens)", context)


def check_conversation(system: str | None, turns: list, tok, context: int, param: str) -> None:
    """Refuse a conversation (the system prompt, then Segments: router/response_store.py) before rendering it
    when its text alone cannot fit `context` tokens: a turn with its exact tokens counts them, any other its
    content's characters (what every chat format renders; a lower bound of its tokens)."""
    limit = text_limit(tok, context)
    if limit is None:
        return
    per_token = limit // context  # characters a token may hold, with SLACK
    exact = sum(len(t.ids) for t in turns if t.ids is not None)
    chars = len(system or "") + sum(len(t.message.content or "") for t in turns if t.ids is None)
    if exact * per_token + chars > limit:
        raise too_long(param, f"at least {exact - (-chars // per_token)} tokens of text", context)


def check_ids(count: int, context: int, param: str) -> None:
    """Refuse an encoded prompt of `count` tokens past the context."""
    if count > context:
        raise too_long(param, f"{count} tokens", context)


async def off_loop(fn, *args, **kw):
    """`fn(*args, **kw)` in a worker thread (encoding, rendering): the event loop keeps serving every stream."""
    return await asyncio.to_thread(fn, *args, **kw)
