"""Token sampling from one sequence's logits with its own seeded generator (never the global one)."""
from __future__ import annotations

import torch


class Sampler:
    """Greedy when temperature == 0, else temperature / top-k / top-p sampling from a per-request generator.

    `params` needs temperature, top_p, top_k and seed attributes (model.SamplingParams or an API request)."""

    def __init__(self, params) -> None:
        if params.temperature < 0:
            raise ValueError(f"temperature={params.temperature}: expected >= 0")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p={params.top_p}: expected 0 < top_p <= 1")
        if params.top_k < 0:
            raise ValueError(f"top_k={params.top_k}: expected >= 0 (0 turns it off)")
        self.params = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] → a token id. Greedy ties go to the lowest id."""
        p = self.params
        logits = logits.float()
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True, stable=True)
            before = sorted_probs.cumsum(-1) - sorted_probs   # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= p.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
