"""expertmesh/chat/thinking.py: the thinking section bounded where tokens are sampled — the state machine alone, its
wire form, and the Sampler running it with a grammar that starts where thinking ends."""

import random

import pytest
import torch
from support.thinking import run

from expertmesh.chat.grammar import json_schema_grammar, ll_tokenizer
from expertmesh.chat.thinking import DEFAULT_BUDGETS, ThinkingBudgets, ThinkingControl, ThinkingState, default_budgets
from expertmesh.chat.tokenizer import ByteTokenizer
from expertmesh.model.sampling import Sampler
from expertmesh.wire.sampling_params import SamplingParams, thinking_from_proto, thinking_to_proto

START, CLOSE, THINK, SEP, OPEN, RESP, EOT, EOS, ROLE = 300, 301, 302, 303, 304, 305, 306, 307, 308
K3_CLOSE = (CLOSE, THINK, SEP, OPEN, RESP, SEP)


@pytest.mark.parametrize("close", [(CLOSE,), K3_CLOSE], ids=["one-token", "k3"])
@pytest.mark.parametrize("limit", [6, 9, 20])
def test_the_limit_closes_thinking_whole_and_counts_the_close(close, limit):
    c = ThinkingControl(phase="reasoning", limit=limit, think_end=close, stop=(EOT,))
    drawn = [random.Random(limit).randrange(0, 200) for _ in range(40)]
    out, state = run(c, drawn)
    cut = limit - len(close)
    assert out[:cut] == drawn[:cut]  # the model's own reasoning, untouched
    assert tuple(out[cut:limit]) == close  # then the whole close, forced
    assert out[limit:] == drawn[limit:]  # then the answer as drawn
    assert state.reasoning_tokens == limit and state.answering


def test_a_close_the_model_starts_itself_is_completed_whatever_it_draws_next():
    c = ThinkingControl(phase="reasoning", limit=100, think_end=K3_CLOSE)
    out, state = run(c, [7, 8, CLOSE, 9, 9, 9, 9, 9, 11, 12])
    assert out == [7, 8, *K3_CLOSE, 11, 12]
    assert state.reasoning_tokens == 2 + len(K3_CLOSE) and state.answering


def test_stop_tokens_pass_through_reasoning_and_template_tokens_never_reach_the_answer():
    c = ThinkingControl(
        phase="reasoning",
        limit=50,
        think_end=(CLOSE,),
        stop=(EOT, EOS),
        not_in_answer=frozenset({START, CLOSE, ROLE}),
        end_of_turn=EOT,
    )
    out, state = run(c, [5, EOS])
    assert out == [5, EOS] and state.reasoning_tokens == 1 and not state.answering
    out, _ = run(c, [5, CLOSE, 6, ROLE, START])
    assert out == [5, CLOSE, 6, EOT, EOT]


def test_maybe_phase_the_first_token_decides():
    c = ThinkingControl(phase="maybe", limit=4, think_start=START, think_end=(CLOSE,))
    out, state = run(c, [START, 1, 2, 3, 4, 5])
    assert out == [START, 1, 2, CLOSE, 4, 5] and state.reasoning_tokens == 4
    out, state = run(c, [9, 1, 2, 3, 4, 5])
    assert out == [9, 1, 2, 3, 4, 5] and state.reasoning_tokens == 0 and state.answering


def test_a_replay_observing_the_output_reaches_the_same_state():
    """After a failover the worker feeds the output again (observe only): same count, same phase."""
    c = ThinkingControl(phase="reasoning", limit=10, think_end=K3_CLOSE)
    out, state = run(c, list(range(30)))
    replay = ThinkingState(c)
    for t in out:
        replay.observe(t)
    assert (replay.reasoning_tokens, replay.phase, replay.closing) == (state.reasoning_tokens, state.phase, 0)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(phase="thinking"), "thinking.phase"),
        (dict(phase="reasoning", limit=0, think_end=(1,)), "thinking.limit"),
        (dict(phase="reasoning"), "thinking.think_end"),
        (dict(phase="maybe", think_end=(1,)), "thinking.think_start"),
        (dict(phase="content", not_in_answer=frozenset({3})), "thinking.end_of_turn"),
    ],
)
def test_bad_controls_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ThinkingControl(**kw)


def test_the_control_round_trips_the_worker_proto():
    c = ThinkingControl(
        phase="maybe",
        limit=24,
        think_start=START,
        think_end=K3_CLOSE,
        stop=(EOT, EOS),
        not_in_answer=frozenset({START, ROLE}),
        end_of_turn=EOT,
    )
    assert thinking_from_proto(thinking_to_proto(c)) == c
    bare = ThinkingControl(phase="content")
    assert thinking_from_proto(thinking_to_proto(bare)) == bare


def test_the_sampler_cuts_thinking_and_starts_the_grammar_after_the_close():
    """Greedy over random logits: the sampler forces the close at the limit, and from the token after it the
    output follows the grammar (JSON) — what grammar_after_token did from the router's side before."""
    t = ByteTokenizer()
    lltok = ll_tokenizer(t)
    close = t.think_end_id
    c = ThinkingControl(phase="reasoning", limit=5, think_end=(close,), stop=tuple(t.eos_ids))
    params = SamplingParams(
        max_tokens=60,
        thinking=c,
        stop_token_ids=(t.end_id,),
        grammar=json_schema_grammar(
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "response_format"
        ),
    )
    s = Sampler(params, lltok)
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(60):
        logits = torch.randn(t.vocab_size, generator=g)
        logits[list(b"{}")] += 4.0  # a model that likes braces: the mask must still hold
        tok = s.sample(logits)
        s.observe(tok)
        out.append(tok)
        if tok == t.end_id:
            break
    assert out[4] == close and close not in out[:4]
    answer = bytes(x for x in out[5:] if x < 256).decode()
    import json

    assert out[-1] == t.end_id and isinstance(json.loads(answer)["a"], int)


@pytest.mark.parametrize(
    "roles, tier",
    [
        (["user"], "high"),
        (["system", "user"], "high"),
        (["user", "assistant", "tool"], "low"),
        (["user", "assistant", "tool", "tool"], "low"),
        (["user", "assistant", "tool", "assistant", "user"], "high"),  # a new task after a finished tool loop
        ([], "high"),
    ],
)
def test_the_auto_tier_plans_new_tasks_high_and_tool_rounds_low(roles, tier):
    from expertmesh.chat.thinking import auto_tier

    got, why = auto_tier(roles)
    assert got == tier and why


def test_budgets_are_serving_policy_positive_and_ordered():
    """Thinking budgets (moved out of the architecture config): per preset by default, checked when set."""
    assert default_budgets("tiny").limit("low") < default_budgets("tiny").limit("max") <= 64
    assert default_budgets("some-hf-model") == DEFAULT_BUDGETS
    assert ThinkingBudgets.parse("3, 5,7") == ThinkingBudgets(3, 5, 7)
    for bad, words in (("100,24,48", "low <= high <= max"), ("0,5,7", "positive"), ("3,5", "LOW,HIGH,MAX")):
        with pytest.raises(ValueError, match=words):
            ThinkingBudgets.parse(bad)
    with pytest.raises(ValueError, match="expected one of low, high, max"):
        DEFAULT_BUDGETS.limit("huge")
