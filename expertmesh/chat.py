"""The chat template, tool-call parsing and thinking budgets (pure functions, no I/O).

Rendering (byte tokens + special tokens; `⟨x⟩` = special token):

    ⟨bos⟩ [⟨system⟩ system text [⟨tools⟩ tools JSON ⟨/tools⟩] ⟨end⟩]
    ⟨user⟩ text ⟨end⟩
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

from expertmesh.tokenizer import ByteTokenizer


class ChatError(ValueError):
    """A malformed conversation; the message names the message index and the field."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str          # the JSON text, verbatim


@dataclass
class Message:
    role: str               # system | user | assistant | tool
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None


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
                raise ChatError(f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no earlier assistant "
                                f"tool call that is still open")
            del pending[m.tool_call_id]
            continue
        if pending and m.role in ("user", "assistant"):
            first = min(pending.items(), key=lambda kv: kv[1])
            raise ChatError(f"messages[{first[1]}]: tool call {first[0]!r} is never answered before "
                            f"messages[{i}] ({m.role})")
        if m.role == "assistant":
            for c in m.tool_calls:
                if c.id in pending:
                    raise ChatError(f"messages[{i}].tool_calls: duplicate id {c.id!r}")
                pending[c.id] = i
    if messages[-1].role == "assistant" and messages[-1].tool_calls:
        raise ChatError(f"messages[{len(messages) - 1}]: the last assistant tool calls need tool results "
                        f"before the model can continue")


def render_tools(tools: list[dict] | None) -> str:
    return json.dumps(tools, sort_keys=True, separators=(",", ":")) if tools else ""


def render(messages: list[Message], tokenizer: ByteTokenizer, *, tools: list[dict] | None = None,
           thinking: bool = True, add_generation_prompt: bool = True) -> list[int]:
    """The token ids of a conversation (validated first)."""
    validate_history(messages)
    t = tokenizer
    ids = [t.bos_id]
    rest = messages
    system = messages[0].content if messages[0].role == "system" else None
    if system is not None or tools:
        ids.append(t.system_id)
        ids += t.encode(system or "")
        if tools:
            ids += [t.tools_start_id] + t.encode(render_tools(tools)) + [t.tools_end_id]
        ids.append(t.end_id)
    if system is not None:
        rest = messages[1:]
    for m in rest:
        if m.role == "user":
            ids += [t.user_id] + t.encode(m.content) + [t.end_id]
        elif m.role == "tool":
            ids += [t.tool_id] + t.encode(f"{m.tool_call_id}\n{m.content}") + [t.end_id]
        else:
            ids += render_assistant(m, t)
    if add_generation_prompt:
        ids += generation_prompt(t, thinking)
    return ids


def generation_prompt(t: ByteTokenizer, thinking: bool) -> list[int]:
    return [t.assistant_id, t.think_start_id] + ([] if thinking else [t.think_end_id])


def render_assistant(m: Message, t: ByteTokenizer) -> list[int]:
    ids = [t.assistant_id, t.think_start_id] + t.encode(m.reasoning or "") + [t.think_end_id]
    ids += t.encode(m.content or "")
    for c in m.tool_calls:
        ids += [t.tool_call_start_id] + t.encode(f"{c.name}\n{c.arguments}") + [t.tool_call_end_id]
    return ids + [t.end_id]


@dataclass
class ParsedOutput:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    reasoning_tokens: int
    finished_thinking: bool


def parse_output(tokens: list[int], t: ByteTokenizer, *, thinking: bool = True, salt: str = "") -> ParsedOutput:
    """Split generated tokens (after the generation prompt) into reasoning, content and tool calls.

    A tool call is `⟨tool_call⟩ name \\n JSON-object ⟨/tool_call⟩`; anything else inside the markers (no name,
    arguments that are not a JSON object, an unclosed call) stays in the content as text."""
    stop = {t.end_id, t.eos_id}
    body = []
    for tok in tokens:
        if tok in stop:
            break
        body.append(tok)
    reasoning_ids: list[int] = []
    finished = not thinking
    i = 0
    if thinking:
        while i < len(body) and body[i] != t.think_end_id:
            reasoning_ids.append(body[i])
            i += 1
        if i < len(body):
            finished = True
            i += 1
    content_ids = body[i:]
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
                raw = t.decode(content_ids[j + 1:end])
                name, sep, args = raw.partition("\n")
                if sep and name.strip() and _is_json_object(args):
                    calls.append(ToolCall(tool_call_id(name.strip(), args, len(calls), salt), name.strip(), args))
                    j = end + 1
                    continue
            content.append(t.decode(content_ids[j:(end + 1 if end > 0 else len(content_ids))], skip_special=False))
            j = end + 1 if end > 0 else len(content_ids)
            continue
        k = j
        while k < len(content_ids) and content_ids[k] != t.tool_call_start_id:
            k += 1
        content.append(t.decode(content_ids[j:k]))
        j = k
    return ParsedOutput(reasoning=t.decode(reasoning_ids), content="".join(content), tool_calls=calls,
                        reasoning_tokens=len(reasoning_ids) + (1 if finished and thinking else 0),
                        finished_thinking=finished)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, TypeError):
        return False


# ----------------------------------------------------------------------------------------------- budgets
TIERS = ("low", "high", "max")
_EFFORT_TO_TIER = {"minimal": "low", "low": "low", "medium": "high", "high": "max"}


def tier_from_request(*, thinking_budget: str | None = None, reasoning_effort: str | None = None,
                      budget_tokens: int | None = None, budgets=None) -> str:
    """The thinking tier of a request: explicit `thinking_budget`, else OpenAI `reasoning_effort`
    (low→low, medium→high, high→max), else Anthropic `budget_tokens` (the smallest tier that covers it,
    `max` beyond), else `high`."""
    if thinking_budget is not None:
        if thinking_budget not in TIERS:
            raise ChatError(f"thinking_budget: {thinking_budget!r} is not one of low, high, max")
        return thinking_budget
    if reasoning_effort is not None:
        if reasoning_effort not in _EFFORT_TO_TIER:
            raise ChatError(f"reasoning_effort: {reasoning_effort!r} is not one of low, medium, high")
        return _EFFORT_TO_TIER[reasoning_effort]
    if budget_tokens is not None:
        if budget_tokens <= 0:
            raise ChatError(f"thinking.budget_tokens={budget_tokens}: expected a positive integer")
        for tier in TIERS:
            if budgets is not None and budget_tokens <= budgets.limit(tier):
                return tier
        return "max"
    return "high"


class ThinkingBudget:
    """Token filter for the router: counts reasoning tokens and forces ⟨/think⟩ once the tier's limit is
    reached (the forced token counts as the last reasoning token). Also keeps special tokens that would break
    the template out of the output: a stray ⟨think⟩ or role token becomes ⟨end⟩."""

    def __init__(self, t: ByteTokenizer, limit: int | None, thinking: bool = True):
        self.t, self.limit = t, limit
        self.in_thinking = thinking
        self.reasoning_tokens = 0
        self.forced = False

    def __call__(self, _request, token: int) -> int:
        t = self.t
        if self.in_thinking:
            if token == t.think_end_id:
                self.in_thinking = False
                self.reasoning_tokens += 1
                return token
            if token in (t.end_id, t.eos_id):
                return token
            if self.limit is not None and self.reasoning_tokens >= self.limit - 1:
                self.in_thinking = False
                self.forced = True
                self.reasoning_tokens += 1
                return t.think_end_id
            self.reasoning_tokens += 1
            return token
        if token in (t.think_start_id, t.think_end_id, t.user_id, t.assistant_id, t.system_id, t.tool_id,
                     t.bos_id, t.tools_start_id, t.tools_end_id, t.pad_id):
            return t.end_id
        return token
