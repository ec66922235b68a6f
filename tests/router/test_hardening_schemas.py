"""Router hardening round 2 (#33, finding 7) on constrained decoding in the shared deployment: large schemas
are refused at once or compiled off the event loop, and a grammar past the decoder's limits is refused when
compiled. Each test failed on the main it was written against."""

from __future__ import annotations

import json
import time

import pytest
from support.router_hardening import HealthPoller, chat_body, post


def nested_any_of(a: int = 50, b: int = 50) -> dict:
    """An anyOf of `a` anyOfs of `b` one-key objects: it compiles, but after `{` the parser's row holds a·b items
    (llguidance allows 2,000)."""
    return {
        "anyOf": [
            {
                "anyOf": [
                    {"type": "object", "properties": {f"{i}_{j}": {"type": "integer"}}, "required": [f"{i}_{j}"]}
                    for j in range(b)
                ]
            }
            for i in range(a)
        ]
    }


def test_large_schemas_do_not_stall_other_clients(api_deployment):
    """#7: eight concurrent 3.6 MB enum schemas stalled /health 5.5 s (body parsing and grammar compilation on the
    event loop). Now a schema over the budget is refused at once, compilation runs in a thread pool, and /health
    answers throughout."""
    import concurrent.futures

    c = api_deployment.cluster
    enum = [f"value-{i:07d}-" + "x" * 20 for i in range(95_000)]
    body = chat_body(
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "big",
                "schema": {"type": "object", "properties": {"a": {"enum": enum}}, "required": ["a"]},
            },
        }
    )
    assert 3.4e6 < len(json.dumps(body)) < 4 * 2**20
    with HealthPoller(c.http_url) as health, concurrent.futures.ThreadPoolExecutor(8) as pool:
        start = time.monotonic()
        answers = list(pool.map(lambda _: post(c, "/v1/chat/completions", body), range(8)))
        took = time.monotonic() - start
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    print(f"8 × 3.6 MB schemas: refused in {took:.2f} s, /health worst {health.worst * 1000:.0f} ms")
    assert health.failures == 0 and health.worst < 1.0, (health.worst, health.failures)


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_grammar_past_the_decoders_limits_is_refused_when_compiled(api_deployment, where):
    """#7: a nested anyOf compiled on the router but exceeded llguidance's row limit mid-decode. The router now
    decodes a little with the worker's limits before scheduling anything: a 400 naming the field."""
    c = api_deployment.cluster
    schema = nested_any_of()
    if where == "tools":
        body = chat_body(
            tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
            tool_choice={"type": "function", "function": {"name": "f"}},
            max_tokens=8,
        )
        param = "tools.0.function.parameters"
    else:
        body = chat_body(
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}, max_tokens=8
        )
        param = "response_format.json_schema.schema"
    r = post(c, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "exceeds the decoder's limits" in err["message"] and "2000" in err["message"]
    # within the limits it decodes (the same shape, 40 alternatives)
    small = chat_body(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": nested_any_of(4, 10)}},
        max_tokens=24,
    )
    assert post(c, "/v1/chat/completions", small).status_code == 200
