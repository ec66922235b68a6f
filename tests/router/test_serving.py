"""The serving layer's pure parts (router/serving.py, errors.py, messages.py): what a request's parameters mean,
decided once for every API; the one error table; the one message parser."""

import queue

import pytest

from expertmesh.chat.format import ChatError
from expertmesh.chat.thinking import default_budgets
from expertmesh.router.chat_prep import Thinking, decide_thinking, max_tokens_for, prompt_room
from expertmesh.router.errors import KINDS, APIError, as_api_error
from expertmesh.router.messages import ANTHROPIC, OPENAI, RESPONSES, openai_messages, read_content, remote_image_urls
from expertmesh.router.request import ContextLengthExceeded, EngineClosed, QueueFull, RequestError

BUDGETS = default_budgets("tiny")


@pytest.mark.parametrize(
    "kw, want",
    [
        ({}, Thinking(True, "high")),
        ({"reasoning_effort": "low"}, Thinking(True, "low")),
        ({"reasoning_effort": "medium"}, Thinking(True, "high")),
        ({"reasoning_effort": "high"}, Thinking(True, "max")),
        ({"reasoning_effort": "none"}, Thinking(False, "high")),
        ({"thinking_budget": "max", "reasoning_effort": "low"}, Thinking(True, "max")),
        ({"template_kwargs": {"enable_thinking": False}}, Thinking(False, "high")),
        ({"template_kwargs": {"thinking": True}, "reasoning_effort": "low"}, Thinking(True, "low")),
        ({"disable": True}, Thinking(False, "high")),
        ({"anthropic": {}}, Thinking(False, "high")),
        ({"anthropic": {"type": "adaptive"}}, Thinking(True, "high")),
        ({"anthropic": {"type": "enabled", "budget_tokens": BUDGETS.low + 1}}, Thinking(True, "high", BUDGETS.low + 1)),
        ({"anthropic": {"type": "enabled", "budget_tokens": 3}, "thinking_budget": "max"}, Thinking(True, "max")),
    ],
)
def test_every_way_of_asking_for_thinking_is_read_once(kw, want):
    assert decide_thinking(budgets=BUDGETS, **kw) == want


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": "extreme", "effort_param": "reasoning.effort"}, "reasoning.effort"),
        ({"reasoning_effort": ["low"]}, "reasoning_effort"),
        ({"thinking_budget": "huge", "reasoning_effort": "low"}, "thinking_budget"),
        ({"thinking_budget": "low", "reasoning_effort": "none"}, "thinking_budget"),
        ({"thinking_budget": "low", "disable": True}, "thinking_budget"),
        ({"template_kwargs": {"tools_in_user_message": True}}, "chat_template_kwargs.tools_in_user_message"),
        ({"template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
        ({"anthropic": {"type": "sometimes"}}, "thinking.type"),
        ({"anthropic": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens"),
        ({"anthropic": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens"),
    ],
)
def test_thinking_refusals_name_the_field(kw, param):
    with pytest.raises(APIError) as e:
        decide_thinking(budgets=BUDGETS, **kw)
    assert e.value.param == param and e.value.message.startswith(param) and e.value.status == 400


def test_thinking_limits():
    assert Thinking(True, "max").limit(BUDGETS) == BUDGETS.max
    assert Thinking(True, "high", 3).limit(BUDGETS) == 3
    assert Thinking(False, "max").limit(BUDGETS) == BUDGETS.low  # a template that cannot turn thinking off


def test_max_tokens_has_one_default_and_one_range():
    assert max_tokens_for(None, prompt_tokens=100, context=4096) == 3996  # chat: what the context leaves
    assert max_tokens_for(None, prompt_tokens=5000, context=4096) == 1  # the engine then names the prompt
    assert max_tokens_for(None, chat=False) == 16  # text completion: OpenAI's 16
    assert max_tokens_for(7, prompt_tokens=100, context=4096) == 7
    assert max_tokens_for(0, chat=False, scoring=True) == 0  # echo: score the prompt only
    for value, kw, needle in [
        (0, {}, "max_tokens=0: expected a positive integer"),
        (-1, {"chat": False, "scoring": False}, "(0 only with echo: score the prompt)"),
        (0, {"chat": False, "param": "params.max_tokens"}, "params.max_tokens=0"),
    ]:
        with pytest.raises(APIError) as e:
            max_tokens_for(value, **kw)
        assert needle in e.value.message and e.value.param == kw.get("param", "max_tokens")
    assert prompt_room(4096, None) == 4095 and prompt_room(4096, 96) == 4000


def test_one_table_for_every_wire():
    e = as_api_error(QueueFull("waiting queue full"))
    assert (e.status, e.type, e.anthropic_body()["error"]["type"], e.grpc_code, e.code) == (
        429,
        "rate_limit_error",
        "rate_limit_error",
        "RESOURCE_EXHAUSTED",
        "queue_full",
    )
    e = as_api_error(EngineClosed("closing"))
    assert (e.status, e.type, e.anthropic_body()["error"]["type"], e.grpc_code) == (
        503,
        "service_unavailable",
        "overloaded_error",
        "UNAVAILABLE",
    )
    e = as_api_error(
        ContextLengthExceeded("prompt: 9 tokens", prompt_tokens=9, max_tokens=1, context=8, param="prompt")
    )
    assert (e.status, e.param, e.code, e.grpc_code) == (400, "prompt", "context_length_exceeded", "INVALID_ARGUMENT")
    assert as_api_error(RequestError("logit_bias: token id 999 outside [0, 288)")).param == "logit_bias"
    assert as_api_error(RequestError("max_tokens=0: expected")).param == "max_tokens"
    assert as_api_error(ChatError("messages[1].tool_call_id: 'x' answers no")).param == "messages[1].tool_call_id"
    assert as_api_error(queue.Empty()).grpc_code == "DEADLINE_EXCEEDED"
    e = as_api_error(KeyError("x"))
    assert (e.status, e.type, e.grpc_code) == (500, "server_error", "INTERNAL") and "KeyError" in e.message
    assert APIError.of_status(415, "unsupported").status == 415
    assert {k.status for k in KINDS.values()} >= {400, 401, 404, 413, 429, 500, 503}


def test_one_parser_for_every_dialect():
    assert read_content("hi", "messages[0].content", OPENAI) == ("hi", None)
    assert read_content(
        [{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}], "input[0].content", RESPONSES
    ) == ("ab", None)
    for content, d, where, needle in [
        ([{"type": "audio"}], OPENAI, "messages[0].content", "messages[0].content[0].type: 'audio'"),
        (
            [{"type": "text", "text": 5}],
            OPENAI,
            "messages[0].content",
            "messages[0].content[0].text: expected a string",
        ),
        ([{"type": "refusal"}], RESPONSES, "input[2].content", "input[2].content[0].type: 'refusal'"),
        ([{"type": "document"}], ANTHROPIC, "messages.1.content", "messages.1.content.0.type: 'document'"),
        (5, OPENAI, "messages[0].content", "messages[0].content: expected a string or a list"),
        ("\ud800", OPENAI, "messages[0].content", "messages[0].content: not valid Unicode"),
    ]:
        with pytest.raises(APIError) as e:
            read_content(content, where, d)
        assert e.value.message.startswith(needle) and e.value.param == e.value.message.split(":")[0]
    msgs = openai_messages(
        [
            {"role": "developer", "content": None},
            {
                "role": "assistant",
                "content": "x",
                "reasoning": "r",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}],
            },
        ]
    )
    assert [m.role for m in msgs] == ["system", "assistant"] and msgs[1].reasoning == "r"
    assert msgs[1].tool_calls[0].arguments == '{"a": 1}'
    urls = remote_image_urls(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "http://h/a"}},
                    {"type": "image_url", "image_url": "data:x"},
                ],
            }
        ],
        OPENAI,
    )
    assert urls == {"messages[0].content[0]": "http://h/a"}
    urls = remote_image_urls(
        [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://h/b"}}]}], ANTHROPIC
    )
    assert urls == {"messages.0.content.0": "https://h/b"}
