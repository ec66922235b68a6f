"""expertmesh/chat/grammar.py (llguidance): the fast mask equals the matcher's token-by-token answer on random
logits, and sampling under it yields JSON that validates against the schema (checked by jsonschema)."""

import json

import jsonschema
import numpy as np
import pytest
import torch

from expertmesh.chat.grammar import Constraint, GrammarError, json_schema_grammar, ll_tokenizer
from expertmesh.chat.tokenizer import ByteTokenizer

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    t = ByteTokenizer()
    return t, ll_tokenizer(t)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_under_the_mask_gives_valid_json_and_the_mask_matches_the_reference(tok, seed):
    t, lltok = tok
    c = Constraint(lltok, json_schema_grammar(SCHEMA, "response_format.json_schema"), "response_format.json_schema")
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(200):
        mask = c.allowed()
        if step % 5 == 0:  # the reference is slow: compare every 5th step
            assert np.array_equal(mask, c.allowed_reference()), step
        if not mask.any():
            break
        logits = torch.randn(t.vocab_size, generator=g).masked_fill(~torch.from_numpy(mask), float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        if token in t.eos_ids:
            break
        c.advance(token)
        out.append(token)
    else:
        pytest.fail("no end within 200 tokens")
    doc = json.loads(t.decode(out))
    jsonschema.validate(doc, SCHEMA)
    assert " \n" not in t.decode(out) and "\n" not in t.decode(out)  # no free whitespace


def test_a_rejected_token_and_an_uncompilable_schema_are_errors_naming_it(tok):
    t, lltok = tok
    c = Constraint(lltok, json_schema_grammar(None, "response_format"), "response_format")
    assert not c.allowed()[ord("x")] and c.allowed()[ord("{")]
    with pytest.raises(GrammarError, match="not allowed"):
        c.advance(ord("x"))
    with pytest.raises(GrammarError, match=r"tools\[0\].function.parameters"):
        Constraint(
            lltok,
            json_schema_grammar(
                {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "tools[0].function.parameters"
            ),
            "tools[0].function.parameters",
        )


def test_sampler_applies_the_grammar_after_thinking_and_forces_the_stop_token(tok):
    """The Sampler as the worker drives it (sample, then observe the token fed back) on random logits of the
    model's (padded) vocabulary: free until the end-of-thinking marker, then JSON that validates, then the
    format's stop token; padded ids beyond the tokenizer are never chosen."""
    from expertmesh.model.sampling import Sampler
    from expertmesh.wire.sampling_params import SamplingParams

    t, lltok = tok
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        stop_token_ids=(t.end_id, t.eos_id),
        grammar=json_schema_grammar(SCHEMA, "s"),
        grammar_after_token=t.think_end_id,
    )
    s = Sampler(params, lltok)
    g = torch.Generator().manual_seed(0)
    for token in list(b"free text ") + [t.think_end_id]:  # thinking: anything goes (forced tokens here)
        s.observe(token)
    out = []
    for _ in range(200):
        token = s.sample(torch.randn(t.vocab_size + 32, generator=g))
        assert token < t.vocab_size
        if token == t.end_id:
            break
        s.observe(token)
        out.append(token)
    assert token == t.end_id, t.decode(out)
    jsonschema.validate(json.loads(t.decode(out)), SCHEMA)


def test_the_fast_mask_equals_the_matcher_on_special_tokens_after_free_text():
    """A grammar whose free-text rule may end right before a special-token terminal: llguidance's bitmask admits
    every special id there; the mask must admit only the one the grammar names (the matcher's answer)."""
    from expertmesh.chat.grammar import Constraint

    t = ByteTokenizer()
    lltok = ll_tokenizer(t)
    end = t.special_to_id[sorted(t.special_to_id)[0]] if hasattr(t, "special_to_id") else t.eos_ids[0]
    c = Constraint(lltok, f"start: TEXT <[{end}]>\nTEXT: /[a-z]*/\n", "test")
    c.advance(ord("a"))
    mask = c.allowed()
    assert np.array_equal(mask, c.allowed_reference())
    specials = [int(s) for s in c.special if mask[s]]
    assert specials == [end]
