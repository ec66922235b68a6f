"""Anthropic's own request checks (issue #51), through the official anthropic client against the session's shared
`expertmesh up`-style deployment: thinking.budget_tokens below max_tokens, no empty stop sequence, at most
MAX_STOP_SEQUENCES of them — each a 400 in Anthropic's error shape naming the field, the server serving on."""

import anthropic
import pytest
from support.api_deployment import API_KEY

from expertmesh.router.protocol import MAX_STOP_SEQUENCES

USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def claude(api_deployment):
    return anthropic.Anthropic(base_url=api_deployment.http_url, api_key=API_KEY, max_retries=0, timeout=60)


def refused(claude, **kw) -> str:
    """The message of the 400 a messages request gets (checked to be Anthropic's shape)."""
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", messages=USER, **kw)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


@pytest.mark.parametrize("budget", [8, 9])
def test_budget_tokens_must_be_below_max_tokens(claude, budget):
    said = refused(claude, max_tokens=8, thinking={"type": "enabled", "budget_tokens": budget})
    assert said.startswith("thinking.budget_tokens=") and "max_tokens=8" in said
    ok = claude.messages.create(
        model="tiny", messages=USER, max_tokens=9, thinking={"type": "enabled", "budget_tokens": 8}
    )
    assert ok.content[0].type == "thinking"


@pytest.mark.parametrize("stops", [[""], ["fine", ""]])
def test_an_empty_stop_sequence_is_refused(claude, stops):
    said = refused(claude, max_tokens=2, stop_sequences=stops)
    assert said.startswith("stop_sequences") and "non-empty" in said


@pytest.mark.parametrize("count", [MAX_STOP_SEQUENCES + 1, 40_000])
def test_the_number_of_stop_sequences_is_capped(claude, count):
    said = refused(claude, max_tokens=2, stop_sequences=[f"s{i}" for i in range(count)])
    assert said.startswith("stop_sequences") and f"at most {MAX_STOP_SEQUENCES}" in said
    ok = claude.messages.create(
        model="tiny", messages=USER, max_tokens=2, stop_sequences=[f"s{i}" for i in range(MAX_STOP_SEQUENCES)]
    )
    assert ok.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
