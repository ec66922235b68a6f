"""A checkpoint's own chat template (Jinja), rendered the way transformers' `apply_chat_template` renders it.

Same environment as transformers (sandboxed, trim_blocks + lstrip_blocks, loop controls, `{% generation %}`,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, `namespace`, `dict`), same variables
(`messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`/`eos_token`/… from tokenizer_config.json,
`enable_thinking`, and `thinking` for templates that read that name instead). Messages are OpenAI-shaped: reasoning
as `reasoning_content` (and `thinking`, as transformers aliases it), tool calls as
`{id, type: function, function: {name, arguments}}` with arguments a dict (the JSON text for a template that only
renders text, as DeepSeek's concatenate it), tool results with `tool_call_id`. Parsed reasoning and content come
back without surrounding whitespace: the template writes its own separators when they are sent back.

User-supplied strings are sanitized as `apply_chat_template(..., sanitize_control_tokens=True)` does: a control
token (`<|im_end|>`, `<think>`, …) typed by a user is tokenized as ordinary text, never as the token.

What the template means for parsing the model's output is detected when it loads:
- thinking: a `<think>`/`</think>` pair (or `<thinking>`, `<|think|>` forms) that the template writes and the
  vocabulary holds as single tokens; a template without one has thinking off (reasoning requests are accepted,
  reasoning comes back empty);
- end of turn: the token the template writes after an assistant's content (generation stops there and at EOS);
- tool calls: one of the known output formats whose opening token the template writes (Hermes `<tool_call>` JSON,
  Kimi K2 `<|tool_calls_section_begin|>`, DeepSeek V3.1 `<｜tool▁calls▁begin｜>`); others stay in the content. The
  format's closing token (`</tool_call>`, the section's end) and the markup of one call (`tool_call_markup`: what a
  forced tool call's grammar spells, router/constraints.py) come with it.

Multi-turn prefix stability (turn N+1's prompt starts with turn N's prompt and output, so the prefix cache only
computes new tokens) is checked on a small built-in conversation; a template that breaks it still serves, with a
warning naming the first turn that diverges.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from expertmesh.chat.format import (
    ChatError,
    ChatMarkers,
    Message,
    ParsedOutput,
    Phase,
    RenderedPrompt,
    ToolCall,
    check_render_options,
    split_reasoning,
    tool_call_id,
    validate_history,
)
from expertmesh.chat.tokenizer import CheckpointTokenizer, read_json

log = logging.getLogger("expertmesh.chat.jinja_template")

MARK_START, MARK_END = "\U000f0000", "\U000f0001"  # transformers' private-use marks around sanitized tokens
THINK_PAIRS = (("<think>", "</think>"), ("<thinking>", "</thinking>"), ("<|think|>", "<|/think|>"))


class ChatTemplateError(ValueError):
    """A chat template that cannot be used; the message names the file."""


# ----------------------------------------------------------------------------------------------- Jinja
@lru_cache(maxsize=8)
def compile_template(text: str):
    """The template compiled in transformers' environment (chat templates are untrusted: sandboxed)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}…{% endgeneration %}` marks assistant text for training masks: rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` without underscore attributes (no route to Python internals)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: underscore names not allowed")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=TemplateDict(),
        namespace=Namespace,
    )
    return env.from_string(text)


def template_literals(text: str) -> str:
    """The template's literal text and string constants, joined by NUL (what transformers searches for the added
    tokens a template writes itself)."""
    import jinja2.nodes

    ast = compile_template(text).environment.parse(text)
    literals = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(literals)


def template_variables(text: str) -> frozenset[str]:
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(compile_template(text).environment.parse(text)))


def template_messages(messages: list[Message], *, arguments_as_text: bool = False) -> list[dict]:
    """Messages as a chat template reads them (OpenAI shape, as transformers passes them). Tool-call arguments
    are a dict, or the JSON text for templates that concatenate them as strings (DeepSeek's)."""
    out = []
    for m in messages:
        d: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": c.arguments if arguments_as_text else arguments_value(c.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning is not None:
            d = {"thinking": m.reasoning, **d, "reasoning_content": m.reasoning}
        out.append(d)
    return out


def arguments_value(arguments: str):
    """Tool-call arguments as templates expect them: a dict when the JSON text is an object."""
    try:
        value = json.loads(arguments)
    except (ValueError, TypeError):
        return arguments
    return value if isinstance(value, dict) else arguments


def mark_control_tokens(value, pattern: re.Pattern):
    """Wrap control tokens inside user strings in private-use marks (after removing any marks already there, so
    none can be forged); dict keys are left alone, as transformers leaves them."""
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return pattern.sub(lambda m: MARK_START + m.group(0) + MARK_END, value)
    if isinstance(value, dict):
        return {k: mark_control_tokens(v, pattern) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_control_tokens(v, pattern) for v in value]
    return value


def encode_marked(tok: CheckpointTokenizer, text: str, marks: re.Pattern) -> list[int]:
    """Rendered text → ids: marked control tokens as plain text, everything else (the template's own control tokens
    included) as usual. Each piece after the first is encoded behind a newline that is then dropped, so that a
    SentencePiece tokenizer adds no word-start space mid-text (transformers does the same)."""
    pieces = marks.split(text)
    newline = tok.encode("\n")
    ids = tok.encode(pieces[0])
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        as_text = i % 2 == 1
        encode = tok.encode_plain if as_text else tok.encode
        piece_ids = encode("\n" + piece)
        piece_ids = piece_ids[len(newline) :] if piece_ids[: len(newline)] == newline else encode(piece)
        if as_text and tok.backend.token_to_id(piece) in piece_ids:
            raise ChatError(f"messages: {piece!r} cannot be sanitized: the tokenizer makes it from plain text")
        ids += piece_ids
    return ids


# ----------------------------------------------------------------------------------------------- tool calls
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


# ----------------------------------------------------------------------------------------------- the format
def single_token(tok: CheckpointTokenizer, text: str) -> int | None:
    try:
        return tok.special(text)
    except ValueError:
        return None


class TemplateChat:
    """A checkpoint's chat template over its tokenizer.json (see the module docstring)."""

    trim_whitespace = True

    def __init__(self, tokenizer: CheckpointTokenizer, template: str | dict[str, str], source: Path):
        self.tokenizer, self.source = tokenizer, source
        self.templates = dict(template) if isinstance(template, dict) else {"default": template}
        for name, text in self.templates.items():
            try:
                compile_template(text)
            except Exception as e:
                raise ChatTemplateError(
                    f"{source}: chat template {name!r} is not valid Jinja ({_one_line(e)})"
                ) from None
        self._control = {name: self._control_patterns(text) for name, text in self.templates.items()}
        default = self.templates[self._pick(None)]
        literals = template_literals(default)
        self.pass_thinking = "thinking" in template_variables(default)
        pair = next(
            (
                (a, b)
                for a, b in THINK_PAIRS
                if a in literals
                and b in literals
                and single_token(tokenizer, a) is not None
                and single_token(tokenizer, b) is not None
            ),
            None,
        )
        self.supports_thinking = pair is not None
        think_start, think_end = (
            (single_token(tokenizer, pair[0]), single_token(tokenizer, pair[1])) if pair else (None, None)
        )
        self.tool_format = next(
            (f for f in TOOL_CALL_FORMATS if f.opener in literals and single_token(tokenizer, f.opener) is not None),
            None,
        )
        tool_close = single_token(tokenizer, self.tool_format.close) if self.tool_format else None
        # one call's markup with its tokens as ids; None when the vocabulary lacks one (no forced calls then)
        self.tool_call_markup = self._resolve_markup(self.tool_format) if tool_close is not None else None
        self.arguments_as_text = self._wants_arguments_as_text()
        end_of_turn = self._end_of_turn()
        stop = tuple(dict.fromkeys(([end_of_turn] if end_of_turn is not None else []) + list(tokenizer.eos_ids)))
        role_tokens = self._role_tokens()
        self.markers = ChatMarkers(
            stop=stop,
            end_of_turn=stop[0],
            think_start=think_start,
            think_end=think_end,
            tool_open=single_token(tokenizer, self.tool_format.opener) if self.tool_format else None,
            tool_close=tool_close,
            not_in_answer=frozenset((role_tokens | {think_start, think_end}) - set(stop) - {None}),
        )

    def _resolve_markup(self, fmt: ToolCallFormat) -> tuple | None:
        out = []
        for part in fmt.markup:
            if isinstance(part, Tok):
                token = single_token(self.tokenizer, part.text)
                if token is None:
                    return None
                out.append(token)
            else:
                out.append(part)
        return tuple(out)

    # --- rendering
    def _pick(self, tools) -> str:
        """The name of the template to use: `tool_use` when there are tools and it exists, else `default`."""
        if tools and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise ChatTemplateError(
            f"{self.source}: several chat templates and none named 'default' ({', '.join(sorted(self.templates))})"
        )

    def _control_patterns(self, text: str) -> tuple[re.Pattern, re.Pattern]:
        """(control tokens, marked control tokens or a lone mark): the tokenizer's special tokens, the tokens in
        tokenizer_config.json `chat_control_tokens`, and the added tokens the template writes itself."""
        tok = self.tokenizer
        listed = tok.config.get("chat_control_tokens")
        literals = template_literals(text) if listed is None else ""
        tokens = [
            t.content
            for t in tok.backend.get_added_tokens_decoder().values()
            if t.special
            or (t.content in listed if listed is not None else t.content in literals and not t.content.isspace())
        ]
        any_token = "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)"
        return re.compile(any_token), re.compile(f"{MARK_START}({any_token}){MARK_END}|[{MARK_START}{MARK_END}]")

    def render_text(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        thinking: bool = True,
        sanitize: bool = True,
        error: type[ValueError] = ChatError,
    ) -> str:
        """The prompt text (with marks around sanitized user tokens when `sanitize`). A template that fails on
        these messages (its raise_exception, or an error of its own) raises `error`."""
        name = self._pick(tools)
        kwargs = {"enable_thinking": thinking, **({"thinking": thinking} if self.pass_thinking else {})}
        if sanitize:
            control, _ = self._control[name]
            messages, tools = mark_control_tokens(messages, control), mark_control_tokens(tools, control)
        try:
            return compile_template(self.templates[name]).render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.tokenizer.template_tokens,
                **kwargs,
            )
        except Exception as e:
            raise error(f"messages: the chat template ({self.source}) refused them: {_one_line(e)}") from None

    def render_ids(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        thinking: bool = True,
    ) -> list[int]:
        text = self.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt, thinking=thinking)
        _, marks = self._control[self._pick(tools)]
        return encode_marked(self.tokenizer, text, marks)

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
        """`thinking_effort`, `tool_choice`, `response_format`: checked, not rendered (chat.ChatFormat)."""
        check_render_options(thinking_effort=thinking_effort, tool_choice=tool_choice, response_format=response_format)
        validate_history(messages)
        ids = self.render_ids(self.template_messages(messages), tools=tools, thinking=thinking)
        return RenderedPrompt(ids, self.phase_after(ids))

    def template_messages(self, messages: list[Message]) -> list[dict]:
        return template_messages(messages, arguments_as_text=self.arguments_as_text)

    def phase_after(self, prompt: list[int]) -> Phase:
        """Where generation starts: inside thinking when the prompt's last think marker opens it; otherwise the
        model may open thinking itself with its first token."""
        m = self.markers
        if not self.supports_thinking:
            return "content"
        last_start = max((i for i, t in enumerate(prompt) if t == m.think_start), default=-1)
        last_end = max((i for i, t in enumerate(prompt) if t == m.think_end), default=-1)
        return "reasoning" if last_start > last_end else "maybe"

    # --- parsing
    def parse_output(self, tokens: list[int], *, phase: Phase, salt: str = "", tools=None) -> ParsedOutput:
        """Reasoning, content and tool calls of generated ids. Reasoning and content come back without the
        whitespace around them: templates write their own separators (`<think>\\n` … `\\n</think>\\n\\n`), and a
        client that sends the answer back unstripped would otherwise get them twice and miss the prefix cache."""
        tok, m = self.tokenizer, self.markers
        split = split_reasoning(tokens, m, phase)
        content_ids, calls, raw = split.content_ids, [], ""
        if m.tool_open is not None and m.tool_open in content_ids:
            at = content_ids.index(m.tool_open)
            region = tok.decode(content_ids[at:], skip_special=False)
            content_ids = content_ids[:at]
            found = self.tool_format.parse(region)
            if found is None:
                raw = region  # malformed tool-call markup stays in the content, as text
            for i, (call_id, name, args) in enumerate(found or []):
                text = json.dumps(args, ensure_ascii=False)
                calls.append(ToolCall(call_id or tool_call_id(name, text, i, salt), name, text))
        return ParsedOutput(
            reasoning=tok.decode(split.reasoning_ids).strip(),
            content=(tok.decode(content_ids) + raw).strip(),
            tool_calls=calls,
            reasoning_tokens=split.reasoning_tokens,
            finished_thinking=split.finished_thinking,
        )

    # --- what the template means, probed at load
    SENTINEL = "PROBE_CONTENT_7f3a"

    def _probe(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """A plain conversation every chat template must render: failing it is an error of the template."""
        return self.render_text(
            messages, add_generation_prompt=add_generation_prompt, sanitize=False, error=ChatTemplateError
        )

    def _wants_arguments_as_text(self) -> bool:
        """Whether tool-call arguments must reach the template as JSON text: true when it renders them from text
        but not from a dict (a dict would fail to concatenate, or come out as a Python repr)."""

        def renders(arguments) -> bool:
            call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": arguments}}
            try:
                text = self.render_text(
                    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
                    tools=PROBE_TOOLS,
                    add_generation_prompt=False,
                    sanitize=False,
                )
            except ChatError:
                return False
            return '"probe_key"' in text

        return not renders({"probe_key": "probe_value"}) and renders('{"probe_key": "probe_value"}')

    def _end_of_turn(self) -> int | None:
        """The token the template writes right after an assistant's content, if it is an added token."""
        text = self._probe(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": self.SENTINEL}],
            add_generation_prompt=False,
        )
        if self.SENTINEL not in text:
            raise ChatTemplateError(f"{self.source}: the chat template drops an assistant message's content")
        after = self.tokenizer.encode(text.split(self.SENTINEL, 1)[1])
        added = self.tokenizer.backend.get_added_tokens_decoder()
        return after[0] if after and after[0] in added else None

    def _role_tokens(self) -> set[int]:
        """The added tokens the template writes around a system and a user message and the generation prompt:
        role markers, which never belong inside an answer."""
        ids = self.tokenizer.encode(
            self._probe(
                [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], add_generation_prompt=True
            )
        )
        added = self.tokenizer.backend.get_added_tokens_decoder()
        return {i for i in ids if i in added}


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


# ----------------------------------------------------------------------------------------------- prefix stability
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def probe_conversation(with_tools: bool) -> list[Message]:
    """Three assistant turns: a tool call and its result (when `with_tools`), answers with reasoning."""
    call = ToolCall("call_0", "get_weather", '{"city": "Paris"}')
    convo = [Message("system", "You are terse."), Message("user", "Weather in Paris?")]
    if with_tools:
        convo += [
            Message("assistant", "", reasoning="Use the tool.", tool_calls=[call]),
            Message("tool", "18 C", tool_call_id=call.id),
        ]
    convo += [
        Message("assistant", "18 C and sunny.", reasoning="The tool said 18 C."),
        Message("user", "And tomorrow?"),
        Message("assistant", "No forecast.", reasoning="I cannot know."),
        Message("user", "Thanks."),
    ]
    return convo


def prefix_stability_problem(fmt: TemplateChat) -> str | None:
    """None when each turn of the probe conversation starts with the previous turn's prompt and output; else a
    sentence naming the first turn that diverges. The output is what the template renders for the assistant
    message, up to the end of turn; the next turn renders what parse_output made of it, as a client sends it back,
    so the check covers the whole loop: render → generate → parse → render."""
    tools = PROBE_TOOLS if fmt.tool_format is not None else None
    try:
        fmt.render(probe_conversation(tools is not None), tools=tools)
    except ChatError:  # a template that refuses tools: check the plain conversation
        tools = None
    tok, stop = fmt.tokenizer, set(fmt.markers.stop)
    sent: list[Message] = []  # the conversation as the client sends it back
    renamed: dict[str, str] = {}  # probe tool-call ids → the ids parse_output gave them
    expected, turn = None, 0  # the previous turn's prompt + output
    for m in probe_conversation(tools is not None) + [None]:
        if m is not None and m.role != "assistant":
            sent.append(Message(m.role, m.content, tool_call_id=renamed.get(m.tool_call_id, m.tool_call_id)))
            continue
        prompt = fmt.render(sent, tools=tools)
        if expected is not None and prompt.ids[: len(expected)] != expected:
            i = _first_difference(prompt.ids, expected)
            return (
                f"turn {turn + 1}'s prompt does not start with turn {turn}'s prompt and output (at token {i}: "
                f"expected {tok.decode(expected[i : i + 4], skip_special=False)!r}, rendered "
                f"{tok.decode(prompt.ids[i : i + 4], skip_special=False)!r})"
            )
        if m is None:
            return None
        turn += 1
        whole = fmt.render_ids(fmt.template_messages(sent + [m]), tools=tools, add_generation_prompt=False)
        if whole[: len(prompt.ids)] != prompt.ids:
            i = _first_difference(whole, prompt.ids)
            return (
                f"turn {turn}'s assistant message does not start with its own prompt (at token {i}: prompt has "
                f"{tok.decode(prompt.ids[i : i + 4], skip_special=False)!r}, the rendered turn "
                f"{tok.decode(whole[i : i + 4], skip_special=False)!r})"
            )
        output = whole[len(prompt.ids) :]
        output = output[: next((k + 1 for k, t in enumerate(output) if t in stop), len(output))]
        parsed = fmt.parse_output(output, phase=prompt.phase, salt="probe")
        if len(parsed.tool_calls) != len(m.tool_calls):
            return (
                f"turn {turn}'s tool calls, as the template writes them, do not parse back as "
                f"{fmt.tool_format.name} tool calls"
            )
        renamed.update({a.id: b.id for a, b in zip(m.tool_calls, parsed.tool_calls)})
        sent.append(
            Message("assistant", parsed.content, reasoning=parsed.reasoning or None, tool_calls=parsed.tool_calls)
        )
        expected = prompt.ids + output
    return None


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------------------------- loading
def find_chat_template(directory: Path) -> tuple[str | dict[str, str], Path] | None:
    """chat_template.jinja, else tokenizer_config.json `chat_template` (a string, or a list of {name, template});
    the file wins, as in transformers."""
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.exists():
        try:
            return jinja_path.read_text(encoding="utf-8"), jinja_path
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{jinja_path}: cannot be read ({_one_line(e)})") from None
    config_path = directory / "tokenizer_config.json"
    if not config_path.exists():
        return None
    value = read_json(config_path, ChatTemplateError).get("chat_template")
    if value is None:
        return None
    if isinstance(value, str):
        return value, config_path
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}, config_path
    raise ChatTemplateError(
        f"{config_path}: chat_template: expected a string or a list of {{name, template}}, found {type(value).__name__}"
    )


def load_template_chat(directory: Path, tokenizer: CheckpointTokenizer) -> TemplateChat | None:
    """The checkpoint's chat format, or None when it has no chat template. Logs what was detected, and a warning
    when the template breaks multi-turn prefix stability."""
    found = find_chat_template(directory)
    if found is None:
        return None
    template, source = found
    fmt = TemplateChat(tokenizer, template, source)
    log.info(
        "chat template %s: thinking %s, tool calls %s",
        source,
        "on" if fmt.supports_thinking else "off (no think tokens in the template)",
        fmt.tool_format.name if fmt.tool_format else "not recognised (they stay in the content)",
    )
    try:
        problem = prefix_stability_problem(fmt)
    except ChatError as e:
        problem = f"the probe conversation does not render ({e})"
    if problem:
        log.warning(
            "chat template %s breaks multi-turn prefix stability: %s; the prefix cache recomputes from there",
            source,
            problem,
        )
    return fmt
