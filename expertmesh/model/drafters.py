"""Speculative decoding's drafters: what proposes the next K tokens for the target model to verify in one forward.

- `MTPDrafter`: the checkpoint's own multi-token-prediction layer (model.mtp[0], transformer.MTPLayer). Its
  position p reads h_p (the target's final normed hidden state at p) and the embedding of token p+1 and predicts
  token p+2; it keeps its own latent cache, one entry per position, like a main MLA / DSA layer. Drafts are
  chained as vLLM's and SGLang's MTP proposers chain them: draft 1 from the last verified position, draft i+1 from
  the MTP layer's own output hidden state at draft i and the embedding of draft i, one position further. The
  chain's cache entries are dropped once the drafts are out (they came from the MTP layer's own states, not the
  target's); the verified positions are then fed with the target's states (`advance`).
- `NgramDrafter`: prompt lookup, no weights — the last n tokens (n from `max_n` down to `min_n`) matched against
  the earlier context (the most recent match wins), the K tokens that followed proposed.

A drafter returns the draft tokens and, for each, the distribution q it was drawn from (None: a point mass, the
n-gram drafter's, or a greedy draft) — what rejection sampling (model/speculative.py) needs.

Shapes: T positions, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from expertmesh.model.cache import Segment
from expertmesh.model.sampling import filtered_probs
from expertmesh.wire.sampling_params import TINY_TEMPERATURE


class MTPDrafter:
    """Drafts with the model's first MTP layer (`Transformer(cfg, mtp=True)` or HFLayout.load_mtp)."""

    def __init__(self, model, params, generator: torch.Generator):
        if not hasattr(model, "mtp"):
            raise ValueError(
                "method 'mtp': the model has no MTP layers loaded (Transformer(cfg, mtp=True) or load_mtp)"
            )
        self.model, self.layer = model, model.mtp[0]
        self.params, self.generator = params, generator
        self.greedy = params.temperature < TINY_TEMPERATURE
        self.cache = self.layer.new_cache()
        self.hidden: torch.Tensor | None = None  # the MTP layer's output at the last verified position [1, H]

    def _run(self, next_tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Positions cache.length .. + T - 1 from the tokens after them [T] and their h [T, H] → outputs [T, H]."""
        emb = self.model.embed(torch.tensor(next_tokens, dtype=torch.int64, device=hidden.device))
        out = self.layer(emb, hidden, [Segment(0, len(next_tokens), self.cache)])
        self.cache.length += len(next_tokens)
        return out

    def advance(self, next_tokens: list[int], hidden: torch.Tensor) -> None:
        """The target verified positions P .. P+T-1 (its normed final states `hidden` [T, H]) and the tokens after
        them `next_tokens` [T] are now known: feed them (P = what this drafter has seen)."""
        self.hidden = self._run(next_tokens, hidden)[-1:]

    def propose(self, k: int, context: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Up to k drafts after `context` (the emitted tokens; its last is the newest, not yet verified)."""
        drafts: list[int] = []
        qs: list[torch.Tensor | None] = []
        seen, h = self.cache.length, self.hidden
        for i in range(k):
            logits = self.layer.logits(h)[0]
            if self.greedy:
                token, q = int(torch.argmax(logits)), None
            else:
                q = filtered_probs(self.params, logits)
                token = int(torch.multinomial(q, 1, generator=self.generator))
            drafts.append(token)
            qs.append(q)
            if i + 1 < k:  # chain: this layer's own output at the draft, the draft's embedding, one position on
                h = self._run([token], h)
        if self.cache.length > seen:  # the chain's entries: gone before the verified positions come
            self.cache.roll_back(seen)
        return drafts, qs


class NgramDrafter:
    """Prompt lookup: the longest suffix of the context (max_n .. min_n tokens) that occurred before, and the
    tokens that followed its most recent occurrence."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: expected 1 <= min_n <= max_n, found min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def advance(self, next_tokens: list[int], hidden: torch.Tensor) -> None:
        """Nothing to feed: the context is all it reads."""

    def propose(self, k: int, context: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
        if k <= 0:
            return [], []
        n_ctx = len(context)
        for n in range(min(self.max_n, n_ctx - 1), self.min_n - 1, -1):
            suffix = context[n_ctx - n :]
            for start in range(n_ctx - n - 1, -1, -1):  # most recent earlier occurrence first
                if context[start : start + n] == suffix:
                    follow = context[start + n : start + n + k]
                    return follow, [None] * len(follow)
        return [], []
