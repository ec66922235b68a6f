"""One chat preparation for every API: a chat request, translated by its API into a `ChatInput`, becomes the
`PreparedChat` the engine is given — thinking decided, the round's tier picked, the prompt options, the declared
tools, the rendering, `truncation: auto` and the limits (reasoning tokens, max_tokens), all decided here once.

The OpenAI chat completions and `/tokenize`, Anthropic messages and count_tokens, the Responses API and gRPC Chat
each read their own request shape into a ChatInput and read their answer from the PreparedChat, so one
conversation has one prompt, and one token count, on every surface.

Also what a request's parameters mean, read once: `decide_thinking` (reasoning_effort, thinking_budget,
chat_template_kwargs, Anthropic `thinking`, gRPC disable_thinking → on/off, tier, exact limit) and `max_tokens_for`
(the one default of max_tokens and its range).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from expertmesh.chat.format import ChatError, Message, RenderedPrompt, message_images, tier_from_request
from expertmesh.chat.thinking import AUTO_TIER, ThinkingBudgets, auto_tier
from expertmesh.router.conversation import (
    PromptOptions,
    prompt_tools,
    render_conversation,
    tool_choice_option,
    truncate,
)
from expertmesh.router.errors import APIError
from expertmesh.router.response_store import ReasoningMemory, Segment
from expertmesh.router.text_bounds import check_conversation, off_loop

# ----------------------------------------------------------------------------------------------- limits
TEXT_COMPLETION_MAX_TOKENS = 16


def max_tokens_for(
    requested: int | None,
    *,
    prompt_tokens: int = 0,
    context: int = 0,
    chat: bool = True,
    scoring: bool | None = None,
    param: str = "max_tokens",
) -> int:
    """The one place max_tokens gets its default and its range. Unset: a chat answer (chat completions, Responses,
    gRPC Chat) may use what the context leaves after its prompt (OpenAI's and vLLM's behaviour; an over-long prompt
    keeps 1, so the engine answers context_length_exceeded naming the prompt); a text completion (/v1/completions,
    gRPC Generate) generates 16, OpenAI's documented default for completions. Anthropic's messages require it.
    0 only when `scoring` a text completion's prompt (`echo`; None: the API cannot score)."""
    if requested is None:
        return max(context - prompt_tokens, 1) if chat else TEXT_COMPLETION_MAX_TOKENS
    if requested < 0 or (requested == 0 and not scoring):
        hint = "" if scoring is None else " (0 only with echo: score the prompt)"
        raise APIError(f"{param}={requested}: expected a positive integer{hint}", param=param)
    return requested


def prompt_room(context: int, max_tokens: int | None) -> int:
    """The tokens a prompt may take (what `truncation: auto` cuts to): the context less what the answer is given,
    or less one token when max_tokens is unset (the answer then takes the rest)."""
    return context - (max_tokens if max_tokens is not None else 1)


# ----------------------------------------------------------------------------------------------- thinking
@dataclass(frozen=True)
class Thinking:
    """What a request asks of thinking: on or off, the tier (reported as `thinking_budget`) and, for Anthropic's
    budget_tokens, an exact limit in place of the tier's. Tier "auto" (reasoning_effort / thinking_budget "auto")
    is decided per round by `for_round`; `auto` then says why."""

    on: bool = True
    tier: str = "high"
    exact: int | None = None
    auto: str | None = None

    def for_round(self, roles: list[str]) -> Thinking:
        """The tier of this round: "auto" decided from the conversation's roles (thinking.auto_tier)."""
        if self.tier != AUTO_TIER:
            return self
        tier, why = auto_tier(roles)
        return Thinking(self.on, tier, self.exact, why)

    @property
    def effort(self) -> str | None:
        """The tier as the prompt states it (K3's thinking_effort); None with thinking off."""
        return self.tier if self.on else None

    def limit(self, budgets: ThinkingBudgets) -> int:
        """Reasoning tokens allowed. Off: a template that cannot turn thinking off gets the low tier's limit."""
        if not self.on:
            return budgets.limit("low")
        return self.exact if self.exact is not None else budgets.limit(self.tier)


ADAPTIVE_TIER = "high"  # Anthropic thinking.type "adaptive": the model decides, within this tier's limit
TEMPLATE_SWITCHES = ("enable_thinking", "thinking")  # chat_template_kwargs that turn thinking on / off


def decide_thinking(
    *,
    thinking_budget: str | None = None,
    reasoning_effort: str | None = None,
    effort_param: str = "reasoning_effort",
    template_kwargs: dict | None = None,
    anthropic: dict | None = None,
    disable: bool = False,
    budgets: ThinkingBudgets | None = None,
) -> Thinking:
    """Every way a request speaks of thinking, read once: OpenAI `reasoning_effort` (none turns it off; minimal / low
    → low, medium → high, high → max), `thinking_budget` (a tier), `chat_template_kwargs.enable_thinking` /
    `thinking` (as Qwen / vLLM and DeepSeek V3.1 name it; other template kwargs are refused), Anthropic `thinking`
    ({type: enabled, budget_tokens} an exact limit, adaptive the `high` tier, disabled — its default — off), gRPC
    `disable_thinking`. A tier asked for while thinking is off is refused. `budgets`: the deployment's
    ThinkingBudgets (the tier that covers an Anthropic budget is the one reported)."""
    on = reasoning_effort != "none" and not disable
    for key, value in (template_kwargs or {}).items():
        if key not in TEMPLATE_SWITCHES or not isinstance(value, bool):
            raise APIError(
                f"chat_template_kwargs.{key}: only enable_thinking / thinking (true or false) are supported",
                param=f"chat_template_kwargs.{key}",
            )
        on = on and value
    budget_tokens, adaptive = None, False
    if anthropic is not None:
        kind = anthropic.get("type", "disabled")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise APIError(f"thinking.type: {kind!r} is not one of enabled, disabled, adaptive", param="thinking.type")
        on, adaptive = kind != "disabled", kind == "adaptive"
        if kind == "enabled":
            budget_tokens = anthropic.get("budget_tokens")
            if not isinstance(budget_tokens, int) or isinstance(budget_tokens, bool):
                raise APIError(
                    f"thinking.budget_tokens: expected an integer, found {budget_tokens!r}",
                    param="thinking.budget_tokens",
                )
    if not on and thinking_budget is not None:
        raise APIError("thinking_budget: given while thinking is turned off", param="thinking_budget")
    if reasoning_effort is not None and not isinstance(reasoning_effort, str):
        raise APIError(
            f"{effort_param}: expected a string, found {type(reasoning_effort).__name__}", param=effort_param
        )
    effort = None if reasoning_effort == "none" else reasoning_effort
    if AUTO_TIER in (thinking_budget, effort) and on:
        return Thinking(on, AUTO_TIER)  # decided per round (Thinking.for_round)
    asked = [
        (p, v)
        for p, v in (
            ("thinking_budget", thinking_budget),
            (effort_param, effort),
            ("thinking.budget_tokens", budget_tokens),
        )
        if v is not None
    ]
    try:
        tier = tier_from_request(
            thinking_budget=thinking_budget or (ADAPTIVE_TIER if adaptive else None),
            reasoning_effort=effort,
            budget_tokens=budget_tokens,
            budgets=budgets,
        )
    except ChatError as e:  # names the first field asked (tier_from_request reads them in that order)
        param = asked[0][0] if asked else "thinking_budget"
        raise APIError(str(e).replace("reasoning_effort:", f"{param}:", 1), param=param) from None
    return Thinking(on, tier, budget_tokens if thinking_budget is None else None)


@dataclass(frozen=True)
class ThinkingAsk:
    """How a request speaks of thinking, in its API's words (decide_thinking's arguments)."""

    thinking_budget: str | None = None
    reasoning_effort: str | None = None
    effort_param: str = "reasoning_effort"  # how the request names its effort (errors)
    template_kwargs: dict | None = None
    anthropic: dict | None = None
    disable: bool = False


# ----------------------------------------------------------------------------------------------- preparation
@dataclass
class ChatInput:
    """A chat request as its API translated it: the conversation (the system prompt, then the turns: segments,
    with their exact tokens where known), how it speaks of thinking, its tools (chat-shaped) and tool choice (any
    API's shape), response format, truncation policy and max_tokens."""

    system: str | None
    turns: list[Segment]
    thinking: ThinkingAsk = field(default_factory=ThinkingAsk)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None
    truncation: str | None = None  # "auto": cut the oldest history to fit (router/truncation.py)
    max_tokens: int | None = None  # None: max_tokens_for's default
    max_tokens_param: str = "max_tokens"  # how the request names it (errors)
    param: str = "messages"  # how the request names its conversation (errors)

    @classmethod
    def of_messages(cls, messages: list[Message], memory: ReasoningMemory | None = None, **kw) -> ChatInput:
        """A chat-shaped conversation (a leading system message, then turns). With a reasoning memory, reasoning a
        client dropped is put back into its assistant messages (in place: they are the answer's key), and an answer
        generated here keeps exactly the tokens generated (the prefix cache then covers it whole)."""
        exact = memory.fill(messages) if memory is not None else [None] * len(messages)
        head = 1 if messages and messages[0].role == "system" else 0
        turns = [Segment(m, ids) for m, ids in zip(messages[head:], exact[head:])]
        return cls(messages[0].content if head else None, turns, **kw)


@dataclass
class PreparedChat:
    """What the engine is fed for a chat request and how it is bounded, decided once (prepare_chat)."""

    rendered: RenderedPrompt
    thinking: Thinking  # the round's: "auto" already decided
    reasoning_limit: int  # reasoning tokens allowed (the tier's, or Anthropic's exact budget)
    max_tokens: int  # resolved against the context left after the prompt
    max_tokens_param: str
    options: PromptOptions  # what the prompt states (K3): tier, tool choice, response format
    tools: list[dict] | None  # the request's declared tools (typing call arguments)
    system: str | None
    turns: list[Segment]  # the conversation after the system prompt as fed (truncation applied)
    truncation_report: dict | None = None  # what `truncation: auto` cut (None: nothing)

    @property
    def prompt(self) -> list[int]:
        return self.rendered.ids

    @property
    def images(self) -> list:
        """The images of the conversation as fed, in order."""
        return message_images([t.message for t in self.turns])

    def headers(self) -> dict[str, str]:
        """Response headers: the tier reasoning_effort "auto" chose and why; what truncation cut."""
        out = (
            {"x-expertmesh-thinking": f"{self.thinking.tier}; auto: {self.thinking.auto}"} if self.thinking.auto else {}
        )
        if self.truncation_report:
            out["x-expertmesh-truncation"] = json.dumps(self.truncation_report, separators=(",", ":"))
        return out


async def prepare_chat_off_loop(fmt, chat: ChatInput, *, budgets: ThinkingBudgets, context: int) -> PreparedChat:
    """`prepare_chat` in a worker thread: rendering and encoding a long conversation never holds the event loop."""
    return await off_loop(prepare_chat, fmt, chat, budgets=budgets, context=context)


def prepare_chat(fmt, chat: ChatInput, *, budgets: ThinkingBudgets, context: int) -> PreparedChat:
    """A chat request → its prompt and limits: thinking decided (and "auto" for this round), the prompt options and
    the tools the prompt declares (with tool_choice none only a format that states the choice keeps them),
    text that cannot fit the context refused before rendering (without truncation: router/text_bounds.py),
    `truncation: auto` to the room the answer leaves, the rendering, the reasoning limit from `budgets` and
    max_tokens against `context`."""
    roles = (["system"] if chat.system is not None else []) + [t.role for t in chat.turns]
    thinking = decide_thinking(**asdict(chat.thinking), budgets=budgets).for_round(roles)
    options = PromptOptions(thinking.effort, tool_choice_option(chat.tool_choice), chat.response_format)
    tools = prompt_tools(fmt, chat.tools, options.tool_choice)
    turns, report = chat.turns, None
    if chat.truncation != "auto":  # text that cannot fit is refused before it is rendered (router/text_bounds.py)
        check_conversation(chat.system, turns, fmt.tokenizer, context, chat.param)
    if chat.truncation == "auto":
        limit = prompt_room(context, chat.max_tokens)
        turns, plan = truncate(fmt, chat.system, tools, turns, thinking.on, limit=limit, options=options)
        report = plan.report() if plan.changed else None
    rendered = render_conversation(fmt, chat.system, tools, turns, thinking.on, param=chat.param, options=options)
    max_tokens = max_tokens_for(
        chat.max_tokens, prompt_tokens=len(rendered.ids), context=context, param=chat.max_tokens_param
    )
    return PreparedChat(
        rendered,
        thinking,
        thinking.limit(budgets),
        max_tokens,
        chat.max_tokens_param,
        options,
        chat.tools,
        chat.system,
        turns,
        report,
    )
