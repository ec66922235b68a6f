"""Token sampling from one sequence's logits with its own seeded generator (never the global one)."""
from __future__ import annotations

import math

import torch


MAX_SEED = 2 ** 63 - 1
MAX_LOGPROBS = 20          # top alternatives per position (vLLM's default bound)


def check_sampling(params) -> None:
    """Raise ValueError naming the field when sampling parameters are out of range (NaN included)."""
    t, p, k, seed = params.temperature, params.top_p, params.top_k, params.seed
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature={t}: expected a finite number >= 0")
    if not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
        raise ValueError(f"top_p={p}: expected 0 < top_p <= 1")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"top_k={k}: expected an integer >= 0 (0 turns it off)")
    if seed is not None and (not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed={seed}: expected an integer in [0, 2**63 - 1]")
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name, None)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"{name}={n}: expected an integer in [0, {MAX_LOGPROBS}] (top alternatives per token)")


class Sampler:
    """Greedy when temperature == 0, else temperature / top-k / top-p sampling from a per-request generator.

    `params` needs temperature, top_p, top_k and seed attributes (model.SamplingParams or an API request)."""

    def __init__(self, params) -> None:
        check_sampling(params)
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
            before = sorted_probs.double().cumsum(-1) - sorted_probs.double()   # mass strictly above each token
            drop = before >= p.top_p
            drop[0] = False                                   # the most likely token always survives
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
