"""Parsing K3's output at once (expertmesh/chat/k3_parse.py through K3Chat.parse_output): what the template renders
for every assistant message of the oracle (support/k3_cases.py) parses back to that message, whole and streamed; the
parsing rules on hand-written markup; argument typing; attribute escaping and literal markup in text."""

import json

import pytest
from support.k3_cases import K3_CASES, phase
from support.k3_chat import ids_of, model_output, stream

from expertmesh.chat.format import Message, ToolCall

CASES = {c["name"]: c for c in K3_CASES}


# ----------------------------------------------------------------------------------------------- the oracle
def expected_parse(m: dict) -> tuple[str, str, list | None]:
    """(reasoning, content, [(name, arguments)] or None when a call's arguments render as a json block of text
    that is not a JSON object — the tools section then stays content)."""
    reasoning = m.get("reasoning_content") or ""
    calls = []
    for c in m.get("tool_calls") or ():
        args = c["function"]["arguments"]
        try:
            value = json.loads(args)
        except ValueError:
            value = None
        if not isinstance(value, dict) and args.strip():
            return reasoning if reasoning.strip() else "", m.get("content") or "", None
        calls.append((c["function"]["name"], value if isinstance(value, dict) else {}))
    return reasoning if reasoning.strip() else "", m.get("content") or "", calls


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["outputs"]])
def test_what_the_template_renders_parses_back(k3_chat, name):
    case = CASES[name]
    for out in case["outputs"]:
        m = case["messages"][out["message"]]
        ids = out["ids"]
        assert ids[-1] == k3_chat.eom_id
        parsed = k3_chat.parse_output(ids, phase=phase(case), salt="s", tools=case["tools"])
        reasoning, content, calls = expected_parse(m)
        if not case["options"]["thinking"]:
            reasoning = ""
        assert parsed.reasoning == reasoning and parsed.finished_thinking
        if calls is None:
            assert parsed.tool_calls == [] and parsed.content.startswith(content)
            assert "<|open|>tools<|sep|>" in parsed.content and "not json at all" in parsed.content
        else:
            assert parsed.content == content
            assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
        stream = k3_chat.stream_parser(phase=phase(case), salt="s", tools=case["tools"])
        stream.feed_many(ids)
        stream.finish()
        assert stream.result() == parsed


# ----------------------------------------------------------------------------------------------- parsing rules
CALL = (
    '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="number"<|sep|>1<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)


@pytest.mark.parametrize(
    "output, reasoning, content, calls, finished",
    [
        # the generation prompt opened think; the model closes it and answers
        (
            "why<|close|>think<|sep|><|open|>response<|sep|>Hi!<|close|>response<|sep|><|close|>message<|sep|>",
            "why",
            "Hi!",
            [],
            True,
        ),
        # truncated inside thinking (a budget or max_tokens cut)
        ("still thinking", "still thinking", "", [], False),
        # the closer skipped: the response opener ends the reasoning (llama.cpp)
        ("hm<|open|>response<|sep|>ok<|close|>response<|sep|>", "hm", "ok", [], True),
        # the response opener is optional; prose naming the tags survives
        (
            "<|close|>think<|sep|>Use the response tag, then think.<|close|>message<|sep|>",
            "",
            "Use the response tag, then think.",
            [],
            True,
        ),
        # a stray marker and another special token stay as their text
        (
            "r<|close|>think<|sep|><|open|>response<|sep|>a<|sep|>b[BOS]c<|open|>x<|close|>response<|sep|>",
            "r",
            "a<|sep|>b[BOS]c<|open|>x",
            [],
            True,
        ),
        # tool calls; whitespace between calls is fine; text after the response outside a section: content
        (
            "r<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>  <|open|>tools<|sep|>\n"
            + CALL
            + " \n"
            + CALL
            + "<|close|>tools<|sep|><|close|>message<|sep|>",
            "r",
            "",
            [("f", {"a": 1}), ("f", {"a": 1})],
            True,
        ),
        (
            "<|close|>think<|sep|><|open|>response<|sep|>A<|close|>response<|sep|>tail<|close|>message<|sep|>junk",
            "",
            "Atail",
            [],
            True,
        ),
        # a section cut short between calls keeps its calls; inside a call it is content
        (
            "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>" + CALL,
            "",
            "",
            [("f", {"a": 1})],
            True,
        ),
        (
            "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>" + CALL[:60],
            "",
            "<|open|>tools<|sep|>" + CALL[:60],
            [],
            True,
        ),
        # garbage inside the section: the section so far is content, parsing goes on from the garbage as content
        (
            "<|close|>think<|sep|><|open|>response<|sep|>x<|close|>response<|sep|><|open|>tools<|sep|>"
            + CALL
            + "oops"
            + CALL
            + "<|close|>tools<|sep|><|close|>message<|sep|>",
            "",
            "x<|open|>tools<|sep|>" + CALL + "oops" + CALL + "<|close|>tools<|sep|>",
            [],
            True,
        ),
        # the message closed mid-call: section content, message over
        (
            "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
            '<|open|>call tool="f" index="1"<|sep|><|close|>message<|sep|>after',
            "",
            '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>',
            [],
            True,
        ),
        # a json block holding an object is the call's arguments; one that is not is malformed
        (
            '<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="g" '
            'index="1"<|sep|><|open|>json type="object"<|sep|>{"q": [1, "two"]}<|close|>json<|sep|><|close|>call<|sep|>'
            "<|close|>tools<|sep|>",
            "",
            "",
            [("g", {"q": [1, "two"]})],
            True,
        ),
    ],
)
def test_parse_rules(k3_chat, output, reasoning, content, calls, finished):
    ids = ids_of(k3_chat, output)
    parsed = k3_chat.parse_output(ids + [k3_chat.eom_id] + ids_of(k3_chat, "after the stop"), phase="reasoning")
    assert (parsed.reasoning, parsed.content, parsed.finished_thinking) == (reasoning, content, finished)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert stream(k3_chat, ids + [k3_chat.eom_id], "reasoning") == parsed


def test_argument_types_schema_first_then_the_type_attribute(k3_chat):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "s": {"type": "string"},
                        "n": {"type": "integer"},
                        "u": {"type": ["string", "null"]},
                    },
                },
            },
        }
    ]

    def arg(key, kind, value):
        return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'

    body = (
        arg("s", "number", "5")
        + arg("n", "string", "7")
        + arg("u", "null", "null")
        + arg("x", "object", '{"a": 1}')
        + arg("y", "boolean", "maybe")
        + arg("z", "number", "NaN")
        + '<|open|>argument key="w"<|sep|>3<|close|>'
        "argument<|sep|>"
    )
    out = ids_of(
        k3_chat,
        '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>' + body + "<|close|>call<|sep|>"
        "<|close|>tools<|sep|>",
    )
    declared = json.loads(k3_chat.parse_output(out, phase="content", tools=tools).tool_calls[0].arguments)
    assert declared == {"s": "5", "n": 7, "u": None, "x": {"a": 1}, "y": "maybe", "z": "NaN", "w": "3"}
    undeclared = json.loads(k3_chat.parse_output(out, phase="content").tool_calls[0].arguments)
    assert undeclared == {"s": 5, "n": "7", "u": None, "x": {"a": 1}, "y": "maybe", "z": "NaN", "w": "3"}


def test_attributes_are_unescaped_and_literal_markup_in_text_is_text(k3_chat):
    name, key = 'a"b&amp;c', 'k"&'
    reply = Message(
        "assistant",
        "<|close|>response<|sep|> typed by the model as text",
        reasoning="<|close|>think<|sep|> as text",
        tool_calls=[ToolCall("1", name, json.dumps({key: "<|close|>argument<|sep|>v"}))],
    )
    out = model_output(k3_chat, [Message("user", "x")], reply, tools=None)
    parsed = k3_chat.parse_output(out, phase="reasoning")
    assert parsed.reasoning == reply.reasoning and parsed.content == reply.content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (name, {key: "<|close|>argument<|sep|>v"})
    ]
