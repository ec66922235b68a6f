"""Hardening round 2 of the router's public APIs (#33, findings 1, 3, 4, 7, 8, 9, 11, 12): work proportional to what
was paid for and off the event loop (images, schemas), gRPC streams and request ids, stored responses within their
byte bound, image URLs, the Responses API's loose ends, constrained decoding on a checkpoint with its own
tokenizer.json, and forced tool calls on checkpoint chat templates. Each test failed on the main it was written
against."""

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


# ----------------------------------------------------------------------------------------------- 11, 12: a user's checkpoint
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


# ----------------------------------------------------------------------------------------------- a served router
KEY = "sk-hardening-router"


def png_1bit(width: int, height: int) -> bytes:
    """A black 1-bit PNG of width × height written directly (Pillow would hold every pixel to write it): a few KB
    for tens of millions of pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + the row's bits
    z, parts = zlib.compressobj(9), []
    rows_per_piece = max(1, (1 << 20) // len(row))
    piece = row * rows_per_piece
    for _ in range(height // rows_per_piece):
        parts.append(z.compress(piece))
    parts.append(z.compress(row * (height % rows_per_piece)) + z.flush())
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
        + chunk(b"IDAT", b"".join(parts))
        + chunk(b"IEND", b"")
    )


def data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


class HealthPoller:
    """GET /health in a loop from a thread while a test runs: the slowest answer (and whether every one came)."""

    def __init__(self, url: str):
        import threading

        self.url, self.latencies, self.failures = url + "/health", [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import httpx

        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    ok = c.get(self.url).status_code == 200
                except Exception:
                    ok = False
                self.latencies.append(time.monotonic() - start)
                self.failures += not ok
                self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def worst(self) -> float:
        return max(self.latencies)


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


class DripServer:
    """An HTTP server for image URLs: /drip sends a PNG one byte every 0.2 s (a slow-drip body), /cat.png at once."""

    def __init__(self):
        import http.server
        import threading

        body = png_1bit(56, 56)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("content-type", "image/png")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                try:
                    if self.path.startswith("/drip"):
                        for b in body:
                            self.wfile.write(bytes([b]))
                            self.wfile.flush()
                            time.sleep(0.2)
                    else:
                        self.wfile.write(body)
                except OSError:
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint_dir):
    """`expertmesh up`'s processes on the tiny checkpoint (vision encoder included): stored responses bounded at
    1 MiB, remote images from the drip server within 2 s, clients that stop reading cut off after 3 s."""
    from expertmesh.entry.cluster import LocalCluster, free_port

    drip = DripServer()
    ck = tiny_checkpoint_dir
    c = LocalCluster(
        ck,
        attention_workers=1,
        expert_workers=1,
        http_port=free_port(),
        grpc_port=free_port(),
        extra_env={"EXPERTMESH_API_KEY": KEY},
        router_args=[
            "--stored-responses-mib",
            "1",
            "--image-fetch-timeout",
            "2",
            "--client-write-timeout",
            "3",
            "--image-fetch-allow",
            f"127.0.0.1:{drip.port},localhost:{drip.port}",
        ],
    )
    with c:
        yield c, drip
    drip.server.shutdown()


def chat_body(*parts, **kw) -> dict:
    return {
        "model": "tiny",
        "max_tokens": 2,
        "temperature": 0,
        "reasoning_effort": "none",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}],
        **kw,
    }


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def post(c, path: str, body: dict, timeout: float = 120, key: str = KEY):
    import httpx

    return httpx.post(c.http_url + path, json=body, timeout=timeout, headers={"authorization": f"Bearer {key}"})


def test_degenerate_pngs_are_refused_from_their_header_in_under_2s_while_health_answers(cluster):
    """#1: a 97 KB 1-bit PNG of 1×49,999,999 pixels stalled /health and every stream ~7 s (decoded on the event
    loop, ≥ 2.5 GB); four 6 KB PNGs of 49,999,999×1 stalled everything 22 s. Now the header is read, the side and
    aspect-ratio bounds refuse them before a pixel is decoded."""
    c, _ = cluster
    tall, wide = png_1bit(1, 49_999_999), png_1bit(49_999_999, 1)
    assert len(tall) < 200_000 and len(wide) < 10_000
    before = peak_rss_mib(c.router.proc.pid)
    with HealthPoller(c.http_url) as health:
        for parts in ([image(data_url(tall))], [image(data_url(wide))] * 4):
            start = time.monotonic()
            r = post(c, "/v1/chat/completions", chat_body(*parts))
            took = time.monotonic() - start
            assert r.status_code == 400 and "messages[0].content[1]" in r.json()["error"]["message"], r.text
            assert "per side" in r.json()["error"]["message"]
            assert took < 2, took
    assert health.failures == 0 and health.worst < 1.0, (health.worst, health.failures)
    assert peak_rss_mib(c.router.proc.pid) - before < 100


def test_a_large_image_is_decoded_off_the_event_loop(cluster):
    """#1: an image within every bound but costly to decode (7,000×7,000 pixels from a 6 KB PNG) is decoded in a
    decoder process: /health answers throughout and the router's own memory does not grow with the pixels."""
    c, _ = cluster
    big = png_1bit(7_000, 7_000)
    before = peak_rss_mib(c.router.proc.pid)
    with HealthPoller(c.http_url) as health:
        start = time.monotonic()
        r = post(c, "/v1/chat/completions", chat_body(image(data_url(big)), {"type": "text", "text": "?"}))
        took = time.monotonic() - start
    assert r.status_code == 200, r.text
    grown = peak_rss_mib(c.router.proc.pid) - before
    print(
        f"7000x7000 1-bit PNG: answered in {took:.2f} s, /health worst {health.worst * 1000:.0f} ms over "
        f"{len(health.latencies)} polls, router peak RSS +{grown:.0f} MiB"
    )
    assert health.failures == 0 and health.worst < 1.0, (health.worst, health.failures)
    assert grown < 100


def test_the_images_cost_is_checked_against_the_context_before_decoding(cluster):
    """#1: the context check ran only after every image was decoded; sixteen full-size images that cannot fit
    the context are refused from their headers."""
    c, _ = cluster
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4000, 4000)).save(buf, format="PNG")
    max_ctx = post(c, "/tokenize", {"prompt": "x"}).json()["max_model_len"]
    start = time.monotonic()
    r = post(c, "/v1/chat/completions", chat_body(*[image(data_url(buf.getvalue()))] * 16))
    assert time.monotonic() - start < 2
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert err["param"] == "messages[0].content[4]" and f"context of {max_ctx}" in err["message"], err


# ----------------------------------------------------------------------------------------------- 4, 9: stored responses
def test_stored_responses_count_their_images_pixels_against_the_byte_bound(cluster):
    """#4: a segment accounted as 12 KB held 7.2 MB of pixels; with --stored-responses-mib 1, 21.7 MB of pixels
    stayed retrievable. Now the pixels count: a 1 MiB store keeps one response holding a 448×448 image (602 KB of
    pixels), never three."""
    import io

    import numpy as np
    from PIL import Image

    c, _ = cluster
    ids = []
    for seed in range(3):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (448, 448, 3), dtype=np.uint8)).save(
            buf, format="PNG"
        )
        r = post(
            c,
            "/v1/responses",
            {
                "model": "tiny",
                "max_output_tokens": 2,
                "reasoning": {"effort": "none"},
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is it?"},
                            {"type": "input_image", "image_url": data_url(buf.getvalue())},
                        ],
                    }
                ],
            },
        )
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    import httpx

    kept = [
        i
        for i in ids
        if httpx.get(f"{c.http_url}/v1/responses/{i}", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    ]
    assert kept == ids[-1:], kept
    # the one kept is continued with its image
    r = post(
        c,
        "/v1/responses",
        {
            "model": "tiny",
            "max_output_tokens": 2,
            "previous_response_id": ids[-1],
            "input": "And now?",
            "reasoning": {"effort": "none"},
        },
    )
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] > 256, r.text


def test_the_store_counts_pixels_and_shared_segments_once():
    """#4 in the store itself: pixels count, and a chain's shared segments and images count once."""
    import numpy as np

    from expertmesh.chat.format import Message
    from expertmesh.router.prepared_image import PreparedImage
    from expertmesh.router.response_store import ResponseStore, Segment, StoredResponse

    img = PreparedImage(np.zeros((1400, 1792, 3), dtype=np.uint8), "d" * 64, 3200, (1792, 1400))  # 7.5 MB
    seg = Segment(Message("user", "look", parts=[img, "look"]), list(range(3300)))
    store = ResponseStore(max_bytes=2**20, replica="x")
    store.put(StoredResponse("resp_x_" + "0" * 24, {}, [], [seg]))
    assert len(store) == 0 and store.bytes == 0  # 7.5 MB of pixels do not fit in 1 MiB
    store = ResponseStore(max_bytes=64 * 2**20, replica="x")
    answers = [Segment(Message("assistant", f"answer {i}"), list(range(10))) for i in range(3)]
    for i in range(3):  # a chain: each keeps the segments before
        store.put(StoredResponse(f"resp_x_{i:024d}", {}, [], [seg] + answers[: i + 1]))
    assert img.pixels.nbytes <= store.bytes < img.pixels.nbytes + 64 * 1024
    for i in range(3):
        store.delete(f"resp_x_{i:024d}")
    assert store.bytes == 0 and not store._held


@pytest.mark.parametrize(
    "item,param",
    [
        ({"type": "message", "role": "user", "content": "hi", "id": 42}, "input[0].id"),
        ({"type": "message", "role": "user", "content": "hi", "id": {"nested": "object"}}, "input[0].id"),
        ({"type": "message", "role": "user", "content": "hi", "id": "x" * 129}, "input[0].id"),
        ({"type": "function_call_output", "call_id": "c" * 129, "output": "18 C"}, "input[0].call_id"),
        ({"type": "function_call", "call_id": ["a"], "name": "f", "arguments": "{}"}, "input[0].call_id"),
    ],
)
def test_client_item_ids_are_bounded_strings(cluster, item, param):
    """#9: client item ids of any JSON type (and any length) were stored and echoed."""
    c, _ = cluster
    r = post(c, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [item]})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_metadata_is_bounded_as_openai_bounds_it(cluster):
    """#9: 3 MB of metadata was accepted and stored; OpenAI allows 16 pairs of 64 / 512 characters."""
    c, _ = cluster
    base = {"model": "tiny", "max_output_tokens": 1, "input": "hi", "reasoning": {"effort": "none"}}
    for metadata in (
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": 1},
        {"k": "v" * 3_000_000},
    ):
        r = post(c, "/v1/responses", {**base, "metadata": metadata})
        assert r.status_code in (400, 413) and "metadata" in r.text[:400] or r.status_code == 413, r.text[:300]
    ok = {f"k{i}": "v" * 512 for i in range(16)}
    r = post(c, "/v1/responses", {**base, "metadata": ok})
    assert r.status_code == 200 and r.json()["metadata"] == ok


def test_include_on_input_items_is_honoured_or_refused(cluster):
    """#9: `include=foo` on input_items was silently accepted."""
    import httpx

    c, _ = cluster
    rid = post(
        c, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": "hi", "reasoning": {"effort": "none"}}
    ).json()["id"]
    h = {"authorization": f"Bearer {KEY}"}
    r = httpx.get(f"{c.http_url}/v1/responses/{rid}/input_items", params={"include": "foo"}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "include[0]", r.text
    r = httpx.get(
        f"{c.http_url}/v1/responses/{rid}/input_items", params={"include": "reasoning.encrypted_content"}, headers=h
    )
    assert r.status_code == 200 and r.json()["data"][0]["content"][0]["text"] == "hi"


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


# ----------------------------------------------------------------------------------------------- 8: image URLs
def test_an_image_fetch_has_one_deadline_for_the_whole_body(cluster):
    """#8: --image-fetch-timeout was per read: a URL dripping a byte at a time held a request 81 s with 3 s set."""
    c, drip = cluster
    start = time.monotonic()
    r = post(c, "/v1/chat/completions", chat_body(image(f"http://127.0.0.1:{drip.port}/drip.png")))
    took = time.monotonic() - start
    assert r.status_code == 400 and "longer than 2 s" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages[0].content[1]"
    assert took < 4, took


@pytest.mark.parametrize(
    "url,why",
    [
        ("http://127.0.0.1:99999/cat.png", "port '99999'"),
        ("http://127.0.0.1:8o8o/cat.png", "port '8o8o'"),
        ("http://[::1/cat.png", "malformed URL"),
        ("http://:80/cat.png", "no host"),
    ],
)
def test_a_malformed_image_url_is_a_400_naming_the_part(cluster, url, why):
    """#8: malformed ports were a 500 with a traceback."""
    c, _ = cluster
    r = post(c, "/v1/chat/completions", chat_body(image(url)))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]" and why in err["message"], err


def test_image_urls_are_logged_without_userinfo_or_query(cluster):
    """#8: remote image URLs were logged at INFO with userinfo and presigned query strings."""
    c, drip = cluster
    url = f"http://alice:hunter2@127.0.0.1:{drip.port}/cat.png?X-Amz-Signature=s3cr3tsig&X-Amz-Credential=AKIA"
    r = post(c, "/v1/chat/completions", chat_body(image(url)))
    assert r.status_code == 200, r.text
    r = post(
        c,
        "/v1/chat/completions",
        chat_body(image(url.replace("cat.png", "missing.png").replace("127.0.0.1", "localhost"))),
    )
    time.sleep(0.5)
    logged = "\n".join(c.router.lines)
    assert f"127.0.0.1:{drip.port}/cat.png" in logged  # the fetch is logged ...
    for secret in ("hunter2", "alice", "s3cr3tsig", "AKIA", "X-Amz"):  # ... without its secrets
        assert secret not in logged, [line for line in c.router.lines if secret in line]


# ----------------------------------------------------------------------------------------------- 3: gRPC
def grpc_stub(c, *options):
    import grpc

    from expertmesh.protos import router_pb2_grpc

    # a connection of its own (channels of one process share connections unless told not to)
    channel = grpc.insecure_channel(
        f"127.0.0.1:{c.grpc_port}", options=[("grpc.use_local_subchannel_pool", 1), *options]
    )
    return channel, router_pb2_grpc.RouterStub(channel)


AUTH = (("authorization", f"Bearer {KEY}"),)


def test_grpc_request_id_is_bounded_and_invalid_utf8_is_invalid_argument(cluster):
    """#3: a 1 MiB request_id with max_tokens 64 gave a 68 MB response (it is echoed in every event); a string
    field with invalid UTF-8 was not INVALID_ARGUMENT."""
    import grpc

    from expertmesh.protos import router_pb2, sampling_pb2

    c, _ = cluster
    channel, stub = grpc_stub(c)
    params = sampling_pb2.SamplingParams(max_tokens=2)
    for rid in ("r" * 129, "é" * 65, "x" * 2**20):
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.Generate(
                    router_pb2.GenerateRequest(text="hi", request_id=rid, params=params), metadata=AUTH, timeout=30
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    events = list(
        stub.Generate(
            router_pb2.GenerateRequest(text="hi", request_id="r" * 128, params=params), metadata=AUTH, timeout=30
        )
    )
    assert events[0].request_id == "r" * 128
    raw = router_pb2.GenerateRequest(text="hi", params=params).SerializeToString().replace(b"hi", b"h\xff")
    generate = channel.unary_stream("/expertmesh.v1.Router/Generate")
    with pytest.raises(grpc.RpcError) as e:
        list(generate(raw, metadata=AUTH, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in e.value.details(), e.value
    channel.close()


def test_grpc_clients_that_never_read_do_not_take_the_api_down(cluster):
    """#3: 500 streams on one connection that are never read held the 32-thread pool: the public gRPC API was
    unavailable for ≥ 90 s. Now one connection gets at most 16 streams at once, a stream whose client stops reading
    is cancelled after the write deadline (3 s here), and another client is served meanwhile."""

    from expertmesh.protos import router_pb2, sampling_pb2

    c, _ = cluster
    # a client that reads nothing and offers a 1 KB window: the server's writes block at once
    bad_channel, bad = grpc_stub(c, ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024))
    hog = router_pb2.GenerateRequest(
        text="Tell me everything. " * 8,
        request_id="h" * 128,
        return_text=True,
        params=sampling_pb2.SamplingParams(max_tokens=3000, temperature=1.0, seed=1),
    )
    calls = [bad.Generate(hog, metadata=AUTH) for _ in range(500)]  # started, never read
    try:
        time.sleep(3)
        channel, stub = grpc_stub(c)
        start = time.monotonic()
        assert stub.ListModels(router_pb2.ListModelsRequest(), metadata=AUTH, timeout=10).models
        listed = time.monotonic() - start
        events = list(
            stub.Generate(
                router_pb2.GenerateRequest(text="hi", params=sampling_pb2.SamplingParams(max_tokens=4)),
                metadata=AUTH,
                timeout=60,
            )
        )
        generated = time.monotonic() - start
        assert events[-1].finish.usage.completion_tokens == 4
        print(f"beside 500 unread streams: ListModels {listed:.2f} s, a 4-token Generate {generated:.2f} s")
        assert listed < 2, listed
        deadline = time.monotonic() + 60  # the stalled streams are cut off by the write deadline
        while time.monotonic() < deadline and not any("read nothing" in line for line in c.router.lines):
            time.sleep(0.5)
        assert any("read nothing" in line for line in c.router.lines)
        channel.close()
    finally:
        for call in calls:
            call.cancel()
        bad_channel.close()


# ----------------------------------------------------------------------------------------------- 7: schemas
def nested_any_of(a: int = 50, b: int = 50) -> dict:
    """An anyOf of `a` anyOfs of `b` one-key objects: it compiles, but after `{` the parser's row holds a·b items
    (llguidance allows 2,000)."""
    return {
        "anyOf": [
            {
                "anyOf": [
                    {"type": "object", "properties": {f"{i}_{j}": {"type": "integer"}}, "required": [f"{i}_{j}"]}
                    for j in range(b)
                ]
            }
            for i in range(a)
        ]
    }


def test_large_schemas_do_not_stall_other_clients(cluster):
    """#7: eight concurrent 3.6 MB enum schemas stalled /health 5.5 s (body parsing and grammar compilation on the
    event loop). Now a schema over the budget is refused at once, compilation runs in a thread pool, and /health
    answers throughout."""
    import concurrent.futures

    c, _ = cluster
    enum = [f"value-{i:07d}-" + "x" * 20 for i in range(95_000)]
    body = chat_body(
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "big",
                "schema": {"type": "object", "properties": {"a": {"enum": enum}}, "required": ["a"]},
            },
        }
    )
    assert 3.4e6 < len(json.dumps(body)) < 4 * 2**20
    with HealthPoller(c.http_url) as health, concurrent.futures.ThreadPoolExecutor(8) as pool:
        start = time.monotonic()
        answers = list(pool.map(lambda _: post(c, "/v1/chat/completions", body), range(8)))
        took = time.monotonic() - start
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    print(f"8 × 3.6 MB schemas: refused in {took:.2f} s, /health worst {health.worst * 1000:.0f} ms")
    assert health.failures == 0 and health.worst < 1.0, (health.worst, health.failures)


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_grammar_past_the_decoders_limits_is_refused_when_compiled(cluster, where):
    """#7: a nested anyOf compiled on the router but exceeded llguidance's row limit mid-decode. The router now
    decodes a little with the worker's limits before scheduling anything: a 400 naming the field."""
    c, _ = cluster
    schema = nested_any_of()
    if where == "tools":
        body = chat_body(
            tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
            tool_choice={"type": "function", "function": {"name": "f"}},
            max_tokens=8,
        )
        param = "tools.0.function.parameters"
    else:
        body = chat_body(
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}, max_tokens=8
        )
        param = "response_format.json_schema.schema"
    r = post(c, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "exceeds the decoder's limits" in err["message"] and "2000" in err["message"]
    # within the limits it decodes (the same shape, 40 alternatives)
    small = chat_body(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": nested_any_of(4, 10)}},
        max_tokens=24,
    )
    assert post(c, "/v1/chat/completions", small).status_code == 200
