"""Speculative decoding on an attention worker (`--speculative-method mtp|ngram --speculative-tokens K`): the data
path's side of model/speculative.py. A generating sequence keeps its drafter state and its pending drafts in its
SequenceState (`spec`); a decode segment the router lets emit several tokens (`StepSegment.max_new`) feeds the
newest token and up to max_new - 1 pending drafts as one verify segment over the paged KV (model/cache.Segment.verify:
every row computes what a one-token decode step computes), the rows are accepted as `speculate` accepts them, the
caches are rolled back to the last kept position, and the drafter proposes the next K.

Acceptance (`verify`): the request's own Sampler for every row — logit bias, penalties, grammar masks and the thinking
state machine act as in plain decoding, and only kept tokens are observed. Greedy: the longest prefix of drafts
equal to the target's tokens, plus the target's token after it. Sampling: rejection sampling
(speculative.accept_sampled) with the request's seeded generator; sequences whose sampling carries a grammar or a
thinking section do not speculate (speculate() refuses them too), greedy ones always may.

Rollback: the caller truncates the latent and indexer pages to the kept length (the blocks stay reserved; the rejected
rows are past every later context length, so no selection sees them) and restores each KDA layer's state kept for
that position (SequenceCache.roll_back) — before any snapshot, so prefixes, tiers and hand-offs never hold a rejected
position. A sequence that saves a prefix in a step verifies no drafts in it.

The MTP drafter (`mtp`): the checkpoint's MTP layer on this worker (HFLayout.load_mtp without its routed experts);
its MoE goes through the expert exchange like any layer's (`experts`: layer n_layers + j, placed by a plan made with
`mtp` — planner.placed_layers). Each sequence has its own MTP cache, fed the
target's normed final state at every kept position with the token after it (prefill chunks included; the state of a
chunk's last position waits for the next token), batched over the step's sequences; drafts are chained as
model/drafters.MTPDrafter chains them and the chain's cache entries dropped. A sequence opened from a cached prefix
or handed off starts its MTP cache at that point (the prefix's positions are not in it): drafts are poorer there,
the output the same. The n-gram drafter (`ngram`) looks up the tokens this worker fed for the sequence (a cached
prefix's tokens are not among them).

Shapes: T rows, H hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from expertmesh.model.cache import Segment, SequenceCache
from expertmesh.model.drafters import NgramDrafter
from expertmesh.model.moe import LOCAL_EXPERTS
from expertmesh.model.sampling import filtered_probs
from expertmesh.model.speculative import METHODS, accept_sampled
from expertmesh.wire.sampling_params import TINY_TEMPERATURE
from expertmesh.wire.worker_api import TokenLogprobs, WorkerError
from expertmesh.worker.sequences import token_logprobs


@dataclass
class SpecState:
    """One sequence's drafter state."""

    greedy: bool
    context: list[int] = field(default_factory=list)  # tokens fed for it on this worker (the n-gram drafter's)
    last: int | None = None  # the newest emitted token (not fed yet), which `drafts` follow
    drafts: list[int] = field(default_factory=list)
    qs: list = field(default_factory=list)  # each draft's distribution (None: a point mass / greedy)
    mtp_cache: SequenceCache | None = None
    h_pending: torch.Tensor | None = None  # [1, H] the target's state at the last fed position, its next token unfed
    mtp_hidden: torch.Tensor | None = None  # [1, H] the MTP output at its last fed position: draft 1 reads it


class Speculation:
    """A worker's speculation: its drafter, the figures its metrics report."""

    def __init__(self, model, method: str, k: int, experts=None):
        if method not in METHODS:
            raise WorkerError(f"--speculative-method: expected one of {', '.join(METHODS)}, found {method!r}")
        if not isinstance(k, int) or k <= 0:
            raise WorkerError(f"--speculative-tokens: expected an integer >= 1 with a method, found {k!r}")
        self.model, self.method, self.k = model, method, k
        self.experts = experts or (lambda: LOCAL_EXPERTS)  # → the MTP layer's routed-experts backend for a forward
        self.layer = model.mtp[0] if method == "mtp" else None
        self.ngram = NgramDrafter() if method == "ngram" else None
        self.drafted = 0
        self.accepted = 0
        self.drafted_by_position = [0] * k
        self.accepted_by_position = [0] * k
        self.verify_steps = 0
        self.verify_seconds = 0.0

    def new_state(self, sampler) -> SpecState | None:
        """A new sequence's state; None for one that does not speculate (sampling under a grammar or thinking)."""
        greedy = sampler.params.temperature < TINY_TEMPERATURE
        if not greedy and (sampler.constraint is not None or sampler.thinking is not None):
            return None
        return SpecState(greedy, mtp_cache=self.layer.new_cache() if self.layer is not None else None)

    # ------------------------------------------------------------------ a step's verify segments
    def drafts_for(self, seq, token_ids: list[int], max_new: int, room: int, saving: bool) -> list[int]:
        """The drafts a segment feeds after `token_ids`: its pending drafts, when it is one decode token — the one
        they were drafted after — and may emit more than one (`max_new`), within `room` more KV positions, and it
        saves no prefix this step."""
        st = seq.spec
        if st is None or saving or not seq.generating or len(token_ids) != 1 or token_ids[0] != st.last:
            return []
        return st.drafts[: max(0, min(max_new - 1, room - 1))]

    def verify(
        self, seq_id: str, seq, fed: list[int], logits: torch.Tensor, before: int
    ) -> tuple[list[int], list[TokenLogprobs]]:
        """A verify segment's rows (fed: the newest token then the drafts, logits [T, V] at positions before ..)
        → (the emitted tokens, their log-prob entries). Observes the kept tokens: the newest and the accepted
        drafts (the last emitted is fed, hence observed, next step)."""
        st, sampler, params = seq.spec, seq.sampler, seq.params
        drafts = fed[1:]
        sampler.observe(fed[0])
        seq.observed.append(fed[0])
        emitted: list[int] = []
        for j in range(len(drafts) + 1):
            if st.greedy:
                token = sampler.sample(logits[j])
                ok = j < len(drafts) and token == drafts[j]
            else:
                p = filtered_probs(params, sampler._adjusted(logits[j].float()))
                if j < len(drafts):
                    token, ok = accept_sampled(p, st.qs[j], drafts[j], sampler.generator)
                else:
                    token, ok = int(torch.multinomial(p, 1, generator=sampler.generator)), False
            if j < len(drafts):
                self.accepted_by_position[j] += ok
                self.accepted += ok
            emitted.append(token)
            if not ok or token in params.stop_token_ids:
                break
            sampler.observe(token)
            seq.observed.append(token)
        self.drafted += len(drafts)
        for j in range(len(drafts)):
            self.drafted_by_position[j] += 1
        entries = []
        if params.logprobs is not None:
            lp = torch.log_softmax(logits[: len(emitted)], dim=-1)
            entries.append(token_logprobs(seq_id, before + 1, lp, emitted, params.logprobs))
        return emitted, entries

    def timed(self, seconds: float) -> None:
        """A step with verify segments took `seconds`."""
        self.verify_steps += 1
        self.verify_seconds += seconds

    # ------------------------------------------------------------------ after a step: feed, then draft
    @torch.no_grad()
    def advance(self, items: list[tuple[object, list[int], int, int | None]], x: torch.Tensor, draft=True) -> None:
        """After a step: per speculating sequence (seq, the tokens it kept in its cache, their first row in the
        step's final hidden states `x` [T, H], the newest emitted token or None) — feed the drafter, then (`draft`:
        unless the router speculates for no segment of the step — a batch over --speculative-max-batch) draft the next K after
        each sequence that emitted a token. Without `draft` the MTP layer is not fed either (a large batch pays
        nothing for speculation): its cache skips those positions, so drafts after them are poorer, never wrong."""
        if self.layer is not None and not draft:
            for seq, _, _, _ in items:
                seq.spec.h_pending = seq.spec.mtp_hidden = None  # fed afresh from the next kept states
        if self.layer is not None and draft:
            groups = []
            for seq, kept, row, last in items:
                st = seq.spec
                normed = self.model.norm(x[row : row + len(kept)])  # what the LM head reads
                # pairs (state at p, token p+1): the pending state with the first kept token (none pending: that
                # pair was fed, or cannot be — a fresh start), each kept state with the token after it
                if st.h_pending is None:
                    hidden, nxt = normed, kept[1:]
                else:
                    hidden, nxt = torch.cat([st.h_pending, normed]), list(kept)
                nxt += [last] if last is not None else []
                hidden = hidden[: len(nxt)]
                st.h_pending = None if last is not None else normed[-1:]
                if nxt:
                    groups.append((st, nxt, hidden))
            for (st, _, _), out in zip(groups, self._mtp_feed(groups)):
                st.mtp_hidden = out[-1:]
        drafting = []
        for seq, kept, _, last in items:
            st = seq.spec
            st.context += kept
            st.last, st.drafts, st.qs = last, [], []
            if last is not None:
                drafting.append((seq, st))
        if not drafting or not draft:
            return
        if self.ngram is not None:
            for _, st in drafting:
                st.drafts, st.qs = self.ngram.propose(self.k, [*st.context, st.last])
            return
        self._mtp_draft([(seq, st) for seq, st in drafting if st.mtp_hidden is not None])

    def _mtp_feed(self, groups: list[tuple[SpecState, list[int], torch.Tensor]]) -> list[torch.Tensor]:
        """(state, next tokens [T], states [T, H]) of several sequences → their MTP outputs [T, H], one forward."""
        if not groups:
            return []
        dev = self.model.embed.weight.device
        tokens = torch.tensor([t for _, nxt, _ in groups for t in nxt], dtype=torch.int64, device=dev)
        segs, start = [], 0
        for st, nxt, _ in groups:
            segs.append(Segment(start, len(nxt), st.mtp_cache))
            start += len(nxt)
        out = self.layer(self.model.embed(tokens), torch.cat([h for _, _, h in groups]), segs, self.experts())
        for st, nxt, _ in groups:
            st.mtp_cache.length += len(nxt)
        return list(out.split([len(nxt) for _, nxt, _ in groups]))

    def _mtp_draft(self, drafting: list) -> None:
        """K chained drafts for each (seq, state), the chain's positions batched over the sequences, its cache
        entries dropped after."""
        if not drafting:
            return
        seen = [st.mtp_cache.length for _, st in drafting]
        h = torch.cat([st.mtp_hidden for _, st in drafting])
        for i in range(self.k):
            logits = self.layer.logits(h)
            tokens, best = [], logits.argmax(dim=-1).tolist()  # one device → host copy for the greedy rows
            for row, (seq, st) in enumerate(drafting):
                if st.greedy:
                    token, q = best[row], None
                else:
                    q = filtered_probs(seq.params, logits[row])
                    token = int(torch.multinomial(q, 1, generator=seq.sampler.generator))
                st.drafts.append(token)
                st.qs.append(q)
                tokens.append(token)
            if i + 1 < self.k:  # chain: the layer's own output, the draft's embedding, one position on
                h = torch.cat(
                    self._mtp_feed([(st, [t], h[r : r + 1]) for r, ((_, st), t) in enumerate(zip(drafting, tokens))])
                )
        for (_, st), length in zip(drafting, seen):
            if st.mtp_cache.length > length:
                st.mtp_cache.roll_back(length)

    def figures(self) -> dict:
        """What the worker's metrics report."""
        return {
            "method": self.method,
            "tokens": self.k,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "drafted_by_position": list(self.drafted_by_position),
            "accepted_by_position": list(self.accepted_by_position),
            "verify_steps": self.verify_steps,
            "verify_seconds": self.verify_seconds,
        }
