"""Chat formats, tool-call parsing and thinking budgets (pure functions, no I/O; `chat_formats.load_chat` picks a
checkpoint's format).

A chat format turns messages into prompt ids and generated ids back into reasoning, content and tool calls. Three
exist: the built-in one below (byte tokenizer, synthetic checkpoints), a checkpoint's own Jinja chat template
(`expertmesh.chat.jinja_template`) and Kimi K3's XTML format (`expertmesh.chat.k3`). The router sees only what they share:

    fmt.tokenizer, fmt.markers (ChatMarkers), fmt.supports_thinking, fmt.trim_whitespace
    fmt.render(messages, tools=..., thinking=..., thinking_effort=..., tool_choice=..., response_format=...)
        -> RenderedPrompt(ids, phase)
    fmt.parse_output(tokens, phase=..., salt=..., tools=...) -> ParsedOutput

`thinking_effort` (a tier: low / high / max), `tool_choice` and `response_format` reach the prompt only in a format
whose model was trained on them (K3 renders each as a system message); the others check them
(`check_render_options`, the same ChatError everywhere) and leave the prompt as it is — there the tier is a token
cap and the other two are enforced by constrained decoding alone. `tools` in parse_output are the request's
declared tools, for a format that types tool-call arguments by their schema (K3); the others ignore them.

`phase` says where generation starts: "reasoning" (the prompt opened the thinking section), "content", or "maybe"
(a template whose model opens thinking itself: a first generated think-start token starts reasoning).

Built-in rendering (byte tokens + special tokens; `⟨x⟩` = special token):

    ⟨bos⟩ [⟨system⟩ system text [⟨tools⟩ tools JSON ⟨/tools⟩] ⟨end⟩]
    ⟨user⟩ text [⟨image⟩ ⟨image_pad⟩×(its tokens) ⟨/image⟩ text]* ⟨end⟩
    ⟨assistant⟩ [⟨think⟩ reasoning ⟨/think⟩] content [⟨tool_call⟩ name \\n arguments ⟨/tool_call⟩]* ⟨end⟩
    ⟨tool⟩ tool_call_id \\n result ⟨end⟩
    generation prompt: ⟨assistant⟩ ⟨think⟩   (thinking on)   or   ⟨assistant⟩ ⟨think⟩ ⟨/think⟩ (off)

Every earlier turn is rendered whole (reasoning, tool calls, tool results), and an assistant turn renders
exactly the tokens the model generated for it (tool arguments are kept verbatim, never re-serialised), so the
prompt of turn N+1 starts with the prompt of turn N plus its output: the prefix cache recomputes only the
new tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Protocol

from expertmesh.chat.thinking import Phase, ThinkingControl
from expertmesh.chat.tokenizer import ByteTokenizer


class ChatError(ValueError):
    """A malformed conversation; the message names the message index and the field."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text, verbatim


@dataclass
class Message:
    role: str  # system | user | assistant | tool
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    # a user turn with images: its content in order, text (str) and images (router.images.PreparedImage: rendered
    # as ⟨image⟩ ⟨image_pad⟩×tokens ⟨/image⟩); `content` then holds the text alone
    parts: list | None = None


def message_images(messages: list[Message]) -> list:
    """The images of `messages` in the order they are rendered."""
    return [p for m in messages for p in (m.parts or ()) if not isinstance(p, str)]


def tool_call_id(name: str, arguments: str, index: int, salt: str) -> str:
    """Deterministic ids (same output → same ids), unique within a response by index and request salt."""
    digest = hashlib.sha256(f"{salt}|{index}|{name}|{arguments}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def validate_history(messages: list[Message]) -> None:
    """Every tool message answers an earlier assistant tool call; every tool call is answered before the
    next user or assistant turn that follows the tool results."""
    if not messages:
        raise ChatError("messages: expected at least one message")
    pending: dict[str, int] = {}
    for i, m in enumerate(messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise ChatError(f"messages[{i}].role: {m.role!r} is not one of system, user, assistant, tool")
        if m.role == "system" and i != 0:
            raise ChatError(f"messages[{i}]: a system message is only allowed first")
        if m.role == "tool":
            if not m.tool_call_id:
                raise ChatError(f"messages[{i}].tool_call_id: required for a tool message")
            if m.tool_call_id not in pending:
                raise ChatError(
                    f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no earlier assistant "
                    f"tool call that is still open"
                )
            del pending[m.tool_call_id]
            continue
        if pending and m.role in ("user", "assistant"):
            first = min(pending.items(), key=lambda kv: kv[1])
            raise ChatError(
                f"messages[{first[1]}]: tool call {first[0]!r} is never answered before messages[{i}] ({m.role})"
            )
        if m.role == "assistant":
            for c in m.tool_calls:
                if c.id in pending:
                    raise ChatError(f"messages[{i}].tool_calls: duplicate id {c.id!r}")
                pending[c.id] = i
    if messages[-1].role == "assistant" and messages[-1].tool_calls:
        raise ChatError(
            f"messages[{len(messages) - 1}]: the last assistant tool calls need tool results "
            f"before the model can continue"
        )


def render_tools(tools: list[dict] | None) -> str:
    return json.dumps(tools, sort_keys=True, separators=(",", ":")) if tools else ""


def render(
    messages: list[Message],
    tokenizer: ByteTokenizer,
    *,
    tools: list[dict] | None = None,
    thinking: bool = True,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The token ids of a conversation (validated first): the header, each message on its own, the generation
    prompt — a concatenation, so a conversation can also be assembled piece by piece (the Responses API splices
    the exact generated tokens of earlier turns between rendered messages)."""
    validate_history(messages)
    t = tokenizer
    system = messages[0].content if messages[0].role == "system" else None
    ids = render_header(system, tools, t)
    for m in messages[1:] if system is not None else messages:
        ids += render_message(m, t)
    if add_generation_prompt:
        ids += generation_prompt(t, thinking)
    return ids


def render_header(system: str | None, tools: list[dict] | None, t: ByteTokenizer) -> list[int]:
    """⟨bos⟩ and the system turn (system text, tools)."""
    ids = [t.bos_id]
    if system is not None or tools:
        ids.append(t.system_id)
        ids += t.encode(system or "")
        if tools:
            ids += [t.tools_start_id] + t.encode(render_tools(tools)) + [t.tools_end_id]
        ids.append(t.end_id)
    return ids


def render_message(m: Message, t: ByteTokenizer) -> list[int]:
    """One user, tool or assistant message (after the header)."""
    if m.role == "user" and m.parts is not None:
        ids = [t.user_id]
        for p in m.parts:
            ids += (
                t.encode(p)
                if isinstance(p, str)
                else [t.image_start_id] + [t.image_pad_id] * p.tokens + [t.image_end_id]
            )
        return ids + [t.end_id]
    if m.role == "user":
        return [t.user_id] + t.encode(m.content) + [t.end_id]
    if m.role == "tool":
        return [t.tool_id] + t.encode(f"{m.tool_call_id}\n{m.content}") + [t.end_id]
    return render_assistant(m, t)


def generation_prompt(t: ByteTokenizer, thinking: bool) -> list[int]:
    return [t.assistant_id, t.think_start_id] + ([] if thinking else [t.think_end_id])


def render_assistant(m: Message, t: ByteTokenizer) -> list[int]:
    ids = [t.assistant_id, t.think_start_id] + t.encode(m.reasoning or "") + [t.think_end_id]
    ids += t.encode(m.content or "")
    for c in m.tool_calls:
        ids += [t.tool_call_start_id] + t.encode(f"{c.name}\n{c.arguments}") + [t.tool_call_end_id]
    return ids + [t.end_id]


@dataclass(frozen=True)
class ChatMarkers:
    """The token ids a chat format gives meaning to in generated output."""

    stop: tuple[int, ...]  # the answer is over (end of turn, EOS)
    end_of_turn: int  # what a stray template token in an answer becomes
    think_start: int | None = None
    think_end: int | None = None  # the token that ends thinking (the first of think_end_ids)
    # the whole sequence that ends thinking and opens the answer where that is more than one token (K3:
    # ⟨close⟩ think ⟨sep⟩ ⟨open⟩ response ⟨sep⟩): what a budget cut forces (thinking_control)
    think_end_ids: tuple[int, ...] = ()
    tool_open: int | None = None  # streaming holds back from tool_open to tool_close (None: to the end)
    tool_close: int | None = None
    not_in_answer: frozenset[int] = frozenset()  # template tokens that would corrupt the history in an answer


def builtin_markers(t: ByteTokenizer) -> ChatMarkers:
    return ChatMarkers(
        stop=(t.end_id, t.eos_id),
        end_of_turn=t.end_id,
        think_start=t.think_start_id,
        think_end=t.think_end_id,
        tool_open=t.tool_call_start_id,
        tool_close=t.tool_call_end_id,
        not_in_answer=frozenset(
            (
                t.think_start_id,
                t.think_end_id,
                t.user_id,
                t.assistant_id,
                t.system_id,
                t.tool_id,
                t.bos_id,
                t.tools_start_id,
                t.tools_end_id,
                t.pad_id,
            )
        ),
    )


@dataclass
class RenderedPrompt:
    ids: list[int]
    phase: Phase


@dataclass
class ParsedOutput:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    reasoning_tokens: int
    finished_thinking: bool


@dataclass
class SplitOutput:
    reasoning_ids: list[int]
    content_ids: list[int]
    reasoning_tokens: int  # reasoning text plus the markers the model generated (think start/end)
    finished_thinking: bool


def split_reasoning(tokens: list[int], m: ChatMarkers, phase: Phase) -> SplitOutput:
    """Generated ids (after the prompt) up to the first stop id, split at the end-of-thinking marker."""
    body = []
    for tok in tokens:
        if tok in m.stop:
            break
        body.append(tok)
    markers = 0
    if phase == "maybe" and body and body[0] == m.think_start:
        phase, body, markers = "reasoning", body[1:], 1
    if phase != "reasoning":
        return SplitOutput([], body, 0, True)
    end = body.index(m.think_end) if m.think_end in body else len(body)
    finished = end < len(body)
    return SplitOutput(body[:end], body[end + 1 :], end + markers + finished, finished)


def parse_output(tokens: list[int], t: ByteTokenizer, *, thinking: bool = True, salt: str = "") -> ParsedOutput:
    """Split generated tokens (after the built-in generation prompt) into reasoning, content and tool calls.

    A tool call is `⟨tool_call⟩ name \\n JSON-object ⟨/tool_call⟩`; anything else inside the markers (no name,
    arguments that are not a JSON object, an unclosed call) stays in the content as text."""
    split = split_reasoning(tokens, builtin_markers(t), "reasoning" if thinking else "content")
    content_ids = split.content_ids
    content, calls = [], []
    j = 0
    while j < len(content_ids):
        tok = content_ids[j]
        if tok == t.tool_call_start_id:
            try:
                end = content_ids.index(t.tool_call_end_id, j + 1)
            except ValueError:
                end = -1
            if end > 0:
                raw = t.decode(content_ids[j + 1 : end])
                name, sep, args = raw.partition("\n")
                if sep and name.strip() and is_json_object(args):
                    calls.append(ToolCall(tool_call_id(name.strip(), args, len(calls), salt), name.strip(), args))
                    j = end + 1
                    continue
            content.append(t.decode(content_ids[j : (end + 1 if end > 0 else len(content_ids))], skip_special=False))
            j = end + 1 if end > 0 else len(content_ids)
            continue
        k = j
        while k < len(content_ids) and content_ids[k] != t.tool_call_start_id:
            k += 1
        content.append(t.decode(content_ids[j:k]))
        j = k
    return ParsedOutput(
        reasoning=t.decode(split.reasoning_ids),
        content="".join(content),
        tool_calls=calls,
        reasoning_tokens=split.reasoning_tokens,
        finished_thinking=split.finished_thinking,
    )


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, TypeError):
        return False


# ----------------------------------------------------------------------------------------------- budgets
TIERS = ("low", "high", "max")
_EFFORT_TO_TIER = {"minimal": "low", "low": "low", "medium": "high", "high": "max", "max": "max"}


def tier_from_request(
    *,
    thinking_budget: str | None = None,
    reasoning_effort: str | None = None,
    budget_tokens: int | None = None,
    budgets=None,
) -> str:
    """The thinking tier of a request: explicit `thinking_budget`, else OpenAI `reasoning_effort`
    (minimal, low→low, medium→high, high, max→max), else Anthropic `budget_tokens` (the smallest tier that covers it,
    `max` beyond), else `high`."""
    if thinking_budget is not None:
        if thinking_budget not in TIERS:
            raise ChatError(f"thinking_budget: {thinking_budget!r} is not one of low, high, max")
        return thinking_budget
    if reasoning_effort is not None:
        if reasoning_effort not in _EFFORT_TO_TIER:
            raise ChatError(
                f"reasoning_effort: {reasoning_effort!r} is not one of none, minimal, low, medium, high, max, auto"
            )
        return _EFFORT_TO_TIER[reasoning_effort]
    if budget_tokens is not None:
        if budget_tokens <= 0:
            raise ChatError(f"thinking.budget_tokens={budget_tokens}: expected a positive integer")
        for tier in TIERS:
            if budgets is not None and budget_tokens <= budgets.limit(tier):
                return tier
        return "max"
    return "high"


def thinking_control(m: ChatMarkers, phase: Phase, limit: int | None) -> ThinkingControl:
    """A chat format's markers, where its generation starts and the reasoning limit → what the attention worker's
    sampler enforces (expertmesh/chat/thinking.py): reasoning counted and cut at `limit` with the format's whole close
    (K3's is ⟨close⟩ think ⟨sep⟩ ⟨open⟩ response ⟨sep⟩), template tokens kept out of the answer. A format with no
    thinking section starts in the answer."""
    close = m.think_end_ids or ((m.think_end,) if m.think_end is not None else ())
    if not close:
        phase = "content"
    return ThinkingControl(
        phase=phase,
        limit=limit if phase != "content" else None,
        think_start=m.think_start,
        think_end=close,
        stop=tuple(m.stop),
        not_in_answer=frozenset(m.not_in_answer),
        end_of_turn=m.end_of_turn,
    )


# ----------------------------------------------------------------------------------------------- formats
TOOL_CHOICES = ("auto", "none", "required")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def check_render_options(*, thinking_effort: str | None = None, tool_choice=None, response_format=None) -> None:
    """The render options every format accepts, checked alike: ChatError naming the one that is wrong.
    `thinking_effort` a tier or None; `tool_choice` None, auto / none / required, or a named-function object;
    `response_format` None or {type: text | json_object | json_schema, ...}."""
    if thinking_effort is not None and thinking_effort not in TIERS:
        raise ChatError(f"thinking_effort: {thinking_effort!r} is not one of {', '.join(TIERS)}")
    if tool_choice is not None and not isinstance(tool_choice, dict) and tool_choice not in TOOL_CHOICES:
        raise ChatError(f"tool_choice: {tool_choice!r} is not one of {', '.join(TOOL_CHOICES)} or a function")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") not in RESPONSE_FORMAT_TYPES
    ):
        raise ChatError(
            f"response_format: expected {{type: {' | '.join(RESPONSE_FORMAT_TYPES)}}}, got {response_format!r}"
        )


class ChatFormat(Protocol):
    """What the router needs of a chat format (BuiltinChat, chat_template.TemplateChat, chat_k3.K3Chat,
    chat_formats.NoChatTemplate)."""

    tokenizer: object  # Byte- | Checkpoint- | TikTokenTokenizer: the interface in expertmesh.chat.tokenizer
    markers: ChatMarkers
    supports_thinking: bool
    trim_whitespace: bool  # parse_output strips the whitespace around reasoning and content

    def render(
        self,
        messages: list[Message],
        *,
        tools: list[dict] | None = None,
        thinking: bool = True,
        thinking_effort: str | None = None,
        tool_choice=None,
        response_format=None,
    ) -> RenderedPrompt: ...

    def parse_output(
        self, tokens: list[int], *, phase: Phase, salt: str = "", tools: list[dict] | None = None
    ) -> ParsedOutput: ...


class BuiltinChat:
    """The built-in format over the byte tokenizer (synthetic checkpoints)."""

    supports_thinking = True
    trim_whitespace = False

    def __init__(self, tokenizer: ByteTokenizer | None = None):
        self.tokenizer = tokenizer or ByteTokenizer()
        self.markers = builtin_markers(self.tokenizer)

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
        check_render_options(thinking_effort=thinking_effort, tool_choice=tool_choice, response_format=response_format)
        return RenderedPrompt(
            render(messages, self.tokenizer, tools=tools, thinking=thinking), "reasoning" if thinking else "content"
        )

    def parse_output(
        self, tokens: list[int], *, phase: Phase, salt: str = "", tools: list[dict] | None = None
    ) -> ParsedOutput:
        return parse_output(tokens, self.tokenizer, thinking=phase == "reasoning", salt=salt)
