"""Rendering a conversation in Kimi K3's chat format as `Kimi-K3.jinja` renders it (chat/k3.py's module docstring
gives the layout): the system texts the template writes, sorted JSON, and the prompt as special ids with every text run
between two of them tokenized as plain text."""

from __future__ import annotations

import json
from dataclasses import dataclass

from expertmesh.chat.format import ChatError, Message, ToolCall, check_render_options, validate_history
from expertmesh.chat.jinja_env import arguments_value
from expertmesh.chat.k3_markup import CLOSE, END_OF_MSG, MEDIA_TOKENS, OPEN, SEP, K3Vocab, escape_attr

TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
EFFORT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
    "`thinking_effort={}`."
)
TOOL_CHOICE = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
RESPONSE_FORMAT = {
    "json_object": "The system is invoked with `response_format=json_object`.\n" + RAW_JSON,
    "json_schema": (
        "The system is invoked with `response_format=json_schema`.\n"
        + RAW_JSON
        + "\nThe JSON data must match the following schema:\n```json\n{}\n```"
    ),
}


def json_sorted(value) -> str:
    """JSON with the keys of every object sorted (case-sensitively), no spaces; scalars as json.dumps."""
    if isinstance(value, dict):
        return (
            "{"
            + ",".join(
                json.dumps(k, ensure_ascii=False) + ":" + json_sorted(v)
                for k, v in sorted(value.items(), key=lambda kv: kv[0])
            )
            + "}"
        )
    if value is None or isinstance(value, (str, int, float, bool)):
        return json.dumps(value, ensure_ascii=False)
    return "[" + ",".join(json_sorted(v) for v in value) + "]"


def xtml_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


class Pieces:
    """Special ids and text, in order; `ids()` tokenizes each text run between two specials as one piece."""

    def __init__(self, vocab: K3Vocab):
        self.vocab, self.items = vocab, []

    def special(self, token: str) -> None:
        self.items.append(self.vocab.id_of[token])

    def text(self, text: str) -> None:
        if text:
            self.items.append(text)

    def open(self, tag: str, attrs=()) -> None:
        self.special(OPEN)
        self.text(tag + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs))
        self.special(SEP)

    def close(self, tag: str) -> None:
        self.special(CLOSE)
        self.text(tag)
        self.special(SEP)

    def message(self, attrs, body: str) -> None:
        self.open("message", attrs)
        self.text(body)
        self.close("message")
        self.special(END_OF_MSG)

    def runs(self):
        """(True, id) and (False, text run) in order, adjacent texts joined."""
        text: list[str] = []
        for item in self.items:
            if isinstance(item, str):
                text.append(item)
                continue
            if text:
                yield False, "".join(text)
                text = []
            yield True, item
        if text:
            yield False, "".join(text)

    def ids(self) -> list[int]:
        out: list[int] = []
        for special, value in self.runs():
            out += [value] if special else self.vocab.tokenizer.encode_plain(value)
        return out

    def text_form(self) -> str:
        tok = self.vocab.tokenizer
        return "".join(tok.id_to_special[v] if special else v for special, v in self.runs())


@dataclass(frozen=True)
class RenderOptions:
    tools: list[dict] | None = None
    thinking: bool = True
    thinking_effort: str | None = None
    tool_choice: object = None
    response_format: dict | str | None = None
    add_generation_prompt: bool = True


def render_pieces(vocab: K3Vocab, messages: list[Message], o: RenderOptions) -> Pieces:
    """The prompt as special ids and text runs, in order (the module docstring of chat/k3.py)."""
    check_render_options(
        thinking_effort=o.thinking_effort if o.thinking else None,
        tool_choice=o.tool_choice,
        response_format=o.response_format,
    )
    p = Pieces(vocab)
    if o.tools:
        p.message([("role", "system"), ("type", "tool-declare")], TOOL_DECLARE + json_sorted(o.tools) + "\n```")
    if o.thinking and o.thinking_effort is not None:
        p.message([("role", "system"), ("type", "thinking-effort")], EFFORT.format(o.thinking_effort).strip())
    calls: list[ToolCall] | None = None
    tool_index = 0
    for i, m in enumerate(messages):
        if m.role in ("user", "system"):
            p.open("message", [("role", m.role)])
            _content(vocab, p, m, i)
            p.close("message")
            p.special(END_OF_MSG)
        elif m.role == "assistant":
            calls, tool_index = m.tool_calls, 0
            p.open("message", [("role", "assistant")])
            _assistant(p, m, o.thinking)
            p.close("message")
            p.special(END_OF_MSG)
        elif m.role == "tool" and (i == 0 or messages[i - 1].role != "tool"):
            run = []
            for other in messages[i:]:
                if other.role != "tool":
                    break
                run.append(other)
            ids = [str(c.id) for c in calls or ()]
            ordered: list[tuple[Message, str | None]] = []
            if all(t.tool_call_id is not None and str(t.tool_call_id) in ids for t in run):
                for k, c in enumerate(calls):  # the results in the order of the calls they answer
                    if str(c.id) not in ids[:k]:
                        ordered += [(t, c.name) for t in run if str(t.tool_call_id) == str(c.id)]
            else:
                ordered = [(t, None) for t in run]
            for t, name in ordered:
                tool_index += 1
                if name is None and calls is not None and tool_index <= len(calls):
                    name = calls[tool_index - 1].name
                if name is None:
                    raise ChatError(
                        f"messages[{messages.index(t)}]: a tool result needs a tool name: answer a "
                        f"preceding assistant tool call"
                    )
                p.open("message", [("role", "tool"), ("tool", name), ("index", tool_index)])
                p.text(t.content)
                p.close("message")
                p.special(END_OF_MSG)
    if isinstance(o.tool_choice, str) and o.tool_choice in TOOL_CHOICE:
        p.message([("role", "system"), ("type", "tool-choice")], TOOL_CHOICE[o.tool_choice])
    kind = o.response_format.get("type") if isinstance(o.response_format, dict) else o.response_format
    if kind == "json_object":
        p.message([("role", "system"), ("type", "response-format")], RESPONSE_FORMAT[kind])
    elif kind == "json_schema":
        p.message(
            [("role", "system"), ("type", "response-format")],
            RESPONSE_FORMAT[kind].format(json_sorted(response_schema(o.response_format))).strip(),
        )
    if o.add_generation_prompt:
        p.open("message", [("role", "assistant")])
        p.open("think" if o.thinking else "response")
    return p


def _content(vocab: K3Vocab, p: Pieces, m: Message, i: int) -> None:
    if m.parts is None:
        p.text(m.content)
        return
    for part in m.parts:
        if isinstance(part, str):
            p.text(part)
            continue
        missing = [t for t in MEDIA_TOKENS if t not in vocab.id_of]
        if missing:
            raise ChatError(
                f"messages[{i}]: an image needs the special tokens {', '.join(missing)}, which "
                f"this tokenizer does not have"
            )
        width, height = part.source_size
        p.special("<|media_begin|>")
        p.text(f"image {width}x{height}")
        p.special("<|media_content|>")
        for _ in range(part.tokens):
            p.special("<|media_pad|>")
        p.special("<|media_end|>")


def _assistant(p: Pieces, m: Message, thinking: bool) -> None:
    if thinking:
        p.open("think")
        if m.reasoning is not None and m.reasoning.strip():
            p.text(m.reasoning)
        p.close("think")
    p.open("response")
    p.text(m.content)
    p.close("response")
    if not m.tool_calls:
        return
    p.open("tools")
    for n, c in enumerate(m.tool_calls, start=1):
        p.open("call", [("tool", c.name), ("index", n)])
        args = arguments_value(c.arguments)  # a dict, or text (a `json` block when not blank)
        if isinstance(args, dict):
            for key, value in args.items():
                p.open("argument", [("key", key), ("type", xtml_type(value))])
                p.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                p.close("argument")
        elif isinstance(args, str) and args.strip():
            p.open("json", [("type", "object")])
            p.text(args)
            p.close("json")
        p.close("call")
    p.close("tools")


def validate(messages: list[Message], add_generation_prompt: bool) -> None:
    """chat.validate_history; without a generation prompt the conversation may end in an assistant's tool calls
    (what the model wrote, before the results)."""
    last = messages[-1] if messages else None
    if not add_generation_prompt and last is not None and last.role == "assistant" and last.tool_calls:
        validate_history(messages + [Message("tool", "", tool_call_id=c.id) for c in last.tool_calls])
    else:
        validate_history(messages)


def response_schema(response_format) -> object:
    """The schema of a json_schema response_format, found where the template looks: json_schema.schema, then
    json_schema.json_schema, then json_schema itself."""
    wrapper = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if isinstance(wrapper, dict) and "schema" in wrapper:
        return wrapper["schema"]
    if isinstance(wrapper, dict) and "json_schema" in wrapper:
        return wrapper["json_schema"]
    return wrapper
