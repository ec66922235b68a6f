"""API-level constrained decoding (#15): `response_format` / `text.format` and forcing `tool_choice` → an llguidance
grammar for SamplingParams.grammar, compiled here first so a bad schema is a 400 naming it before anything is
scheduled.

A forced tool call is the chat format's own markup — the built-in ⟨tool_call⟩ name \\n JSON-arguments
⟨/tool_call⟩, a checkpoint template's Hermes `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`, Kimi K2's or
DeepSeek V3.1's section (chat_template.ToolCallFormat.markup) — with the name among the allowed tools and the
arguments validating against that tool's `parameters`; the sampler then forces the end of turn. With thinking on, the grammar starts after the end-of-thinking marker (reasoning stays free).

Every refusal is a GrammarError whose `param` names the field as the request spelled it (`Fields`: chat's
`tools.0.function.parameters`, Anthropic's `tools.0.input_schema`, Responses' `text.format.schema`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from expertmesh.chat_template import ARGUMENTS, NAME, NAME_JSON
from expertmesh.grammar import JSON_OPTIONS, GrammarError, json_schema_grammar

BUILTIN_CALL = (NAME, "\n", ARGUMENTS)      # the built-in format's call between ⟨tool_call⟩ and ⟨/tool_call⟩


@dataclass(frozen=True)
class Fields:
    """How a request spells the fields a grammar comes from."""
    tool_schema: str = "tools.{}.function.parameters"
    format: str = "response_format"
    schema: str = "response_format.json_schema.schema"


CHAT_FIELDS = Fields()
ANTHROPIC_FIELDS = Fields(tool_schema="tools.{}.input_schema")
RESPONSES_FIELDS = Fields(format="text.format", schema="text.format.schema")


def refuse(param: str, detail: str) -> GrammarError:
    e = GrammarError(f"{param}: {detail}")
    e.param = param
    return e


def check_grammar(grammar: str, where: str) -> str:
    """`grammar` when llguidance compiles it, else GrammarError naming `where`."""
    try:
        err = llguidance.LLMatcher.validate_grammar(grammar, None)
    except Exception as e:                     # noqa: BLE001 - the engine's own message is the useful part
        err = str(e)
    if err:
        raise refuse(where, f"cannot be compiled: {err}")
    return grammar


def json_grammar(schema: dict | None, where: str) -> str:
    """Any JSON object (schema None, `json_object`) or JSON validating against `schema`."""
    if schema is not None and not isinstance(schema, dict):
        raise refuse(where, f"expected a JSON schema object, got {type(schema).__name__}")
    try:
        return check_grammar(json_schema_grammar(schema, where), where)
    except GrammarError as e:
        e.param = where
        raise


def _markup_lark(markup: tuple, name: str, args_rule: str) -> str:
    """One call's markup (text, token ids and slots) as a Lark sequence."""
    out = []
    for part in markup:
        if isinstance(part, int):
            out.append(f"<[{part}]>")
        elif part == NAME:
            out.append(json.dumps(name))
        elif part == NAME_JSON:
            out.append(json.dumps(json.dumps(name, ensure_ascii=False)))
        elif part == ARGUMENTS:
            out.append(args_rule)
        else:
            out.append(json.dumps(part))
    return " ".join(out)


def tool_call_grammar(tools: list[dict], tool_open: int, tool_close: int, markup: tuple = BUILTIN_CALL) -> str:
    """Exactly one call of one of `tools` ({name, parameters, where}) in the chat format's tool-call markup:
    ⟨tool_open⟩ `markup` ⟨tool_close⟩ (markup: text, token ids and the NAME / NAME_JSON / ARGUMENTS slots)."""
    rules, alts = [], []
    for i, t in enumerate(tools):
        schema = t.get("parameters") or {"type": "object"}
        if not isinstance(schema, dict):
            raise refuse(t["where"], "expected a JSON schema object")
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
        check_grammar(llguidance.LLMatcher.grammar_from_lark(f"start: %json {json.dumps(schema)}"), t["where"])
        alts.append(f"call{i}")
        rules.append(f"call{i}: {_markup_lark(markup, t['name'], f'args{i}')}\nargs{i}: %json {json.dumps(schema)}")
    lark = f"start: <[{tool_open}]> ({' | '.join(alts)}) <[{tool_close}]>\n" + "\n".join(rules)
    return check_grammar(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


def forced_tools(choice, tools: list[dict] | None, fields: Fields = CHAT_FIELDS) -> list[dict] | None:
    """Chat-shaped `tools` ([{type: function, function: {name, parameters}}]) and a forcing `tool_choice`
    ("required", or {type: function, function: {name}} / {type: function, name}) → the tools the call may use;
    None when the choice does not force a call. A choice naming no tool given is refused naming tool_choice."""
    if choice in (None, "auto", "none"):
        return None
    listed = [{"name": (t.get("function") or {}).get("name"), "parameters": (t.get("function") or {}).get("parameters"),
               "where": fields.tool_schema.format(i)} for i, t in enumerate(tools or [])]
    if not listed:
        raise refuse("tool_choice", f"{choice!r} forces a tool call but no tools are given")
    if choice == "required":
        return listed
    name = function_name(choice)
    keep = [t for t in listed if t["name"] == name]
    if name is None or not keep:
        raise refuse("tool_choice", f"{choice!r} is neither 'auto', 'none', 'required' nor a function among the "
                                    f"tools ({', '.join(str(t['name']) for t in listed)})")
    return keep


def function_name(choice) -> str | None:
    """{type: function, function: {name}} (chat) or {type: function, name} (Responses) → the name."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return (choice.get("function") or {}).get("name") or choice.get("name")
    return None


def response_schema(fmt: dict | None, fields: Fields = CHAT_FIELDS) -> tuple[dict | None, str] | None:
    """OpenAI chat `response_format` (text / json_object / json_schema{schema}) → (the schema — None: any JSON
    object —, the field it came from), or None when the answer is free text."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return None, fields.format
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise refuse(f"{fields.format}.json_schema", "expected an object with a `schema`")
        schema = spec.get("schema") or {"type": "object"}
        if not isinstance(schema, dict):
            raise refuse(fields.schema, f"expected a JSON schema object, got {type(schema).__name__}")
        return schema, fields.schema
    raise refuse(f"{fields.format}.type", f"{fmt.get('type')!r} is not one of text, json_object, json_schema")


def response_format_grammar(fmt: dict | None, fields: Fields = CHAT_FIELDS) -> str | None:
    """`response_format` → a bare-JSON grammar (the formats whose answer is the JSON itself) or None."""
    schema = response_schema(fmt, fields)
    return None if schema is None else json_grammar(*schema)


def answer_grammar(fmt, choice, tools, response_format: dict | None = None,
                   fields: Fields = CHAT_FIELDS) -> str | None:
    """The grammar a request's forcing `tool_choice` (chat-shaped `tools`) or `response_format` (json_object /
    json_schema) puts on the answer — from its first token (the sampler starts it where thinking ends); None for
    neither. A format with its own tool-call grammar (K3's tagged calls and response section) builds it."""
    forced = forced_tools(choice, tools, fields)
    if hasattr(fmt, "tool_call_grammar"):
        if forced is not None:
            return check_grammar(fmt.tool_call_grammar(forced, thinking=False), "tools")
        schema = response_schema(response_format, fields)
        if schema is None:
            return None
        return check_grammar(fmt.response_grammar(schema[0], thinking=False), schema[1])
    markers = fmt.markers
    if forced is None:
        return response_format_grammar(response_format, fields)
    markup = getattr(fmt, "tool_call_markup", BUILTIN_CALL)     # a checkpoint template's format, else built-in
    if markers.tool_open is None or markers.tool_close is None or markup is None:
        raise refuse("tool_choice", "forcing a tool call needs a chat format with tool-call marker tokens")
    return tool_call_grammar(forced, markers.tool_open, markers.tool_close, markup)
