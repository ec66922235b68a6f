"""Kimi K3's chat format (XTML): rendering as `Kimi-K3.jinja` renders, parsing K3's output (at once and
incrementally), and the grammars that constrain K3's own tool-call and response markup.

Markup. `⟨open⟩ ⟨close⟩ ⟨sep⟩ ⟨eom⟩` are the special tokens `<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`;
tag names and attributes are ordinary text: `open_tag(t, attrs) = ⟨open⟩ t( k="v")* ⟨sep⟩` (attribute values
escaped `&`→`&amp;`, `"`→`&quot;`; bodies are raw), `close_tag(t) = ⟨close⟩ t ⟨sep⟩`. Every message is
`open_tag(message, role=…) body close_tag(message) ⟨eom⟩`; no BOS, nothing between messages. In order:

    tool declarations (when tools)   role="system" type="tool-declare": "# Tools\\n…```json\\n" + tools + "\\n```"
    thinking effort (thinking on and thinking_effort low|high|max)   role="system" type="thinking-effort"
    the messages: system / user (text; images as their media blocks), assistant (open_tag(think) reasoning
        close_tag(think) — only with thinking on, kept for every assistant message — then open_tag(response)
        content close_tag(response), then its tool calls in a tools section: open_tag(call, tool=, index=) with
        open_tag(argument, key=, type=) value close_tag(argument) per argument, strings raw and other values as
        JSON), tool results (role="tool" tool="name" index="n", a run of them re-ordered into the call order)
    tool_choice required / none      role="system" type="tool-choice"
    response_format json_object / json_schema   role="system" type="response-format"
    generation prompt                open_tag(message, role=assistant) open_tag(think)  (or open_tag(response))

JSON in declarations and schemas has its keys sorted at every level, case-sensitively (codepoint order: K3's
reference encoder sorts with `sort_keys`, and llama.cpp's `dictsort` compares case-sensitively, where Python
jinja2's `dictsort` would fold case); other JSON is `json.dumps(ensure_ascii=False)` (Python's number forms:
llama.cpp's Jinja writes the float 1.0 as `1`, Python and K3's reference encoder as `1.0`).

Ids, not text: the renderer emits the markers as special ids and tokenizes every text run between two of them with
`encode_plain`, so text a user, a tool or the model wrote never becomes a control token. That is what K3's own
renderer does under vLLM (`apply_chat_template(tokenize=True)`); llama.cpp tokenizes the rendered string with
special-token parsing, which differs only when message text contains a special-token string. Images (a user
message's `parts`) become `<|media_begin|>image WxH<|media_content|>` + `<|media_pad|>`×tokens + `<|media_end|>`,
as vLLM expands K3's `<|kimi_image_placeholder|>` (W×H the uploaded size): the vision path's image run is
⟨media_content⟩ ⟨media_pad⟩×n ⟨media_end⟩ (VisionConfig image_start / image / image_end token ids).

Prefix stability: turn N+1's prompt starts with turn N's prompt and output when the model's output is what the
template writes back (reasoning and content verbatim, `trim_whitespace` off; non-string argument values in
`json.dumps` form, as K3 writes them) and three things stay put between the turns, as the template dictates:
the thinking effort (its system message comes before the conversation: a new tier recomputes everything), thinking
on or off (it decides whether history keeps its think sections), and tool_choice / response_format (their system
messages come after the conversation and are not part of the next turn's history).

Parsing (the output after the generation prompt; the first stop id ends it):

    [reasoning ⟨close⟩think⟨sep⟩] [⟨open⟩response⟨sep⟩] content [⟨close⟩response⟨sep⟩]
    [⟨open⟩tools⟨sep⟩ call* ⟨close⟩tools⟨sep⟩] ⟨close⟩message⟨sep⟩ ⟨eom⟩

- reasoning runs to `⟨close⟩think⟨sep⟩` or, when the model skips that closer, to `⟨open⟩response⟨sep⟩` (as
  llama.cpp); unfinished reasoning (a budget or max_tokens cut) is reasoning, `finished_thinking` False;
- content runs to `⟨close⟩response⟨sep⟩`, `⟨open⟩tools⟨sep⟩` or `⟨close⟩message⟨sep⟩`; the response opener is
  optional. Other markup in reasoning or content (stray tags, lone markers, other special tokens) stays there as
  its text, and so does text after the response outside any section (whitespace there is dropped); anything after
  `⟨close⟩message⟨sep⟩` is not part of the message;
- a tools section is taken whole or not at all, the way the other formats treat tool-call markup: when it is
  well formed (calls with a `tool` attribute, each holding `argument` tags with a `key` attribute or a `json`
  block holding a JSON object, whitespace between them) its calls become `tool_calls`; at the first item that
  does not fit, the section so far goes to the content as text and parsing goes on from that item as content.
  A section cut short by the end of the output keeps its calls when it was between calls, else is content;
- argument values are typed by the declared tool schema when `tools` declares the tool and the property has one
  JSON type (string: the raw text; any other type: the text as JSON, the raw text when it is not JSON); otherwise
  by the `type="…"` attribute the model wrote (string or missing: raw text; others as JSON, raw on failure).
  So the schema takes precedence, as in llama.cpp (vLLM reads the attribute only); the two agree whenever the
  model's attribute matches the schema, and when they disagree the schema's type is what the client gets, while
  the next turn re-renders the attribute from the value's type. Calls to undeclared tools are returned (vLLM);
  llama.cpp drops them.
- tool-call ids are `chat.tool_call_id` (deterministic per request salt); attribute values are unescaped.

`K3StreamParser` gives the same result piece by piece: reasoning and content text as each token arrives (never half
a character; markup held back only while it could still be a tag), each tools section's calls when the section is
complete. The concatenation of its pieces equals `parse_output` for any split of the tokens; it keeps all state in
the parser object (one per stream), and the format object is read-only.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass

from expertmesh.chat.format import (
    ChatError,
    ChatMarkers,
    Message,
    ParsedOutput,
    Phase,
    RenderedPrompt,
    ToolCall,
    check_render_options,
    tool_call_id,
    validate_history,
)
from expertmesh.chat.grammar import JSON_OPTIONS
from expertmesh.chat.jinja_template import arguments_value
from expertmesh.chat.tokenizer import TokenizerError

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
XTML_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)
MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
NOT_IN_ANSWER = ("[BOS]", "[PAD]", "[UNK]", "<|kimi_image_placeholder|>") + MEDIA_TOKENS
THINKING_EFFORTS = ("low", "high", "max")

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
MAX_TAG_BYTES = 1024  # a tag whose text grows past this without ⟨sep⟩ is not a tag: its opener is plain markup


# ----------------------------------------------------------------------------------------------- JSON and attributes
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


def escape_attr(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return re.sub(r"&(amp|quot);", lambda m: "&" if m[1] == "amp" else '"', value)


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


# ----------------------------------------------------------------------------------------------- rendering
class _Pieces:
    """Special ids and text, in order; `ids()` tokenizes each text run between two specials as one piece."""

    def __init__(self, chat: K3Chat):
        self.chat, self.items = chat, []

    def special(self, token: str) -> None:
        self.items.append(self.chat.id_of[token])

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
            out += [value] if special else self.chat.tokenizer.encode_plain(value)
        return out

    def text_form(self) -> str:
        tok = self.chat.tokenizer
        return "".join(tok.id_to_special[v] if special else v for special, v in self.runs())


@dataclass(frozen=True)
class RenderOptions:
    tools: list[dict] | None = None
    thinking: bool = True
    thinking_effort: str | None = None
    tool_choice: object = None
    response_format: dict | str | None = None
    add_generation_prompt: bool = True


class K3Chat:
    """Kimi K3's chat format over its TikToken tokenizer (see the module docstring)."""

    supports_thinking = True
    trim_whitespace = False
    states_tool_choice = True  # tool_choice none keeps the tools declared and says so in the prompt

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.n_base = getattr(tokenizer, "n_base", None)
        if self.n_base is None:
            raise TokenizerError("Kimi K3's chat format needs a TikToken tokenizer (tiktoken.model)")
        missing = [t for t in XTML_TOKENS if t not in tokenizer.special_to_id]
        if missing:
            raise TokenizerError(
                f"{tokenizer.directory / 'tokenizer_config.json'}: Kimi K3's chat format needs "
                f"the special tokens {', '.join(XTML_TOKENS)}; missing {', '.join(missing)}"
            )
        self.id_of = dict(tokenizer.special_to_id)
        self.open_id, self.close_id, self.sep_id, self.eom_id = (self.id_of[t] for t in XTML_TOKENS)
        stop = tuple(dict.fromkeys([self.eom_id, *tokenizer.eos_ids]))
        self.markers = ChatMarkers(
            stop=stop,
            end_of_turn=self.eom_id,
            think_start=None,
            think_end=self.close_id,
            think_end_ids=(
                self.close_id,
                *tokenizer.encode_plain("think"),
                self.sep_id,
                self.open_id,
                *tokenizer.encode_plain("response"),
                self.sep_id,
            ),
            not_in_answer=frozenset(self.id_of[t] for t in NOT_IN_ANSWER if t in self.id_of) - set(stop),
        )

    # --- rendering
    def pieces(self, messages: list[Message], o: RenderOptions) -> _Pieces:
        check_render_options(
            thinking_effort=o.thinking_effort if o.thinking else None,
            tool_choice=o.tool_choice,
            response_format=o.response_format,
        )
        p = _Pieces(self)
        if o.tools:
            p.message([("role", "system"), ("type", "tool-declare")], TOOL_DECLARE + json_sorted(o.tools) + "\n```")
        if o.thinking and o.thinking_effort is not None:
            p.message([("role", "system"), ("type", "thinking-effort")], EFFORT.format(o.thinking_effort).strip())
        calls: list[ToolCall] | None = None
        tool_index = 0
        for i, m in enumerate(messages):
            if m.role in ("user", "system"):
                p.open("message", [("role", m.role)])
                self._content(p, m, i)
                p.close("message")
                p.special(END_OF_MSG)
            elif m.role == "assistant":
                calls, tool_index = m.tool_calls, 0
                p.open("message", [("role", "assistant")])
                self._assistant(p, m, o.thinking)
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

    def _content(self, p: _Pieces, m: Message, i: int) -> None:
        if m.parts is None:
            p.text(m.content)
            return
        for part in m.parts:
            if isinstance(part, str):
                p.text(part)
                continue
            missing = [t for t in MEDIA_TOKENS if t not in self.id_of]
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

    def _assistant(self, p: _Pieces, m: Message, thinking: bool) -> None:
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

    def render_ids(self, messages: list[Message], **options) -> list[int]:
        """The prompt ids (RenderOptions fields as keywords; `add_generation_prompt` too)."""
        o = RenderOptions(**options)
        _validate(messages, o.add_generation_prompt)
        return self.pieces(messages, o).ids()

    def render_text(self, messages: list[Message], **options) -> str:
        """The prompt as the template's text (markers as their strings)."""
        o = RenderOptions(**options)
        _validate(messages, o.add_generation_prompt)
        return self.pieces(messages, o).text_form()

    def render(
        self,
        messages: list[Message],
        *,
        tools: list[dict] | None = None,
        thinking: bool = True,
        thinking_effort: str | None = None,
        tool_choice=None,
        response_format=None,
    ) -> RenderedPrompt:
        """The chat prompt: the generation prompt opens the think section (phase "reasoning") or, with thinking
        off, the response section (phase "content"). `thinking_effort` None renders no thinking-effort message
        (the template's own default, when the variable is not given at all, is "max")."""
        ids = self.render_ids(
            messages,
            tools=tools,
            thinking=thinking,
            thinking_effort=thinking_effort,
            tool_choice=tool_choice,
            response_format=response_format,
        )
        return RenderedPrompt(ids, "reasoning" if thinking else "content")

    # --- parsing
    def parse_output(
        self, tokens: list[int], *, phase: Phase, salt: str = "", tools: list[dict] | None = None
    ) -> ParsedOutput:
        """Reasoning, content and tool calls of generated ids (the module docstring's rules)."""
        body = []
        for t in map(int, tokens):
            if t in self.markers.stop:
                break
            if 0 <= t < self.tokenizer.vocab_size:  # a model's padded rows are no tokens (decode drops them)
                body.append(t)
        return parse_items(lex(self, body), len(body), phase, schema_types(tools), salt)

    def stream_parser(self, *, phase: Phase, salt: str = "", tools: list[dict] | None = None) -> K3StreamParser:
        """A parser for one stream (never share one between requests)."""
        return K3StreamParser(self, phase=phase, salt=salt, tools=tools)

    # --- constrained decoding
    def lark_prefix(self, thinking: bool) -> str:
        """What comes between the grammar's start and the response body: after ⟨close⟩ (the end-of-thinking token
        the router's grammar starts after) the rest of the think closer and the response opener; nothing with
        thinking off (generation starts inside the response)."""
        o, s = self.open_id, self.sep_id
        return f'"think" <[{s}]> <[{o}]> "response" <[{s}]> ' if thinking else ""

    def lark_close(self) -> str:
        c, s = self.close_id, self.sep_id
        return f'<[{c}]> "response" <[{s}]> '

    def response_grammar(self, schema: dict | None, *, thinking: bool) -> str:
        """llguidance Lark for `response_format`: the response is JSON (matching `schema`; any object when None),
        then the message closes (the sampler then forces ⟨eom⟩). With thinking on it applies after the router's
        `grammar_after_token` = markers.think_end."""
        schema = {"type": "object"} if schema is None else schema
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
        c, s = self.close_id, self.sep_id
        return (
            f'start: {self.lark_prefix(thinking)}answer {self.lark_close()}<[{c}]> "message" <[{s}]>\n'
            f"answer: %json {json.dumps(schema)}\n"
        )

    def tool_call_grammar(self, tools: list[dict], *, thinking: bool) -> str:
        """llguidance Lark for a forced tool call (tool_choice required or a named function): an empty response,
        then a tools section of one or more calls of `tools` ({name, parameters}: router.constraints.forced_tools),
        each with the schema's properties in order (required ones always), typed as the template writes them, then
        the message closes."""
        o, c, s = self.open_id, self.close_id, self.sep_id
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
                        json.dumps(f' type="{attr}"')
                        if attr
                        else '" type=\\"" /(number|boolean|null|object|array)/ "\\""'
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
            f"start: {self.lark_prefix(True) if thinking else ''}{self.lark_close()}"
            f'<[{o}]> "tools" <[{s}]> calls1 <[{c}]> "tools" <[{s}]> <[{c}]> "message" <[{s}]>\n'
            + "\n".join(rules)
            + "\nSTRING: /(?s:.+)/\n"
        )
        return lark


MAX_FORCED_CALLS = 8  # calls a forced tools section may hold


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


def _validate(messages: list[Message], add_generation_prompt: bool) -> None:
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


# ----------------------------------------------------------------------------------------------- lexing
TEXT, TAG, RAW = "text", "tag", "raw"
_NAME = r"[A-Za-z_][A-Za-z0-9_.:-]*"
_OPEN_TAG = re.compile(rf'({_NAME})((?: {_NAME}="[^"]*")*)')
_ATTR = re.compile(rf' ({_NAME})="([^"]*)"')


@dataclass(frozen=True)
class Item:
    """A piece of the output: a text run (`text` decoded), a tag (`text` its markup), or other markup (`text` as
    written: a lone marker, an unfinished tag, another special token). `end`: the index after its last token."""

    kind: str
    text: str
    end: int
    opens: bool = False
    name: str = ""
    attrs: tuple = ()

    def attr(self, key: str) -> str | None:
        return dict(self.attrs).get(key)

    def is_tag(self, opens: bool, name: str) -> bool:
        return self.kind == TAG and self.opens == opens and self.name == name


def make_tag(marker: str, body: str, end: int) -> Item:
    raw = marker + body + SEP
    if marker == CLOSE:
        return Item(TAG, raw, end, False, body) if re.fullmatch(_NAME, body) else Item(RAW, raw, end)
    m = _OPEN_TAG.fullmatch(body)
    if m is None:
        return Item(RAW, raw, end)
    attrs = tuple((k, unescape_attr(v)) for k, v in _ATTR.findall(m[2]))
    return Item(TAG, raw, end, True, m[1], attrs)


def lex(chat: K3Chat, tokens: list[int]) -> list[Item]:
    """Generated ids (in the vocabulary, before any stop id) → items (the reference: the whole output at once)."""
    tok, n_base = chat.tokenizer, chat.n_base
    markers = {chat.open_id: OPEN, chat.close_id: CLOSE}

    def is_text(t: int) -> bool:
        return t < n_base

    items: list[Item] = []
    run = bytearray()
    i, n = 0, len(tokens)
    while i < n:
        t = tokens[i]
        if is_text(t):
            run += tok.token_bytes(t)
            i += 1
            continue
        if run:
            items.append(Item(TEXT, run.decode("utf-8", errors="replace"), i))
            run = bytearray()
        if t in markers:
            j, body, aborted = i + 1, bytearray(), False
            while j < n and is_text(tokens[j]):
                body += tok.token_bytes(tokens[j])
                j += 1
                if len(body) > MAX_TAG_BYTES:
                    aborted = True
                    break
            if aborted:
                items.append(Item(RAW, markers[t], i + 1))
                i += 1
            elif j < n and tokens[j] == chat.sep_id:
                items.append(make_tag(markers[t], body.decode("utf-8", errors="replace"), j + 1))
                i = j + 1
            else:
                items.append(Item(RAW, markers[t] + body.decode("utf-8", errors="replace"), j))
                i = j
            continue
        items.append(Item(RAW, tok.id_to_special[t], i + 1))
        i += 1
    if run:
        items.append(Item(TEXT, run.decode("utf-8", errors="replace"), n))
    return items


def _blank(item: Item) -> bool:
    return item.kind == TEXT and not item.text.strip()


# ----------------------------------------------------------------------------------------------- parsing
@dataclass
class _Call:
    name: str
    args: dict


def _finish_calls(calls: list[_Call], first: int, salt: str) -> list[ToolCall]:
    out = []
    for k, c in enumerate(calls, start=first):
        text = json.dumps(c.args, ensure_ascii=False)
        out.append(ToolCall(tool_call_id(c.name, text, k, salt), c.name, text))
    return out


def parse_section(items: list[Item], pos: int, types: dict) -> tuple[bool, list[_Call], int]:
    """A tools section from items[pos] (after its opener): (well formed, its calls, the index after it — or of the
    item that does not fit when not well formed; at the end of the items: well formed when between calls)."""
    calls: list[_Call] = []
    sub, cur, key, kind, value = "between", None, "", None, []
    while pos < len(items):
        it = items[pos]
        if sub == "between":
            if _blank(it):
                pass
            elif it.is_tag(True, "call") and it.attr("tool"):
                cur, sub = _Call(it.attr("tool"), {}), "call"
            elif it.is_tag(False, "tools"):
                return True, calls, pos + 1
            elif it.is_tag(False, "message"):
                return True, calls, pos
            else:
                return False, calls, pos
        elif sub == "call":
            if _blank(it):
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
                calls += _finish_calls(found, len(calls), salt)
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
        elif state == "content" or not _blank(it):
            content.append(it.text)
        pos += 1
    return ParsedOutput("".join(reasoning), "".join(content), calls, reasoning_tokens, finished)


# ----------------------------------------------------------------------------------------------- streaming
class K3StreamParser:
    """Generated ids → ("reasoning", text), ("content", text) and ("tool_call", ToolCall) pieces as they arrive;
    `feed` each id, then `finish` once; `result()` is then what `K3Chat.parse_output` gives for the same ids.
    A state machine over the same items as `lex`, built incrementally: text is decoded as it comes (an incremental
    UTF-8 decoder per run, so a token holding part of a character waits for the rest), a tag is held from its
    ⟨open⟩/⟨close⟩ to its ⟨sep⟩, text after the response waits for its run to end (whitespace there is dropped),
    and a tools section is held until it closes."""

    def __init__(self, chat: K3Chat, *, phase: Phase, salt: str = "", tools: list[dict] | None = None):
        self.chat, self.salt, self.types = chat, salt, schema_types(tools)
        self.tok, self.n_base = chat.tokenizer, chat.n_base
        self.markers = {chat.open_id: OPEN, chat.close_id: CLOSE}
        self.state = {"reasoning": "reasoning_start", "content": "content_start", "maybe": "maybe"}[phase]
        self.n = 0  # ids fed before the first stop id
        self.stopped = self.finished = False
        self.pending: tuple[str, bytearray] | None = None  # an unfinished tag: its marker and text bytes
        self.utf8 = None  # the current text run's decoder (None: no run)
        self.held = ""  # a text run after the response, until it ends
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.finished_thinking, self.reasoning_tokens = phase != "reasoning", 0
        self._section_reset()
        self.out: list = []

    def _section_reset(self) -> None:
        self.sec_raw: list[str] = []
        self.sec_text = ""
        self.sec_calls: list[_Call] = []
        self.sub, self.cur, self.key, self.kind, self.value = "between", None, "", None, []

    # --- output
    def _emit(self, kind: str, text: str) -> None:
        if text:
            (self.reasoning if kind == "reasoning" else self.content).append(text)
            self.out.append((kind, text))

    def _emit_calls(self) -> None:
        for call in _finish_calls(self.sec_calls, len(self.calls), self.salt):
            self.calls.append(call)
            self.out.append(("tool_call", call))

    # --- lexing
    def feed(self, token: int) -> list:
        """The pieces this id completes."""
        self.out = []
        token = int(token)
        if self.stopped or self.finished:
            return self.out
        if token in self.chat.markers.stop:
            self.stopped = True
            return self.out
        if not 0 <= token < self.tok.vocab_size:  # a model's padded rows: no token (as parse_output)
            return self.out
        self.n += 1
        text = token < self.n_base
        if self.pending is not None:
            marker, body = self.pending
            if text:
                body += self.tok.token_bytes(token)
                if len(body) > MAX_TAG_BYTES:  # not a tag: the marker is markup, its text starts a run
                    self.pending = None
                    self._item(Item(RAW, marker, 0))
                    self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
                    self._text(self.utf8.decode(bytes(body)))
                return self.out
            self.pending = None
            if token == self.chat.sep_id:
                self._item(make_tag(marker, body.decode("utf-8", errors="replace"), self.n))
                return self.out
            self._item(Item(RAW, marker + body.decode("utf-8", errors="replace"), self.n - 1))
        if text:
            if self.utf8 is None:
                self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._text(self.utf8.decode(self.tok.token_bytes(token)))
            return self.out
        self._end_run()
        if token in self.markers:
            self.pending = (self.markers[token], bytearray())
        else:
            self._item(Item(RAW, self.tok.id_to_special[token], self.n))
        return self.out

    def feed_many(self, tokens) -> list:
        out = []
        for t in tokens:
            out += self.feed(t)
        return out

    def finish(self) -> list:
        """The pieces the end of the output completes (an unfinished tag, run or section)."""
        self.out = []
        if self.finished:
            return self.out
        if self.pending is not None:
            marker, body = self.pending
            self.pending = None
            self._item(Item(RAW, marker + body.decode("utf-8", errors="replace"), self.n))
        self._end_run()
        if self.state == "section":
            if self.sub == "between":
                self._emit_calls()
            else:
                self._emit("content", "".join(self.sec_raw))
        if self.state in ("reasoning_start", "reasoning"):
            self.finished_thinking, self.reasoning_tokens = False, self.n
        self.finished = True
        return self.out

    def result(self) -> ParsedOutput:
        return ParsedOutput(
            "".join(self.reasoning),
            "".join(self.content),
            list(self.calls),
            self.reasoning_tokens,
            self.finished_thinking,
        )

    def _end_run(self) -> None:
        if self.utf8 is None:
            return
        self._text(self.utf8.decode(b"", final=True))
        self.utf8 = None
        if self.state == "after":
            if self.held.strip():
                self._emit("content", self.held)
            self.held = ""
        elif self.state == "section":
            item, self.sec_text = Item(TEXT, self.sec_text, self.n), ""
            self._section(item)

    # --- parsing
    def _text(self, piece: str) -> None:
        if self.state == "maybe":
            self.state = "content_start"
        if self.state == "reasoning_start":
            self.state = "reasoning"
        if self.state == "content_start":
            self.state = "content"
        if self.state == "reasoning":
            self._emit("reasoning", piece)
        elif self.state == "content":
            self._emit("content", piece)
        elif self.state == "after":
            self.held += piece
        elif self.state == "section":
            self.sec_text += piece

    def _item(self, it: Item) -> None:
        s = self.state
        if s == "done":
            return
        if s == "maybe":
            if it.is_tag(True, "think"):
                self.state = "reasoning"
                return
            s = self.state = "content_start"
        if s == "reasoning_start":
            s = self.state = "reasoning"
            if it.is_tag(True, "think"):
                return
        if s == "reasoning":
            if it.is_tag(False, "think") or it.is_tag(True, "response"):
                self.finished_thinking, self.reasoning_tokens = True, it.end
                self.state = "content_start" if it.is_tag(False, "think") else "content"
            else:
                self._emit("reasoning", it.text)
            return
        if s == "content_start":
            s = self.state = "content"
            if it.is_tag(True, "response"):
                return
        if s == "section":
            self._section(it)
        elif it.is_tag(True, "tools"):
            self.state = "section"
            self._section_reset()
            self.sec_raw.append(it.text)
        elif it.is_tag(False, "message"):
            self.state = "done"
        elif s == "content" and it.is_tag(False, "response"):
            self.state = "after"
        elif s in ("content", "after"):
            self._emit("content", it.text)

    def _section(self, it: Item) -> None:
        """One item of a tools section (parse_section's rules, one item at a time)."""
        sub = self.sub
        if sub == "between":
            if _blank(it):
                pass
            elif it.is_tag(True, "call") and it.attr("tool"):
                self.cur, self.sub = _Call(it.attr("tool"), {}), "call"
            elif it.is_tag(False, "tools") or it.is_tag(False, "message"):
                self._emit_calls()
                self.state = "after"
                if it.is_tag(False, "message"):
                    self._item(it)
                return
            else:
                return self._malformed(it)
        elif sub == "call":
            if _blank(it):
                pass
            elif it.is_tag(True, "argument") and it.attr("key") is not None:
                self.sub, self.key, self.kind, self.value = "arg", it.attr("key"), it.attr("type"), []
            elif it.is_tag(True, "json"):
                self.sub, self.value = "json", []
            elif it.is_tag(False, "call"):
                self.sec_calls.append(self.cur)
                self.sub = "between"
            else:
                return self._malformed(it)
        elif sub == "arg":
            if it.is_tag(False, "argument"):
                self.cur.args[self.key] = argument_value(
                    "".join(self.value), self.kind, self.types.get(self.cur.name, {}).get(self.key)
                )
                self.sub = "call"
            else:
                self.value.append(it.text)
        else:
            if it.is_tag(False, "json"):
                try:
                    obj = loads_strict("".join(self.value))
                except ValueError:
                    obj = None
                if not isinstance(obj, dict):
                    return self._malformed(it)
                self.cur.args.update(obj)
                self.sub = "call"
            else:
                self.value.append(it.text)
        self.sec_raw.append(it.text)

    def _malformed(self, it: Item) -> None:
        """The section so far is content; `it` is read again as content."""
        self._emit("content", "".join(self.sec_raw))
        self.state = "content"
        self._section_reset()
        if it.kind == TEXT:
            self._text(it.text)
        else:
            self._item(it)
