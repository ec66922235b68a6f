"""Session-aware eviction of cached prefixes: which prefixes leave an attention worker's device pool first, and
whether each is demoted to the worker's lower tiers (host memory, disk) or dropped. A pure function of plain data.

Prefix keys form hash chains (router/kv.py PrefixHasher): a conversation's prefixes at 64, 128, ... tokens each
contain the shorter ones. So, victims first:
  1. superseded prefixes — a longer prefix of the same conversation is cached, and holds everything they do; they
     are *dropped*, not demoted (a lower-tier copy would duplicate the longer one's bytes);
  2. the newest prefix of a finished one-shot request (no tools offered, nothing cached before it);
  3. of a conversation that ended with an answer;
  4. of a request still running (its sequence holds the same blocks: demoting frees them only once it ends);
  5. of a conversation whose last turn ended with tool calls — the client is coming back with the results: kept
     warm longest.
Within a class, least recently used first. Everything outside class 1 is demoted (the worker drops it if it has
no lower tier or no room).
"""

from __future__ import annotations

from dataclasses import dataclass

ONE_SHOT, ANSWERED, RUNNING, AWAITING_TOOL = "one_shot", "answered", "running", "awaiting_tool"
_RANK = {ONE_SHOT: 0, ANSWERED: 1, RUNNING: 2, AWAITING_TOOL: 3}


@dataclass(frozen=True)
class PrefixInfo:
    """One cached prefix as the policy reads it."""

    key: str
    length: int  # tokens
    last_used: int  # larger: used more recently (saved, or hit by an admission)
    superseded: bool  # a longer cached prefix of the same conversation exists
    session: str  # ONE_SHOT | ANSWERED | RUNNING | AWAITING_TOOL (of the request that last used it)


@dataclass(frozen=True)
class Victim:
    key: str
    demote: bool  # False: drop it (superseded)


def eviction_order(prefixes: list[PrefixInfo]) -> list[Victim]:
    """Every prefix of `prefixes` in the order they should leave the device, each marked demote or drop."""
    ranked = sorted(prefixes, key=lambda p: (not p.superseded, _RANK[p.session], p.last_used))
    return [Victim(p.key, demote=not p.superseded) for p in ranked]


def session_state(*, done: bool, awaiting_tool: bool, tools_offered: bool, continued: bool) -> str:
    """The class of a request's newest prefix: `continued` — it started from a cached prefix (a later turn)."""
    if not done:
        return RUNNING
    if awaiting_tool:
        return AWAITING_TOOL
    return ANSWERED if tools_offered or continued else ONE_SHOT
