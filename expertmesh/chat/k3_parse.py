"""Parsing K3's output at once (chat/k3.py's module docstring gives the rules): the items of chat/k3_markup.py's
`lex` become reasoning, content and tool calls; argument values are typed by the declared tool schema, else by the
`type=` attribute the model wrote. chat/k3_stream.py applies the same rules one item at a time."""

from __future__ import annotations

import json
from dataclasses import dataclass

from expertmesh.chat.format import ParsedOutput, Phase, ToolCall, tool_call_id
from expertmesh.chat.k3_markup import Item, is_blank


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str):
    """json.loads without NaN / Infinity (they would make the arguments text invalid JSON)."""
    return json.loads(text, parse_constant=_reject_constant)


JSON_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")


def argument_value(raw: str, type_attr: str | None, schema_type: str | None):
    """A parsed argument: typed by the schema's type when there is one, else by the `type=` attribute."""
    kind = schema_type if schema_type in JSON_TYPES else (type_attr or "string")
    if kind == "string":
        return raw
    try:
        return loads_strict(raw)
    except ValueError:
        return raw


def schema_types(tools: list[dict] | None) -> dict[str, dict[str, str | None]]:
    """{tool name: {property: its single JSON type, or None}} of OpenAI-shaped (or flat {name, parameters}) tools."""
    out: dict[str, dict[str, str | None]] = {}
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) and isinstance(t.get("function"), dict) else t
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        types: dict[str, str | None] = {}
        for key, prop in props.items() if isinstance(props, dict) else ():
            kind = prop.get("type") if isinstance(prop, dict) else None
            if isinstance(kind, list) and len(kind) == 1:
                kind = kind[0]
            types[key] = kind if isinstance(kind, str) else None
        out[fn["name"]] = types
    return out


@dataclass
class CallDraft:
    name: str
    args: dict


def finish_calls(calls: list[CallDraft], first: int, salt: str) -> list[ToolCall]:
    out = []
    for k, c in enumerate(calls, start=first):
        text = json.dumps(c.args, ensure_ascii=False)
        out.append(ToolCall(tool_call_id(c.name, text, k, salt), c.name, text))
    return out


def parse_section(items: list[Item], pos: int, types: dict) -> tuple[bool, list[CallDraft], int]:
    """A tools section from items[pos] (after its opener): (well formed, its calls, the index after it — or of the
    item that does not fit when not well formed; at the end of the items: well formed when between calls)."""
    calls: list[CallDraft] = []
    sub, cur, key, kind, value = "between", None, "", None, []
    while pos < len(items):
        it = items[pos]
        if sub == "between":
            if is_blank(it):
                pass
            elif it.is_tag(True, "call") and it.attr("tool"):
                cur, sub = CallDraft(it.attr("tool"), {}), "call"
            elif it.is_tag(False, "tools"):
                return True, calls, pos + 1
            elif it.is_tag(False, "message"):
                return True, calls, pos
            else:
                return False, calls, pos
        elif sub == "call":
            if is_blank(it):
                pass
            elif it.is_tag(True, "argument") and it.attr("key") is not None:
                sub, key, kind, value = "arg", it.attr("key"), it.attr("type"), []
            elif it.is_tag(True, "json"):
                sub, value = "json", []
            elif it.is_tag(False, "call"):
                calls.append(cur)
                sub = "between"
            else:
                return False, calls, pos
        elif sub == "arg":
            if it.is_tag(False, "argument"):
                cur.args[key] = argument_value("".join(value), kind, types.get(cur.name, {}).get(key))
                sub = "call"
            else:
                value.append(it.text)
        else:  # json
            if it.is_tag(False, "json"):
                try:
                    obj = loads_strict("".join(value))
                except ValueError:
                    obj = None
                if not isinstance(obj, dict):
                    return False, calls, pos
                cur.args.update(obj)
                sub = "call"
            else:
                value.append(it.text)
        pos += 1
    return sub == "between", calls, pos


def parse_items(items: list[Item], n_tokens: int, phase: Phase, types: dict, salt: str) -> ParsedOutput:
    """The reference parse of a whole output's items (see the module docstring)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    pos, finished, reasoning_tokens = 0, True, 0
    if phase == "maybe":
        if items and items[0].is_tag(True, "think"):
            phase, pos = "reasoning", 1
        else:
            phase = "content"
    elif phase == "reasoning" and items and items[0].is_tag(True, "think"):
        pos = 1  # the opener repeated after the generation prompt's
    if phase == "reasoning":
        end = next(
            (k for k in range(pos, len(items)) if items[k].is_tag(False, "think") or items[k].is_tag(True, "response")),
            None,
        )
        if end is None:
            return ParsedOutput("".join(it.text for it in items[pos:]), "", [], n_tokens, False)
        reasoning = [it.text for it in items[pos:end]]
        reasoning_tokens, pos = items[end].end, end + 1
        state = "content_start" if items[end].is_tag(False, "think") else "content"
    else:
        state = "content_start"
    if state == "content_start":
        if pos < len(items) and items[pos].is_tag(True, "response"):
            pos += 1
        state = "content"
    while pos < len(items):
        it = items[pos]
        if it.is_tag(True, "tools"):
            ok, found, nxt = parse_section(items, pos + 1, types)
            if ok:
                calls += finish_calls(found, len(calls), salt)
                state = "after"
            else:
                content += [x.text for x in items[pos:nxt]]
                state = "content"
            pos = nxt
            continue
        if it.is_tag(False, "message"):
            break
        if state == "content" and it.is_tag(False, "response"):
            state = "after"
        elif state == "content" or not is_blank(it):
            content.append(it.text)
        pos += 1
    return ParsedOutput("".join(reasoning), "".join(content), calls, reasoning_tokens, finished)
