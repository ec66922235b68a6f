"""One chat preparation (router/chat_prep.py) behind every surface: the same conversation — a system prompt, tools,
a thinking effort, a multi-turn history with an assistant turn that reasoned and called a tool, the tool's result —
has one prompt token count on OpenAI `/tokenize`, chat completions' usage, Anthropic count_tokens and messages'
usage, the Responses API's usage and gRPC Chat's usage. Driven by the official clients against an in-process
router (tiny model, one attention and one expert worker); every answer is a few tokens."""

import json

import anthropic
import grpc
import httpx
import openai
import pytest

from expertmesh.chat.thinking import default_budgets
from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.model.config import preset
from expertmesh.protos import chat_pb2, router_pb2_grpc
from expertmesh.router.grpc_service import serve_router_grpc
from expertmesh.router.http import build_app, serve_http

SYSTEM = "You are terse."
NAME, DESCRIPTION = "get_weather", "weather for a city"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
ARGS = json.dumps({"city": "Oslo"})  # as the Anthropic reader renders a tool_use input
ASK, THOUGHT, SAID, RESULT, FOLLOW_UP = "Weather in Oslo?", "look it up", "Checking.", "21 C", "And tomorrow?"
CALL_ID = "call_1"

CHAT_TOOLS = [{"type": "function", "function": {"name": NAME, "description": DESCRIPTION, "parameters": SCHEMA}}]
CHAT_MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": ASK},
    {
        "role": "assistant",
        "content": SAID,
        "reasoning_content": THOUGHT,
        "tool_calls": [{"id": CALL_ID, "type": "function", "function": {"name": NAME, "arguments": ARGS}}],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
    {"role": "user", "content": FOLLOW_UP},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = preset("tiny").model_copy(update={"layer_types": ("kda", "dsa")})  # two layers: a faster step
    ck = create_checkpoint(cfg, tmp_path_factory.mktemp("prep") / "tiny", seed=0)
    engine = build_local_engine(Checkpoint(ck), attention_workers=1, expert_workers=1)
    port = free_port()
    srv, thread = serve_http(build_app(engine), "127.0.0.1", port)
    grpc_server = serve_router_grpc(engine, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_server.bound_port}", engine
    grpc_server.stop(0)
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def tokenize(url: str, **body) -> int:
    r = httpx.post(url + "/tokenize", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def chat_counts(url: str, oai: openai.OpenAI) -> list[int]:
    """/tokenize and chat completions' usage.prompt_tokens."""
    same = {"messages": CHAT_MESSAGES, "tools": CHAT_TOOLS, "reasoning_effort": "low"}
    r = oai.chat.completions.create(model="tiny", max_completion_tokens=2, temperature=0, **same)
    assert r.thinking_budget == "low"
    return [tokenize(url, **same), r.usage.prompt_tokens]


def anthropic_counts(claude: anthropic.Anthropic) -> list[int]:
    """count_tokens and messages' usage (input + cache reads); thinking's budget_tokens picks the low tier."""
    same = {
        "model": "tiny",
        "system": SYSTEM,
        "tools": [{"name": NAME, "description": DESCRIPTION, "input_schema": SCHEMA}],
        "thinking": {"type": "enabled", "budget_tokens": default_budgets("tiny").low},
        "messages": [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": THOUGHT, "signature": ""},
                    {"type": "text", "text": SAID},
                    {"type": "tool_use", "id": CALL_ID, "name": NAME, "input": json.loads(ARGS)},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": CALL_ID, "content": RESULT},
                    {"type": "text", "text": FOLLOW_UP},
                ],
            },
        ],
    }
    counted = claude.messages.count_tokens(**same).input_tokens
    u = claude.messages.create(max_tokens=default_budgets("tiny").low + 1, **same).usage  # above budget_tokens
    return [counted, u.input_tokens + u.cache_read_input_tokens]


def responses_count(client: openai.OpenAI) -> int:
    r = client.responses.create(
        model="tiny",
        instructions=SYSTEM,
        tools=[{"type": "function", "name": NAME, "description": DESCRIPTION, "parameters": SCHEMA}],
        reasoning={"effort": "low"},
        input=[
            {"type": "message", "role": "user", "content": ASK},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": SAID}]},
            {"type": "function_call", "call_id": CALL_ID, "name": NAME, "arguments": ARGS},
            {"type": "function_call_output", "call_id": CALL_ID, "output": RESULT},
            {"type": "message", "role": "user", "content": FOLLOW_UP},
        ],
        max_output_tokens=2,
        temperature=0,
        store=False,
    )
    return r.usage.input_tokens


def grpc_count(target: str) -> int:
    m = chat_pb2.ChatMessage
    call = chat_pb2.ToolCall(id=CALL_ID, name=NAME, arguments=ARGS)
    request = chat_pb2.ChatRequest(
        messages=[
            m(role="system", content=SYSTEM),
            m(role="user", content=ASK),
            m(role="assistant", content=SAID, reasoning=THOUGHT, tool_calls=[call]),
            m(role="tool", content=RESULT, tool_call_id=CALL_ID),
            m(role="user", content=FOLLOW_UP),
        ],
        tools=[chat_pb2.Tool(name=NAME, description=DESCRIPTION, parameters_json=json.dumps(SCHEMA))],
        thinking_budget="low",
    )
    request.params.max_tokens = 2
    with grpc.insecure_channel(target) as channel:
        events = list(router_pb2_grpc.RouterStub(channel).Chat(request, timeout=60))
    finish = events[-1].finish
    assert finish.thinking_budget == "low"
    return finish.usage.prompt_tokens


def test_one_conversation_has_one_token_count_on_every_surface(stack):
    url, target, _ = stack
    oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    counts = {
        "tokenize / chat usage": chat_counts(url, oai),
        "count_tokens / messages usage": anthropic_counts(claude),
        "responses usage": [responses_count(oai)],
        "grpc chat usage": [grpc_count(target)],
    }
    assert len({n for ns in counts.values() for n in ns}) == 1, counts
    # what is counted holds the tools, the history's reasoning and the thinking switch: dropping any changes it
    (n,) = {n for ns in counts.values() for n in ns}
    base = {"messages": CHAT_MESSAGES, "tools": CHAT_TOOLS, "reasoning_effort": "low"}
    assert tokenize(url, **{**base, "tools": None}) < n
    no_thought = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CHAT_MESSAGES]
    assert tokenize(url, **{**base, "messages": no_thought}) < n
    assert tokenize(url, **{**base, "reasoning_effort": "none"}) != n
