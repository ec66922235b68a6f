"""The context-overflow policy (Responses `truncation`, chat completions' opt-in `truncation`): a pure function
from a conversation's per-message token counts to what to keep.

`disabled`: nothing is dropped; a conversation that does not fit is a 400 `context_length_exceeded` (the
engine's own check, with the counts).

`auto`, in this order, until the prompt plus the reserved output fits the window:
1. shorten the oldest tool results to a placeholder, oldest first (the calls that asked for them, every turn's
   reasoning, the system prompt and the last rounds stay whole);
2. drop the oldest rounds whole (an assistant turn with the results of its tool calls and the user message that
   led to it), oldest first;
3. if the protected last rounds alone do not fit, protect one round fewer and repeat; the last round (the one
   the model answers) is never touched — when it alone does not fit, the request is refused as with `disabled`.
Once it has to cut, it cuts down to a target below the limit (the API layer uses half of the room
between the fixed part and the limit) when the protected rounds allow it, so that the next turns, which extend
the stored (cut) conversation, hit the prefix cache until the next cut. What was shortened and dropped is
reported with the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEHOLDER = "[omitted to fit the context window]"
POLICIES = ("auto", "disabled")


@dataclass(frozen=True)
class Piece:
    role: str  # user | assistant | tool
    tokens: int
    short_tokens: int | None = None  # the tokens of a tool result once shortened to the placeholder


@dataclass
class TruncationPlan:
    keep: list[int]  # indices kept, in order
    shortened: list[int] = field(default_factory=list)  # kept tool results replaced by the placeholder
    dropped: list[int] = field(default_factory=list)
    dropped_rounds: int = 0
    tokens_before: int = 0
    tokens: int = 0  # the prompt's tokens after (fixed part included)
    fits: bool = True

    @property
    def changed(self) -> bool:
        return bool(self.shortened or self.dropped)

    def report(self) -> dict:
        return {
            "type": "auto",
            "dropped_rounds": self.dropped_rounds,
            "dropped_items": len(self.dropped),
            "shortened_tool_results": len(self.shortened),
            "input_tokens_before": self.tokens_before,
            "input_tokens_after": self.tokens,
        }


def rounds(roles: list[str]) -> list[int]:
    """The round of each message: a round starts at a user message, or at an assistant message that does not
    directly follow a user message (the model's next step after tool results or after its own turn)."""
    out, r = [], -1
    for i, role in enumerate(roles):
        if i == 0 or role == "user" or (role == "assistant" and roles[i - 1] != "user"):
            r += 1
        out.append(r)
    return out


def plan_truncation(
    pieces: list[Piece], *, fixed: int, limit: int, keep_last_rounds: int = 2, target: int | None = None
) -> TruncationPlan:
    """What to keep so that `fixed` (header, generation prompt) plus the kept pieces is at most `limit` tokens
    (the window less the reserved output). Pure: counts in, indices out.

    `target` (≤ limit): once over the limit, cut down to this instead when the protected rounds allow it, so
    the next turns fit without cutting again — each cut changes the prompt's prefix (the prefix cache misses
    from there), so cutting rarely and by more keeps a long session cached."""
    before = fixed + sum(p.tokens for p in pieces)
    if before <= limit:
        return TruncationPlan(list(range(len(pieces))), tokens_before=before, tokens=before)
    of = rounds([p.role for p in pieces])
    last = of[-1] if of else -1
    goals = [g for g in (target, limit) if g is not None and g <= limit]
    for protect, goal in ((p, g) for p in range(max(1, keep_last_rounds), 0, -1) for g in goals):
        first_protected = last - protect + 1
        total, shortened, dropped = before, [], set()
        for i, p in enumerate(pieces):  # 1. oldest tool results first
            if total <= goal:
                break
            if (
                of[i] < first_protected
                and p.role == "tool"
                and p.short_tokens is not None
                and p.short_tokens < p.tokens
            ):
                shortened.append(i)
                total -= p.tokens - p.short_tokens
        n_rounds = 0
        for r in range(first_protected):  # 2. then the oldest rounds
            if total <= goal:
                break
            members = [i for i in range(len(pieces)) if of[i] == r]
            for i in members:
                total -= pieces[i].short_tokens if i in shortened else pieces[i].tokens
            dropped.update(members)
            n_rounds += 1 if members else 0
        if total <= goal:
            return TruncationPlan(
                [i for i in range(len(pieces)) if i not in dropped],
                [i for i in shortened if i not in dropped],
                sorted(dropped),
                n_rounds,
                before,
                total,
                True,
            )
    return TruncationPlan(list(range(len(pieces))), tokens_before=before, tokens=before, fits=False)
