"""Parsing K3's output incrementally (expertmesh/chat/k3_stream.py through K3Chat.stream_parser): the stream equals
the whole-output parser for every prefix, every tokenization and malformed or damaged markup (hypothesis); a tag
that never ends does not hold the stream; 16 streams at once give what they give one at a time."""

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.k3_chat import ids_of, model_output, stream

from expertmesh.chat.format import Message, ToolCall
from expertmesh.chat.k3 import K3Chat
from expertmesh.chat.k3_markup import MAX_TAG_BYTES

HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


text_st = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
tricky_st = st.sampled_from(
    [
        "<|open|>",
        "<|close|>think<|sep|>",
        "response",
        "think",
        '"',
        "&amp;",
        "&",
        "\n",
        " ",
        "  ",
        "é",
        "日本",
        "🌍",
        "{}",
        "<|sep|>",
        'index="1"',
    ]
)
rich_text = st.lists(st.one_of(text_st, tricky_st), max_size=6).map("".join)
json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    rich_text,
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text_st, inner, max_size=3)),
    max_leaves=6,
)
long_text = st.tuples(rich_text, st.integers(200, 1500)).map(lambda t: (t[0] or "ß") * t[1])  # several KB
key_st = st.text(st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=20)
args_st = st.dictionaries(key_st, st.one_of(json_value, long_text), max_size=4)
reply_st = st.builds(
    lambda content, reasoning, calls: Message(
        "assistant",
        content,
        reasoning=reasoning,
        tool_calls=[ToolCall(f"id{i}", name, json.dumps(a, ensure_ascii=False)) for i, (name, a) in enumerate(calls)],
    ),
    rich_text,
    st.one_of(st.none(), rich_text, long_text),
    st.lists(st.tuples(key_st.filter(bool), args_st), max_size=3),
)


def retokenize(k3_chat: K3Chat, ids: list[int], explode: list[bool]) -> list[int]:
    """The same output in another tokenization: chosen text tokens split into their single bytes (tags split
    across tokens, characters split across tokens)."""
    tok, out = k3_chat.tokenizer, []
    for k, t in enumerate(ids):
        if t < tok.n_base and explode[k % len(explode)]:
            out += [tok.encoding.encode_single_token(bytes([b])) for b in tok.token_bytes(t)]
        else:
            out.append(t)
    return out


@HYPOTHESIS
@given(
    reply=reply_st, thinking=st.booleans(), explode=st.lists(st.booleans(), min_size=1, max_size=7), cut=st.floats(0, 1)
)
def test_streaming_equals_parsing_for_every_prefix_and_tokenization(k3_chat, reply, thinking, explode, cut):
    ph = "reasoning" if thinking else "content"
    out = retokenize(k3_chat, model_output(k3_chat, [Message("user", "go")], reply, thinking=thinking), explode)
    parsed = k3_chat.parse_output(out, phase=ph, salt="h")
    assert stream(k3_chat, out, ph, salt="h") == parsed
    # the message comes back whole, whatever the tokenization
    assert parsed.content == reply.content
    assert parsed.reasoning == (reply.reasoning if thinking and reply.reasoning and reply.reasoning.strip() else "")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in reply.tool_calls
    ]
    # any prefix (a cut anywhere: mid-tag, mid-character) parses as the stream of that prefix does, and what a
    # stream emitted before the cut is never taken back
    k = int(cut * len(out))
    assert stream(k3_chat, out[:k], ph, salt="h") == k3_chat.parse_output(out[:k], phase=ph, salt="h")
    p = k3_chat.stream_parser(phase=ph, salt="h")
    early = p.feed_many(out[:k])
    for kind in ("reasoning", "content"):
        assert getattr(parsed, kind).startswith("".join(t for k2, t in early if k2 == kind))


def soup_pieces(k3_chat: K3Chat) -> list[list[int]]:
    t, o, c, s = k3_chat.tokenizer, k3_chat.open_id, k3_chat.close_id, k3_chat.sep_id
    words = [
        "think",
        "response",
        "tools",
        'call tool="f" index="1"',
        'argument key="a" type="number"',
        'argument key="b" type="string"',
        'json type="object"',
        "message",
        "call",
        "argument",
        "json",
        " ",
        "\n",
        "1",
        '{"a": 1}',
        "x",
        "é",
        'call index="2"',
        "bad tag!",
    ]
    return (
        [[o], [c], [s], [t.special("[BOS]")], [t.special("<|media_pad|>")], [t.vocab_size + 5]]
        + [t.encode_plain(w) for w in words]
        + [[0xE6], [0x97]]
    )  # lone UTF-8 bytes


@HYPOTHESIS
@given(
    picks=st.lists(st.integers(0, 10**6), max_size=60),
    ph=st.sampled_from(["reasoning", "content", "maybe"]),
    tools=st.booleans(),
)
def test_streaming_equals_parsing_on_malformed_markup(k3_chat, picks, ph, tools):
    pieces = soup_pieces(k3_chat)
    ids = [i for k in picks for i in pieces[k % len(pieces)]]
    tools = (
        [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "string"}}}}}]
        if tools
        else None
    )
    assert stream(k3_chat, ids, ph, tools, salt="m") == k3_chat.parse_output(ids, phase=ph, salt="m", tools=tools)


@HYPOTHESIS
@given(reply=reply_st, edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=4))
def test_streaming_equals_parsing_on_damaged_outputs(k3_chat, reply, edits):
    out = model_output(k3_chat, [Message("user", "go")], reply)
    pieces = soup_pieces(k3_chat)
    for where, what in edits:
        at = where % (len(out) + 1)
        out = out[:at] + pieces[what % len(pieces)] + out[at + (what % 2) :]  # insert, or replace one token
    assert stream(k3_chat, out, "reasoning", salt="d") == k3_chat.parse_output(out, phase="reasoning", salt="d")


def test_a_tag_that_never_ends_is_text_and_does_not_hold_the_stream(k3_chat):
    long = k3_chat.tokenizer.encode_plain("x" * (MAX_TAG_BYTES + 50))
    ids = [k3_chat.open_id] + long + [k3_chat.sep_id]
    p = k3_chat.stream_parser(phase="content")
    emitted = p.feed_many(ids[:-1])
    assert "".join(t for _, t in emitted) == "<|open|>" + "x" * (MAX_TAG_BYTES + 50)
    assert stream(k3_chat, ids, "content") == k3_chat.parse_output(ids, phase="content")
    # at the limit: a blank "tag" after the response is markup (kept); one byte more, its text is blank (dropped)
    after = ids_of(k3_chat, "A<|close|>response<|sep|>")
    results = []
    for n in (MAX_TAG_BYTES, MAX_TAG_BYTES + 1):
        ids = after + [k3_chat.open_id] + k3_chat.tokenizer.encode_plain(" " * n) + [k3_chat.sep_id]
        results.append(k3_chat.parse_output(ids, phase="content").content)
        assert stream(k3_chat, ids, "content").content == results[-1]
    assert results == ["A<|open|>" + " " * MAX_TAG_BYTES + "<|sep|>", "A<|open|><|sep|>"]


def test_sixteen_concurrent_streams_give_what_they_give_alone(k3_chat):
    """vLLM #54701 (empty tool_calls with 6–14 streams at once) and SGLang #23363 (long arguments dropped): 16
    streams interleaved token by token in threads, long arguments, each equal to its run alone."""
    rng = random.Random(7)
    replies = [
        Message(
            "assistant",
            f"reply {n} " + "é" * rng.randrange(50),
            reasoning=f"r{n} " * rng.randrange(1, 200),
            tool_calls=[
                ToolCall(
                    f"c{n}_{j}",
                    f"tool_{n}",
                    json.dumps(
                        {
                            "code": "".join(rng.choice('abc日本 \n{}"<>|') for _ in range(rng.randrange(2000, 6000))),
                            "n": n,
                            "j": j,
                        },
                        ensure_ascii=False,
                    ),
                )
                for j in range(n % 3 + 1)
            ],
        )
        for n in range(16)
    ]
    outputs = [model_output(k3_chat, [Message("user", "go")], r) for r in replies]
    alone = [stream(k3_chat, o, "reasoning", salt=str(n)) for n, o in enumerate(outputs)]
    barrier = threading.Barrier(16)

    def run(n: int):
        barrier.wait()
        p = k3_chat.stream_parser(phase="reasoning", salt=str(n))
        for t in outputs[n]:
            p.feed(t)
        p.finish()
        return p.result(), k3_chat.parse_output(outputs[n], phase="reasoning", salt=str(n))

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, range(16)))
    for n, (streamed, parsed) in enumerate(together):
        assert streamed == parsed == alone[n]
        assert [json.loads(c.arguments) for c in streamed.tool_calls] == [
            json.loads(c.arguments) for c in replies[n].tool_calls
        ]
