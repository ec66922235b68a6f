"""Router hardening round 2 (#33, findings 9, 11, 12) on a user-style checkpoint served in process: constrained
decoding with the checkpoint's own tokenizer.json, forced tool calls on checkpoint chat templates (Hermes, Kimi,
DeepSeek), and stored responses that belong to the key that created them. Each test failed on the main it was
written against."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
from support.hf_fixtures import DEEPSEEK, DEEPSEEK_TOKENS, KIMI, KIMI_TOOL_TOKENS, build_large_bpe, write_checkpoint

from expertmesh.chat.grammar import Constraint, ll_tokenizer
from expertmesh.chat.load import load_chat

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    """A tiny model under a user-style checkpoint: a 32k byte-level BPE tokenizer.json and a Hermes (ChatML,
    `<tool_call>`) chat template, served in process over HTTP."""
    import openai

    from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
    from expertmesh.entry.cluster import free_port
    from expertmesh.entry.local import build_local_engine
    from expertmesh.model.config import preset
    from expertmesh.router.http import build_app, serve_http

    tk = build_large_bpe(32_000)
    cfg = preset("tiny").model_copy(update={"vocab_size": tk.get_vocab_size() + 14})
    d = create_checkpoint(cfg, tmp_path_factory.mktemp("hermes") / "ckpt", seed=0)
    write_checkpoint(d, tokenizer=tk, generation_eos=["<|im_end|>", "</s>"])
    chat = load_chat(d, model_vocab_size=cfg.vocab_size)
    engine = build_local_engine(Checkpoint(d), max_waiting=8, max_queue_wait=120)
    port = free_port()
    srv, thread = serve_http(build_app(engine, chat=chat), "127.0.0.1", port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    yield client, engine, chat
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def test_json_schema_on_a_checkpoint_with_its_own_tokenizer_json_validates_within_seconds(hermes):
    """#11: building the grammar tokenizer from a tokenizer.json raised AttributeError (no decode_bytes) inside
    OpenSequence, the engine kept retrying, and the request got 429 after the 300 s queue wait."""
    client, engine, chat = hermes
    for effort in ("none", "low"):
        start = time.monotonic()
        r = client.chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "Weather in Paris as JSON?"}],
            max_tokens=64,
            temperature=0,
            reasoning_effort=effort,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
        )
        assert time.monotonic() - start < 30
        jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)


def test_a_failed_grammar_setup_reaches_the_client_at_once(hermes, monkeypatch):
    """#11: nothing may wait silently on a failed setup — a worker that cannot build its grammar tokenizer refuses
    the request itself, and the client hears of it at once (it waited out the queue before)."""
    import openai

    from expertmesh.worker import attention

    client, engine, _ = hermes

    def broken(tok):
        raise AttributeError("'CheckpointTokenizer' object has no attribute 'decode_bytes'")

    monkeypatch.setattr(attention, "ll_tokenizer", broken)
    for worker in engine.attention:  # the in-process AttentionWorker behind its metrics wrapper
        monkeypatch.setattr(worker._client, "_lltok", None, raising=False)
    start = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        client.with_options(timeout=30).chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "JSON please"}],
            max_tokens=8,
            reasoning_effort="none",
            response_format={"type": "json_object"},
        )
    assert time.monotonic() - start < 10
    assert "grammar" in str(e.value) and "decode_bytes" in str(e.value)


def test_tool_choice_required_and_named_return_a_valid_call_on_a_hermes_template(hermes):
    """#12: the Hermes format was detected (tool_open) but tool_close never was, so every forced call was refused
    with "forcing a tool call needs a chat format with tool-call marker tokens"."""
    client, engine, chat = hermes
    assert chat.markers.tool_close == chat.tokenizer.special("</tool_call>")
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = client.chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=96,
            temperature=0,
            reasoning_effort="none",
        )
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        if isinstance(choice, dict):
            assert calls[0].function.name == "get_time"
        jsonschema.validate(json.loads(calls[0].function.arguments), schema[calls[0].function.name])
    # streamed: the call comes back structured, no markup in the content
    chunks = list(
        client.chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=96,
            temperature=0,
            reasoning_effort="none",
            stream=True,
        )
    )
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)


@pytest.mark.parametrize("template,extra", [(KIMI, KIMI_TOOL_TOKENS), (DEEPSEEK, DEEPSEEK_TOKENS)])
def test_forced_call_grammar_spells_each_section_format(tmp_path, template, extra):
    """#12, the other template formats: the forced call's grammar is the format's own markup, which parses back as
    the call."""
    from expertmesh.chat.format import Message
    from expertmesh.router.constraints import answer_grammar

    fmt = load_chat(write_checkpoint(tmp_path, template=template, extra_special=extra))
    assert fmt.markers.tool_close == fmt.tokenizer.special(fmt.tool_format.close)
    grammar = answer_grammar(fmt, "required", TOOLS[:1])
    call = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
    }
    from expertmesh.router.messages import openai_messages

    reply = openai_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])[0]
    history = [Message("user", "Weather in Paris?")]
    prompt = fmt.render(history, tools=TOOLS[:1], thinking=False).ids
    full = fmt.render_ids(
        fmt.template_messages(history + [reply]), tools=TOOLS[:1], add_generation_prompt=False, thinking=False
    )
    out = full[len(prompt) - 1 :] if full[: len(prompt) - 1] == prompt[:-1] else full[len(prompt) :]
    start = out.index(fmt.markers.tool_open)
    end = out.index(fmt.markers.tool_close) + 1
    c = Constraint(ll_tokenizer(fmt.tokenizer), grammar, "tools")
    for t in out[start:end]:
        assert c.allowed()[t], fmt.tokenizer.decode([t], skip_special=False)
        c.advance(t)
    assert c.matcher.is_accepting()
    parsed = fmt.parse_output(out[start:end] + [fmt.markers.end_of_turn], phase="content")
    assert [(x.name, json.loads(x.arguments)) for x in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})
    ]


def test_stored_responses_belong_to_the_key_that_created_them(hermes):
    """#9: with keys that differ (a router that accepts any key), any key holder with an id could read, delete
    or continue another's stored response."""
    import httpx

    client, engine, _ = hermes
    url = str(client.base_url).rstrip("/")
    body = {"model": engine.model_name, "max_output_tokens": 1, "input": "hi", "reasoning": {"effort": "none"}}

    def h(key):
        return {"authorization": f"Bearer {key}"} if key else {}

    created = httpx.post(f"{url}/responses", json=body, headers=h("key-alice"), timeout=60).json()
    rid = created["id"]
    item = created["output"][0]["id"]
    for key, status in (("key-bob", 404), ("", 404), ("key-alice", 200)):
        assert httpx.get(f"{url}/responses/{rid}", headers=h(key)).status_code == status, key
        assert httpx.get(f"{url}/responses/{rid}/input_items", headers=h(key)).status_code == status, key
        follow = httpx.post(f"{url}/responses", json={**body, "previous_response_id": rid}, headers=h(key), timeout=60)
        assert follow.status_code == status, (key, follow.text)
    # another key's output item ids are not this server's to it: sent back, they are rendered from their text
    assert (
        httpx.post(
            f"{url}/responses",
            json={
                **body,
                "input": [
                    {"type": "message", "role": "user", "content": "hi"},
                    {
                        "id": item,
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "x"}],
                    },
                    {"type": "message", "role": "user", "content": "again"},
                ],
            },
            headers=h("key-bob"),
            timeout=60,
        ).status_code
        == 200
    )
    assert httpx.delete(f"{url}/responses/{rid}", headers=h("key-bob")).status_code == 404
    assert httpx.delete(f"{url}/responses/{rid}", headers=h("key-alice")).status_code == 200
