"""Chat template, tool-call parsing, thinking tiers and budgets (pure functions)."""

import json

import pytest
from support.thinking import run as emitted  # what the worker's sampler emits under a thinking control

from expertmesh.chat.format import (
    ChatError,
    Message,
    ToolCall,
    builtin_markers,
    parse_output,
    render,
    thinking_control,
    tier_from_request,
    validate_history,
)
from expertmesh.chat.thinking import default_budgets
from expertmesh.chat.tokenizer import ByteTokenizer

T = ByteTokenizer()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def six_turn_session():
    """(history before turn n, the assistant output of turn n) for a 6-turn tool session."""
    history = [Message("system", "You are a weather agent."), Message("user", "Weather in Paris and Oslo?")]
    turns = []
    for n in range(6):
        call = ToolCall(f"call_{n}", "get_weather", json.dumps({"city": f"city-{n}", "unit": "C"}))
        out = Message(
            "assistant", content=f"checking {n}", reasoning=f"I should call the tool for city {n}.", tool_calls=[call]
        )
        turns.append((list(history), out))
        history += [out, Message("tool", f"{10 + n} degrees", tool_call_id=call.id)]
    return turns, history


def generated_tokens(out: Message) -> list[int]:
    """What the model emits after the generation prompt for this assistant message."""
    ids = T.encode(out.reasoning) + [T.think_end_id] + T.encode(out.content)
    for c in out.tool_calls:
        ids += [T.tool_call_start_id] + T.encode(f"{c.name}\n{c.arguments}") + [T.tool_call_end_id]
    return ids + [T.end_id]


def test_prompt_of_turn_n_plus_1_starts_with_prompt_and_output_of_turn_n():
    turns, _ = six_turn_session()
    for (hist, out), (next_hist, _) in zip(turns, turns[1:]):
        prompt = render(hist, T, tools=TOOLS)
        nxt = render(next_hist, T, tools=TOOLS)
        full = prompt + generated_tokens(out)
        assert nxt[: len(full)] == full
        assert len(nxt) > len(full)


def test_parse_output_splits_reasoning_content_and_tool_calls():
    _, out = six_turn_session()[0][0]
    parsed = parse_output(generated_tokens(out), T, salt="r1")
    assert parsed.reasoning == out.reasoning and parsed.content == out.content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in out.tool_calls]
    assert parsed.tool_calls[0].id.startswith("call_") and parsed.finished_thinking
    assert parsed.reasoning_tokens == len(T.encode(out.reasoning)) + 1


@pytest.mark.parametrize("inner", ["get_weather {not json}", "no-newline", "\n{}", "get_weather\n[1, 2]"])
def test_malformed_tool_calls_stay_content(inner):
    ids = [T.think_end_id] + T.encode("before ") + [T.tool_call_start_id] + T.encode(inner) + [T.tool_call_end_id]
    parsed = parse_output(ids, T)
    assert parsed.tool_calls == []
    assert parsed.content.startswith("before ") and inner in parsed.content


def test_unclosed_tool_call_and_random_tokens_never_crash():
    import random

    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(T.vocab_size) for _ in range(rng.randrange(0, 40))]
        parse_output(ids, T, thinking=rng.random() < 0.5)
    parsed = parse_output([T.think_end_id, T.tool_call_start_id] + T.encode("f\n{}"), T)
    assert parsed.tool_calls == [] and "f\n{}" in parsed.content


@pytest.mark.parametrize(
    "messages, needle",
    [
        ([], "messages: expected at least one message"),
        (
            [Message("user", "hi"), Message("tool", "x", tool_call_id="nope")],
            "messages[1].tool_call_id: 'nope' answers no",
        ),
        (
            [Message("user", "hi"), Message("assistant", tool_calls=[ToolCall("a", "f", "{}")]), Message("user", "?")],
            "messages[1]: tool call 'a' is never answered before messages[2] (user)",
        ),
        ([Message("user", "hi"), Message("system", "late")], "messages[1]: a system message is only allowed first"),
        ([Message("robot", "hi")], "messages[0].role: 'robot'"),
        ([Message("user", "hi"), Message("tool", "x")], "messages[1].tool_call_id: required"),
    ],
)
def test_history_errors_name_the_message(messages, needle):
    with pytest.raises(ChatError) as e:
        validate_history(messages)
    assert needle in str(e.value)


def test_tiers():
    budgets = default_budgets("tiny")
    assert tier_from_request(thinking_budget="low") == "low"
    assert [tier_from_request(reasoning_effort=e) for e in ("low", "medium", "high")] == ["low", "high", "max"]
    assert tier_from_request(budget_tokens=budgets.low, budgets=budgets) == "low"
    assert tier_from_request(budget_tokens=budgets.low + 1, budgets=budgets) == "high"
    assert tier_from_request(budget_tokens=10**6, budgets=budgets) == "max"
    assert tier_from_request() == "high"
    with pytest.raises(ChatError, match="thinking_budget: 'huge'"):
        tier_from_request(thinking_budget="huge")
    with pytest.raises(ChatError, match="reasoning_effort"):
        tier_from_request(reasoning_effort="extreme")


def test_budget_forces_end_of_thinking_at_the_limit():
    control = thinking_control(builtin_markers(T), "reasoning", 5)
    out, state = emitted(control, [ord("a")] * 9)
    assert out[:4] == [ord("a")] * 4 and out[4] == T.think_end_id and out[5:] == [ord("a")] * 4
    assert state.reasoning_tokens == 5
    # a model that closes thinking itself is not forced; stray template tokens in the answer end the turn
    # instead of corrupting the history
    out, state = emitted(control, [1, T.think_end_id, 2, T.user_id])
    assert out == [1, T.think_end_id, 2, T.end_id] and state.reasoning_tokens == 2
