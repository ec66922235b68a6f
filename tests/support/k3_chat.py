"""Helpers of the K3 chat tests (tests/chat/test_k3_*.py): a tool to call, what the model writes for a reply, markup
written as ids, and a stream parser's run checked against its own pieces."""

import re

from expertmesh.chat.format import Message
from expertmesh.chat.k3 import K3Chat

WEATHER = {  # a tool with string, integer and object arguments
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
        },
    },
}


def model_output(k3_chat: K3Chat, history: list[Message], reply: Message, **o) -> list[int]:
    """What the model writes for `reply` after `history`'s generation prompt (the template's form of it)."""
    prompt = k3_chat.render_ids(history, **o)
    whole = k3_chat.render_ids(history + [reply], **o, add_generation_prompt=False)
    assert whole[: len(prompt)] == prompt
    return whole[len(prompt) :]


def ids_of(k3_chat: K3Chat, *parts) -> list[int]:
    """Markup as ids: the XTML markers and other special strings as their ids, the rest as text."""
    tok, out = k3_chat.tokenizer, []
    for part in parts:
        for piece in re.split(r"(<\|[a-z_]+\|>|\[[A-Z]+\])", part):
            if piece in tok.special_to_id:
                out.append(tok.special_to_id[piece])
            elif piece:
                out += tok.encode_plain(piece)
    return out


def stream(k3_chat: K3Chat, ids: list[int], ph: str, tools=None, salt: str = ""):
    """A stream parser's result for `ids`, checked to be the concatenation of the pieces it emitted."""
    p = k3_chat.stream_parser(phase=ph, salt=salt, tools=tools)
    pieces = p.feed_many(ids) + p.finish()
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    calls = [t for k, t in pieces if k == "tool_call"]
    result = p.result()
    assert (result.reasoning, result.content, result.tool_calls) == (reasoning, content, calls)
    return result
