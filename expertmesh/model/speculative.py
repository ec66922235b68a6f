"""Speculative decoding in the single-process reference model: a drafter (model/drafters.py: the checkpoint's MTP
layer, or n-gram prompt lookup) proposes K tokens, the target verifies the newest token and the K drafts in one
forward, and every accepted token is exactly the token plain decoding would have produced.

Exactness. The verify forward runs its K+1 rows as a *verify segment* (cache.Segment.verify): each row computes what
a one-token decode step at its position computes — KDA token by token in the recurrent form, MLA / DSA each row
through the paged decode kernel over the cache up to its own position, every projection row-invariant — so its
logits have the bits of plain decoding's, and greedy texts are identical with and without speculation.

Acceptance. Greedy: the target's token at each row (the request's Sampler, so penalties, bias, thinking and grammar
act as in plain decoding) is compared with the draft; the longest matching prefix is kept plus the target's token at
the first mismatch (or the bonus token after K accepted drafts). Sampling: rejection sampling — draft x accepted
with probability min(1, p(x) / q(x)), else a token drawn from norm(max(p − q, 0)) (q a point mass for the n-gram
drafter) — so each emitted token is distributed as the target's p; draws come from the request's seeded
generator, never a global one.

Rollback. After r tokens are emitted from a verify of K+1 rows, the caches keep rows 0 .. r-1 (the newest token and
the accepted drafts): latent caches and DSA indexer keys are truncated (no rejected position stays visible to a
later top-k), and each KDA layer takes the recurrent and conv state the verify kept after row r-1
(SequenceCache.roll_back: per-position states, no replay). The MTP drafter's own cache is rolled back the same way.

Shapes: T rows, H hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from expertmesh.model.cache import Segment, SequenceCache
from expertmesh.model.drafters import MTPDrafter, NgramDrafter
from expertmesh.model.sampling import Sampler, filtered_probs
from expertmesh.model.transformer import Generation, Transformer
from expertmesh.wire.sampling_params import TINY_TEMPERATURE, SamplingParams

METHODS = ("mtp", "ngram")


@dataclass
class SpeculativeGeneration(Generation):
    """A generation and its speculation figures: drafted / accepted drafts in all and by draft position (index i:
    the (i+1)-th draft of a step), and the verify steps (target forwards after the prompt)."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token); 1.0 without speculation."""
        return (len(self.tokens) - 1) / self.verify_steps if self.verify_steps else 0.0


def forward_rows(
    model: Transformer, token_ids: list[int], cache: SequenceCache, verify: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed `token_ids` after what `cache` has seen (a verify segment when `verify`) → (fp32 logits [T, V], the
    final normed hidden states [T, H] the MTP layer reads). The logits are `Transformer.forward`'s, bit for bit."""
    tokens = torch.tensor(token_ids, dtype=torch.int64, device=model.embed.weight.device)
    x = model.hidden_states(model.embed(tokens), [Segment(0, len(token_ids), cache, verify=verify)])
    cache.length += len(token_ids)
    normed = model.norm(x)
    return model.lm_head(normed).float(), normed


def accept_sampled(p: torch.Tensor, q: torch.Tensor | None, draft: int, generator: torch.Generator) -> tuple[int, bool]:
    """Rejection sampling for one draft: p [V] the target's distribution, q [V] the draft's (None: a point mass on
    `draft`) → (the emitted token, whether it is the draft). The emitted token is distributed as p."""
    p_x = float(p[draft])
    q_x = 1.0 if q is None else float(q[draft])
    if float(torch.rand((), generator=generator)) * q_x < p_x:  # u < p(x) / q(x)
        return draft, True
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p ≤ q everywhere with p ≠ q cannot happen; rounding can: fall back on p
        residual, total = p, float(p.sum())
    return int(torch.multinomial(residual / total, 1, generator=generator)), False


def _check_request(params, sampler: Sampler, k: int) -> bool:
    """→ greedy or not; refuses what this reference cannot yet speculate exactly."""
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k: expected an integer >= 0 draft tokens, found {k!r}")
    greedy = params.temperature < TINY_TEMPERATURE
    if not greedy and (sampler.constraint is not None or sampler.thinking is not None):
        raise ValueError(
            "grammar / thinking: speculative sampling (temperature > 0) does not take them yet; use greedy decoding"
        )
    return greedy


@torch.no_grad()
def speculate(
    model: Transformer,
    prompt: list[int],
    sampler: Sampler,
    drafter,
    k: int,
    prefill_chunk: int | None = None,
) -> tuple[SpeculativeGeneration, SequenceCache]:
    """`generate`, with `drafter` proposing up to `k` tokens a step → (the generation, the sequence's cache: every
    token but the last emitted, as plain decoding leaves it). Prefill in chunks of `prefill_chunk` as `generate`."""
    params = sampler.params
    greedy = _check_request(params, sampler, k)
    if not prompt:
        raise ValueError("prompt: expected at least one token")
    cache = model.new_cache()
    chunk = prefill_chunk or len(prompt)
    hidden = []
    for start in range(0, len(prompt), chunk):
        logits, normed = forward_rows(model, prompt[start : start + chunk], cache, verify=False)
        hidden.append(normed)
    out = SpeculativeGeneration(drafted_by_position=[0] * k, accepted_by_position=[0] * k)
    max_context = model.cfg.max_context

    def emit(token: int, fed: int) -> bool:
        """Append an emitted token (plain decoding had fed `fed` tokens when it sampled it) → whether it ends."""
        sampler.observe(token)
        out.tokens.append(token)
        if token in params.stop_token_ids:
            out.finish_reason = "stop"
            return True
        return len(out.tokens) >= params.max_tokens or fed >= max_context

    first = sampler.sample(logits[-1])
    if params.max_tokens <= 0 or emit(first, cache.length):
        return out, cache
    drafter.advance(prompt[1:] + [first], torch.cat(hidden))
    context = prompt + [first]
    while True:
        seen = cache.length
        room = min(k, params.max_tokens - len(out.tokens) - 1, max_context - seen - 1)
        drafts, qs = drafter.propose(room, context) if room > 0 else ([], [])
        drafts, qs = drafts[: max(room, 0)], qs[: max(room, 0)]
        logits, normed = forward_rows(model, [context[-1], *drafts], cache, verify=True)
        out.verify_steps += 1
        emitted: list[int] = []
        done = False
        for j in range(len(drafts) + 1):
            if greedy:
                token = sampler.sample(logits[j])
                ok = j < len(drafts) and token == drafts[j]
            elif j < len(drafts):
                p = filtered_probs(params, sampler._adjusted(logits[j].float()))
                token, ok = accept_sampled(p, qs[j], drafts[j], sampler.generator)
            else:
                p = filtered_probs(params, sampler._adjusted(logits[j].float()))
                token, ok = int(torch.multinomial(p, 1, generator=sampler.generator)), False
            if j < len(drafts):
                out.accepted_by_position[j] += ok
                out.accepted += ok
            emitted.append(token)
            done = emit(token, seen + j + 1)
            if done or not ok:
                break
        out.drafted += len(drafts)
        for j in range(len(drafts)):
            out.drafted_by_position[j] += 1
        cache.roll_back(seen + len(emitted))
        if done:
            return out, cache
        drafter.advance(emitted, normed[: len(emitted)])
        context += emitted


def generate_speculative(
    model: Transformer,
    prompt: list[int],
    params: SamplingParams,
    method: str = "mtp",
    k: int = 2,
    prefill_chunk: int | None = None,
    ngram: tuple[int, int] = (4, 1),
) -> SpeculativeGeneration:
    """`generate` with speculation: `method` "mtp" (the model's MTP layer; load it with HFLayout.load_mtp or build
    Transformer(cfg, mtp=True)) or "ngram" (prompt lookup over n = ngram[0] .. ngram[1] tokens), `k` drafts a step.
    Greedy output is identical to `generate`'s; sampled output is distributed as the target's."""
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, found {method!r}")
    sampler = Sampler(params)
    drafter = MTPDrafter(model, params, sampler.generator) if method == "mtp" else NgramDrafter(*ngram)
    return speculate(model, prompt, sampler, drafter, k, prefill_chunk)[0]
