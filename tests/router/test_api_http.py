"""The public HTTP APIs driven by the official openai and anthropic clients against an `expertmesh up`-style
multi-process deployment on loopback."""

import json

import anthropic
import httpx
import openai
import pytest
from support.api_deployment import API_KEY

from expertmesh.chat.thinking import default_budgets
from expertmesh.model.config import preset

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server(api_deployment):
    """`expertmesh up`-style: router + 1 attention + 2 expert workers as processes, the key from the environment
    (the session's shared deployment, tests/support/api_deployment.py)."""
    return api_deployment.http_url, api_deployment.cluster


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_health_and_completions(server, oai):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"
    out = oai.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0)
    n = out.usage.completion_tokens
    assert 0 < n <= 6 and out.choices[0].finish_reason == ("length" if n == 6 else "stop")  # stop = EOS
    again = oai.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0)
    assert again.choices[0].text == out.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in oai.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == out.choices[0].text
    # a stop string that never matches changes nothing (the text it held back once came back twice, unstreamed)
    held = oai.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0, stop=["never-seen"])
    assert held.choices[0].text == out.choices[0].text


def test_chat_non_streaming_reasoning_and_usage(server, oai):
    r = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi there"}],
        max_completion_tokens=40,
        temperature=0,
        reasoning_effort="low",
    )
    limit = default_budgets("tiny").low
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens <= limit
    msg = r.choices[0].message
    n = r.usage.completion_tokens
    assert 0 < n <= 40 and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason == ("length" if n == 40 else "stop")  # no tools: never tool_calls
    assert isinstance(msg.reasoning_content, str) and msg.reasoning_content  # it reasoned: the text is there


def test_chat_streaming_matches_non_streaming(server, oai):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Stream me"}],
        max_tokens=30,
        temperature=0,
        reasoning_effort="medium",
    )
    full = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert content == (full.choices[0].message.content or "")
    assert reasoning == (getattr(full.choices[0].message, "reasoning_content", None) or "")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.parametrize("effort, tier", [("low", "low"), ("medium", "high"), ("high", "max")])
def test_budgets_never_exceeded_and_answer_follows(server, oai, effort, tier):
    limit = default_budgets("tiny").limit(tier)
    r = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Think hard"}],
        max_tokens=limit + 20,
        temperature=0,
        reasoning_effort=effort,
    )
    assert r.usage.completion_tokens_details.reasoning_tokens <= limit
    assert (
        r.usage.completion_tokens > r.usage.completion_tokens_details.reasoning_tokens
        or r.choices[0].finish_reason == "stop"
    )


def test_six_turn_tool_conversation_hits_the_prefix_cache(server, oai):
    messages = [
        {"role": "system", "content": "You are a careful weather agent. " * 12},
        {"role": "user", "content": "What is the weather in Paris, Oslo and Lima?"},
    ]
    cached_ratios = []
    for turn in range(6):
        r = oai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
        if turn:
            cached_ratios.append(r.usage.prompt_tokens_details.cached_tokens / r.usage.prompt_tokens)
        call_id = f"call_turn{turn}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"step {turn}",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": f"c{turn}"})},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"{turn} C"})
    assert min(cached_ratios) >= 0.9, cached_ratios


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model 'nope' not found"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens=0"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
        (
            {"model": "tiny", "messages": [{"role": "tool", "content": "x", "tool_call_id": "zz"}]},
            400,
            "messages[0].tool_call_id: 'zz' answers no",
        ),
        (
            {
                "model": "tiny",
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "user", "content": "y"},
                ],
            },
            400,
            "tool call 'a' is never answered",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"},
            400,
            "reasoning_effort",
        ),
    ],
)
def test_chat_errors_have_openai_shape(server, body, status, needle):
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and {"message", "type", "param", "code"} <= set(err)
    ok = httpx.post(
        server[0] + "/v1/completions",
        json={"model": "tiny", "prompt": "a", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert ok.status_code == 200  # the server keeps serving


def test_wrong_api_key_is_401_and_the_key_is_never_logged(server):
    bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert API_KEY not in str(e.value)
    metrics = httpx.get(server[0] + "/metrics").text
    logs = "\n".join(line for child in server[1].children for line in child.lines)
    assert API_KEY not in metrics and API_KEY not in logs and "sk-wrong" not in logs
    assert all(API_KEY not in arg for child in server[1].children for arg in child.args)  # not in `ps` either


def test_the_key_is_checked_before_the_body_and_numbers_must_be_finite(server):
    """An unauthenticated client learns nothing of the schema (401 before any 400); the scheme is
    case-insensitive; NaN / inf are refused as such, naming the field."""
    url = server[0] + "/v1/chat/completions"
    for body in ({"model": "tiny", "messages": "not a list", "bogus": 1}, "{not json"):
        kw = {"json": body} if isinstance(body, dict) else {"content": body}
        r = httpx.post(url, headers={"Authorization": "Bearer sk-wrong"}, **kw)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "messages" not in r.text and "bogus" not in r.text
    r = httpx.post(server[0] + "/v1/messages", content="{not json", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error"
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = httpx.post(url, json=ok, headers={"Authorization": f"bearer {API_KEY}"})
    assert r.status_code == 200
    r = httpx.post(
        url,
        content='{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert "finite" in r.json()["error"]["message"]


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key=API_KEY, max_retries=0, timeout=60)


def test_anthropic_messages_with_thinking_and_tools(server, claude):
    limit = default_budgets("tiny").low
    msg = claude.messages.create(
        model="tiny",
        max_tokens=40,
        thinking={"type": "enabled", "budget_tokens": limit},
        tools=[{"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}}],
        messages=[
            {"role": "user", "content": "Weather in Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "call it", "signature": ""},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "20 C"}]},
        ],
    )
    assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert msg.content[0].type == "thinking"
    assert msg.usage.output_tokens <= 40 and msg.usage.input_tokens > 0


def test_anthropic_streaming_events(server, claude):
    kw = dict(
        model="tiny",
        max_tokens=30,
        thinking={"type": "enabled", "budget_tokens": 8},
        messages=[{"role": "user", "content": "Stream please"}],
    )
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.usage.output_tokens <= 30


def test_anthropic_errors(server):
    r = httpx.post(
        server[0] + "/v1/messages",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": API_KEY},
    )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and "max_tokens" in body["error"]["message"]
    r = httpx.post(
        server[0] + "/v1/messages",
        json={"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": "wrong"},
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_chat_cli_streams_and_keeps_history(server, capsys, monkeypatch):
    from expertmesh.entry.cli import main

    assert (
        main(["chat", "--url", server[0], "--api-key", API_KEY, "--thinking", "low", "--max-tokens", "12", "Hello"])
        == 0
    )
    err = capsys.readouterr().err
    assert "prompt (" in err and "reasoning) tokens]" in err
    # interactive: two turns share history, so the second turn's prompt is served from the prefix cache
    answers = iter(["first question " * 6, "second", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt="": next(answers))
    assert main(["chat", "--url", server[0], "--api-key", API_KEY, "--thinking", "low", "--max-tokens", "8"]) == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if "cached)" in l]
    assert len(lines) == 2 and "(0 cached)" in lines[0] and "(0 cached)" not in lines[1]


# ---------------------------------------------------------------------------------------------- context, tokens
def test_context_limits_are_reported_and_named(server, oai):
    model = oai.models.list().data[0]
    assert model.max_model_len == preset("tiny").max_context
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt=[1] * model.max_model_len, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert f"{model.max_model_len} tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="tiny", max_tokens=model.max_model_len, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"


def test_tokenize_counts_what_the_endpoints_feed(server, oai):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = "Count me, twice: ü ✓"
    r = httpx.post(
        server[0] + "/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True}, headers=headers
    ).json()
    out = oai.completions.create(model="tiny", prompt=text, max_tokens=1, temperature=0)
    assert r["count"] == len(r["tokens"]) == out.usage.prompt_tokens and r["max_model_len"] == 4096
    assert "".join(r["token_strs"][1:8]) == text[:7]  # after the BOS token (bytes: ASCII only here)
    back = httpx.post(server[0] + "/detokenize", json={"tokens": r["tokens"]}, headers=headers).json()
    assert back["prompt"] == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    r = httpx.post(server[0] + "/tokenize", json={"messages": messages, "tools": TOOLS}, headers=headers).json()
    chat = oai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=2)
    assert r["count"] == chat.usage.prompt_tokens
    bad = httpx.post(server[0] + "/tokenize", json={"prompt": "x", "add_bos": True}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_bos"
    bad = httpx.post(server[0] + "/detokenize", json={"tokens": [10**6]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_anthropic_count_tokens_equals_usage(server, claude):
    kw = dict(
        model="tiny",
        system="You are terse.",
        thinking={"type": "enabled", "budget_tokens": 8},
        tools=[{"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}}],
        messages=[{"role": "user", "content": "Weather in Lima, counted " + "again " * 7}],
    )
    counted = claude.messages.count_tokens(**kw).input_tokens
    msg = claude.messages.create(max_tokens=9, **kw)  # above budget_tokens, as Anthropic requires
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 20


def test_chat_logprobs_stream_and_not(server, oai):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    out = oai.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens > 0
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob == tops[0]  # greedy
    streamed = [
        e
        for c in oai.chat.completions.create(stream=True, **kw)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert oai.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None
    # a token that is part of a UTF-8 sequence (a lone lead byte 0xC3, forced): its text is U+FFFD, its bytes exact
    lead = oai.chat.completions.create(**{**kw, "reasoning_effort": "none", "logit_bias": {"195": 100}})
    assert [(e.token, e.bytes) for e in lead.choices[0].logprobs.content[:3]] == [("\ufffd", [0xC3])] * 3
    for bad in ({"logprobs": False}, {"top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**{**kw, **bad})
        assert e.value.param == "top_logprobs"


def test_stop_strings_cut_the_content(server, oai, claude):
    """A stop string ends the answer before it (finish_reason stop; Anthropic stop_sequence), streamed or not."""
    base = dict(model="tiny", max_tokens=40, temperature=0, reasoning_effort="low")
    for i in range(8):  # a prompt whose greedy answer has text to cut
        messages = [{"role": "user", "content": f"Tell me about stop strings, take {i}."}]
        full = oai.chat.completions.create(messages=messages, **base).choices[0].message.content or ""
        if len(full) >= 6:
            break
    assert len(full) >= 6, full
    stop = full[3:5]
    cut = full[: full.find(stop)]
    out = oai.chat.completions.create(messages=messages, stop=[stop, "never-seen"], **base)
    assert out.choices[0].message.content == (cut or None) and out.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(messages=messages, stop=stop, stream=True, **base)
        if c.choices
    )
    assert streamed == cut
    greedy = {"extra_body": {"temperature": 0}}
    plain = claude.messages.create(model="tiny", max_tokens=40, messages=messages, **greedy)
    text = plain.content[0].text
    assert len(text) >= 4, text
    stop = text[2:4]
    msg = claude.messages.create(model="tiny", max_tokens=40, messages=messages, stop_sequences=[stop], **greedy)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.find(stop)]
    with claude.messages.stream(model="tiny", max_tokens=40, messages=messages, stop_sequences=[stop], **greedy) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == (
        "stop_sequence",
        stop,
        text[: text.find(stop)],
    )


def test_sampling_parameters_are_honoured_or_refused(server, oai, claude):
    messages = [{"role": "user", "content": "Repeat after me."}]
    base = dict(model="tiny", messages=messages, max_tokens=12, temperature=0, reasoning_effort="low")
    plain = oai.chat.completions.create(**base)
    biased = oai.chat.completions.create(logit_bias={"120": 100}, **base)  # 'x'
    assert biased.usage.completion_tokens >= 1 and biased != plain
    assert "x" * 3 in (biased.choices[0].message.content or "") + (biased.choices[0].message.reasoning_content or "")
    oai.chat.completions.create(frequency_penalty=1.5, presence_penalty=0.5, user="u-1", **base)
    oai.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"top_k": 5, "min_p": 0.1})
    claude.messages.create(
        model="tiny", max_tokens=3, messages=messages, metadata={"user_id": "u-1"}, extra_body={"top_k": 5}
    )
    refused = [
        ({"logit_bias": {"120": 101}}, "logit_bias"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"extra_body": {"guided_json": {}}}, "guided_json"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ]
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**{**base, **extra})
        assert e.value.param.split(".")[0] == param, (extra, e.value.message)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="hi", max_tokens=3, best_of=2)
    assert e.value.param == "best_of"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="tiny",
            max_tokens=3,
            messages=messages,
            tool_choice={"type": "tool", "name": "g"},
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
        )
    assert "tool_choice" in e.value.message


def test_thinking_can_be_turned_off(server, oai):
    messages = [{"role": "user", "content": "No thinking, please."}]
    on = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    assert on.usage.completion_tokens_details.reasoning_tokens > 0
    for off in ({"reasoning_effort": "none"}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
        out = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0, **off)
        assert out.usage.completion_tokens_details.reasoning_tokens == 0, off
        assert not getattr(out.choices[0].message, "reasoning_content", None), off
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=3,
            extra_body={"chat_template_kwargs": {"tools_in_user_message": True}},
        )
    assert e.value.param == "chat_template_kwargs.tools_in_user_message"


def test_streamed_anthropic_usage_reports_cache_reads(server, claude):
    kw = dict(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "cache me " * 12}])
    claude.messages.create(**kw)  # leaves the prompt's prefix cached
    plain = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert plain.usage.cache_read_input_tokens > 0
    assert final.usage.cache_read_input_tokens == plain.usage.cache_read_input_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens


def test_history_accepts_the_reasoning_field_name(server, oai):
    turn = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning": "greet"},
        {"role": "user", "content": "again"},
    ]
    a = httpx.post(server[0] + "/tokenize", json={"messages": turn}, headers={"Authorization": f"Bearer {API_KEY}"})
    turn[1] = {**turn[1], "reasoning_content": turn[1].pop("reasoning")}
    b = httpx.post(server[0] + "/tokenize", json={"messages": turn}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert a.status_code == 200 and a.json()["tokens"] == b.json()["tokens"]
    turn[1] = {"role": "assistant", "content": "hello", "reasoning": 5}  # read, hence checked
    c = httpx.post(server[0] + "/tokenize", json={"messages": turn}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert c.status_code == 400 and c.json()["error"]["param"] == "messages[1].reasoning"


def test_anthropic_budget_tokens_is_an_exact_limit(server, claude):
    """budget_tokens limits thinking tokens exactly (tiers are presets, not a rounding: the router's reasoning-token
    counter moves by the budget, for a random model that never ends thinking by itself); adaptive thinks within the
    documented tier; an unknown thinking.type is a 400 naming it."""

    def reasoning_total() -> float:
        text = httpx.get(server[0] + "/metrics").text
        return float(
            next(line.split()[-1] for line in text.splitlines() if line.startswith("expertmesh_reasoning_tokens_total"))
        )

    low = default_budgets("tiny").low
    for budget in (3, low + 5):
        before = reasoning_total()
        msg = claude.messages.create(
            model="tiny",
            max_tokens=60,
            thinking={"type": "enabled", "budget_tokens": budget},
            messages=[{"role": "user", "content": "Think it over."}],
            extra_body={"temperature": 0},
        )
        assert msg.content[0].type == "thinking" and reasoning_total() - before == budget
    msg = claude.messages.create(
        model="tiny", max_tokens=40, thinking={"type": "adaptive"}, messages=[{"role": "user", "content": "Adapt."}]
    )
    assert msg.content[0].type == "thinking"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="tiny", max_tokens=4, thinking={"type": "sometimes"}, messages=[{"role": "user", "content": "x"}]
        )
    assert "thinking.type" in e.value.message
