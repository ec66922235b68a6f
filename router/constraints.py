"""API-level constrained decoding (#15): `response_format` and forced `tool_choice` → an llguidance grammar for
SamplingParams.grammar, compiled here first so a bad schema is a 400 naming it before anything is scheduled.

A forced tool call is the chat format's own markup — ⟨tool_call⟩ name \\n JSON-arguments ⟨/tool_call⟩ — with the
name among the allowed tools and the arguments validating against that tool's `parameters`; the sampler then
forces the end of turn. With thinking on, the grammar starts after the end-of-thinking marker (reasoning stays free).
"""
from __future__ import annotations

import json

import llguidance

from expertmesh.grammar import JSON_OPTIONS, GrammarError, json_schema_grammar


def check_grammar(grammar: str, where: str) -> str:
    """`grammar` when llguidance compiles it, else GrammarError naming `where`."""
    try:
        err = llguidance.LLMatcher.validate_grammar(grammar, None)
    except Exception as e:                     # noqa: BLE001 - the engine's own message is the useful part
        err = str(e)
    if err:
        raise GrammarError(f"{where}: cannot be compiled: {err}")
    return grammar


def json_grammar(schema: dict | None, where: str) -> str:
    """Any JSON object (schema None, `json_object`) or JSON validating against `schema`."""
    if schema is not None and not isinstance(schema, dict):
        raise GrammarError(f"{where}: expected a JSON schema object, got {type(schema).__name__}")
    return check_grammar(json_schema_grammar(schema, where), where)


def tool_call_grammar(tools: list[dict], tool_open: int, tool_close: int) -> str:
    """Exactly one call of one of `tools` ({name, parameters, where}) in the chat format's tool-call markup."""
    rules, alts = [], []
    for i, t in enumerate(tools):
        schema = t.get("parameters") or {"type": "object"}
        if not isinstance(schema, dict):
            raise GrammarError(f"{t['where']}: expected a JSON schema object")
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
        check_grammar(llguidance.LLMatcher.grammar_from_lark(f"start: %json {json.dumps(schema)}"), t["where"])
        alts.append(f"call{i}")
        rules.append(f"call{i}: {json.dumps(t['name'] + chr(10))} args{i}\nargs{i}: %json {json.dumps(schema)}")
    lark = f"start: <[{tool_open}]> ({' | '.join(alts)}) <[{tool_close}]>\n" + "\n".join(rules)
    return check_grammar(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


def grammar_params(grammar: str | None, markers, thinking: bool) -> dict:
    """SamplingParams fields: the grammar, applied after the end of thinking when thinking is on."""
    if grammar is None:
        return {}
    after = markers.think_end if thinking and markers.think_end is not None else None
    return {"grammar": grammar, "grammar_after_token": after}


def forced_tools(choice, tools: list[dict] | None, *, named=None) -> list[dict] | None:
    """OpenAI-shaped `tools` ([{type: function, function: {name, parameters}}]) and a forcing `tool_choice`
    ("required", or a named one whose name `named(choice)` gives) → the tools the call may use; None when the
    choice does not force a call. ValueError naming tool_choice when it names no tool given."""
    if choice in (None, "auto", "none"):
        return None
    listed = [{"name": (t.get("function") or {}).get("name"), "parameters": (t.get("function") or {}).get("parameters"),
               "where": f"tools.{i}.function.parameters"} for i, t in enumerate(tools or [])]
    if not listed:
        raise ValueError(f"tool_choice: {choice!r} forces a tool call but no tools are given")
    if choice == "required":
        return listed
    name = named(choice) if named is not None else None
    keep = [t for t in listed if t["name"] == name]
    if name is None or not keep:
        raise ValueError(f"tool_choice: {choice!r} is neither 'auto', 'none', 'required' nor a function among "
                         f"the tools ({', '.join(str(t['name']) for t in listed)})")
    return keep


def openai_function_name(choice) -> str | None:
    """{type: function, function: {name}} (chat) or {type: function, name} (Responses) → the name."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return (choice.get("function") or {}).get("name") or choice.get("name")
    return None


def response_format_grammar(fmt: dict | None) -> str | None:
    """OpenAI chat `response_format` (text / json_object / json_schema{schema}) → a grammar or None."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return json_grammar(None, "response_format")
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format.json_schema: expected an object with a `schema`")
        return json_grammar(spec.get("schema") or {"type": "object"}, "response_format.json_schema.schema")
    raise GrammarError(f"response_format.type: {fmt.get('type')!r} is not one of text, json_object, json_schema")


def where_of(e: Exception) -> str:
    """The parameter a GrammarError / ValueError message starts with ("tools.0.function.parameters: ...")."""
    return str(e).split(":", 1)[0].split("=", 1)[0].strip()
