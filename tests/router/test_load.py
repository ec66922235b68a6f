"""Load and backpressure through the real HTTP server (in-process engine on loopback), driven by
bench/load.py's `run_load`: only explicit, OpenAI-shaped 429s under overload, every KV block back after the
load, no RSS growth after warm-up, a full queue answers 429 at once, and a client that goes away frees its slot.
"""

import gc
import importlib.util
import time

import httpx
import pytest
from support.paths import REPO

from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.router.engine import QueueFull
from expertmesh.router.http import build_app, serve_http
from expertmesh.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("bench_load", REPO / "bench" / "load.py")
load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load)

MAX_RUNNING, MAX_WAITING = 4, 4  # 16 clients against 8 slots: the queue overflows, 429s happen
CLIENTS, SECONDS = 16, 5


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    ck = tiny_checkpoint
    engine = build_local_engine(
        ck, attention_workers=1, expert_workers=2, max_running=MAX_RUNNING, max_waiting=MAX_WAITING
    )
    port = free_port()
    srv, thread = serve_http(build_app(engine), "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def wait_engine_idle(engine, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.num_running() or engine.num_waiting():
        assert time.monotonic() < deadline, (
            f"engine not idle: {engine.num_running()} running, {engine.num_waiting()} waiting"
        )
        time.sleep(0.02)


def assert_every_block_free(url: str, engine) -> None:
    """No sequence left open and, once the prefix cache is emptied, every KV block free — on the workers
    themselves, in the router's view, and in /metrics."""
    wait_engine_idle(engine)
    for i, w in enumerate(engine.attention):
        assert w.info()["sequences"] == 0, f"attention-{i}: sequences left open after the load"
        for key in engine.kv.eviction_candidates(i):  # the prefix cache holds blocks by design: drop it
            engine._drop_prefix(i, key)
        info = w.info()
        assert info["prefixes"] == 0, f"attention-{i}: {info['prefixes']} prefixes the router does not know of"
        assert info["free_blocks"] == info["total_blocks"], f"attention-{i}: {info}"
        assert engine.kv.workers[i].free_blocks == info["total_blocks"], "router's free-block count drifted"
        assert engine.kv.workers[i].sequences == 0
    kv = load.kv_blocks(httpx.get(url + "/metrics").text)
    assert kv["free"] == kv["total"] == sum(w.total_blocks for w in engine.kv.workers)


def check_round(r: dict) -> None:
    assert r["completed"] > 0 and r["output_tokens"] > 0, r
    others = {k: v for k, v in r["errors"].items() if k != "429" and v}
    assert not others, f"errors other than 429: {others}; examples {r['examples']}"
    assert r["errors"]["429"] > 0, "the bounded queue never overflowed: the test did not exercise backpressure"
    assert r["bad_error_bodies"] == 0, r["examples"].get("429")


def test_overload_only_429s_no_kv_leak_no_rss_growth(server):
    url, engine = server
    warm = load.run_load(url, CLIENTS, SECONDS, seed=1, backoff=0.2)  # warm-up round
    check_round(warm)
    assert_every_block_free(url, engine)
    gc.collect()
    rss_warm = load.rss_bytes()
    second = load.run_load(url, CLIENTS, SECONDS, seed=2, backoff=0.2)
    check_round(second)
    assert_every_block_free(url, engine)
    gc.collect()
    rss_end = load.rss_bytes()
    growth = (rss_end - rss_warm) / rss_warm
    assert growth < 0.05, f"RSS grew {100 * growth:.1f}% after warm-up ({rss_warm >> 20} → {rss_end >> 20} MiB)"


def fill_queue(engine) -> list:
    """Occupy every running slot and the whole waiting queue with long greedy requests (no stop token)."""
    reqs = []
    params = SamplingParams(max_tokens=2000, temperature=0.0, stop_token_ids=())
    for i in range(4 * (MAX_RUNNING + MAX_WAITING)):
        try:
            reqs.append(engine.submit([(7 * i + j) % 256 for j in range(32)], params))
        except QueueFull:
            if engine.num_waiting() == MAX_WAITING and engine.num_running() == MAX_RUNNING:
                return reqs
            time.sleep(0.05)
    raise AssertionError(f"could not fill the queue: {engine.num_running()} running, {engine.num_waiting()} waiting")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_full_queue_answers_429_at_once(server, stream):
    url, engine = server
    reqs = fill_queue(engine)
    try:
        t0 = time.perf_counter()
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": stream},
            timeout=30,
        )
        elapsed = time.perf_counter() - t0
        assert r.status_code == 429, r.text
        assert load.openai_error_shaped(r.content), r.text
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "queue full" in err["message"]
        assert elapsed < 1.0, f"the 429 took {elapsed:.2f}s"
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 429 and load.openai_error_shaped(r.content), r.text
    finally:
        for req in reqs:
            engine.cancel(req)
    wait_engine_idle(engine)
    ok = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert_every_block_free(url, engine)


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(False, id="json"),
        pytest.param(True, id="stream"),
    ],
)
def test_client_that_goes_away_frees_its_slot(server, stream):
    url, engine = server
    wait_engine_idle(engine)
    submitted = []
    submit = engine.submit
    engine.submit = lambda *a, **kw: submitted.append(submit(*a, **kw)) or submitted[-1]  # see the request
    body = {"model": "tiny", "prompt": list(range(40, 72)), "max_tokens": 3000, "temperature": 0, "stream": stream}
    try:
        t0 = time.monotonic()
        try:  # read for ~0.5 s, then drop the connection
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=httpx.Timeout(0.5, connect=5)) as r:
                for _ in r.iter_bytes():
                    if time.monotonic() - t0 > 0.5:
                        break
        except httpx.ReadTimeout:
            pass
        left_at = time.monotonic()
        assert len(submitted) == 1
        req = submitted[0]
        if req.finish_reason == "stop":
            pytest.skip("the completion hit EOS before the client went away")
        while not req.done and time.monotonic() < left_at + 3.0:
            time.sleep(0.02)
        assert req.done and req.finish_reason == "cancelled", (
            f"request still {'running' if not req.done else req.finish_reason} with {len(req.output)} tokens "
            f"3 s after its client left"
        )
    finally:
        engine.submit = submit
        for req in submitted:
            engine.cancel(req)
    wait_engine_idle(engine)
    assert_every_block_free(url, engine)
