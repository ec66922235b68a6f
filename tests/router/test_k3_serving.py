"""Kimi K3 through the router's APIs (#32 items 4–6): a tiny K3 checkpoint (tests/k3_checkpoint.py, its TikToken
vocabulary and XTML chat format) served in process over HTTP and gRPC with the official client.

- `/tokenize` with a chat request returns exactly what Kimi-K3.jinja renders (tests/data/k3/chat_cases.json, made
  by scripts/k3_chat_oracle.py from llama.cpp's template) and what the chat endpoint feeds;
- the thinking tier reaches the prompt as K3's thinking_effort, and the tier's token cap is enforced by the
  worker's sampler, which closes K3's six-token thinking section whole; `reasoning_effort: "auto"` picks the tier
  per round and says so;
- constrained decoding forces K3's own tool-call markup and JSON answers;
- streamed and whole answers are the same, alone or 16 at a time.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from support.k3_cases import K3_CASES
from support.k3_checkpoint import write_k3_checkpoint

from expertmesh.chat.load import load_chat
from expertmesh.chat.thinking import ThinkingBudgets
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.router.chat_prep import ChatInput, ThinkingAsk, prepare_chat
from expertmesh.router.http import build_app, serve_http
from expertmesh.router.messages import openai_messages

BUDGETS = (16, 24, 32)  # low / high / max reasoning tokens: the close alone is 10 in the test vocabulary
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    d = write_k3_checkpoint(tmp_path_factory.mktemp("k3serve") / "k3", experts="mxfp4", seed=0)
    ckpt = Checkpoint(d)
    cfg = ckpt.cfg
    chat = load_chat(d, model_vocab_size=cfg.vocab_size)
    engine = build_local_engine(ckpt, serving_cfg=cfg, max_waiting=64)
    port = free_port()
    srv, thread = serve_http(
        build_app(engine, chat=chat, thinking_budgets=ThinkingBudgets(*BUDGETS)), "127.0.0.1", port
    )
    url = f"http://127.0.0.1:{port}"
    yield {
        "url": url,
        "chat": chat,
        "engine": engine,
        "client": openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120),
    }
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def tokenize_request(case: dict) -> dict:
    """The chat-cases options as a /tokenize (= chat) request: a tier is thinking_budget, thinking off is
    reasoning_effort none."""
    o = case["options"]
    body = {"messages": case["messages"], "tools": case["tools"]}
    if not o["thinking"]:
        body["reasoning_effort"] = "none"
    else:
        body["thinking_budget"] = o["thinking_effort"]
    for key in ("tool_choice", "response_format"):
        if o[key] is not None:
            body[key] = o[key]
    return body


TOKENIZE_CASES = [
    c
    for c in K3_CASES
    if c["options"]["add_generation_prompt"]
    and not c["images"]
    and not (c["options"]["thinking"] and c["options"]["thinking_effort"] is None)
]


@pytest.mark.parametrize("case", TOKENIZE_CASES, ids=[c["name"] for c in TOKENIZE_CASES])
def test_tokenize_equals_the_reference_template(k3, case):
    """Kimi-K3.jinja's rendering through the checkpoint's own tokenizer, token for token (a request always
    states its tier: the router's default is `high`, so the template's no-effort case is left out)."""
    r = httpx.post(k3["url"] + "/tokenize", json=tokenize_request(case), timeout=60)
    if len(case["ids"]) > k3["engine"].cfg.max_context:  # /tokenize refuses it, saying how long it renders
        assert r.status_code == 400 and f"messages: {len(case['ids'])} tokens" in r.json()["error"]["message"]
        assert rendered_in_process(k3, tokenize_request(case)) == case["ids"]
        return
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == case["ids"]


def rendered_in_process(k3, body: dict) -> list[int]:
    """What /tokenize renders for `body`, prepared here without the serving context's bound."""
    chat = ChatInput.of_messages(
        openai_messages(body["messages"]),
        thinking=ThinkingAsk(body.get("thinking_budget"), body.get("reasoning_effort")),
        tools=body.get("tools"),
        tool_choice=body.get("tool_choice"),
        response_format=body.get("response_format"),
    )
    return prepare_chat(k3["chat"], chat, budgets=ThinkingBudgets(*BUDGETS), context=2**20).prompt


def test_tokenize_counts_what_the_chat_endpoint_feeds(k3):
    case = next(c for c in K3_CASES if c["name"] == "unicode, quotes and ampersands")
    body = tokenize_request(case)
    ids = httpx.post(k3["url"] + "/tokenize", json=body, timeout=60).json()["tokens"]
    r = k3["client"].chat.completions.create(
        model=k3["engine"].model_name,
        max_tokens=2,
        temperature=0,
        messages=body["messages"],
        tools=body["tools"],
        extra_body={"thinking_budget": case["options"]["thinking_effort"]},
    )
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("tier, limit", [("low", BUDGETS[0]), ("high", BUDGETS[1])])
def test_the_tier_cap_closes_thinking_whole(k3, tier, limit):
    """A random model never closes thinking itself: the sampler cuts it at the tier's cap with K3's whole close,
    and the answer follows as content."""
    r = k3["client"].chat.completions.create(
        model=k3["engine"].model_name,
        temperature=0,
        max_tokens=limit + 8,
        messages=[{"role": "user", "content": "Hello, who are you?"}],
        extra_body={"thinking_budget": tier},
    )
    assert r.usage.completion_tokens_details.reasoning_tokens == limit
    assert r.choices[0].message.reasoning_content and r.choices[0].message.content


def test_streamed_equals_whole_alone_and_sixteen_at_once(k3):
    client, name = k3["client"], k3["engine"].model_name
    prompts = [[{"role": "user", "content": f"Question {i}: the weather in city {i}?"}] for i in range(16)]

    def whole(messages):
        m = (
            client.chat.completions.create(
                model=name,
                messages=messages,
                max_tokens=24,
                temperature=0,
                tools=[WEATHER],
                extra_body={"thinking_budget": "low"},
            )
            .choices[0]
            .message
        )
        return (
            m.reasoning_content or "",
            m.content or "",
            [(c.function.name, c.function.arguments) for c in m.tool_calls or []],
        )

    def streamed(messages):
        reasoning, content = "", ""
        for c in client.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=24,
            temperature=0,
            tools=[WEATHER],
            stream=True,
            extra_body={"thinking_budget": "low"},
        ):
            if c.choices:
                d = c.choices[0].delta
                reasoning += getattr(d, "reasoning_content", None) or ""
                content += d.content or ""
        return reasoning, content

    alone = [whole(p) for p in prompts[:4]]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(whole, prompts))
        streams = list(pool.map(streamed, prompts))
    assert together[:4] == alone
    assert streams == [(r, c) for r, c, _ in together]  # tool-call markup is held back from the stream


def test_forced_tool_call_is_k3_markup_and_validates(k3):
    schema = WEATHER["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = k3["client"].chat.completions.create(
            model=k3["engine"].model_name,
            temperature=0,
            max_tokens=300,
            tools=[WEATHER],
            tool_choice=choice,
            messages=[{"role": "user", "content": "Weather in Paris for 2 days?"}],
            extra_body={"thinking_budget": "low"},
        )
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather"
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schema)


def test_response_format_json_schema_validates(k3):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    r = k3["client"].chat.completions.create(
        model=k3["engine"].model_name,
        temperature=0,
        max_tokens=80,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        extra_body={"thinking_budget": "low"},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_auto_tier_plans_high_and_continues_low_and_says_so(k3):
    """reasoning_effort auto: a new task is a planning round (high), a round answering tool results is low; the
    header names the choice and the prompt states it as K3's thinking_effort."""
    case = next(c for c in K3_CASES if c["name"] == "unicode, quotes and ampersands")
    after_tools = [m for m in case["messages"]]
    while after_tools[-1]["role"] != "tool":
        after_tools.pop()
    for messages, tier in ((case["messages"], "high"), (after_tools, "low")):
        body = {
            "model": k3["engine"].model_name,
            "messages": messages,
            "tools": case["tools"],
            "max_tokens": 2,
            "temperature": 0,
            "reasoning_effort": "auto",
        }
        r = httpx.post(k3["url"] + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-expertmesh-thinking"].startswith(f"{tier}; auto: ")
        assert r.json()["thinking_budget"] == tier
        explicit = httpx.post(
            k3["url"] + "/tokenize",
            timeout=60,
            json={"messages": messages, "tools": case["tools"], "thinking_budget": tier},
        ).json()["tokens"]
        auto = httpx.post(
            k3["url"] + "/tokenize",
            timeout=60,
            json={"messages": messages, "tools": case["tools"], "reasoning_effort": "auto"},
        ).json()["tokens"]
        assert auto == explicit and r.json()["usage"]["prompt_tokens"] == len(explicit)
