"""Constrained decoding with llguidance: grammars compiled from JSON schemas and one matcher per request. No tensor
library here — the router compiles grammars to refuse bad ones early; the attention workers' sampler masks with them.

Why llguidance rather than xgrammar: llguidance is a Rust wheel with no Python dependencies (7.6 MB installed
here); xgrammar 0.2.9 requires torch, transformers, triton (on Linux x86_64) and apache-tvm-ffi — on a router or
worker image that is a second torch resolution this project must never let pull a CUDA build. llguidance has
JSON schema / Lark / regex front ends and needs only each token id's bytes, which every tokenizer here has.

One `Constraint` per request: its matcher sees only that request's tokens, so a row's mask never depends on the
other rows of the batch (batch invariance). `allowed` is the fast path (llguidance's bitmask, unpacked);
`allowed_reference` asks the matcher token by token and is what tests compare it with.
"""
from __future__ import annotations

import json
from functools import lru_cache

import llguidance
import numpy as np

# compact separators, no free whitespace: JSON output cannot run away in spaces or newlines
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema or grammar the engine cannot compile; the message names what was given (`where`)."""


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
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tok)), n_vocab=tok.vocab_size,
                                  eos_token=list(tok.eos_ids))


def json_schema_grammar(schema: dict | None, where: str) -> str:
    """A grammar for JSON matching `schema` (None: any JSON object, as `response_format: json_object`)."""
    schema = {"type": "object"} if schema is None else schema
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"{where}: {e}") from None


@lru_cache(maxsize=8)
def special_ids(lltok: llguidance.LLTokenizer) -> np.ndarray:
    """The special token ids of a (process-wide, long-lived) llguidance tokenizer."""
    return np.array([t for t in range(lltok.vocab_size) if lltok.is_special_token(t)], dtype=np.int64)


class Constraint:
    """One request's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, lltok: llguidance.LLTokenizer, grammar: str, where: str) -> None:
        self.vocab_size = lltok.vocab_size
        self.special = special_ids(lltok)
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"{where}: cannot be compiled: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """bool[vocab]: the tokens the grammar accepts next (fast path: the packed bitmask, unpacked; bit i of
        the little-endian words is token i). Special tokens the mask lets through are asked of the matcher one by
        one: where a free-text rule may end before a special-token terminal (a K3 string argument before
        ⟨close⟩), llguidance's mask admits every special id, and the matcher would refuse the wrong ones."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        for t in self.special[mask[self.special]]:
            mask[t] = self.matcher.validate_tokens([int(t)]) == 1
        return mask

    def allowed_reference(self) -> np.ndarray:
        """The same set asked token by token of a copy of the matcher (slow; for tests)."""
        return np.array([self.matcher.deep_copy().try_consume_tokens([t]) == 1 for t in range(self.vocab_size)])

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed here: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting() and not bool(self.allowed().any())
