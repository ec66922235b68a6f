"""The Responses API (router/responses_api.py) driven by the official openai client and the OpenAI Agents SDK
against an in-process router (tiny model, one attention and one expert worker), plus the pure pieces: the
truncation policy (router/truncation.py) and the response store (router/response_store.py).

The tiny synthetic model emits random tokens; where a test needs a tool call or a final answer, a script forces
the generated tokens (the engine's token filter, as thinking budgets force the end of thinking), so the router
sees exactly what a model that calls tools would produce."""

import asyncio
import json

import httpx
import openai
import pytest

from expertmesh.chat.format import Message, ToolCall
from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.model.config import preset
from expertmesh.router.conversation import system_and_rest
from expertmesh.router.http import build_app, serve_http
from expertmesh.router.response_store import ReasoningMemory, ResponseStore, Segment, StoredResponse
from expertmesh.router.server import serving_config
from expertmesh.router.truncation import Piece, plan_truncation, rounds

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": t["name"], "description": t["description"], "parameters": t["parameters"]},
    }
    for t in TOOLS
]
SYSTEM = "You are a careful weather agent. " * 4


class Script:
    """Forces the next requests' generated tokens: each queued list is one request's output."""

    def __init__(self, engine):
        self.queue: list[list[int]] = []
        submit = engine.submit

        def scripted(prompt, params, token_filter=None, **kw):
            if not self.queue:
                return submit(prompt, params, token_filter=token_filter, **kw)
            tokens, at = self.queue.pop(0), [0]

            def force(req, token):
                token = tokens[at[0]] if at[0] < len(tokens) else token
                at[0] += 1
                return token_filter(req, token) if token_filter is not None else token

            return submit(prompt, params, token_filter=force, **kw)

        engine.submit = scripted


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = preset("tiny").model_copy(update={"layer_types": ("kda", "dsa")})  # two layers: a faster step
    ck = create_checkpoint(cfg, tmp_path_factory.mktemp("responses") / "tiny", seed=0)
    engine = build_local_engine(Checkpoint(ck), attention_workers=1, expert_workers=1)
    script = Script(engine)
    port, other = free_port(), free_port()
    srv, thread = serve_http(build_app(engine, response_store=ResponseStore(replica="a")), "127.0.0.1", port)
    srv2, thread2 = serve_http(build_app(engine, response_store=ResponseStore(replica="b")), "127.0.0.1", other)
    from expertmesh.chat.tokenizer import ByteTokenizer

    yield type(
        "Stack",
        (),
        {
            "url": f"http://127.0.0.1:{port}",
            "url_b": f"http://127.0.0.1:{other}",
            "engine": engine,
            "script": script,
            "tok": ByteTokenizer(),
        },
    )
    for s, t in ((srv, thread), (srv2, thread2)):
        s.should_exit = True
        t.join(timeout=10)
    engine.close()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=60)


def tool_call_tokens(tok, reasoning: str, city: str) -> list[int]:
    return (
        tok.encode(reasoning)
        + [tok.think_end_id, tok.tool_call_start_id]
        + tok.encode(f'get_weather\n{{"city": "{city}"}}')
        + [tok.tool_call_end_id, tok.end_id]
    )


def answer_tokens(tok, reasoning: str, text: str) -> list[int]:
    return tok.encode(reasoning) + [tok.think_end_id] + tok.encode(text) + [tok.end_id]


# ----------------------------------------------------------------------------------------------- chains
def responses_chain(stack, client, turns: int) -> list[float]:
    """A tool-calling chain over previous_response_id; returns cached/input per follow-up turn."""
    ratios, prev, prev_input = [], None, 0
    for turn in range(turns):
        stack.script.queue.append(tool_call_tokens(stack.tok, f"s{turn}", f"c{turn}"))
        inp = (
            "What is the weather in Paris, Oslo and Lima?"
            if prev is None
            else [{"type": "function_call_output", "call_id": prev.output[-1].call_id, "output": f"{turn} C"}]
        )
        r = client.responses.create(
            model="tiny",
            instructions=SYSTEM,
            input=inp,
            tools=TOOLS,
            previous_response_id=prev.id if prev else None,
            max_output_tokens=48,
            temperature=0,
        )
        assert r.status == "completed" and r.output[-1].type == "function_call", r.output
        assert r.output[0].type == "reasoning" and r.output[0].content[0].text == f"s{turn}"
        assert json.loads(r.output[-1].arguments) == {"city": f"c{turn}"}
        if prev is not None:
            assert r.usage.input_tokens_details.cached_tokens >= prev_input, (turn, r.usage, prev_input)
            ratios.append(r.usage.input_tokens_details.cached_tokens / r.usage.input_tokens)
            # token-exact: the previous prompt and output, then only the tool result and the generation prompt
            tok = stack.tok
            added = 1 + len(tok.encode(f"{prev.output[-1].call_id}\n{turn} C")) + 1 + 2
            assert r.usage.input_tokens == prev.usage.input_tokens + prev.usage.output_tokens + added
        prev, prev_input = r, r.usage.input_tokens
    return ratios


def chat_chain(stack, oai_chat, turns: int, *, keep_reasoning: bool = True) -> list[float]:
    """The same chain over chat completions, the client sending the history back as text."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris, Oslo and Lima?"},
    ]
    ratios = []
    for turn in range(turns):
        stack.script.queue.append(tool_call_tokens(stack.tok, f"s{turn}", f"c{turn}"))
        r = oai_chat.chat.completions.create(
            model="tiny", messages=messages, tools=CHAT_TOOLS, max_tokens=48, temperature=0
        )
        if turn:
            ratios.append(r.usage.prompt_tokens_details.cached_tokens / r.usage.prompt_tokens)
        m = r.choices[0].message
        call = m.tool_calls[0]
        history = {"role": "assistant", "content": m.content, "tool_calls": [call.model_dump()]}
        if keep_reasoning:
            history["reasoning_content"] = m.reasoning_content
        messages += [history, {"role": "tool", "tool_call_id": call.id, "content": f"{turn + 1} C"}]
    return ratios


def test_tool_chain_over_previous_response_id_caches_the_whole_history_chat_vs_responses(stack, client, capsys):
    """Each follow-up's cached tokens cover at least the whole previous prompt; the closing note's measurement:
    cached/input per follow-up turn of a 5-turn chain, chat completions vs responses (`pytest -s` prints it)."""
    resp = responses_chain(stack, client, 5)
    chat = chat_chain(stack, client, 5)
    with capsys.disabled():
        print("\nturn  chat cached/prompt  responses cached/input")
        for i, (c, r) in enumerate(zip(chat, resp)):
            print(f"{i + 2:>4}  {c:>18.3f}  {r:>21.3f}")
    assert len(resp) == len(chat) == 4 and min(resp) > 0.8


def test_stored_responses_retrieve_list_delete_and_404(stack, client):
    stack.script.queue.append(tool_call_tokens(stack.tok, "look", "Oslo"))
    r = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "weather in Oslo?"}],
        tools=TOOLS,
        max_output_tokens=40,
        temperature=0,
        metadata={"k": "v"},
    )
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output[-1].call_id == r.output[-1].call_id and got.metadata == {"k": "v"}
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "weather in Oslo?"
    # another replica does not hold it: 404 naming the owner (route follow-ups by the id's replica part)
    other = openai.OpenAI(base_url=stack.url_b + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model="tiny", input="and now?", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["code"] == "previous_response_not_found" and "replica 'a'" in e.value.body["message"]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    # store: false keeps nothing
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"truncation": "middle"}, "truncation"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"background": True}, "background"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ],
)
def test_parameters_are_honoured_or_refused_naming_them(stack, extra, param):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(stack.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_near_valid_input_items_get_an_answer_or_a_400_never_a_5xx(stack):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    junk = st.one_of(
        st.none(),
        st.integers(-2, 2),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
    )
    text = st.one_of(st.text(max_size=8), st.just("\ud800"))
    part = st.one_of(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["input_text", "output_text", "refusal"]), "text": st.one_of(text, junk)}
        ),
        junk,
    )
    content = st.one_of(text, st.lists(part, max_size=2), junk)
    item = st.one_of(
        st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(["user", "assistant", "developer", "tool"]), junk)},
            optional={"type": st.just("message"), "content": content, "id": st.one_of(text, junk)},
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call")},
            optional={
                "call_id": st.one_of(st.just("call_a"), junk),
                "name": st.one_of(text, junk),
                "arguments": st.one_of(st.just("{}"), text, junk),
                "id": junk,
            },
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call_output")},
            optional={"call_id": st.one_of(st.just("call_a"), junk), "output": content},
        ),
        st.fixed_dictionaries(
            {"type": st.just("reasoning")},
            optional={"content": st.lists(part, max_size=1), "id": st.one_of(text, junk)},
        ),
        junk,
    )
    body = st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "input": st.one_of(text, st.lists(item, max_size=4)),
            "max_output_tokens": st.just(2),
        },
        optional={
            "stream": st.booleans(),
            "instructions": st.one_of(text, junk),
            "previous_response_id": st.one_of(st.just("resp_a_" + "0" * 24), junk),
        },
    )
    seen = []

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=body)
    def run(body):
        r = httpx.post(
            stack.url + "/v1/responses",
            content=json.dumps(body).encode("utf-8", "surrogatepass"),
            headers={"content-type": "application/json"},
            timeout=60,
        )
        seen.append(r.status_code)
        assert r.status_code < 500, (body, r.text[:300])

    run()
    assert 200 in seen and 400 in seen, seen


# ----------------------------------------------------------------------------------------------- streaming
def test_stream_event_order_and_the_completed_response(stack, client):
    tok = stack.tok
    stack.script.queue.append(
        tok.encode("hmm")
        + [tok.think_end_id]
        + tok.encode("Looking.")
        + [tok.tool_call_start_id]
        + tok.encode('get_weather\n{"city": "Lima"}')
        + [tok.tool_call_end_id, tok.end_id]
    )
    events = list(
        client.responses.create(
            model="tiny", input="weather in Lima?", tools=TOOLS, stream=True, max_output_tokens=48, temperature=0
        )
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ], collapsed
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "hmm" and final.output[1].content[0].text == "Looking."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Looking."
    assert final.usage.output_tokens == 3 + 1 + 8 + 1 + 28 + 2
    assert final.usage.output_tokens_details.reasoning_tokens == 4  # "hmm" + the end-of-thinking token
    stored = client.responses.retrieve(final.id)
    assert stored.output[-1].arguments == '{"city": "Lima"}'


# ----------------------------------------------------------------------------------------------- truncation
def test_truncation_auto_keeps_a_40_turn_chain_inside_the_window_while_disabled_refuses(stack, client, monkeypatch):
    window, max_out = 640, 16
    monkeypatch.setattr(stack.engine, "cfg", serving_config(stack.engine.cfg, max_context=window))
    tok = stack.tok
    tools = [{"type": "function", "name": "w", "parameters": {}}]
    call = [tok.think_end_id, tok.tool_call_start_id] + tok.encode("w\n{}") + [tok.tool_call_end_id, tok.end_id]

    def chain(policy: str):
        prev, reports = None, []
        for turn in range(40):
            stack.script.queue.append(call)
            inp = (
                "Weather everywhere, one city per step."
                if prev is None
                else [
                    {
                        "type": "function_call_output",
                        "call_id": prev.output[-1].call_id,
                        "output": f"city {turn}: sunny, 20 C, light wind from the west, humidity 40%",
                    }
                ]
            )
            raw = client.responses.with_raw_response.create(
                model="tiny",
                input=inp,
                tools=tools,
                previous_response_id=prev.id if prev else None,
                max_output_tokens=max_out,
                temperature=0,
                truncation=policy,
            )
            prev = raw.parse()
            assert prev.output[-1].type == "function_call"
            assert prev.usage.input_tokens + max_out <= window
            reports.append(prev.model_extra.get("truncation_report"))
            assert (raw.headers.get("x-expertmesh-truncation") is not None) == (reports[-1] is not None)
        return reports

    with pytest.raises(openai.BadRequestError) as e:
        chain("disabled")
    assert e.value.body["code"] == "context_length_exceeded"
    stack.script.queue.clear()
    reports = chain("auto")
    assert len(reports) == 40 and reports[0] is None
    changed = [r for r in reports if r]
    assert all(r["dropped_rounds"] > 0 and r["input_tokens_after"] <= r["input_tokens_before"] for r in changed)
    assert len(changed) <= 40 // 3 + 1  # cut by more than needed: the next turns fit and hit the cache


def test_truncation_auto_on_chat_completions_is_opt_in(stack, client, monkeypatch):
    monkeypatch.setattr(stack.engine, "cfg", serving_config(stack.engine.cfg, max_context=200))
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(8):
        messages += [
            {"role": "user", "content": f"question {i} " * 4},
            {"role": "assistant", "content": f"answer {i} " * 4, "reasoning_content": "r"},
        ]
    messages.append({"role": "user", "content": "last question"})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=16, extra_body={"truncation": "auto"}
    )
    report = json.loads(r.headers["x-expertmesh-truncation"])
    assert report["dropped_rounds"] > 0 and r.parse().usage.prompt_tokens + 16 <= 200


def test_plan_truncation_on_crafted_histories():
    # user, then rounds of (assistant call, tool result); the last round is the one being answered
    roles = ["user"] + ["assistant", "tool"] * 5
    assert rounds(roles) == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    pieces = [Piece(r, 10 if r != "tool" else 50, 5 if r == "tool" else None) for r in roles]
    total = 20 + sum(p.tokens for p in pieces)  # 20 fixed: header + generation prompt
    assert plan_truncation(pieces, fixed=20, limit=total).changed is False
    p = plan_truncation(pieces, fixed=20, limit=total - 60)  # two oldest tool results shortened
    assert p.shortened == [2, 4] and not p.dropped and p.tokens <= total - 60
    p = plan_truncation(pieces, fixed=20, limit=160)  # shorten the three old ones, drop rounds
    assert p.dropped == [0, 1, 2, 3, 4] and p.dropped_rounds == 2 and p.tokens <= 160 and p.shortened == [6]
    assert all(i >= 7 for i in p.keep if pieces[i].role == "tool" and i not in p.shortened)  # last rounds whole
    p = plan_truncation(pieces, fixed=20, limit=80)  # only the last round fits
    assert p.fits and p.keep == [9, 10]
    assert not plan_truncation(pieces, fixed=20, limit=79).fits  # the last round alone is too long
    p = plan_truncation(pieces, fixed=20, limit=total - 1, target=total - 100)  # past the limit: to the target
    assert p.shortened == [2, 4, 6] and p.tokens <= total - 100
    p = plan_truncation(pieces, fixed=20, limit=160, target=100)  # target out of reach: the limit
    assert p.dropped == [0, 1, 2, 3, 4] and p.tokens <= 160


def test_response_store_is_bounded_by_count_bytes_and_ttl():
    now = [0.0]
    store = ResponseStore(max_responses=3, max_bytes=10_000, ttl=100, replica="x", clock=lambda: now[0])

    def put(n_tokens=10):
        rid = store.new_id()
        seg = Segment(Message("assistant", "a"), list(range(n_tokens)), (f"msg_{rid}",))
        store.put(StoredResponse(rid, {"id": rid}, [], [seg]))
        return rid

    ids = [put() for _ in range(4)]
    assert store.get(ids[0]) is None and all(store.get(i) for i in ids[1:])  # count bound, LRU
    store.get(ids[1])
    ids.append(put())
    assert store.get(ids[2]) is None and store.get(ids[1]) is not None  # recently used stays
    big = put(2200)  # ~9.8 KB (4 bytes a token, texts, the object): the rest goes
    assert store.get(big) is not None and len(store) == 1 and store.bytes <= 10_000
    now[0] = 101
    assert store.get(big) is None and len(store) == 0  # TTL
    assert ResponseStore.replica_of(store.new_id()) == "x"


def test_reasoning_memory_fills_what_clients_drop():
    mem = ReasoningMemory(max_entries=2)
    before = [Message("user", "q")]
    mem.remember(
        before, Message("assistant", "", reasoning="think", tool_calls=[ToolCall("call_1", "f", "{}")]), [1, 2, 3]
    )
    mem.remember([Message("user", "other")], Message("assistant", "", reasoning="elsewhere"))
    stripped = before + [Message("assistant", "", tool_calls=[ToolCall("call_1", "f", "{}")])]
    assert mem.fill(stripped) == [None, [1, 2, 3]] and stripped[1].reasoning == "think"  # exact tokens
    edited = before + [Message("assistant", "", reasoning="edited", tool_calls=[ToolCall("call_1", "f", "{}")])]
    assert mem.fill(edited) == [None, None] and edited[1].reasoning == "edited"  # what the client sent
    other = before + [Message("assistant", "", tool_calls=[ToolCall("call_2", "f", "{}")])]
    assert mem.fill(other) == [None, None] and other[1].reasoning is None
    # an empty answer is matched by the conversation it answered, not by its (empty) text alone
    empty = [Message("user", "other"), Message("assistant", ""), Message("user", "q"), Message("assistant", "")]
    mem.fill(empty)
    assert empty[1].reasoning == "elsewhere" and empty[3].reasoning is None


def test_instructions_and_a_leading_developer_message_both_reach_the_system_prompt():
    system, rest = system_and_rest([Segment(Message("system", "dev")), Segment(Message("user", "u"))], "ins")
    assert system == "ins\n\ndev" and [s.role for s in rest] == ["user"]
    assert system_and_rest([Segment(Message("user", "u"))], None)[0] is None


# ----------------------------------------------------------------------------------------------- clients
def test_chat_client_that_strips_reasoning_gets_the_same_tokens(stack, client):
    stack.script.queue.append(tool_call_tokens(stack.tok, "first I think", "Rome"))
    messages = [{"role": "user", "content": "weather in Rome?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS, max_tokens=48, temperature=0)
    m = r.choices[0].message
    assert m.reasoning_content == "first I think"

    def follow_up(keep: bool):
        history = {"role": "assistant", "content": m.content, "tool_calls": [c.model_dump() for c in m.tool_calls]}
        if keep:
            history["reasoning_content"] = m.reasoning_content
        conv = messages + [history, {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "21 C"}]
        ids = httpx.post(stack.url + "/tokenize", json={"messages": conv, "tools": CHAT_TOOLS}).json()["tokens"]
        r2 = client.chat.completions.create(model="tiny", messages=conv, tools=CHAT_TOOLS, max_tokens=12, temperature=0)
        out = r2.choices[0].message
        return ids, r2.usage.prompt_tokens, out.reasoning_content, out.content

    kept, stripped = follow_up(True), follow_up(False)
    assert stripped == kept
    assert "first I think" in stack.tok.decode(stripped[0])
    # turned off, the stripped history is a different prompt
    app = build_app(stack.engine, reasoning_memory=False)
    from fastapi.testclient import TestClient

    history = {"role": "assistant", "content": m.content, "tool_calls": [c.model_dump() for c in m.tool_calls]}
    conv = messages + [history, {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "21 C"}]
    ids = TestClient(app).post("/tokenize", json={"messages": conv, "tools": CHAT_TOOLS}).json()["tokens"]
    assert len(ids) < len(kept[0])


def test_agents_sdk_responses_model_runs_a_tool_using_agent(stack):
    """The SDK's default model (OpenAIResponsesModel over the default client) runs a tool-using agent, plain and
    streamed; it sends the history back as items, and ours keep their exact tokens: all of it is cached."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(
        openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0), use_for_tracing=False
    )
    agents.set_default_openai_api("responses")
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        calls.append(city)
        return f"{city}: 18 C"

    tok = stack.tok
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the tool.",
        tools=[get_weather],
        model="tiny",
        model_settings=agents.ModelSettings(temperature=0, max_tokens=48),
    )
    stack.script.queue += [
        tool_call_tokens(tok, "need the tool", "Paris"),
        answer_tokens(tok, "got it", "Paris is 18 C."),
        tool_call_tokens(tok, "again", "Oslo"),
        answer_tokens(tok, "ok", "Oslo is 18 C."),
    ]

    async def both():  # one event loop: the client's connections belong to it
        result = await agents.Runner.run(agent, "What is the weather in Paris?")
        streamed = agents.Runner.run_streamed(agent, "And in Oslo?")
        kinds = [e.type async for e in streamed.stream_events()]
        return result, streamed, kinds

    result, streamed, kinds = asyncio.run(both())
    assert calls == ["Paris", "Oslo"] and result.final_output == "Paris is 18 C."
    first, second = result.raw_responses
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert streamed.final_output == "Oslo is 18 C." and "raw_response_event" in kinds
