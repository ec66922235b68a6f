"""Constrained decoding with llguidance: grammars compiled from JSON schemas and one matcher per request. No tensor
library here — the router compiles grammars to refuse bad ones early; the attention workers' sampler masks with them.

Why llguidance rather than xgrammar: llguidance is a Rust wheel with no Python dependencies (7.6 MB installed
here); xgrammar 0.2.9 requires torch, transformers, triton (on Linux x86_64) and apache-tvm-ffi — on a router or
worker image that is a second torch resolution this project must never let pull a CUDA build. llguidance has
JSON schema / Lark / regex front ends and needs only each token id's bytes, which every tokenizer here has.

One `Constraint` per request: its matcher sees only that request's tokens, so a row's mask never depends on the
other rows of the batch (batch invariance). `allowed` is the fast path (llguidance's bitmask, unpacked);
`allowed_reference` asks the matcher token by token and is what tests compare it with.

Limits: one set (`LIMITS`: llguidance's parser limits — Earley items per row and per step, lexer fuel and
states, grammar size) is what the router checks a grammar with and what the worker decodes with. Some grammars
compile but exceed a limit only while decoding (an `anyOf` of 2,500 objects: 2,500 items in the row after `{`,
over the 2,000 allowed); `probe` walks a grammar a few dozen tokens on seeded random paths with the same limits, so
the router refuses those before anything is scheduled (a 400 naming the field) rather than mid-answer.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from functools import lru_cache
from threading import Lock

import llguidance
import numpy as np

# compact separators, no free whitespace: JSON output cannot run away in spaces or newlines
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema or grammar the engine cannot compile; the message names what was given (`where`)."""


# llguidance's parser limits (its defaults, stated: the router's checks and the worker's matchers use these)
LIMITS = {
    "max_items_in_row": 2000,
    "step_max_items": 50_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
}


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS, verbose_errors=False)


def validate(grammar: str) -> str:
    """ "" when llguidance compiles `grammar` within LIMITS (no tokenizer needed), else its error."""
    try:
        return llguidance.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    except Exception as e:  # noqa: BLE001 - the engine's own message is the useful part
        return str(e) or type(e).__name__


_PROBED: OrderedDict[tuple, str] = OrderedDict()  # (tokenizer, grammar digest) → error ("": fits)
_PROBED_LOCK = Lock()


def probe(lltok: llguidance.LLTokenizer, grammar: str, *, walks: int = 3, steps: int = 48) -> str:
    """Decode `grammar` a little, as the worker will (same tokenizer, same LIMITS): `walks` seeded random paths of
    up to `steps` tokens each. "" when no limit was hit, else llguidance's error. Results are remembered (the same
    schema, request after request, is probed once)."""
    key = (id(lltok), hashlib.sha256(grammar.encode()).digest())
    with _PROBED_LOCK:
        if key in _PROBED:
            _PROBED.move_to_end(key)
            return _PROBED[key]
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=parser_limits())
    error = matcher.get_error() if matcher.is_error() else ""
    special = special_ids(lltok)
    for walk in range(walks if not error else 0):
        m, rng = matcher.deep_copy(), random.Random(walk)
        for _ in range(steps):
            if m.is_stopped() or m.is_error():
                break
            allowed = np.flatnonzero(allowed_mask(m, lltok.vocab_size, special))
            if m.is_error() or not len(allowed):
                break
            m.consume_token(int(allowed[rng.randrange(len(allowed))]))
        if m.is_error() and is_limit_error(m.get_error()):
            error = m.get_error()
            break
    with _PROBED_LOCK:
        _PROBED[key] = error
        while len(_PROBED) > 512:
            _PROBED.popitem(last=False)
    return error


class _Vocab:
    """What llguidance's TokenizerWrapper reads: each id's bytes, the EOS and special ids, and an encoder."""

    def __init__(self, tok) -> None:
        n = tok.vocab_size
        specials = set(getattr(tok, "id_to_special", {}))
        self.tokens = [b"" if i in specials else tok.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = sorted(specials)
        self.eos_token_id = tok.eos_ids[0]
        self.bos_token_id = None
        self._tok = tok

    def __call__(self, text) -> list[int]:
        return self._tok.encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


def ll_tokenizer(tok) -> llguidance.LLTokenizer:
    """The llguidance view of one of expertmesh's tokenizers (built once per process and shared)."""
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocab(tok)), n_vocab=tok.vocab_size, eos_token=list(tok.eos_ids)
    )


def is_limit_error(message: str) -> bool:
    """Whether llguidance stopped for one of its limits (rather than a token the grammar refuses)."""
    return any(s in message for s in ("max is", "fuel", "too big", "too many", "limit", "lexer states"))


def allowed_mask(matcher: llguidance.LLMatcher, vocab_size: int, special: np.ndarray) -> np.ndarray:
    """bool[vocab]: the tokens `matcher` accepts next — llguidance's bitmask, unpacked (bit i of the little-endian
    words is token i), with the special tokens it lets through asked of the matcher one by one (see
    Constraint.allowed)."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    mask = np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)
    for t in special[mask[special]]:
        mask[t] = matcher.validate_tokens([int(t)]) == 1
    return mask


def json_schema_grammar(schema: dict | None, where: str) -> str:
    """A grammar for JSON matching `schema` (None: any JSON object, as `response_format: json_object`)."""
    schema = {"type": "object"} if schema is None else schema
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"{where}: {e}") from None


@lru_cache(maxsize=4)
def cached_ll_tokenizer(tok) -> llguidance.LLTokenizer:
    """ll_tokenizer, once per tokenizer object (the router's: probes)."""
    return ll_tokenizer(tok)


@lru_cache(maxsize=8)
def special_ids(lltok: llguidance.LLTokenizer) -> np.ndarray:
    """The special token ids of a (process-wide, long-lived) llguidance tokenizer."""
    return np.array([t for t in range(lltok.vocab_size) if lltok.is_special_token(t)], dtype=np.int64)


class Constraint:
    """One request's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, lltok: llguidance.LLTokenizer, grammar: str, where: str) -> None:
        self.vocab_size = lltok.vocab_size
        self.special = special_ids(lltok)
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=parser_limits())
        if self.matcher.is_error():
            raise GrammarError(f"{where}: cannot be compiled: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """bool[vocab]: the tokens the grammar accepts next (fast path: the packed bitmask, unpacked; bit i of
        the little-endian words is token i). Special tokens the mask lets through are asked of the matcher one by
        one: where a free-text rule may end before a special-token terminal (a K3 string argument before
        ⟨close⟩), llguidance's mask admits every special id, and the matcher would refuse the wrong ones."""
        return allowed_mask(self.matcher, self.vocab_size, self.special)

    def allowed_reference(self) -> np.ndarray:
        """The same set asked token by token of a copy of the matcher (slow; for tests)."""
        return np.array([self.matcher.deep_copy().try_consume_tokens([t]) == 1 for t in range(self.vocab_size)])

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed here: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting() and not bool(self.allowed().any())
