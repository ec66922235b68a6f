"""The thinking section of a chat turn, bounded where tokens are sampled: a pure state machine over one output's
tokens that counts reasoning tokens and, at the tier's limit, forces the format's end of thinking; the attention
worker's sampler runs it (with the request's grammar, which starts where thinking ends), and the router replays
it over the tokens it receives to count usage. No tensors, no I/O.

    phase "reasoning": generation starts inside the thinking section (the prompt opened it)
          "content":   thinking is off, or the format has none
          "maybe":     the model opens thinking itself: a first output token `think_start` starts reasoning

In reasoning, the first token of `think_end` (sampled, or forced once `limit` reasoning tokens have been output)
starts the close; the rest of `think_end` is forced in order — a multi-token close (K3: ⟨close⟩ think ⟨sep⟩ ⟨open⟩
response ⟨sep⟩) is always whole — and every token up to the end of it counts as reasoning. In the answer, a
template token that would corrupt the history (`not_in_answer`) becomes `end_of_turn`. Stop tokens pass through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["reasoning", "content", "maybe"]
PHASES = ("reasoning", "content", "maybe")


@dataclass(frozen=True)
class ThinkingControl:
    """What the sampler enforces about thinking for one request (from the chat format's markers and the tier)."""

    phase: Phase
    limit: int | None = None  # reasoning tokens allowed, the forced close included; None: no limit
    think_start: int | None = None
    think_end: tuple[int, ...] = ()
    stop: tuple[int, ...] = ()
    not_in_answer: frozenset[int] = frozenset()
    end_of_turn: int | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"thinking.phase: expected one of {', '.join(PHASES)}, found {self.phase!r}")
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1
        ):
            raise ValueError(f"thinking.limit: expected a positive integer, found {self.limit!r}")
        if self.phase != "content" and not self.think_end:
            raise ValueError("thinking.think_end: a thinking phase needs the tokens that end it")
        if self.phase == "maybe" and self.think_start is None:
            raise ValueError("thinking.think_start: phase 'maybe' needs the token that opens thinking")
        if self.not_in_answer and self.end_of_turn is None:
            raise ValueError("thinking.end_of_turn: needed to replace the not_in_answer tokens")


class ThinkingState:
    """One output's progress through a ThinkingControl. `next_token(sampled)` says what to emit instead of a
    sampled token; `observe(token)` advances past a token of the output (emitted, or replayed after a failover)."""

    def __init__(self, control: ThinkingControl):
        self.c = control
        self.phase: Phase = control.phase
        self.reasoning_tokens = 0
        self.closing = 0  # tokens of think_end emitted so far while closing (0: not closing)

    @property
    def answering(self) -> bool:
        """Past thinking: the answer's tokens (a grammar on the answer applies from here)."""
        return self.phase == "content"

    def next_token(self, sampled: int) -> int:
        """The token to emit where `sampled` was drawn (the same one unless the control overrides it)."""
        c = self.c
        if self.phase == "maybe":
            return sampled  # the first token decides (observe)
        if self.phase == "reasoning":
            if self.closing:
                return c.think_end[self.closing]  # the rest of a close, in order
            if sampled in c.stop:
                return sampled
            if c.limit is not None and self.reasoning_tokens >= c.limit - len(c.think_end):
                return c.think_end[0]  # the limit: close now (the close fits in it)
            return sampled
        return c.end_of_turn if sampled in c.not_in_answer else sampled

    def observe(self, token: int) -> None:
        c = self.c
        if self.phase == "maybe":
            self.phase = "reasoning" if token == c.think_start else "content"
            if self.phase == "reasoning":
                self.reasoning_tokens += 1
            return
        if self.phase != "reasoning":
            return
        if token in c.stop and not self.closing:
            return
        self.reasoning_tokens += 1
        if self.closing or token == c.think_end[0]:
            self.closing += 1
        if self.closing == len(c.think_end):
            self.phase, self.closing = "content", 0


# ----------------------------------------------------------------------------------------------- budgets
TIERS = ("low", "high", "max")


@dataclass(frozen=True)
class ThinkingBudgets:
    """Reasoning-token limits per thinking tier: serving policy, set per deployment (the router's
    `--thinking-budgets LOW,HIGH,MAX`, the operator's spec.thinking), not part of a model's architecture."""

    low: int
    high: int
    max: int

    def __post_init__(self) -> None:
        for tier in TIERS:
            value = getattr(self, tier)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"thinking budgets: {tier}={value!r} is not a positive integer")
        if not self.low <= self.high <= self.max:
            raise ValueError(
                f"thinking budgets must satisfy low <= high <= max, got low={self.low} high={self.high} max={self.max}"
            )

    def limit(self, tier: str) -> int:
        if tier not in TIERS:
            raise ValueError(f"thinking tier {tier!r}: expected one of low, high, max")
        return getattr(self, tier)

    @classmethod
    def parse(cls, text: str) -> ThinkingBudgets:
        """`LOW,HIGH,MAX` (the router's --thinking-budgets); ValueError saying what is wrong."""
        parts = [x.strip() for x in text.split(",")]
        if len(parts) != 3 or not all(p.lstrip("-").isdigit() for p in parts):
            raise ValueError(f"expected three integers LOW,HIGH,MAX, got {text!r}")
        return cls(*(int(p) for p in parts))


# the defaults by model preset (expertmesh.model.config.preset): the tiny test model keeps tiers of a few dozen
# tokens so tests exercise the cut; any other model (a Hugging Face checkpoint) gets DEFAULT_BUDGETS
PRESET_BUDGETS = {
    "tiny": ThinkingBudgets(low=8, high=24, max=48),
    "small": ThinkingBudgets(low=64, high=256, max=1024),
    "full-2.8t": ThinkingBudgets(low=4096, high=32_768, max=131_072),
}
DEFAULT_BUDGETS = ThinkingBudgets(low=1024, high=8192, max=32768)


def default_budgets(model_name: str) -> ThinkingBudgets:
    """The budgets a deployment of `model_name` (ModelConfig.name) gets unless it sets its own."""
    return PRESET_BUDGETS.get(model_name, DEFAULT_BUDGETS)


# ----------------------------------------------------------------------------------------------- the auto tier
AUTO_TIER = "auto"


def auto_tier(roles: list[str]) -> tuple[str, str]:
    """`reasoning_effort: "auto"`: the thinking tier for this round of a conversation, from its messages' roles
    (system / user / assistant / tool, in order), and why — reported in the response and the span.

    A round that answers tool results (the last message is a tool's) continues a plan already made: "low". Any
    other round — a new user task, or one with no tool results since the user's last message — is where the plan
    is made: "high". A client's explicit tier always wins; the caller asks this only for "auto"."""
    if roles and roles[-1] == "tool":
        return "low", "continues after tool results"
    return "high", "a new task: planning"
