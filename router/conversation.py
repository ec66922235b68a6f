"""A conversation → the prompt the model is fed, for the chat endpoints and the Responses API alike.

A conversation is a list of segments (router/response_store.py): each message with its exact tokens when known.
With the built-in chat format the prompt is their concatenation between the header and the generation prompt, and
a generated turn's segment is the generation prompt plus exactly the tokens the model produced (reasoning and
tool-call markup included), so a follow-up starts with exactly the previous prompt and output: the prefix cache
recomputes only the new tokens. A checkpoint's Jinja chat template cannot be rendered piece by piece; there the
history is rendered from its text (reasoning included) and the cache hits as far as the template keeps earlier
turns. `truncation: auto` (router/truncation.py decides) is applied here. router/chat_prep.py is what calls these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from expertmesh.chat.format import (
    BuiltinChat,
    ChatError,
    ChatFormat,
    Message,
    RenderedPrompt,
    generation_prompt,
    render_header,
    render_message,
    validate_history,
)
from expertmesh.router.errors import APIError
from expertmesh.router.response_store import Segment
from expertmesh.router.truncation import PLACEHOLDER, Piece, TruncationPlan, plan_truncation


@dataclass(frozen=True)
class PromptOptions:
    """What a request asks of its prompt beyond messages and tools, for a format whose model was trained on it
    (K3 states each in a system message): the thinking tier, the tool choice (auto / none / required) and
    response_format. Other formats check them and leave the prompt as it is (constrained decoding and the
    sampler's reasoning cap enforce them there)."""

    thinking_effort: str | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None


NO_OPTIONS = PromptOptions()


def tool_choice_option(choice) -> str | dict | None:
    """Any API's tool_choice (OpenAI / Responses strings and named functions, Anthropic {type}) → chat's shape for
    the prompt: "none", "required" (Anthropic any), a named function {type: function, function: {name}} (K3's
    template states nothing for it: its grammar names the tool), or None (auto)."""
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind in ("none", "required"):
        return kind
    if kind == "any":
        return "required"
    if kind in ("tool", "function"):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        return {"type": "function", "function": {"name": name}}
    return None


def prompt_tools(fmt: ChatFormat, tools, tool_choice: str | None):
    """The tools a prompt declares: with tool_choice none, only a format that states the choice to the model
    keeps them declared (K3's template renders both); others drop them, so the model is not tempted."""
    return tools if tool_choice != "none" or getattr(fmt, "states_tool_choice", False) else None


def splices(fmt: ChatFormat) -> bool:
    """Whether the format renders message by message (the built-in one): exact tokens can be spliced in."""
    return isinstance(fmt, BuiltinChat)


def system_and_rest(segments: list[Segment], instructions: str | None) -> tuple[str | None, list[Segment]]:
    """The system prompt (`instructions`, then a leading system / developer input message, one after the other)
    and the rest of the conversation."""
    system = instructions
    rest = segments
    if segments and segments[0].role == "system":
        first = segments[0].message.content
        system = first if instructions is None else f"{instructions}\n\n{first}"
        rest = segments[1:]
    for s in rest:
        if s.role == "system":
            raise APIError(
                "input: a system / developer message is only allowed first (use `instructions`)", param="input"
            )
    return system, rest


def segment_ids(fmt: ChatFormat, seg: Segment) -> list[int]:
    return seg.ids if seg.ids is not None else render_message(seg.message, fmt.tokenizer)


def render_conversation(
    fmt: ChatFormat,
    system: str | None,
    tools,
    segments: list[Segment],
    thinking: bool,
    param: str = "input",
    options: PromptOptions = NO_OPTIONS,
) -> RenderedPrompt:
    """The prompt of a conversation (segments after the system message), a 400 naming what is wrong."""
    messages = ([Message("system", system)] if system is not None else []) + [s.message for s in segments]
    try:
        if not splices(fmt):
            return fmt.render(messages, tools=tools, thinking=thinking, **asdict(options))
        validate_history(messages)
        t = fmt.tokenizer
        ids = render_header(system, tools, t)
        for s in segments:
            ids += segment_ids(fmt, s)
        return RenderedPrompt(ids + generation_prompt(t, thinking), "reasoning" if thinking else "content")
    except ValueError as e:  # ChatError (named already for messages), or text that is not valid Unicode
        said = str(e) if isinstance(e, ChatError) and param == "messages" else f"{param}: {e}"
        raise APIError(said, param=param) from None


def truncate(
    fmt: ChatFormat,
    system: str | None,
    tools,
    segments: list[Segment],
    thinking: bool,
    *,
    limit: int,
    options: PromptOptions = NO_OPTIONS,
) -> tuple[list[Segment], TruncationPlan]:
    """`truncation: auto` over a conversation (router/truncation.py decides; this counts and applies)."""

    def count(seg: Segment) -> int:
        if splices(fmt):
            return len(segment_ids(fmt, seg))
        m = seg.message
        return (
            len(
                fmt.tokenizer.encode(
                    m.content + (m.reasoning or "") + "".join(c.name + c.arguments for c in m.tool_calls)
                )
            )
            + 4
        )

    def short(seg: Segment) -> Segment:
        return Segment(Message("tool", PLACEHOLDER, tool_call_id=seg.message.tool_call_id))

    pieces = [Piece(s.role, count(s), count(short(s)) if s.role == "tool" else None) for s in segments]
    total = len(render_conversation(fmt, system, tools, segments, thinking, options=options).ids)
    fixed = max(0, total - sum(p.tokens for p in pieces))
    plan = plan_truncation(pieces, fixed=fixed, limit=limit, target=fixed + (limit - fixed) // 2)
    if not plan.changed:
        return segments, plan
    shortened = set(plan.shortened)
    return [short(segments[i]) if i in shortened else segments[i] for i in plan.keep], plan


def answer_segment(fmt: ChatFormat, output: list[int], parsed, item_ids: tuple[str, ...], thinking: bool) -> Segment:
    """The generated turn as a segment: the generation prompt and exactly the generated tokens (`output`), closed
    with the end-of-turn token when the model did not stop by itself (built-in format); its text otherwise."""
    msg = Message("assistant", parsed.content, reasoning=parsed.reasoning or None, tool_calls=parsed.tool_calls)
    if not splices(fmt):
        return Segment(msg, None, item_ids)
    out = list(output)
    if not out or out[-1] not in fmt.markers.stop:
        out.append(fmt.markers.end_of_turn)
    return Segment(msg, generation_prompt(fmt.tokenizer, thinking) + out, item_ids)
