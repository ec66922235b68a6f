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

The Jinja environment is chat/jinja_env.py; the tool-call formats are chat/tool_call_formats.py.

Multi-turn prefix stability (turn N+1's prompt starts with turn N's prompt and output, so the prefix cache only
computes new tokens) is checked on a small built-in conversation; a template that breaks it still serves, with a
warning naming the first turn that diverges.
"""

from __future__ import annotations

import json
import logging
import re
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
from expertmesh.chat.hf_tokenizer import CheckpointTokenizer
from expertmesh.chat.jinja_env import (
    MARK_END,
    MARK_START,
    compile_template,
    encode_marked,
    mark_control_tokens,
    template_literals,
    template_messages,
    template_variables,
)
from expertmesh.chat.tokenizer_files import read_json
from expertmesh.chat.tool_call_formats import TOOL_CALL_FORMATS, Tok, ToolCallFormat

log = logging.getLogger("expertmesh.chat.jinja_template")

THINK_PAIRS = (("<think>", "</think>"), ("<thinking>", "</thinking>"), ("<|think|>", "<|/think|>"))


class ChatTemplateError(ValueError):
    """A chat template that cannot be used; the message names the file."""


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
