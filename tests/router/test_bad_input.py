"""Malformed input, table-driven, across every way in: HTTP bodies (OpenAI and Anthropic), gRPC Generate,
MoEDeployment specs (tests/operator/test_spec_bad_input.py), checkpoints
(tests/checkpoint/test_checkpoint_bad_input.py) and the CLI (tests/entry/test_cli_bad_input.py). Each case asserts the status / exception AND that the message
names what is wrong; after every HTTP and gRPC case the server must still serve a normal request.

Cases marked xfail(strict=True) are known bugs (the reason says what happens and where): they assert the
behaviour that should be, so fixing the bug turns them into XPASS, which fails until the mark is removed.
"""

import json
import time
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import httpx
import pytest
from support.log_filters import ErrorSignatures

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2
from expertmesh.router.grpc_service import serve_router_grpc
from expertmesh.router.http import MAX_BODY_BYTES, build_app, serve_http

USER = [{"role": "user", "content": "hi"}]
CMPL, CHAT, MSGS = "/v1/completions", "/v1/chat/completions", "/v1/messages"


def xfail(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt_dir(tiny_checkpoint_dir):
    return tiny_checkpoint_dir  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.fixture(scope="module")
def stack(ckpt_dir):
    engine = build_local_engine(Checkpoint(ckpt_dir), attention_workers=1, expert_workers=2, max_waiting=16)
    port, grpc_port = free_port(), free_port()
    srv, thread = serve_http(build_app(engine), "127.0.0.1", port)
    grpc_server = serve_router_grpc(engine, "127.0.0.1", grpc_port)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    errors = ErrorSignatures().install()
    yield SimpleNamespace(
        url=f"http://127.0.0.1:{port}", stub=router_pb2_grpc.RouterStub(channel), engine=engine, errors=errors
    )
    errors.uninstall()
    channel.close()
    grpc_server.stop(0)
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def _unwedge(engine) -> None:
    """Drop whatever a case left queued or running, so a wedged request cannot break the next case."""
    for req in list(engine.waiting) + list(engine.running):
        engine.cancel(req)
    deadline = time.monotonic() + 30
    while (engine.num_waiting() or engine.num_running()) and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture
def http_still_serves(stack):
    """After the case, a normal HTTP request must succeed."""
    yield stack
    _unwedge(stack.engine)
    r = httpx.post(stack.url + CMPL, json={"model": "tiny", "prompt": "ok", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, f"the server stopped serving after the case: {r.status_code} {r.text}"


@pytest.fixture
def grpc_still_serves(stack):
    """After the case, a normal gRPC Generate must succeed."""
    yield stack
    _unwedge(stack.engine)
    events = list(
        stack.stub.Generate(
            router_pb2.GenerateRequest(text="ok", params=sampling_pb2.SamplingParams(max_tokens=1)), timeout=60
        )
    )
    assert events[-1].HasField("finish"), "gRPC Generate stopped serving after the case"


# ----------------------------------------------------------------------------------------------- HTTP
@dataclass
class Raw:
    """A request body sent as given (not JSON-encoded by the test)."""

    data: bytes
    content_type: str | None = "application/json"
    chunked: bool = False  # stream it without a Content-Length
    method: str = "POST"


def nested(depth: int) -> bytes:
    return b'{"model":"tiny","prompt":"a","max_tokens":2,"x":' + b"[" * depth + b"]" * depth + b"}"


BIG = {"model": "tiny", "prompt": "a" * (MAX_BODY_BYTES + 2**20), "max_tokens": 2}
GOOD = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
ANSWERED = [
    {"role": "user", "content": "x"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    },
]
NOT_STR_SAFE = "must be a 400 naming the field, not a 500 from an AttributeError/TypeError deep in the template"

TINY_TOP_P = (
    "top_p=1e-46 (> 0, so accepted) → 500 'invalid multinomial distribution': expertmesh/model/sampling.py "
    "Sampler.sample compares float32 probability mass with top_p, which rounds to 0.0 in float32, so "
    "every token is masked; either sample (200) or refuse with 400 naming top_p"
)
BODY_PARSE = (
    "FastAPI's generic body-parse HTTPException ('There was an error parsing the body') escapes "
    "build_app's handlers (router/http.py): the answer is {'detail': ...}, not OpenAI-shaped, and does "
    "not say what is wrong"
)
HTTP_CASES = [
    # --- /v1/completions: fields
    pytest.param(CMPL, {"prompt": "hi"}, 400, ["model", "field required"], id="cmpl-missing-model"),
    pytest.param(CMPL, {"model": 5, "prompt": "hi"}, 400, ["model", "string"], id="cmpl-model-not-a-string"),
    pytest.param(CMPL, {"model": "nope", "prompt": "hi"}, 404, ["model 'nope' not found"], id="cmpl-unknown-model"),
    pytest.param(CMPL, {"model": "tiny", "prompt": {"text": "hi"}}, 400, ["prompt"], id="cmpl-prompt-wrong-type"),
    pytest.param(CMPL, {"model": "tiny", "prompt": ""}, 400, ["prompt", "non-empty"], id="cmpl-empty-prompt"),
    pytest.param(CMPL, {"model": "tiny", "prompt": []}, 400, ["prompt", "at least one token"], id="cmpl-no-tokens"),
    pytest.param(
        CMPL,
        {"model": "tiny", "prompt": [5, 288]},
        400,
        ["prompt", "token id 288", "[0, 288)"],
        id="cmpl-token-outside-vocab",
    ),
    pytest.param(CMPL, {"model": "tiny", "prompt": [-1]}, 400, ["prompt", "token id -1"], id="cmpl-negative-token"),
    pytest.param(
        CMPL,
        {"model": "tiny", "prompt": [1] * 5000},
        400,
        ["prompt", "5000 tokens", "context is 4096"],
        id="cmpl-prompt-over-context",
    ),
    pytest.param(
        CMPL, {"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400, ["max_tokens=-1"], id="cmpl-negative-max-tokens"
    ),
    pytest.param(
        CMPL,
        {"model": "tiny", "prompt": "hi", "max_tokens": 1.5},
        400,
        ["max_tokens", "integer"],
        id="cmpl-fractional-max-tokens",
    ),
    pytest.param(
        CMPL,
        {"model": "tiny", "prompt": "hi", "max_tokens": "ten"},
        400,
        ["max_tokens", "integer"],
        id="cmpl-max-tokens-string",
    ),
    pytest.param(
        CMPL,
        {"model": "tiny", "prompt": "hi", "max_tokens": 10**12, "stream": True},
        400,
        ["max_tokens"],
        id="cmpl-huge-max-tokens",
    ),
    pytest.param(
        CMPL,
        {"model": "tiny", "prompt": "hi", "temperature": -1},
        400,
        ["temperature", "greater than"],
        id="cmpl-negative-temperature",
    ),
    pytest.param(CMPL, {"model": "tiny", "prompt": "hi", "top_p": 0}, 400, ["top_p"], id="cmpl-zero-top-p"),
    pytest.param(
        CMPL,
        {"model": "tiny", "prompt": "hi", "top_p": 1e-46, "max_tokens": 2},
        (200, 400),
        ["top_p"],
        id="cmpl-subnormal-top-p",
    ),
    pytest.param(
        CMPL, {"model": "tiny", "prompt": "hi", "n": 17}, 400, ["n", "less than or equal to 16"], id="cmpl-n-17"
    ),
    pytest.param(
        CMPL, {"model": "tiny", "prompt": "hi", "stop": list("abcde")}, 400, ["stop", "at most 4"], id="cmpl-five-stops"
    ),
    pytest.param(
        CMPL,
        {"model": "tiny", "prompt": "hi", "max_tokens": 2, "seed": 2**70},
        400,
        ["seed"],
        id="cmpl-seed-beyond-int64",
    ),
    pytest.param(
        CMPL, {"model": "tiny", "prompt": "\ud800", "max_tokens": 2}, 400, ["prompt"], id="cmpl-lone-surrogate"
    ),
    # --- /v1/completions: the body itself
    pytest.param(CMPL, Raw(b"not json"), 400, ["json"], id="cmpl-not-json"),
    pytest.param(CMPL, Raw(b""), 400, ["body"], id="cmpl-empty-body"),
    pytest.param(CMPL, Raw(b"[1, 2]"), 400, ["body"], id="cmpl-body-not-an-object"),
    pytest.param(
        CMPL, Raw(b'{"model":"tiny","prompt":"\xff\xfe","max_tokens":2}'), 400, ["utf-8"], id="cmpl-invalid-utf8"
    ),
    pytest.param(CMPL, Raw(nested(10_000)), 400, ["body"], id="cmpl-nested-10000-levels"),
    pytest.param(
        CMPL,
        Raw(b'{"model":"tiny","prompt":"hi","max_tokens":' + b"9" * 5000 + b"}"),
        400,
        ["body"],
        id="cmpl-5000-digit-number",
    ),
    pytest.param(CMPL, Raw(json.dumps(BIG).encode()), 413, ["exceeds the limit"], id="cmpl-oversized-body"),
    pytest.param(
        CMPL, Raw(json.dumps(BIG).encode(), chunked=True), 413, ["exceeds the limit"], id="cmpl-oversized-chunked-body"
    ),
    pytest.param(
        CMPL, Raw(GOOD, content_type="text/plain"), (400, 415), ["content-type"], id="cmpl-wrong-content-type"
    ),
    pytest.param(CMPL, Raw(b"", method="GET"), 405, ["method"], id="cmpl-wrong-method"),
    # --- /v1/chat/completions
    pytest.param(CHAT, {"model": "tiny", "messages": []}, 400, ["messages", "at least 1"], id="chat-no-messages"),
    pytest.param(CHAT, {"model": "tiny", "messages": "hi"}, 400, ["messages", "list"], id="chat-messages-not-list"),
    pytest.param(
        CHAT, {"model": "tiny", "messages": [5]}, 400, ["messages.0", "dictionary"], id="chat-message-not-object"
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
        400,
        ["messages[0].role", "'robot'"],
        id="chat-bad-role",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": [{"content": "x"}]},
        400,
        ["messages[0].role", "None"],
        id="chat-missing-role",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        ["messages[0].content[0]", "URL"],
        id="chat-image-part-without-url",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
        400,
        ["messages[0]", "content[0]", "text"],
        id="chat-non-text-part",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": [{"role": "tool", "content": "x", "tool_call_id": "zz"}]},
        400,
        ["messages[0].tool_call_id", "'zz'"],
        id="chat-unknown-tool-call-id",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": ANSWERED + [{"role": "user", "content": "y"}]},
        400,
        ["tool call 'a' is never answered"],
        id="chat-unanswered-tool-call",
    ),
    pytest.param(
        CHAT,
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "a"}]}],
        },
        400,
        ["messages[1].tool_calls[0]"],
        id="chat-tool-call-without-function",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": "x", "tool_calls": 5}]},
        400,
        ["messages[0].tool_calls"],
        id="chat-tool-calls-not-list",
    ),
    pytest.param(
        CHAT,
        {
            "model": "tiny",
            "messages": [
                {"role": "assistant", "content": "x", "reasoning_content": 5},
                {"role": "user", "content": "y"},
            ],
        },
        400,
        ["messages[0].reasoning_content"],
        id="chat-reasoning-not-string",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": [{"role": "tool", "content": "x", "tool_call_id": ["a"]}]},
        400,
        ["messages[0].tool_call_id"],
        id="chat-tool-call-id-not-string",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]},
        400,
        ["messages[0].content"],
        id="chat-lone-surrogate",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": USER, "reasoning_effort": "extreme"},
        400,
        ["reasoning_effort", "'extreme'"],
        id="chat-bad-reasoning-effort",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": USER, "max_tokens": -5},
        400,
        ["max_tokens=-5"],
        id="chat-negative-max-tokens",
    ),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": USER, "temperature": "hot"},
        400,
        ["temperature"],
        id="chat-temperature-string",
    ),
    # --- /v1/messages (Anthropic shape)
    pytest.param(
        MSGS, {"model": "tiny", "messages": USER}, 400, ["max_tokens", "field required"], id="msgs-missing-max-tokens"
    ),
    pytest.param(
        MSGS,
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
        400,
        ["messages.0.role", "'system'"],
        id="msgs-bad-role",
    ),
    pytest.param(
        MSGS,
        {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
        },
        400,
        ["messages.0.content.0.type", "'document'"],
        id="msgs-unsupported-block",
    ),
    pytest.param(
        MSGS,
        {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        400,
        ["messages.0.content.0.source.type", "base64"],
        id="msgs-image-without-source",
    ),
    pytest.param(
        MSGS,
        {"model": "tiny", "max_tokens": 4, "messages": USER, "temperature": 1.5},
        400,
        ["temperature", "less than or equal to 1"],
        id="msgs-temperature-above-1",
    ),
    pytest.param(
        MSGS,
        {"model": "tiny", "max_tokens": 4, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": -5}},
        400,
        ["budget_tokens"],
        id="msgs-negative-budget-tokens",
    ),
    pytest.param(
        MSGS,
        {"model": "tiny", "max_tokens": 4, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": "lots"}},
        400,
        ["budget_tokens"],
        id="msgs-budget-tokens-string",
    ),
    pytest.param(
        MSGS,
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        ["messages.0.content.0.text"],
        id="msgs-text-not-string",
    ),
]


def send(url: str, path: str, payload, timeout: float = 4.0) -> httpx.Response:
    """POST a case; an error answers at once, so no answer within `timeout` is a hang (an AssertionError)."""
    try:
        if isinstance(payload, Raw):
            headers = {"content-type": payload.content_type} if payload.content_type else {}
            if payload.method != "POST":
                return httpx.request(payload.method, url + path, timeout=timeout)
            content = payload.data
            if payload.chunked:
                content = (payload.data[i : i + 2**16] for i in range(0, len(payload.data), 2**16))
            return httpx.post(url + path, content=content, headers=headers, timeout=timeout)
        if path != MSGS and "max_tokens" not in payload:
            payload = {"max_tokens": 2, **payload}  # keep an accepted request short
        with httpx.stream(
            "POST",
            url + path,
            content=json.dumps(payload),
            timeout=timeout,
            headers={"content-type": "application/json"},
        ) as r:
            if r.status_code == 200 and "text/event-stream" in r.headers.get("content-type", ""):
                return r  # accepted a stream: don't read it (closing cancels the request)
            r.read()
            return r
    except httpx.TimeoutException:
        raise AssertionError(f"no answer within {timeout:.0f}s") from None


def _text(r: httpx.Response) -> str:
    try:
        return r.text
    except httpx.ResponseNotRead:
        return "(a stream, not read)"


def error_message(path: str, r: httpx.Response) -> str:
    """The error's message, checking the body has the API's error shape."""
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(f"error body is not JSON: {r.text[:300]!r}") from None
    if path == MSGS:
        assert body.get("type") == "error" and isinstance(body.get("error"), dict), f"not Anthropic-shaped: {body}"
        assert {"type", "message"} <= set(body["error"]), body
    else:
        assert isinstance(body.get("error"), dict), f"not OpenAI-shaped: {body}"
        assert {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]["message"]


@pytest.mark.parametrize("path, payload, status, needles", HTTP_CASES)
def test_http_bad_input(http_still_serves, path, payload, status, needles):
    stack = http_still_serves
    logged = len(stack.errors.seen)
    r = send(stack.url, path, payload)
    wanted = status if isinstance(status, tuple) else (status,)
    assert r.status_code in wanted, (
        f"status {r.status_code}, expected {status}: {_text(r)[:400]} "
        f"(server logged: {stack.errors.seen[logged:][-1:]})"
    )
    if r.status_code == 200:  # a case that may be served rather than refused
        return
    message = error_message(path, r)
    missing = [n for n in needles if n.lower() not in message.lower()]
    assert not missing, f"message {message!r} does not name {missing}"


# ----------------------------------------------------------------------------------------------- gRPC
G, P, T = router_pb2.GenerateRequest, sampling_pb2.SamplingParams, router_pb2.TokenIds
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
GRPC_CASES = [
    pytest.param(G(), INVALID, ["prompt", "text or token_ids"], id="no-prompt"),
    pytest.param(G(token_ids=T(ids=[])), INVALID, ["prompt: expected at least one token"], id="empty-token-ids"),
    pytest.param(G(text=""), INVALID, ["prompt.text", "non-empty"], id="empty-text"),
    pytest.param(G(token_ids=T(ids=[3, 288])), INVALID, ["token id 288"], id="token-outside-vocab"),
    pytest.param(G(token_ids=T(ids=[1] * 5000)), INVALID, ["5000 tokens", "context is 4096"], id="over-context"),
    pytest.param(G(text="hi", params=P(max_tokens=0)), INVALID, ["params.max_tokens=0"], id="zero-max-tokens"),
    pytest.param(G(text="hi", params=P(max_tokens=-3)), INVALID, ["params.max_tokens=-3"], id="negative-max-tokens"),
    pytest.param(G(text="hi", params=P(temperature=-1)), INVALID, ["params.temperature"], id="negative-temperature"),
    pytest.param(G(text="hi", params=P(top_p=1.5)), INVALID, ["params.top_p=1.5"], id="top-p-above-1"),
    pytest.param(G(model="other", text="hi"), NOT_FOUND, ["model 'other' not found", "'tiny'"], id="unknown-model"),
    pytest.param(G(text="hi", params=P(max_tokens=2, top_k=-1)), INVALID, ["top_k"], id="negative-top-k"),
    pytest.param(
        G(text="hi", params=P(max_tokens=2, temperature=1.0, top_p=1e-46)), None, ["top_p"], id="subnormal-top-p"
    ),
    pytest.param(
        G(text="hi", params=P(max_tokens=2, temperature=float("nan"))), INVALID, ["temperature"], id="nan-temperature"
    ),
    pytest.param(
        G(text="hi", params=P(max_tokens=2, logprobs=1)),
        INVALID,
        ["params.logprobs", "not supported"],
        id="logprobs-not-on-grpc",
    ),
    pytest.param(G(text="hi", params=P(max_tokens=2, min_p=3)), INVALID, ["params.min_p=3"], id="min-p-above-1"),
    pytest.param(
        G(text="hi", params=P(max_tokens=2, logit_bias={999: 1.0})),
        INVALID,
        ["logit_bias", "999"],
        id="logit-bias-outside-vocab",
    ),
]


@pytest.mark.parametrize("request_, code, needles", GRPC_CASES)
def test_grpc_bad_input(grpc_still_serves, request_, code, needles):
    """`code` None: a case that may be served or refused with INVALID_ARGUMENT, but nothing else."""
    if code is None:
        try:
            events = list(grpc_still_serves.stub.Generate(request_, timeout=3))
        except grpc.RpcError as e:
            assert e.code() == INVALID, f"{e.code()}: {e.details()}"
            assert all(n in e.details() for n in needles), e.details()
            return
        assert events[-1].HasField("finish")
        return
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_still_serves.stub.Generate(request_, timeout=3))
    assert e.value.code() == code, f"{e.value.code()}: {e.value.details()}"
    missing = [n for n in needles if n not in e.value.details()]
    assert not missing, f"details {e.value.details()!r} do not name {missing}"
