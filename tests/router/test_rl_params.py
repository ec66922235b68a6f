"""What RL and eval tools send (#32 item 7), as vLLM honours it, through the official client: `n` parallel samples
(the prompt's KV shared through the prefix cache, each sample its own seeded generator), `ignore_eos`, and
`return_token_ids` — on completions and chat, streamed and not."""

import httpx
import openai
import pytest

from expertmesh.chat.tokenizer import ByteTokenizer
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.router.http import build_app, serve_http

CHUNK = 16
T = ByteTokenizer()


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    d = tiny_checkpoint.path
    engine = build_local_engine(Checkpoint(d), attention_workers=1, expert_workers=2, prefill_chunk=CHUNK)
    port = free_port()
    srv, thread = serve_http(build_app(engine), "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    yield engine, url, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


PROMPT = list(range(40, 40 + 5 * CHUNK + 3))  # five chunks and a tail: a cached prefix of 40 tokens


def test_n_samples_are_the_seeded_single_requests_and_share_the_prompt(served):
    engine, _, client = served
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0)
    before = engine.stats.cached_tokens
    r = client.completions.create(**kw, n=4, seed=11, extra_body={"return_token_ids": True})
    cached = engine.stats.cached_tokens - before
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(**kw, seed=11 + i).choices[0].text for i in range(4)]
    assert [c.text for c in r.choices] == singles  # sample i is seed + i's request, bit for bit
    assert len(set(singles)) > 1
    assert cached >= 3 * 5 * CHUNK  # samples 1..3 started from sample 0's prefix
    # the prompt counted once (the samples share it), every sample's output
    assert r.usage.prompt_tokens == len(PROMPT)
    assert r.usage.completion_tokens == sum(len(c.model_dump()["token_ids"]) for c in r.choices) == 4 * 6


def test_chat_n_streamed_equals_whole(served):
    _, _, client = served
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me about " + "x" * 30}],
        max_tokens=20,
        temperature=0.8,
        seed=3,
        n=3,
    )
    whole = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    got = {i: ["", ""] for i in range(3)}
    for c in client.chat.completions.create(**kw, stream=True):
        for ch in c.choices:
            got[ch.index][0] += getattr(ch.delta, "reasoning_content", None) or ""
            got[ch.index][1] += ch.delta.content or ""
    assert [tuple(got[i]) for i in range(3)] == [
        (c.message.reasoning_content or "", c.message.content or "") for c in whole.choices
    ]
    assert whole.usage.completion_tokens == sum(len(c.model_dump()["token_ids"]) for c in whole.choices)
    assert len({(c.message.reasoning_content, c.message.content) for c in whole.choices}) > 1  # own generators


def test_ignore_eos_generates_to_max_tokens(served):
    _, _, client = served
    eos = T.eos_ids[0]
    kw = dict(model="tiny", prompt="hello", max_tokens=7, temperature=0, logit_bias={str(eos): 100})
    stops = client.completions.create(**kw)
    assert stops.choices[0].finish_reason == "stop" and stops.usage.completion_tokens == 1
    goes_on = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert goes_on.choices[0].finish_reason == "length" and goes_on.usage.completion_tokens == 7


def test_return_token_ids_completions_and_chat(served):
    _, url, client = served
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0].model_dump()
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == r.usage.completion_tokens
    streamed = {"prompt": None, "ids": []}
    for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stream=True, extra_body={"return_token_ids": True}
    ):
        d = c.choices[0].model_dump()
        streamed["prompt"] = streamed["prompt"] or d.get("prompt_token_ids")
        streamed["ids"] += d.get("token_ids") or []
    assert streamed == {"prompt": PROMPT, "ids": choice["token_ids"]}
    messages = [{"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    ).model_dump()
    ids = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert chat["prompt_token_ids"] == ids
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    ids_streamed, prompt = [], None
    for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True, extra_body={"return_token_ids": True}
    ):
        d = c.model_dump()
        prompt = prompt or d.get("prompt_token_ids")
        for ch in d["choices"]:
            ids_streamed += ch.get("token_ids") or []
    assert prompt == ids and ids_streamed == chat["choices"][0]["token_ids"]
