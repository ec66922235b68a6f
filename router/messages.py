"""The one message parser: what each API sends as a conversation → `expertmesh.chat.format.Message`s (and the Responses
API's segments), with its tools in the chat form the templates render.

The APIs differ in vocabulary, not in structure: a message has a role, content (a string, or a list of typed parts:
text, images, and per API tool results / reasoning / tool calls), maybe reasoning and tool calls. One reader,
`read_parts`, walks any content list; a `Dialect` says which part types hold text and images, how an image part is
read, and how a path into the body is spelled in errors (`messages[1].content[2]` in OpenAI's and Responses' bodies,
`messages.1.content.2` in Anthropic's). Every refusal is a 400 naming that path.

Images go into an `images.ImageBudget` as they are met (per-request limits); remote URLs are fetched before parsing
(`remote_image_urls` lists them for `images.fetch_remote`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from expertmesh.chat.format import Message, ToolCall
from expertmesh.router.errors import APIError
from expertmesh.router.images import is_remote
from expertmesh.router.response_store import ResponseStore, Segment


# ----------------------------------------------------------------------------------------------- dialects
def _openai_image(part: dict, images, where: str):
    spec = part.get("image_url")
    url, detail = (spec.get("url"), spec.get("detail") or "auto") if isinstance(spec, dict) else (spec, "auto")
    return images.from_url(url, where, detail)


def _openai_image_url(part: dict):
    spec = part.get("image_url")
    return spec.get("url") if isinstance(spec, dict) else spec


def _anthropic_image(part: dict, images, where: str):
    """An `image` block (source base64, or url when the server allows remote hosts)."""
    source = part.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return images.from_base64(source.get("media_type"), source.get("data"), where)
    if kind == "url":
        return images.from_url(source.get("url"), where)
    raise APIError(f"{where}.source.type: {kind!r} is not one of base64, url", param=f"{where}.source.type")


def _anthropic_image_url(part: dict):
    source = part.get("source")
    return source.get("url") if isinstance(source, dict) and source.get("type") == "url" else None


def _responses_image(part: dict, images, where: str):
    if part.get("file_id") is not None:
        raise APIError(f"{where}.file_id: not supported (send image_url)", param=f"{where}.file_id")
    return images.from_url(part.get("image_url"), where, part.get("detail") or "auto")


@dataclass(frozen=True)
class Dialect:
    text_types: tuple[str, ...]  # part types whose `text` is text
    image_type: str  # the image part type
    read_image: Callable  # (part, images, where) -> PreparedImage
    image_url: Callable  # part -> its URL (remote ones are fetched first), or None
    dotted: bool = False  # list indices as `.2` (Anthropic) rather than `[2]`

    def at(self, where: str, i: int) -> str:
        return f"{where}.{i}" if self.dotted else f"{where}[{i}]"


OPENAI = Dialect(("text",), "image_url", _openai_image, _openai_image_url)
ANTHROPIC = Dialect(("text",), "image", _anthropic_image, _anthropic_image_url, dotted=True)
RESPONSES = Dialect(
    ("input_text", "output_text", "text", "reasoning_text", "summary_text"),
    "input_image",
    _responses_image,
    lambda part: part.get("image_url"),
)


def read_parts(content, where: str, d: Dialect, *, images=None, other: tuple[str, ...] = ()) -> list[tuple]:
    """A content list → [(type, path, value)]: text parts as their text, image parts (only with an ImageBudget) as
    the PreparedImage, the `other` types the caller reads as the part itself. Anything else is a 400 naming it."""
    out = []
    for j, part in enumerate(content):
        at = d.at(where, j)
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in d.text_types:
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError(f"{at}.text: expected a string, found {type(text).__name__}", param=f"{at}.text")
            out.append((kind, at, text))
        elif kind == d.image_type and images is not None:
            out.append((kind, at, d.read_image(part, images, at)))
        elif kind in other:
            out.append((kind, at, part))
        else:
            accepted = [d.text_types[0]] + ([d.image_type] if images is not None else []) + list(other)
            raise APIError(f"{at}.type: {kind!r} is not supported here ({', '.join(accepted)})", param=f"{at}.type")
    return out


def read_content(content, where: str, d: Dialect, *, images=None) -> tuple[str, list | None]:
    """Message content — a string, or a list of text (and, with an ImageBudget, image) parts — → its text and,
    when it holds images, its parts in order (str and PreparedImage)."""
    if isinstance(content, str):
        text, parts = content, None
    elif isinstance(content, list):
        read = read_parts(content, where, d, images=images)
        text = "".join(v for kind, _, v in read if kind != d.image_type)
        parts = [v for _, _, v in read] if any(kind == d.image_type for kind, _, _ in read) else None
    else:
        raise APIError(f"{where}: expected a string or a list of text parts", param=where)
    _check_unicode(text, where)
    return text, parts


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"{where}: not valid Unicode ({e.reason} at character {e.start})", param=where) from None


def remote_image_urls(items, d: Dialect, field: str = "messages") -> dict[str, str]:
    """{part path: url} of the remote (http/https) image URLs in a conversation (fetched before it is parsed)."""
    out = {}
    for i, item in enumerate(items if isinstance(items, list) else ()):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == d.image_type:
                url = d.image_url(part)
                if is_remote(url):
                    out[d.at(f"{d.at(field, i)}.content", j)] = url
    return out


def _string(m: dict, key: str, where: str) -> None:
    if m.get(key) is not None and not isinstance(m.get(key), str):
        raise APIError(f"{where}.{key}: expected a string", param=f"{where}.{key}")


# ----------------------------------------------------------------------------------------------- OpenAI chat
OPENAI_ROLES = ("system", "user", "assistant", "tool")


def openai_messages(raw: list[dict], images=None) -> list[Message]:
    """Chat-completions messages (`developer` is `system`; `reasoning_content`, or vLLM's `reasoning`, on assistant
    turns). `images` (images.ImageBudget): where user image parts go; None: image parts are refused."""
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in OPENAI_ROLES:
            raise APIError(f"{where}.role: {role!r} is not one of {', '.join(OPENAI_ROLES)}", param=f"{where}.role")
        for key in ("reasoning_content", "reasoning", "tool_call_id"):
            _string(m, key, where)
        content, parts = read_content(
            "" if m.get("content") is None else m["content"],
            f"{where}.content",
            OPENAI,
            images=images if role == "user" else None,
        )
        reasoning = m.get("reasoning_content") if m.get("reasoning_content") is not None else m.get("reasoning")
        out.append(
            Message(
                role,
                content,
                reasoning=reasoning,
                tool_calls=_openai_calls(m.get("tool_calls"), where),
                tool_call_id=m.get("tool_call_id"),
                parts=parts,
            )
        )
    return out


def _openai_calls(raw, where: str) -> list[ToolCall]:
    if raw is not None and not isinstance(raw, list):
        raise APIError(f"{where}.tool_calls: expected a list of tool calls", param=f"{where}.tool_calls")
    calls = []
    for j, c in enumerate(raw or []):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not c.get("id"):
            raise APIError(f"{at}: expected {{id, type: function, function: {{name, arguments}}}}", param=at)
        if not isinstance(c["id"], str):
            raise APIError(f"{at}.id: expected a string", param=f"{at}.id")
        args = fn.get("arguments", "{}")
        calls.append(ToolCall(c["id"], fn["name"], args if isinstance(args, str) else json.dumps(args)))
    return calls


# ----------------------------------------------------------------------------------------------- Anthropic
def anthropic_messages(system, raw: list[dict], images=None) -> list[Message]:
    """A messages request's `system` and `messages`: user turns of text, image and tool_result blocks (each result a
    tool message), assistant turns of thinking, text and tool_use blocks."""
    out: list[Message] = []
    if system:
        out.append(
            Message(
                "system",
                system
                if isinstance(system, str)
                else "".join(b.get("text", "") for b in system if isinstance(b, dict)),
            )
        )
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise APIError(f"{where}.role: {role!r} is not one of user, assistant", param=f"{where}.role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError(f"{where}.content: expected a string or a list of content blocks", param=f"{where}.content")
        if role == "user":
            read = read_parts(blocks, f"{where}.content", ANTHROPIC, images=images, other=("tool_result",))
            for kind, _, block in read:
                if kind == "tool_result":
                    result = block.get("content", "")
                    if isinstance(result, list):
                        result = "".join(x.get("text", "") for x in result if isinstance(x, dict))
                    out.append(Message("tool", str(result), tool_call_id=block.get("tool_use_id")))
            parts = [v for kind, _, v in read if kind != "tool_result"]
            texts = [v for kind, _, v in read if kind == "text"]
            if len(parts) > len(texts):
                out.append(Message("user", "".join(texts), parts=parts))
            elif texts:
                out.append(Message("user", "".join(texts)))
            continue
        msg = Message("assistant")
        for kind, at, value in read_parts(blocks, f"{where}.content", ANTHROPIC, other=("thinking", "tool_use")):
            if kind == "text":
                msg.content += value
            elif kind == "thinking":
                thought = value.get("thinking", "")
                if not isinstance(thought, str):
                    raise APIError(
                        f"{at}.thinking: expected a string, found {type(thought).__name__}", param=f"{at}.thinking"
                    )
                msg.reasoning = (msg.reasoning or "") + thought
            else:
                msg.tool_calls.append(
                    ToolCall(value.get("id", ""), value.get("name", ""), json.dumps(value.get("input", {})))
                )
        out.append(msg)
    return out


def anthropic_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic tools ({name, description, input_schema}) → the chat form."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {}),
            },
        }
        for t in (tools or [])
    ] or None


# ----------------------------------------------------------------------------------------------- Responses
def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def responses_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools ({type, name, description, parameters, strict}) → the chat form the template
    renders. `strict` is not rendered (a forced call is constrained by its `parameters` either way)."""
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(
                f"tools[{i}].type: {kind!r} is not supported (only 'function' tools)", param=f"tools[{i}].type"
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise APIError(f"tools[{i}].name: expected a non-empty string", param=f"tools[{i}].name")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description") or "",
                    "parameters": t.get("parameters") or {},
                },
            }
        )
    return out or None


def _responses_text(content, where: str) -> str:
    return read_content(content, where, RESPONSES)[0]


MAX_ID_CHARS = 128  # a client's item id or call_id (this server's are 28-32 characters)


def bounded_id(value, where: str) -> str:
    """A client-given id: a string of 1 to MAX_ID_CHARS printable characters, else a 400 naming it."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS or not value.isprintable():
        shown = type(value).__name__ if not isinstance(value, str) else f"{len(value)} characters"
        raise APIError(
            f"{where}: expected a string of 1 to {MAX_ID_CHARS} printable characters, found {shown}", param=where
        )
    return value


def _item_id(item: dict, where: str, prefix: str) -> str:
    """An input item's id: the client's (bounded_id), or a new one when it gives none."""
    return new_item_id(prefix) if item.get("id") in (None, "") else bounded_id(item["id"], f"{where}.id")


def responses_input(
    raw: str | list[dict], store: ResponseStore, images=None, owner: str = ""
) -> tuple[list[Segment], list[dict]]:
    """Responses input items → segments and the items as listed (ids added). Consecutive assistant-side items
    (reasoning, assistant message, function calls) are one assistant turn; a turn sent back with this server's
    item ids (of a response `owner` stored) keeps its exact tokens, and its reasoning even when the client dropped
    it. Item ids and call ids are strings of bounded length."""
    if isinstance(raw, str):
        item = {
            "id": new_item_id("msg"),
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": raw}],
        }
        return [Segment(Message("user", raw))], [item]
    segments: list[Segment] = []
    listed: list[dict] = []
    turn: list[tuple[int, dict]] = []

    def close_turn() -> None:
        if turn:
            segments.append(_assistant_turn(turn, store, owner))
            turn.clear()

    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where}: expected an object", param=where)
        kind, role = item.get("type") or "message", item.get("role")
        if kind == "reasoning" and turn:
            close_turn()  # a new turn starts with its reasoning
        if kind in ("reasoning", "function_call") or (kind == "message" and role == "assistant"):
            if kind == "message" and any((it.get("type") or "message") == "message" for _, it in turn):
                close_turn()
            turn.append((i, item))
            listed.append({**item, "id": _item_id(item, where, "fc" if kind == "function_call" else "msg")})
            continue
        close_turn()
        if kind == "message":
            if role not in ("user", "system", "developer"):
                raise APIError(
                    f"{where}.role: {role!r} is not one of user, assistant, system, developer", param=f"{where}.role"
                )
            text, parts = read_content(
                item.get("content", ""), f"{where}.content", RESPONSES, images=images if role == "user" else None
            )
            segments.append(Segment(Message("system" if role == "developer" else role, text, parts=parts)))
            listed.append(
                {
                    "id": _item_id(item, where, "msg"),
                    "type": "message",
                    "role": role,
                    "status": "completed",
                    "content": [{"type": "input_text", "text": text}],
                }
            )
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _responses_text(output, f"{where}.output")
            call_id = bounded_id(item.get("call_id"), f"{where}.call_id")
            segments.append(Segment(Message("tool", text, tool_call_id=call_id)))
            listed.append({"status": "completed", **item, "id": _item_id(item, where, "fco"), "type": kind})
        else:
            raise APIError(
                f"{where}.type: {kind!r} is not supported (message, function_call, function_call_output, reasoning)",
                param=f"{where}.type",
            )
    close_turn()
    return segments, listed


def _assistant_turn(items: list[tuple[int, dict]], store: ResponseStore, owner: str = "") -> Segment:
    msg, ids = Message("assistant"), []
    for i, item in items:
        where, kind = f"input[{i}]", item.get("type") or "message"
        ids.append(None if item.get("id") in (None, "") else bounded_id(item["id"], f"{where}.id"))
        if kind == "reasoning":
            msg.reasoning = (msg.reasoning or "") + _responses_text(item.get("content") or [], f"{where}.content")
        elif kind == "message":
            msg.content += _responses_text(item.get("content", ""), f"{where}.content")
        else:
            for key in ("name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(f"{where}.{key}: expected a string", param=f"{where}.{key}")
            call_id = bounded_id(item.get("call_id"), f"{where}.call_id")
            msg.tool_calls.append(ToolCall(call_id, item["name"], item["arguments"]))
    return _known_turn(store, tuple(ids), msg, owner) or Segment(msg)


def _known_turn(store: ResponseStore, ids: tuple, msg: Message, owner: str = "") -> Segment | None:
    """The stored segment of a generated turn sent back whole (same item ids, same answer): its exact tokens."""
    stored = store.by_output_item(ids[0], owner) if ids and ids[0] else None
    if stored is None:
        return None
    seg = stored.segments[-1]
    want = [i for i in seg.item_ids if not i.startswith("rs_")]
    got = [i for i in ids if i and not str(i).startswith("rs_")]
    same = seg.message.content == msg.content and [(c.id, c.name, c.arguments) for c in seg.message.tool_calls] == [
        (c.id, c.name, c.arguments) for c in msg.tool_calls
    ]
    return seg if same and want == got else None


# ----------------------------------------------------------------------------------------------- gRPC
def grpc_messages(messages) -> list[Message]:
    """expertmesh.v1.ChatMessage → Message (unset strings are absent)."""
    return [
        Message(
            m.role,
            m.content,
            reasoning=m.reasoning or None,
            tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls],
            tool_call_id=m.tool_call_id or None,
        )
        for m in messages
    ]


def grpc_tools(tools) -> list[dict] | None:
    """expertmesh.v1.Tool (parameters as JSON text) → the chat form."""
    out = []
    for i, t in enumerate(tools):
        try:
            params = json.loads(t.parameters_json) if t.parameters_json else {}
        except ValueError:
            raise APIError(f"tools[{i}].parameters_json: not valid JSON", param=f"tools[{i}].parameters_json") from None
        out.append(
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": params}}
        )
    return out or None
