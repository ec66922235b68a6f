"""API-level constrained decoding (#15): `response_format` / `text.format` and forcing `tool_choice` → an llguidance
grammar for SamplingParams.grammar, compiled here first so a bad schema is a 400 naming it before anything is
scheduled.

A forced tool call is the chat format's own markup — the built-in ⟨tool_call⟩ name \\n JSON-arguments
⟨/tool_call⟩, a checkpoint template's Hermes `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`, Kimi K2's or
DeepSeek V3.1's section (chat/tool_call_formats.ToolCallFormat.markup) — with the name among the allowed tools and the
arguments validating against that tool's `parameters`; the sampler then forces the end of turn. With thinking on,
the grammar starts after the end-of-thinking marker (reasoning stays free).

Every refusal is a GrammarError whose `param` names the field as the request spelled it (`Fields`: chat's
`tools.0.function.parameters`, Anthropic's `tools.0.input_schema`, Responses' `text.format.schema`).

Work bounded and off the event loop: a schema over `SCHEMA_BUDGET_BYTES` is refused before it is compiled;
compilation runs within llguidance's limits (grammar.LIMITS, the worker's too), then the grammar is probed with the
chat format's own tokenizer (grammar.probe: one that compiles but exceeds a limit while decoding is refused here);
the HTTP handlers run all of it in a small thread pool (`compile_off_loop`) within `COMPILE_SECONDS`, at most
`MAX_COMPILES_WAITING` waiting (429 beyond): eight concurrent 3.6 MB enum schemas stalled /health 5.5 s.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from expertmesh.chat.grammar import (
    JSON_OPTIONS,
    GrammarError,
    cached_ll_tokenizer,
    json_schema_grammar,
    probe,
    validate,
)
from expertmesh.chat.tool_call_formats import ARGUMENTS, NAME, NAME_JSON
from expertmesh.router.errors import APIError

SCHEMA_BUDGET_BYTES = 256 * 1024  # one schema's JSON (OpenAI's own bound: 120,000 characters of names and enums)
COMPILE_SECONDS = 10.0
COMPILE_THREADS = 2
MAX_COMPILES_WAITING = 32

BUILTIN_CALL = (NAME, "\n", ARGUMENTS)  # the built-in format's call between ⟨tool_call⟩ and ⟨/tool_call⟩


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


def check_grammar(grammar: str, where: str, tokenizer=None) -> str:
    """`grammar` when llguidance compiles it within grammar.LIMITS — and, given the chat format's `tokenizer`, decodes
    a little within them (grammar.probe) — else GrammarError naming `where`."""
    if len(grammar) > 4 * SCHEMA_BUDGET_BYTES:
        raise refuse(where, f"a grammar of {len(grammar)} bytes, more than the {4 * SCHEMA_BUDGET_BYTES} allowed")
    err = validate(grammar)
    if err:
        raise refuse(where, f"cannot be compiled: {err}")
    if tokenizer is not None:
        err = probe(cached_ll_tokenizer(tokenizer), grammar)
        if err:
            raise refuse(
                where,
                f"exceeds the decoder's limits (llguidance: {err.splitlines()[0]}); simplify it (fewer "
                f"alternatives in one anyOf / oneOf, less nesting)",
            )
    return grammar


def check_schema_size(schema, where: str) -> None:
    size = len(json.dumps(schema))
    if size > SCHEMA_BUDGET_BYTES:
        raise refuse(where, f"a schema of {size} bytes, more than the {SCHEMA_BUDGET_BYTES} allowed")


def json_grammar(schema: dict | None, where: str) -> str:
    """Any JSON object (schema None, `json_object`) or JSON validating against `schema`."""
    if schema is not None and not isinstance(schema, dict):
        raise refuse(where, f"expected a JSON schema object, got {type(schema).__name__}")
    check_schema_size(schema, where)
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
        check_schema_size(schema, t["where"])
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
    listed = [
        {
            "name": (t.get("function") or {}).get("name"),
            "parameters": (t.get("function") or {}).get("parameters"),
            "where": fields.tool_schema.format(i),
        }
        for i, t in enumerate(tools or [])
    ]
    if not listed:
        raise refuse("tool_choice", f"{choice!r} forces a tool call but no tools are given")
    if choice == "required":
        return listed
    name = function_name(choice)
    keep = [t for t in listed if t["name"] == name]
    if name is None or not keep:
        raise refuse(
            "tool_choice",
            f"{choice!r} is neither 'auto', 'none', 'required' nor a function among the "
            f"tools ({', '.join(str(t['name']) for t in listed)})",
        )
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


def answer_grammar(fmt, choice, tools, response_format: dict | None = None, fields: Fields = CHAT_FIELDS) -> str | None:
    """The grammar a request's forcing `tool_choice` (chat-shaped `tools`) or `response_format` (json_object /
    json_schema) puts on the answer — from its first token (the sampler starts it where thinking ends); None for
    neither. A format with its own tool-call grammar (K3's tagged calls and response section) builds it. The
    grammar is probed with the format's tokenizer (check_grammar)."""
    forced = forced_tools(choice, tools, fields)
    if forced is None:
        schema = response_schema(response_format, fields)
        if schema is None:
            return None
        where = schema[1]
    else:
        where = "tools" if len(forced) > 1 or choice == "required" else forced[0]["where"]
    return check_grammar(_answer_grammar(fmt, forced, response_format, fields), where, fmt.tokenizer)


def _answer_grammar(fmt, forced, response_format, fields: Fields) -> str | None:
    if hasattr(fmt, "tool_call_grammar"):
        if forced is not None:
            for t in forced:
                check_schema_size(t.get("parameters"), t["where"])
            return check_grammar(fmt.tool_call_grammar(forced, thinking=False), "tools")
        schema = response_schema(response_format, fields)
        check_schema_size(schema[0], schema[1])
        return check_grammar(fmt.response_grammar(schema[0], thinking=False), schema[1])
    markers = fmt.markers
    if forced is None:
        return response_format_grammar(response_format, fields)
    markup = getattr(fmt, "tool_call_markup", BUILTIN_CALL)  # a checkpoint template's format, else built-in
    if markers.tool_open is None or markers.tool_close is None or markup is None:
        raise refuse("tool_choice", "forcing a tool call needs a chat format with tool-call marker tokens")
    return tool_call_grammar(forced, markers.tool_open, markers.tool_close, markup)


_POOL = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
_waiting = 0
_waiting_lock = threading.Lock()


async def compile_off_loop(fn, *args, param: str | None = None):
    """`fn(*args)` (a grammar compilation: answer_grammar) in the compile pool, within COMPILE_SECONDS; its
    GrammarError (a ValueError) as the 400 naming its field, a full pool as 429, the budget spent as a 400."""
    global _waiting
    with _waiting_lock:
        if _waiting >= MAX_COMPILES_WAITING:
            raise APIError(
                f"{param or 'grammar'}: {MAX_COMPILES_WAITING} grammars are being compiled; retry later",
                param=param,
                code="grammar_compiler_busy",
                kind="rate_limit",
            )
        _waiting += 1
    try:
        future = asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(future), COMPILE_SECONDS)
        except TimeoutError:
            raise APIError(
                f"{param or 'grammar'}: not compiled within {COMPILE_SECONDS:g} s; simplify it",
                param=param,
                code="grammar_too_complex",
            ) from None
        except ValueError as e:
            raise APIError(str(e), param=getattr(e, "param", None) or param) from None
    finally:
        with _waiting_lock:
            _waiting -= 1
