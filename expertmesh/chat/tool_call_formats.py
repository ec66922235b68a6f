"""The tool-call output formats a chat template may use (Hermes `<tool_call>` JSON, Kimi K2's tool-call section,
DeepSeek V3.1's): how each is parsed out of the model's output, and the markup of one call that a forced tool call's
grammar spells (router/constraints.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """A place in a tool call's markup the call fills: its `name` (as text), `name_json` (a JSON string) or
    `arguments` (the JSON arguments)."""

    what: str


@dataclass(frozen=True)
class Tok:
    """A single token of the vocabulary written by its text (a format's special / added token)."""

    text: str


NAME, NAME_JSON, ARGUMENTS = Slot("name"), Slot("name_json"), Slot("arguments")


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls: `opener` starts them; `call` matches one call (after optional whitespace);
    a section format wraps all calls in opener … closer. `close` is the token that ends the markup (one call's
    for Hermes, the section's otherwise) and `markup` what one call is between `opener` and `close` (text, tokens
    and slots): what a forced call's grammar spells."""

    name: str
    opener: str
    call: re.Pattern
    fields: Callable[[re.Match], tuple[str | None, str, object] | None]  # → (id or None, name, arguments)
    closer: str | None = None  # section formats only
    close: str = ""
    markup: tuple = ()

    def parse(self, text: str) -> list[tuple[str | None, str, dict]] | None:
        """The calls in `text` (the output from the opener on, special tokens kept), or None unless the whole text
        is well-formed calls with JSON-object arguments."""
        pos = len(self.opener) if self.closer else 0
        if not text.startswith(self.opener):
            return None
        calls = []
        while (m := self.call.match(text, pos)) is not None:
            found = self.fields(m)
            if found is None or not isinstance(found[2], dict) or not found[1]:
                return None
            calls.append(found)
            pos = m.end()
        rest = text[pos:].strip()
        if self.closer and rest.startswith(self.closer):
            rest = rest[len(self.closer) :].strip()
        return calls if calls and not rest else None


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _hermes_fields(m: re.Match):
    obj = _json_or_none(m["json"])
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return None, obj["name"], obj.get("arguments", obj.get("parameters"))


def _kimi_fields(m: re.Match):
    call_id = m["id"].strip()
    name = call_id.rsplit(":", 1)[0].split(".", 1)[-1] if ":" in call_id else call_id.split(".", 1)[-1]
    return call_id, name, _json_or_none(m["args"])


def _deepseek_fields(m: re.Match):
    return None, m["name"].strip(), _json_or_none(m["args"])


TOOL_CALL_FORMATS = (
    ToolCallFormat(
        "hermes",
        "<tool_call>",
        re.compile(r"\s*<tool_call>\s*(?P<json>.*?)\s*</tool_call>", re.S),
        _hermes_fields,
        close="</tool_call>",
        markup=('\n{"name": ', NAME_JSON, ', "arguments": ', ARGUMENTS, "}\n"),
    ),
    ToolCallFormat(
        "kimi_k2",
        "<|tool_calls_section_begin|>",
        re.compile(
            r"\s*<\|tool_call_begin\|>(?P<id>[^<]*?)<\|tool_call_argument_begin\|>(?P<args>.*?)"
            r"<\|tool_call_end\|>",
            re.S,
        ),
        _kimi_fields,
        closer="<|tool_calls_section_end|>",
        close="<|tool_calls_section_end|>",
        markup=(
            Tok("<|tool_call_begin|>"),
            "functions.",
            NAME,
            ":0",
            Tok("<|tool_call_argument_begin|>"),
            ARGUMENTS,
            Tok("<|tool_call_end|>"),
        ),
    ),
    ToolCallFormat(
        "deepseek_v3.1",
        "<｜tool▁calls▁begin｜>",
        re.compile(r"\s*<｜tool▁call▁begin｜>(?P<name>[^<]*?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>", re.S),
        _deepseek_fields,
        closer="<｜tool▁calls▁end｜>",
        close="<｜tool▁calls▁end｜>",
        markup=(Tok("<｜tool▁call▁begin｜>"), NAME, Tok("<｜tool▁sep｜>"), ARGUMENTS, Tok("<｜tool▁call▁end｜>")),
    ),
)
