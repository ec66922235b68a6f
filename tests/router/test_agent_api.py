"""#15 "agent APIs that keep their word", driven by the official openai / anthropic clients and a plain gRPC stub
against one multi-process deployment with a small serving context (--max-context), so that requests without
max_tokens (which now run to the end of the context) stay short on random tiny weights."""

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import grpc
import httpx
import jsonschema
import openai
import pytest

from expertmesh.entry.cluster import LocalCluster, free_port
from expertmesh.protos import chat_pb2, router_pb2_grpc, sampling_pb2

API_KEY = "sk-test-agent-api"
CONTEXT = 384  # room for a rendered list of two tools (the byte tokenizer: one token per byte) and a call


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint_dir):
    ck = tiny_checkpoint_dir
    c = LocalCluster(
        ck,
        attention_workers=1,
        expert_workers=2,
        http_port=free_port(),
        grpc_port=free_port(),
        extra_env={"EXPERTMESH_API_KEY": API_KEY},
        router_args=["--max-context", str(CONTEXT)],
    )
    with c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def prompt_of(oai, n_tokens: int) -> tuple[list[dict], int]:
    """The longest user message of repeated words whose rendered chat prompt (thinking off) is at most `n_tokens`
    long, and that length (from /tokenize; bisection over the word count)."""

    def render(words: int):
        msgs = [{"role": "user", "content": " ".join(["lorem", "ipsum", "dolor"][i % 3] for i in range(words))}]
        r = httpx.post(
            str(oai.base_url).removesuffix("/v1/") + "/tokenize",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": "tiny", "messages": msgs, "chat_template_kwargs": {"enable_thinking": False}},
        )
        if r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded":
            return msgs, CONTEXT + 1  # /tokenize refuses a prompt past the context
        return msgs, r.json()["count"]

    lo, hi = 1, n_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if render(mid)[1] <= n_tokens else (lo, mid - 1)
    return render(lo)


def test_models_report_the_serving_context(oai):
    assert oai.models.list().data[0].model_extra["max_model_len"] == CONTEXT


def test_near_context_prompt_without_max_tokens_runs_to_the_context(oai):
    msgs, n = prompt_of(oai, CONTEXT - 6)
    out = oai.chat.completions.create(
        model="tiny", messages=msgs, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert out.usage.prompt_tokens == n > CONTEXT - 12
    # before #15 the default was a fixed 256 > the context left: a 400; now it is what the context leaves
    if out.choices[0].finish_reason == "length":
        assert out.usage.prompt_tokens + out.usage.completion_tokens == CONTEXT
    else:
        assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens <= CONTEXT - n


def test_over_context_is_context_length_exceeded_with_the_counts(oai):
    msgs = [{"role": "user", "content": "lorem ipsum dolor " * CONTEXT}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=msgs, temperature=0)
    assert err.value.code == "context_length_exceeded"
    assert str(CONTEXT) in err.value.message and "tokens" in err.value.message
    msgs, n = prompt_of(oai, CONTEXT - 6)
    with pytest.raises(openai.BadRequestError) as err:  # fits alone, not with the max_tokens asked for
        oai.chat.completions.create(
            model="tiny",
            messages=msgs,
            temperature=0,
            max_tokens=CONTEXT - n + 1,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    assert err.value.code == "context_length_exceeded" and f"({n} tokens)" in err.value.message


def test_stop_string_cuts_the_content(oai):
    base = dict(
        model="tiny",
        messages=[{"role": "user", "content": "count"}],
        temperature=0,
        max_tokens=12,
        reasoning_effort="none",
    )
    full = oai.chat.completions.create(**base).choices[0].message.content
    assert full and len(full) >= 4, full
    stop = next(full[i : i + 2] for i in range(len(full) // 2, len(full) - 1) if full.index(full[i : i + 2]) > 0)
    cut = oai.chat.completions.create(**base, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.index(stop)]


def test_logprobs_present_and_logit_bias_changes_the_output(oai):
    base = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=5,
        reasoning_effort="none",
        logprobs=True,
        top_logprobs=2,
    )
    plain = oai.chat.completions.create(**base).choices[0]
    assert len(plain.logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in plain.logprobs.content)
    assert all(t.logprob <= 0 for t in plain.logprobs.content)
    forced = oai.chat.completions.create(**base, logit_bias={"100": 100}).choices[0]
    tokens = [t.token for t in forced.logprobs.content]
    assert len(set(tokens)) == 1 and tokens != [t.token for t in plain.logprobs.content]
    penal = oai.chat.completions.create(**base, logit_bias={"100": 5}, frequency_penalty=2.0).choices[0]
    assert [t.token for t in penal.logprobs.content] != tokens  # the penalty breaks the repetition the bias made


def test_count_tokens_equals_usage(cluster):
    client = anthropic.Anthropic(base_url=cluster.http_url, api_key=API_KEY, max_retries=0, timeout=60)
    req = dict(model="tiny", system="be brief", messages=[{"role": "user", "content": "hello there"}])
    counted = client.messages.count_tokens(**req).input_tokens
    out = client.messages.create(**req, max_tokens=4)
    assert counted == out.usage.input_tokens + out.usage.cache_read_input_tokens + (
        out.usage.cache_creation_input_tokens or 0
    )


def test_grpc_chat_without_deadline_streams_and_reflection_v1(cluster):
    key = [("authorization", f"Bearer {API_KEY}")]
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        req = chat_pb2.ChatRequest(
            messages=[chat_pb2.ChatMessage(role="user", content="hi")],
            params=sampling_pb2.SamplingParams(max_tokens=4, temperature=0),
        )
        events = list(router_pb2_grpc.RouterStub(ch).Chat(req, metadata=key))  # no timeout=: no client deadline
        assert events[-1].HasField("finish") and len(events) >= 2
        with pytest.raises(grpc.RpcError) as err:  # sampling limits checked as on HTTP
            list(
                router_pb2_grpc.RouterStub(ch).Chat(
                    chat_pb2.ChatRequest(
                        messages=[chat_pb2.ChatMessage(role="user", content="hi")],
                        params=sampling_pb2.SamplingParams(max_tokens=4, temperature=-1),
                    ),
                    metadata=key,
                )
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # honoured or refused naming it: the format's stop tokens end a chat
            list(
                router_pb2_grpc.RouterStub(ch).Chat(
                    chat_pb2.ChatRequest(
                        messages=[chat_pb2.ChatMessage(role="user", content="hi")],
                        params=sampling_pb2.SamplingParams(max_tokens=4, stop_token_ids=[5]),
                    ),
                    metadata=key,
                )
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.stop_token_ids" in err.value.details()
        out = list(
            router_pb2_grpc.RouterStub(ch).Chat(
                chat_pb2.ChatRequest(  # logit_bias is honoured ('x')
                    messages=[chat_pb2.ChatMessage(role="user", content="hi")],
                    disable_thinking=True,
                    params=sampling_pb2.SamplingParams(max_tokens=4, temperature=0, logit_bias={120: 100}),
                ),
                metadata=key,
            )
        )
        assert "".join(e.content_delta for e in out) == "xxxx"
        from grpc_reflection.v1alpha import reflection_pb2

        # v1 is the v1alpha messages under a new package: call it by its v1 path with the same codecs
        info = ch.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        reply = next(iter(info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
        names = {s.name for s in reply.list_services_response.service}
        assert {
            "expertmesh.v1.Router",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names


def test_history_with_undecodable_output_keeps_the_prefix_cache(oai):
    """Turn 1's answer is a lone UTF-8 continuation byte (id 128 of the byte tokenizer), returned as U+FFFD, which
    re-tokenizes to other bytes (EF BF BD): the router's memory of the exact ids must still render it as generated,
    so turn 2's prompt is turn 1's prompt + output token for token and the prefix cache covers both."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    first = [{"role": "user", "content": "say it"}]
    one = oai.chat.completions.create(
        model="tiny", messages=first, temperature=0, max_tokens=24, logit_bias={"128": 100}, extra_body=off
    )
    answer = one.choices[0].message.content
    assert answer and set(answer) == {"\ufffd"}, answer
    turn2 = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and?"}]
    two = oai.chat.completions.create(model="tiny", messages=turn2, temperature=0, max_tokens=1, extra_body=off)
    print(one.usage, two.usage)
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens + one.usage.completion_tokens - 16


# ------------------------------------------------------------------------------ constrained decoding (#15)
# random tiny weights: only the grammar makes these outputs valid JSON / parseable calls
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["x", "ok"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
}  # as OpenAI's strict mode requires: else the object may run on
OTHER = {
    "type": "function",
    "function": {
        "name": "g",
        "parameters": {
            "type": "object",
            "properties": {"s": {"enum": ["a", "b"]}},
            "required": ["s"],
            "additionalProperties": False,
        },
    },
}


def point_request(seed: int, **kw) -> dict:
    return dict(
        model="tiny",
        messages=[{"role": "user", "content": "a point"}],
        max_tokens=60,
        seed=seed,
        temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}},
        **kw,
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_validates(oai, seed):
    out = oai.chat.completions.create(
        **point_request(seed, reasoning_effort="low")
    )  # the grammar starts after thinking
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), POINT)


def test_json_object_gives_an_object(oai):
    out = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "json"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body=OFF,
    )
    choice = out.choices[0]
    if choice.finish_reason == "length":  # an open-ended object may not close in 40 tokens: then say so
        assert choice.message.content.startswith("{")
    else:
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "g"}}])
def test_forced_tool_call_parses_and_validates(oai, choice):
    # no max_tokens: the ~20 tokens the two rendered tools leave of the context (a call takes ~15)
    out = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "go"}],
        temperature=0.7,
        seed=5,
        tools=[TOOL, OTHER],
        tool_choice=choice,
        extra_body=OFF,
    )
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    call = c.message.tool_calls[0].function
    if isinstance(choice, dict):
        assert call.name == "g"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (TOOL, OTHER)}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)


def test_anthropic_tool_choice_any_forces_a_valid_call(cluster):
    client = anthropic.Anthropic(base_url=cluster.http_url, api_key=API_KEY, max_retries=0, timeout=60)
    tool = {"name": "f", "input_schema": TOOL["function"]["parameters"]}
    out = client.messages.create(
        model="tiny",
        max_tokens=30,
        messages=[{"role": "user", "content": "go"}],
        tools=[tool],
        tool_choice={"type": "any"},
        thinking={"type": "disabled"},
    )
    assert out.stop_reason == "tool_use", out
    use = [b for b in out.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "f"
    jsonschema.validate(use[0].input, tool["input_schema"])


def test_uncompilable_schema_or_tool_is_a_400_naming_it(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            **point_request(1, extra_body=OFF)
            | {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}}
        )
    assert e.value.param == "response_format.json_schema.schema" and "nope" in e.value.message
    bad = {
        "type": "function",
        "function": {"name": "h", "parameters": {"type": "object", "properties": {"n": {"type": 7}}}},
    }
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "go"}],
            max_tokens=4,
            tools=[TOOL, bad],
            tool_choice="required",
        )
    assert e.value.param == "tools.1.function.parameters", e.value.message


def test_langchain_with_structured_output(cluster):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        ok: bool

    llm = ChatOpenAI(
        model="tiny",
        base_url=cluster.http_url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=40,
        max_retries=0,
        extra_body=OFF,
    )
    point = llm.with_structured_output(Point, method="json_schema").invoke("a point")
    assert isinstance(point, Point)


def test_grammar_is_batch_invariant(oai):
    """Greedy json_schema output alone equals the same request decoded in a batch with other (constrained and
    free) requests: each row's mask comes from its own matcher."""
    req = point_request(7) | {"temperature": 0, "max_tokens": 30, "extra_body": OFF}
    alone = oai.chat.completions.create(**req).choices[0].message.content
    others = [
        dict(
            model="tiny",
            messages=[{"role": "user", "content": "other " * i}],
            max_tokens=20,
            temperature=0,
            extra_body=OFF,
        )
        for i in (1, 2)
    ] + [point_request(8, extra_body=OFF) | {"max_tokens": 30}]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(oai.chat.completions.create, **r) for r in [req] + others]
        batched = futures[0].result().choices[0].message.content
        for f in futures[1:]:
            f.result()
    assert batched == alone
    jsonschema.validate(json.loads(alone), POINT)
