"""The workers' services as their callers see them — the router, and the attention workers' expert exchange: what
a scheduler step sends and gets back, and the errors each service answers with. Both the in-process workers and the
gRPC clients (wire/clients.py) speak these types, so a caller never knows which it holds. Plain data: numeric
fields are arrays (torch tensors from an in-process worker, numpy arrays off the wire — both have `.tolist()`), so
a caller needs neither the model nor torch.

Errors and the gRPC status each travels as (worker/server.py sends the message as the details; the clients raise
the same class again): WorkerError / ExpertRequestError → INVALID_ARGUMENT, NotFound / UnknownExpert → NOT_FOUND,
OutOfBlocks → RESOURCE_EXHAUSTED, NotConnected → FAILED_PRECONDITION, HandOffFailed → ABORTED; WorkerUnavailable is raised by a client when
the worker cannot be reached in time, RemoteError for any other failed call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# ----------------------------------------------------------------------------------------------- errors
class WorkerError(ValueError):
    """A bad request to an attention worker: names the field and what was expected."""


class NotFound(KeyError):
    """Unknown sequence / step / prefix."""

    def __str__(self) -> str:
        return str(self.args[0])


class NotConnected(RuntimeError):
    """A step before `connect_experts` (the router connects workers at start; a restarted worker has forgotten)."""


class OutOfBlocks(RuntimeError):
    """An attention worker's KV pool has no free block left (the router's admission should have prevented this)."""


class HandOffFailed(RuntimeError):
    """A hand-off the receiving attention worker refused or that could not reach it: the sequence stays open on the
    sender, unchanged (the sender itself is fine — not a reason to mark it down)."""


class ExpertRequestError(ValueError):
    """A bad request to an expert worker, naming the field."""


class UnknownExpert(KeyError):
    """(layer, expert) not held by this expert worker."""

    def __str__(self) -> str:
        return str(self.args[0])


class WorkerUnavailable(ConnectionError):
    """The worker cannot be reached, is shutting down, or did not answer within the deadline."""


class RemoteError(RuntimeError):
    """Any other failed call (INTERNAL, UNIMPLEMENTED, ...); `code` is the grpc.StatusCode."""

    def __init__(self, message: str, code: Any = None):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------------------- a step
@dataclass
class StepSegment:
    seq_id: str
    token_ids: list[int]
    sample: bool  # sample a token after this segment's last position
    # tokens the worker may emit (speculation: the newest token's pending drafts verified in this step, each accepted
    # one emitted after the sampled token); 1 = one sampled token
    max_new: int = 1
    # speculation: keep the state at this cache length if the kept tokens reach it (a chunk boundary a verified run
    # may cross) — the next step may then save a prefix of that length (snapshot (key, hold_at)); 0 = none
    hold_at: int = 0


def snapshot_parts(snapshot: str | tuple[str, int]) -> tuple[str, int]:
    """A run_step snapshot — a prefix key (the whole cache), or (key, length) — as (key, length), 0 = whole."""
    return (snapshot, 0) if isinstance(snapshot, str) else snapshot


@dataclass
class TokenLogprobs:
    """Log-probabilities of a sequence's tokens at positions `position`, `position + 1`, ... (each under the
    model's distribution given the tokens before it: log_softmax of the fp32 logits, before temperature / top-k /
    top-p), with each position's top alternatives."""

    seq_id: str
    position: int
    token_ids: Any  # [P] int64
    logprobs: Any  # [P] float32
    top_ids: Any  # [P, N] int64, most likely first
    top_logprobs: Any  # [P, N] float32


@dataclass
class ImageEncode:
    """One encoder run on an attention worker (traces and metrics)."""

    seq_id: str
    tokens: int
    seconds: float


@dataclass
class StepDone:
    step_id: int
    tokens: dict[str, int]  # seq_id → sampled token (segments that asked for one)
    free_blocks: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # seq_id → why (an expert without a live replica)
    experts_down: list[int] = field(default_factory=list)  # expert workers this worker sees down after the step
    exchange_bytes: int = 0  # tensor bytes to and from expert workers in this step
    image_encodes: list[ImageEncode] = field(default_factory=list)  # images encoded in this step
    # speculation: seq_id → the tokens emitted after `tokens[seq_id]` in this step (accepted drafts and the
    # target's own token after them), in order; and → the drafts verified for it in this step
    more_tokens: dict[str, list[int]] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)

    def emitted(self, seq_id: str) -> list[int]:
        """Every token the step emitted for `seq_id`, in order (none when it sampled nothing)."""
        first = self.tokens.get(seq_id)
        return [] if first is None else [first, *self.more_tokens.get(seq_id, ())]


@dataclass
class HandOffResult:
    """A sequence moved from a prefill-pool worker to a decode-pool one (AttentionWorker.hand_off)."""

    free_blocks: int  # the sender's, after it closed its copy
    bytes: int  # tensor bytes moved (KV, indexer keys, recurrent + conv state)
    seconds: float  # export + transfer + import


@dataclass
class ImageSpan:
    """One image of a prompt: its first placeholder token's position and its pixels (uint8 [H, W, 3], numpy or
    torch)."""

    position: int
    pixels: Any
