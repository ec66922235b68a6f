"""Bounded tokenization (issue #51): text that cannot fit the context is refused before it is encoded — a 4 MB
`/tokenize` body is a fast 400 while a stream goes on undisturbed — ids past max_model_len are refused, and every
endpoint that tokenizes user text encodes away from the event loop. In process: the router's HTTP app over an
engine with one attention and two expert workers on the shared tiny checkpoint (byte tokenizer, 4,096-token
context)."""

import threading
import time

import httpx
import pytest

from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.router.http import build_app, serve_http
from expertmesh.router.text_bounds import SLACK

FOUR_MB = 4_000_000


@pytest.fixture(scope="module")
def router(tiny_checkpoint):
    engine = build_local_engine(tiny_checkpoint, attention_workers=1, expert_workers=2)
    port = free_port()
    app = build_app(engine)
    srv, thread = serve_http(app, "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}", engine, app
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_a_4mb_tokenize_body_is_a_fast_400_and_a_stream_goes_on(router):
    url, engine, _ = router
    arrivals: list[float] = []
    streaming = threading.Event()

    def stream():
        body = {"model": "tiny", "prompt": "count on", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 5:
                        streaming.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(60)
    text = "a" * FOUR_MB
    start = time.monotonic()
    r = post(url, "/tokenize", {"model": "tiny", "prompt": text})
    took = time.monotonic() - start
    sent = (start, start + took)
    reader.join(120)
    assert r.status_code == 400, r.text[:200]
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert f"{FOUR_MB} characters" in error["message"] and "4096" in error["message"]
    assert took < 1.0, f"the refusal took {took:.2f} s"
    during = [t for t in arrivals if sent[0] - 1 <= t <= sent[1] + 1]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) > 50 and during and max(gaps) < 1.0, f"the stream stalled {max(gaps):.2f} s"


def test_text_within_the_bound_is_encoded_and_held_to_the_context(router):
    url, engine, _ = router
    context = engine.cfg.max_context
    fits = post(url, "/tokenize", {"model": "tiny", "prompt": "x" * (context - 1)})
    assert fits.status_code == 200 and fits.json()["count"] == context  # BOS + the bytes
    over = post(url, "/tokenize", {"model": "tiny", "prompt": "x" * context})  # encodes to context + 1 ids
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
    assert f"{context + 1} tokens" in over.json()["error"]["message"]
    long_chat = [{"role": "user", "content": "y" * context}]
    over = post(url, "/tokenize", {"model": "tiny", "messages": long_chat})
    assert over.status_code == 400 and over.json()["error"]["param"] == "messages"
    assert over.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "z"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z"}]}, "messages"),
        ("/v1/responses", {"input": "z"}, "input"),
        ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "z"}]}, None),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "z"}]}, None),
        ("/tokenize", {"messages": [{"role": "user", "content": "z"}]}, "messages"),
    ],
)
def test_every_endpoint_refuses_text_that_cannot_fit_before_encoding_it(router, path, body, param):
    url, engine, app = router
    tok = app.state.served.fmt.tokenizer
    beyond = SLACK * engine.cfg.max_context + 1  # the byte tokenizer's tokens are one byte
    key = "prompt" if "prompt" in body else "input" if "input" in body else "messages"
    big = "z" * beyond
    body = {**body, "model": "tiny", key: big if key != "messages" else [{"role": "user", "content": big}]}
    encoded = []
    for name in ("encode", "encode_prompt"):
        real = getattr(tok, name)
        setattr(tok, name, lambda text, real=real: encoded.append(len(text)) or real(text))
    try:
        start = time.monotonic()
        r = post(url, path, body)
        took = time.monotonic() - start
    finally:
        del tok.encode, tok.encode_prompt
    assert r.status_code == 400, r.text[:300]
    if param is None:  # Anthropic's shape
        assert r.json()["type"] == "error" and r.json()["error"]["message"].startswith("messages: ")
        assert "context of 4096 tokens" in r.json()["error"]["message"]
    else:
        assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "context_length_exceeded"
    assert not [n for n in encoded if n >= beyond], "the text was encoded before it was refused"
    assert took < 1.0


@pytest.mark.parametrize(
    "path, body",
    [
        ("/tokenize", {"prompt": "hello there"}),
        ("/tokenize", {"messages": [{"role": "user", "content": "hello there"}]}),
        ("/v1/completions", {"prompt": "hello there", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1}),
        ("/v1/responses", {"input": "hello there", "max_output_tokens": 1}),
        ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "hello there"}]}),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hello there"}]}),
    ],
)
def test_user_text_is_encoded_off_the_event_loop(router, path, body):
    """The HTTP server's event loop runs on its `http` thread: no encoding of user text happens there."""
    url, _, app = router
    tok = app.state.served.fmt.tokenizer
    threads = []
    for name in ("encode", "encode_prompt"):
        real = getattr(tok, name)
        setattr(tok, name, lambda text, real=real: threads.append(threading.current_thread().name) or real(text))
    try:
        r = post(url, path, {"model": "tiny", **body})
    finally:
        del tok.encode, tok.encode_prompt
    assert r.status_code == 200, r.text[:300]
    assert threads and "http" not in threads, threads
