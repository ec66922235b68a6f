"""What a request asks of the sampler — `SamplingParams`, its range checks and its wire form. Plain data with no
tensor library: the router builds and checks these, the attention workers' `sampling.Sampler` carries them out."""

from __future__ import annotations

import math
from dataclasses import dataclass

from expertmesh.chat.thinking import ThinkingControl
from expertmesh.protos import sampling_pb2, worker_pb2

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per position (vLLM's default bound)
TINY_TEMPERATURE = 1e-30  # below this, temperature sampling is the argmax (logits / T would overflow fp32)


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
    mp = getattr(params, "min_p", 0.0)
    if not isinstance(mp, (int, float)) or not 0 <= mp <= 1:  # NaN fails both comparisons
        raise ValueError(f"min_p={mp}: expected 0 <= min_p <= 1")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(params, name, 0.0)
        if not isinstance(v, (int, float)) or not -2 <= v <= 2:
            raise ValueError(f"{name}={v}: expected a number in [-2, 2]")
    for token, bias in getattr(params, "logit_bias", ()):
        if not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias: token {token!r} is not a token id")
        if not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias: the bias of token {token} is {bias}, expected a number in [-100, 100]")
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name, None)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"{name}={n}: expected an integer in [0, {MAX_LOGPROBS}] (top alternatives per token)")
    thinking = getattr(params, "thinking", None)
    if thinking is not None and not isinstance(thinking, ThinkingControl):
        raise ValueError(f"thinking: expected a ThinkingControl, found {type(thinking).__name__}")


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0  # drop tokens below min_p × the most likely one's probability; 0 → off
    presence_penalty: float = 0.0  # OpenAI's: minus this once for every token already generated
    frequency_penalty: float = 0.0  # ... and this times how often it was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    # log-probabilities under the model's own distribution (before temperature / top-k / top-p):
    logprobs: int | None = None  # of each generated token, with this many top alternatives
    prompt_logprobs: int | None = None  # of each prompt token after the first, likewise (no prefix-cache reuse)
    # constrained decoding (expertmesh/chat/grammar.py): an llguidance grammar the output follows, from the token after
    # the first `grammar_after_token` in the output (the end of thinking), or from the first token when None
    grammar: str | None = None
    grammar_after_token: int | None = None
    # a chat turn's thinking section (expertmesh/chat/thinking.py): counted, cut at its limit and closed whole by the
    # sampler; with it, a grammar applies from the answer's first token (grammar_after_token unused). Not part of
    # the public SamplingParams message: workers get it in OpenSequence.
    thinking: ThinkingControl | None = None


def sampling_to_proto(params):
    """SamplingParams → expertmesh.v1.SamplingParams (every field set)."""
    msg = sampling_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
    )
    for f in ("seed", "logprobs", "prompt_logprobs", "grammar", "grammar_after_token"):
        if getattr(params, f, None) is not None:
            setattr(msg, f, getattr(params, f))
    return msg


def thinking_to_proto(c: ThinkingControl):
    """ThinkingControl → expertmesh.v1.ThinkingControl (worker.proto)."""
    msg = worker_pb2.ThinkingControl(
        phase=c.phase, think_end=list(c.think_end), stop=list(c.stop), not_in_answer=sorted(c.not_in_answer)
    )
    for f in ("limit", "think_start", "end_of_turn"):
        if getattr(c, f) is not None:
            setattr(msg, f, getattr(c, f))
    return msg


def thinking_from_proto(msg) -> ThinkingControl:
    """The worker's side (ValueError naming the field when it does not validate)."""
    opt = {f: getattr(msg, f) for f in ("limit", "think_start", "end_of_turn") if msg.HasField(f)}
    return ThinkingControl(
        phase=msg.phase,
        think_end=tuple(msg.think_end),
        stop=tuple(msg.stop),
        not_in_answer=frozenset(msg.not_in_answer),
        **opt,
    )


def sampling_from_proto(msg):
    """expertmesh.v1.SamplingParams → SamplingParams; a field left unset takes the dataclass default.
    Values are not range-checked here (the sampler / engine do that, naming the field)."""
    fields = (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "logprobs",
        "prompt_logprobs",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "grammar",
        "grammar_after_token",
    )
    kw = {f: getattr(msg, f) for f in fields if msg.HasField(f)}
    return SamplingParams(
        **kw, stop_token_ids=tuple(msg.stop_token_ids), logit_bias=tuple(sorted(msg.logit_bias.items()))
    )
