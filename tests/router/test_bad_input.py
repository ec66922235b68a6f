"""Malformed input, table-driven, across every way in: HTTP bodies (OpenAI and Anthropic), gRPC Generate,
MoEDeployment specs, checkpoints and the CLI. Each case asserts the status / exception AND that the message
names what is wrong; after every HTTP and gRPC case the server must still serve a normal request.

Cases marked xfail(strict=True) are known bugs (the reason says what happens and where): they assert the
behaviour that should be, so fixing the bug turns them into XPASS, which fails until the mark is removed.
"""

import json
import logging
import shutil
import time
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from expertmesh.checkpoint.files import CheckpointError
from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
from expertmesh.entry.cli import main
from expertmesh.entry.local import build_local_engine
from expertmesh.entry.up import free_port
from expertmesh.model.config import preset
from expertmesh.operator.spec import GIB, SpecError, parse_spec, resolve_model
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2
from expertmesh.router.grpc_service import serve_router_grpc
from expertmesh.router.http import MAX_BODY_BYTES, build_app, serve_http

USER = [{"role": "user", "content": "hi"}]
CMPL, CHAT, MSGS = "/v1/completions", "/v1/chat/completions", "/v1/messages"


def xfail(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return create_checkpoint(preset("tiny"), tmp_path_factory.mktemp("bad") / "tiny", seed=0)


class ErrorSignatures(logging.Filter):
    """Drops the server's logged exceptions (keeping `Type: message` of each) so that no thread formats their
    tracebacks: CPython 3.11's traceback carets call ast.parse, whose recursion guard is not thread-safe, and a
    server thread formatting one while pytest parses a test's source raises "SystemError: AST constructor
    recursion depth mismatch" (an INTERNALERROR). A logger filter, as pytest attaches its capture handlers to
    every logger; the 5xx themselves are asserted through the responses."""

    LOGGERS = ("uvicorn.error", "expertmesh.router", "grpc._server")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def filter(self, record) -> bool:
        if not record.exc_info:
            return True
        e = record.exc_info[1]
        self.seen.append(f"{type(e).__name__}: {e}")
        return False

    def install(self) -> "ErrorSignatures":
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def uninstall(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


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


# ----------------------------------------------------------------------------------------------- MoEDeployment
def tiny_spec() -> dict:
    return {
        "model": {"preset": "tiny", "checkpoint": {"pvc": {"claimName": "weights", "path": "/ckpt"}}},
        "attentionWorkers": {"gpusPerPod": 0},
        "expertWorkers": {"replicas": 2, "gpusPerPod": 0, "reserveGiB": 0, "gpuMemoryGiB": 2**20 / GIB},
    }


SPEC_CASES = [
    pytest.param(
        {"expertWorkers": {"replicas": -1}},
        ["spec.expertWorkers.replicas", "greater than or equal to 1", "-1"],
        id="negative-expert-replicas",
    ),
    pytest.param({"attentionWorkers": {"replicas": 0}}, ["spec.attentionWorkers.replicas"], id="zero-attention"),
    pytest.param({"router": {"replicas": -2}}, ["spec.router.replicas"], id="negative-router-replicas"),
    pytest.param(
        {"expertWorkers": {"replicas": "two"}}, ["spec.expertWorkers.replicas", "valid integer"], id="replicas-string"
    ),
    pytest.param(
        {"model": {"preset": "huge", "checkpoint": {"uri": "/x"}}}, ["spec.model.preset", "'huge'"], id="unknown-preset"
    ),
    pytest.param(
        {"model": {"preset": "tiny", "config": {}, "checkpoint": {"uri": "/x"}}},
        ["spec.model", "exactly one of model.preset and model.config"],
        id="preset-and-config",
    ),
    pytest.param(
        {"model": {"config": {"hidden_size": -1}, "checkpoint": {"uri": "/x"}}},
        ["spec.model.config.hidden_size", "greater than 0"],
        id="bad-inline-config",
    ),
    pytest.param(
        {"thinking": {"low": 0, "high": 5, "max": 9}},
        ["spec.thinking.low", "greater than 0"],
        id="zero-thinking-budget",
    ),
    pytest.param(
        {"thinking": {"low": 9, "high": 5, "max": 20}},
        ["spec.thinking", "low <= high <= max"],
        id="thinking-out-of-order",
    ),
    pytest.param(
        {"thinking": {"low": 1, "high": 5}}, ["spec.thinking.max", "Field required"], id="thinking-missing-max"
    ),
    pytest.param(
        {"thinking": {"low": "lots", "high": 5, "max": 9}}, ["spec.thinking.low", "'lots'"], id="thinking-not-a-number"
    ),
    pytest.param(
        {"kv": {"maxContext": 10**6}}, ["spec.kv.maxContext=1000000", "max_context=4096"], id="context-beyond-model"
    ),
    pytest.param(
        {"kv": {"maxContext": 10**9}}, ["spec.kv.maxContext", "less than or equal to"], id="context-beyond-the-schema"
    ),
    pytest.param({"kv": {"blockSize": 0}}, ["spec.kv.blockSize"], id="zero-block-size"),
    pytest.param(
        {"expertWorkers": {"reserveGiB": 5.0, "gpuMemoryGiB": 4.0}},
        ["reserveGiB=5.0 must be below"],
        id="reserve-above-memory",
    ),
    pytest.param(
        {"image": {"pullPolicy": "Sometimes"}}, ["spec.image.pullPolicy", "'Sometimes'"], id="bad-pull-policy"
    ),
    pytest.param({"expertWorker": {}}, ["spec.expertWorker", "Extra inputs are not permitted"], id="typo-field"),
]


@pytest.mark.parametrize("patch, needles", SPEC_CASES)
def test_spec_bad_input(patch, needles):
    spec = tiny_spec()
    for k, v in patch.items():
        spec[k] = v if k == "model" else {**spec.get(k, {}), **v}
    with pytest.raises(SpecError) as e:
        resolve_model(parse_spec(spec))
    missing = [n for n in needles if n not in str(e.value)]
    assert not missing, f"{str(e.value)!r} does not name {missing}"


# ----------------------------------------------------------------------------------------------- checkpoints
def _rewrite(path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _header_len(path, n):
    data = path.read_bytes()
    path.write_bytes(n.to_bytes(8, "little") + data[8:])


def _garble_header(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"{" * n + data[8 + n :])


EMBED, L1, L2, L3 = (
    "model-embed.safetensors",
    "model-layers-00001-00001.safetensors",
    "model-layers-00002-00002.safetensors",
    "model-layers-00003-00003.safetensors",
)
SCALES = "layers.3.moe.experts.down.scales"
CKPT_CASES = [
    pytest.param(lambda d: _truncate(d / EMBED), [EMBED, "truncated"], id="truncated-file"),
    pytest.param(lambda d: (d / EMBED).write_bytes(b""), [EMBED, "truncated (no safetensors header)"], id="empty-file"),
    pytest.param(
        lambda d: _header_len(d / EMBED, 10**12),
        [EMBED, "truncated", "header of 1000000000000 bytes"],
        id="header-length-beyond-file",
    ),
    pytest.param(lambda d: _garble_header(d / EMBED), [EMBED, "corrupt safetensors header"], id="garbage-header"),
    pytest.param(
        lambda d: _rewrite(d / L3, lambda t: t.__setitem__(SCALES, t[SCALES].float())),
        [f"'{SCALES}' has dtype F32, expected U8"],
        id="wrong-dtype",
    ),
    pytest.param(
        lambda d: _rewrite(
            d / L2, lambda t: t.__setitem__("layers.2.attn.q_proj.weight", torch.zeros(8, 8, dtype=torch.bfloat16))
        ),
        ["'layers.2.attn.q_proj.weight' has shape [8, 8], expected [32, 64]"],
        id="wrong-shape",
    ),
    pytest.param(
        lambda d: _rewrite(d / L1, lambda t: t.pop("layers.1.moe.router.weight")),
        [L1, "'layers.1.moe.router.weight' missing"],
        id="missing-tensor",
    ),
    pytest.param(lambda d: (d / L1).unlink(), [L1, "missing"], id="missing-shard"),
    pytest.param(
        lambda d: (d / "config.json").write_text("{not json"), ["config.json", "not valid JSON"], id="config-not-json"
    ),
    pytest.param(lambda d: (d / "config.json").unlink(), ["config.json", "missing"], id="config-missing"),
    pytest.param(
        lambda d: (d / "model.safetensors.index.json").write_text("garbage"),
        ["model.safetensors.index.json", "not a valid index"],
        id="index-not-json",
    ),
    pytest.param(lambda d: shutil.rmtree(d), ["not a checkpoint directory"], id="no-such-directory"),
]


@pytest.mark.parametrize("corrupt, needles", CKPT_CASES)
def test_checkpoint_bad_input(ckpt_dir, tmp_path, corrupt, needles):
    d = tmp_path / "ck"
    shutil.copytree(ckpt_dir, d)
    corrupt(d)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d)
    missing = [n for n in needles if n not in str(e.value)]
    assert not missing, f"{str(e.value)!r} does not name {missing}"


# ----------------------------------------------------------------------------------------------- CLI
def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of `expertmesh ARGV`; argparse's SystemExit counts as the exit status."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


UNCAUGHT = (
    "an uncaught {} traceback instead of a one-line error naming {} and exit status 2 (expertmesh/entry/cli.py main "
    "catches only ValueError and FileNotFoundError)"
)
CLI_CASES = [
    pytest.param(["plan", "--preset", "nope", "--expert-pods", "2"], ["--preset", "'nope'"], id="plan-bad-preset"),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "two"], ["--expert-pods", "'two'"], id="plan-pods-not-int"
    ),
    pytest.param(["plan", "--preset", "tiny", "--expert-pods", "-1"], ["--expert-pods", "-1"], id="plan-negative-pods"),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--gpu-memory-gib", "-5"],
        ["--gpu-memory-gib", "-5"],
        id="plan-negative-memory",
    ),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--redundant-experts", "-1"],
        ["--redundant-experts"],
        id="plan-negative-redundant",
    ),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--loads", "{d}/nope.npy"],
        ["--loads", "nope.npy"],
        id="plan-missing-loads",
    ),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--loads", "{d}/config.json"],
        ["--loads"],
        id="plan-loads-wrong-shape",
    ),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--previous", "{d}/nope.json"],
        ["--previous", "nope.json"],
        id="plan-missing-previous",
    ),
    pytest.param(
        ["checkpoint", "inspect", "{d}/nope"], ["nope", "not a checkpoint directory"], id="inspect-missing-dir"
    ),
    pytest.param(
        ["checkpoint", "create", "--preset", "nope", "--out", "{d}/x"],
        ["unknown preset 'nope'"],
        id="create-bad-preset",
    ),
    pytest.param(["checkpoint", "create", "--out", "{d}/config.json"], ["config.json"], id="create-out-is-a-file"),
    pytest.param(
        ["checkpoint", "create", "--out", "{d}/ls0", "--layers-per-shard", "0"],
        ["--layers-per-shard"],
        id="create-zero-layers-per-shard",
    ),
    pytest.param(["model", "describe", "nope"], ["unknown preset 'nope'"], id="describe-bad-preset"),
    pytest.param(
        ["generate", "hi", "--checkpoint", "{d}/nope"],
        ["nope", "not a checkpoint directory"],
        id="generate-missing-checkpoint",
    ),
    pytest.param(
        ["generate", "hi", "--checkpoint", "{ck}", "--top-p", "5"], ["top_p=5.0"], id="generate-top-p-above-1"
    ),
    pytest.param(
        ["generate", "hi", "--checkpoint", "{ck}", "--max-tokens", "-1"],
        ["--max-tokens"],
        id="generate-negative-max-tokens",
    ),
    pytest.param(
        ["chat", "--url", "http://127.0.0.1:9", "--max-tokens", "2", "hi"], ["127.0.0.1:9"], id="chat-unreachable-url"
    ),
    pytest.param(["bogus"], ["invalid choice: 'bogus'"], id="unknown-command"),
]


@pytest.mark.parametrize("argv, needles", CLI_CASES)
def test_cli_bad_input(ckpt_dir, tmp_path, capsys, argv, needles):
    shutil.copy(ckpt_dir / "config.json", tmp_path / "config.json")
    argv = [a.format(d=tmp_path, ck=ckpt_dir) for a in argv]
    code, err = run_cli(argv, capsys)
    assert code != 0, f"exit status 0 for {argv}; stderr {err[-300:]!r}"
    last = err.strip().splitlines()[-1] if err.strip() else ""
    missing = [n for n in needles if n not in last]
    assert not missing, f"last stderr line {last!r} does not name {missing}"
