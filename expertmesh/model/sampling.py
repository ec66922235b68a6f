"""Token sampling from one sequence's logits with its own seeded generator (never the global one)."""

from __future__ import annotations

import torch

from expertmesh.chat.grammar import Constraint, GrammarError
from expertmesh.chat.thinking import ThinkingState
from expertmesh.wire.sampling_params import TINY_TEMPERATURE, check_sampling


class Sampler:
    """One sequence's sampler. The logits are adjusted first — `logit_bias` added, then OpenAI's presence and
    frequency penalties over the tokens generated so far (`observe`) — then greedy when temperature == 0 (or below
    TINY_TEMPERATURE), else temperature, top-k, min-p and top-p, and a draw from the sequence's own seeded generator.

    With `params.thinking` (expertmesh/chat/thinking.py) the drawn token may be overridden: the end of thinking forced
    at the tier's limit and completed when multi-token, a template token kept out of the answer.

    With `params.grammar` (constrained decoding) the sequence's own grammar matcher masks the logits once the
    answer starts — past the thinking section under `params.thinking`, else after `params.grammar_after_token`
    has been output (or from the first token) — and a finished grammar forces the first stop token. `lltok`: the
    process's llguidance tokenizer (grammar.ll_tokenizer), needed only with a grammar.

    `params`: sampling_params.SamplingParams (or anything with its attributes)."""

    def __init__(self, params, lltok=None) -> None:
        check_sampling(params)
        self.params = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.counts: dict[int, int] = {}  # generated token → times, for the penalties
        self.constraint = None
        self.constraint_error: str | None = None  # a forced/replayed token the grammar refused
        grammar = getattr(params, "grammar", None)
        if grammar is not None:
            if lltok is None:
                raise ValueError("grammar: this worker has no tokenizer for constrained decoding")
            self.constraint = Constraint(lltok, grammar, "grammar")  # GrammarError (a ValueError) names it
            self.eos = int(lltok.eos_token)
            self.not_eos = torch.ones(lltok.vocab_size, dtype=torch.bool)
            self.not_eos[list(lltok.eos_tokens)] = False
        control = getattr(params, "thinking", None)
        self.thinking = ThinkingState(control) if control is not None else None
        after = getattr(params, "grammar_after_token", None)
        starts_now = self.thinking.answering if self.thinking is not None else after is None
        self.constrained = self.constraint is not None and starts_now  # the grammar applies from now on

    def observe(self, token: int) -> None:
        """A token that became part of the output (sampled or forced, replays included): the penalties count it
        and the grammar matcher advances past it (or starts after grammar_after_token)."""
        self.counts[token] = self.counts.get(token, 0) + 1
        was_answering = self.thinking is None or self.thinking.answering
        deciding = self._deciding()
        if self.thinking is not None:
            self.thinking.observe(token)
        if self.constraint is None or self.constraint_error is not None:
            return
        if deciding and self.thinking.answering:
            self.constrained = True  # phase "maybe": the first token was the answer's, under the grammar
        if self.constrained:
            if not self.constraint.matcher.is_stopped():
                try:
                    self.constraint.advance(token)
                except ValueError as e:
                    self.constraint_error = str(e)
        elif self.thinking is not None:
            self.constrained = not was_answering and self.thinking.answering  # the close's last token
        elif token == self.params.grammar_after_token:
            self.constrained = True

    def _deciding(self) -> bool:
        """Phase "maybe" under a grammar, before the first token: that token either opens thinking or is the
        answer's first (so the grammar's)."""
        return (
            self.constraint is not None
            and not self.constrained
            and self.thinking is not None
            and self.thinking.phase == "maybe"
        )

    def _grammar_mask(self, logits: torch.Tensor) -> torch.Tensor | None:
        """bool[V] of the tokens the grammar allows next (ids beyond the tokenizer's vocabulary never), or None
        when the grammar is finished (the caller forces a stop token)."""
        if self.constraint_error is not None:
            raise GrammarError(self.constraint_error)
        if self.constraint.matcher.is_stopped():
            return None
        allowed = torch.from_numpy(self.constraint.allowed())
        if self.constraint.matcher.is_accepting() and not bool(allowed[self.not_eos[: len(allowed)]].any()):
            return None  # complete, only EOS left: the format's own stop token instead
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        n = min(len(allowed), len(mask))
        mask[:n] = allowed[:n]
        return mask if bool(mask.any()) else None

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        bias, presence, frequency = (
            getattr(p, "logit_bias", ()),
            getattr(p, "presence_penalty", 0.0),
            getattr(p, "frequency_penalty", 0.0),
        )
        if not bias and not (self.counts and (presence or frequency)):
            return logits
        logits = logits.clone()
        v = logits.shape[-1]
        for token, b in bias:
            if token < v:
                logits[token] += b
        if self.counts and (presence or frequency):
            ids = torch.tensor([t for t in self.counts if t < v], dtype=torch.int64)
            n = torch.tensor([self.counts[t] for t in ids.tolist()], dtype=torch.float32)
            logits[ids] -= presence + frequency * n
        return logits

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] → a token id: the drawn one, unless the thinking control overrides it."""
        token = self._draw(logits)
        return self.thinking.next_token(token) if self.thinking is not None else token

    def _draw(self, logits: torch.Tensor) -> int:
        """logits [V] → a token id. Greedy ties go to the lowest id."""
        p = self.params
        logits = self._adjusted(logits.float())
        if self.constrained or self._deciding():
            mask = self._grammar_mask(logits)
            if mask is None:
                return int(p.stop_token_ids[0]) if p.stop_token_ids else self.eos
            if not self.constrained:  # phase "maybe": the grammar's first tokens, or opening thinking
                mask[self.thinking.c.think_start] = True
            logits = logits.masked_fill(~mask, float("-inf"))
        if p.temperature < TINY_TEMPERATURE:  # 0, or so small that logits / T overflows fp32: the argmax
            return int(torch.argmax(logits))
        return int(torch.multinomial(filtered_probs(p, logits), 1, generator=self.generator))


def filtered_probs(params, logits: torch.Tensor) -> torch.Tensor:
    """logits [V] (already adjusted: bias, penalties, masks) → the distribution fp32 [V] a Sampler draws from at
    temperature > 0: temperature, top-k, min-p, top-p, in that order (speculative decoding's rejection sampling
    needs the same p and q)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    min_p = getattr(params, "min_p", 0.0)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = sorted_probs.double().cumsum(-1) - sorted_probs.double()  # mass strictly above each token
        drop = before >= params.top_p
        drop[0] = False  # the most likely token always survives
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
