"""What an attention worker keeps per open sequence and per cached prefix, and the log-probability entries a
step reports."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from expertmesh.model.cache import SequenceCache
from expertmesh.model.sampling import Sampler
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import (
    TokenLogprobs,
)
from expertmesh.worker.kv import PagedSequenceKV


def token_logprobs(seq_id: str, position: int, logprobs: torch.Tensor, token_ids: list[int], n: int) -> TokenLogprobs:
    """logprobs [P, V] (log_softmax rows), token_ids [P] the tokens that followed → the tokens' entries with the
    top `n` alternatives of each position."""
    ids = torch.tensor(token_ids, dtype=torch.int64)
    top = torch.topk(logprobs, n, dim=-1) if n else None
    return TokenLogprobs(
        seq_id,
        position,
        ids,
        logprobs.gather(-1, ids[:, None])[:, 0],
        top.indices if top is not None else torch.empty(len(token_ids), 0, dtype=torch.int64),
        top.values if top is not None else torch.empty(len(token_ids), 0),
    )


@dataclass
class SequenceState:
    """An open sequence: its KV pages and caches, its sampler and what its log-probs and hand-offs need."""

    kv: PagedSequenceKV
    cache: SequenceCache
    sampler: Sampler
    params: SamplingParams
    # prompt_logprobs: the log-probabilities after the last fed token, waiting for the token that follows it
    # (the next segment's first token: prefill chunks end mid-prompt)
    pending: torch.Tensor | None = None
    generating: bool = False  # the prompt is done: fed tokens are output (the penalties count them)
    owner: str = ""  # the router instance that opened it ("" = no lease)
    images: object = None  # vision.SequenceImages: the prompt's images, spliced in as the prefill reaches them
    observed: list[int] = field(default_factory=list)  # output tokens fed (what a hand-off replays into a sampler)
    spec: object = None  # worker/speculation.SpecState: its drafter state and pending drafts (None: no speculation)
    # speculation: (length, KDA states) kept at a chunk boundary a verified run reached (StepSegment.hold_at), for
    # the snapshot of that length the next step asks for
    held: tuple[int, dict] | None = None

    def hold(self, hold_at: int, kept: int) -> None:
        """After a step that keeps `kept` tokens in the cache (the verify's per-position states not yet rolled
        back): keep the state at cache length `hold_at` if the kept tokens reach it."""
        if 0 < hold_at <= kept:
            states = self.cache.kda_states_at(hold_at)
            if states is not None:
                self.held = (hold_at, states)

    def take_held(self, length: int) -> dict | None:
        """The KDA states held at cache length `length` (forgotten here), or None when the last hold was not there."""
        if self.held is None or self.held[0] != length or length > self.cache.length:
            return None
        states, self.held = self.held[1], None
        return states


@dataclass
class CachedPrefix:
    """A cached prefix: the KV pages and recurrent state after `length` tokens."""

    kv: PagedSequenceKV
    kda_states: dict[int, tuple[torch.Tensor, torch.Tensor]]
    length: int
