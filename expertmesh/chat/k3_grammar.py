"""llguidance Lark grammars for K3's own markup: a `response_format` response (JSON in the response section) and a
forced tool call (a tools section of calls to the given tools, arguments typed as the template writes them). With
thinking on they apply after the router's `grammar_after_token` = markers.think_end (⟨close⟩)."""

from __future__ import annotations

import json

from expertmesh.chat.grammar import JSON_OPTIONS
from expertmesh.chat.k3_markup import K3Vocab, escape_attr

MAX_FORCED_CALLS = 8  # calls a forced tools section may hold


def lark_prefix(vocab: K3Vocab, thinking: bool) -> str:
    """What comes between the grammar's start and the response body: after ⟨close⟩ (the end-of-thinking token
    the router's grammar starts after) the rest of the think closer and the response opener; nothing with
    thinking off (generation starts inside the response)."""
    o, s = vocab.open_id, vocab.sep_id
    return f'"think" <[{s}]> <[{o}]> "response" <[{s}]> ' if thinking else ""


def lark_close(vocab: K3Vocab) -> str:
    c, s = vocab.close_id, vocab.sep_id
    return f'<[{c}]> "response" <[{s}]> '


def response_grammar(vocab: K3Vocab, schema: dict | None, *, thinking: bool) -> str:
    """llguidance Lark for `response_format`: the response is JSON (matching `schema`; any object when None),
    then the message closes (the sampler then forces ⟨eom⟩). With thinking on it applies after the router's
    `grammar_after_token` = markers.think_end."""
    schema = {"type": "object"} if schema is None else schema
    schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    c, s = vocab.close_id, vocab.sep_id
    return (
        f'start: {lark_prefix(vocab, thinking)}answer {lark_close(vocab)}<[{c}]> "message" <[{s}]>\n'
        f"answer: %json {json.dumps(schema)}\n"
    )


def tool_call_grammar(vocab: K3Vocab, tools: list[dict], *, thinking: bool) -> str:
    """llguidance Lark for a forced tool call (tool_choice required or a named function): an empty response,
    then a tools section of one or more calls of `tools` ({name, parameters}: router.constraints.forced_tools),
    each with the schema's properties in order (required ones always), typed as the template writes them, then
    the message closes."""
    o, c, s = vocab.open_id, vocab.close_id, vocab.sep_id
    rules, alts = [], []
    for i, t in enumerate(tools):
        params = t.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        required = set(params.get("required") or ()) if isinstance(params, dict) else set()
        args = []
        for j, (key, prop) in enumerate((props or {}).items()):
            prop = prop if isinstance(prop, dict) else {}
            rule = f"arg{i}_{j}"
            head = f"<[{o}]> {json.dumps('argument key=' + chr(34) + escape_attr(key) + chr(34))}"
            tail = f'<[{c}]> "argument" <[{s}]>'
            kind = prop.get("type")
            json_schema = {**prop, "x-guidance": {**JSON_OPTIONS, **prop.get("x-guidance", {})}}
            alternatives = []
            if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
                alternatives.append(f'{head} " type=\\"string\\"" <[{s}]> {string_value(prop)} {tail}')
            if kind != "string":
                attr = {"integer": "number"}.get(kind, kind) if isinstance(kind, str) else None
                attr_rule = (
                    json.dumps(f' type="{attr}"') if attr else '" type=\\"" /(number|boolean|null|object|array)/ "\\""'
                )
                rules.append(f"{rule}_json: %json {json.dumps(json_schema)}")
                alternatives.append(f"{head} {attr_rule} <[{s}]> {rule}_json {tail}")
            rules.append(f"{rule}: " + " | ".join(alternatives))
            args.append(rule if key in required else f"{rule}?")
        alts.append((json.dumps(f'call tool="{escape_attr(t["name"])}" index="'), f"args{i}"))
        rules.append(f"args{i}: {' '.join(args)}" if args else f'args{i}: ""')
    # the calls numbered 1, 2, ... as the template numbers them (at most MAX_FORCED_CALLS in one section)
    for k in range(1, MAX_FORCED_CALLS + 1):
        nxt = f" calls{k + 1}?" if k < MAX_FORCED_CALLS else ""
        options = " | ".join(
            f'<[{o}]> {opener} "{k}\\"" <[{s}]> {args} <[{c}]> "call" <[{s}]>' for opener, args in alts
        )
        rules.append(f"calls{k}: ({options}){nxt}")
    lark = (
        f"start: {lark_prefix(vocab, True) if thinking else ''}{lark_close(vocab)}"
        f'<[{o}]> "tools" <[{s}]> calls1 <[{c}]> "tools" <[{s}]> <[{c}]> "message" <[{s}]>\n'
        + "\n".join(rules)
        + "\nSTRING: /(?s:.+)/\n"
    )
    return lark


def string_value(prop: dict) -> str:
    """Lark for a string argument's raw value (written between the tags, unquoted) under its schema: one of an
    `enum`'s strings, or text of `minLength`..`maxLength` characters (the JSON Schema bounds), else any text (empty
    included). `pattern` is not applied to raw values (the JSON-typed arguments get the whole schema)."""
    enum = prop.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return (
            "(" + " | ".join(json.dumps(v) if v else '""' for v in enum) + ")"
            if all(enum)
            else "(" + " | ".join(json.dumps(v) for v in enum if v) + ")?"
        )
    lo, hi = prop.get("minLength"), prop.get("maxLength")
    if not isinstance(lo, int) or isinstance(lo, bool) or lo < 0:
        lo = 0
    if not isinstance(hi, int) or isinstance(hi, bool) or hi < max(lo, 1):
        return "STRING?" if lo == 0 else f"/(?s:.{{{lo},}})/"
    return f"/(?s:.{{{max(lo, 1)},{hi}}})/" + ("?" if lo == 0 else "")
