"""Hardening of the engine and workers (issue #19), in process: request ids, prefix keys, stale KV counts, queue
waits, a failing sampler, a hung attention worker — each test fails on the code before the fix."""

import threading
import time

import pytest
from support.paths import REPO

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.local import build_local_engine
from expertmesh.router.engine import QueueFull
from expertmesh.router.kv import prefix_hashes
from expertmesh.router.scheduler import affinity_key, affinity_worker
from expertmesh.wire.sampling_params import SamplingParams

CHUNK = 16
PROMPT = [(5 * i + 1) % 256 for i in range(40)]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.fixture(scope="module")
def eng(ckpt):
    e = build_local_engine(
        ckpt, attention_workers=1, expert_workers=2, prefill_chunk=CHUNK, kv_blocks=24, max_queue_wait=2.0
    )
    yield e
    e.close()


def worker(e, i=0):
    return e.attention[i]._client


def test_client_request_ids_never_reach_the_workers(eng):
    alone = eng.generate(PROMPT, SamplingParams(max_tokens=6)).output
    seen = []
    w = worker(eng)
    orig = w.open_sequence

    def spy(seq_id, *a, **kw):
        seen.append(seq_id)
        return orig(seq_id, *a, **kw)

    w.open_sequence = spy
    try:  # two clients choosing the same request id at the same time
        reqs = [eng.submit(PROMPT, SamplingParams(max_tokens=6), request_id="same") for _ in range(2)]
        assert [r.wait(60).output for r in reqs] == [alone, alone]
    finally:
        del w.open_sequence
    assert len(set(seen)) == 2 and not any("same" in s for s in seen)


def test_prefix_keys_cannot_be_computed_by_others(eng, ckpt):
    eng.generate(PROMPT, SamplingParams(max_tokens=2))
    held = set(worker(eng).prefixes)
    assert held  # the prompt's first chunks were saved
    public = {k for _, k in prefix_hashes(PROMPT, CHUNK)}  # what anyone can compute from the tokens
    assert not held & public
    other = build_local_engine(ckpt, prefill_chunk=CHUNK)
    try:
        other.generate(PROMPT, SamplingParams(max_tokens=2))
        assert not set(worker(other).prefixes) & held  # another router's keys differ too
    finally:
        other.close()


def test_stale_free_block_counts_do_not_block_a_request_forever(eng):
    w = worker(eng)
    w.open_sequence("outsider", SamplingParams(max_tokens=1), reserve_tokens=w.pool.free_blocks * w.pool.block_size)
    req = eng.submit(PROMPT, SamplingParams(max_tokens=4))
    time.sleep(0.8)  # the engine has seen no room and waits
    assert not req.done
    w.close_sequence("outsider")  # room comes back behind the router's back
    assert len(req.wait(10).output) == 4


def test_a_request_that_cannot_get_kv_room_is_refused_after_the_queue_wait(eng):
    w = worker(eng)
    w.open_sequence("outsider", SamplingParams(max_tokens=1), reserve_tokens=w.pool.free_blocks * w.pool.block_size)
    try:
        t0 = time.monotonic()
        with pytest.raises(QueueFull, match="no KV room for 44 tokens"):
            eng.submit(PROMPT, SamplingParams(max_tokens=4)).wait(20)
        assert time.monotonic() - t0 < 6
    finally:
        w.close_sequence("outsider")
    assert len(eng.generate(PROMPT, SamplingParams(max_tokens=3), timeout=30).output) == 3  # still serving


def test_a_failing_sampler_fails_only_its_own_request(eng, monkeypatch):
    from expertmesh.model import sampling

    orig = sampling.Sampler.sample

    def sample(self, logits):
        if self.params.seed == 13:
            raise FloatingPointError("cannot sample")
        return orig(self, logits)

    monkeypatch.setattr(sampling.Sampler, "sample", sample)
    bad = eng.submit(PROMPT[:20], SamplingParams(max_tokens=5, temperature=0.8, seed=13))
    good = eng.submit(PROMPT[:22], SamplingParams(max_tokens=5, temperature=0.8, seed=14))
    assert len(good.wait(60).output) == 5
    with pytest.raises(RuntimeError, match="sampling failed: FloatingPointError: cannot sample"):
        bad.wait(60)


def test_a_hung_attention_worker_is_failed_over_and_its_sequences_closed_later(ckpt):
    # two sessions, one on each worker (session affinity places a prompt by its first chunk)
    side = [affinity_worker(affinity_key(PROMPT[k : k + 30], CHUNK), [0, 1]) for k in range(10)]
    ps = [PROMPT[side.index(w) : side.index(w) + 30] for w in (0, 1)]
    ref = build_local_engine(ckpt, prefill_chunk=CHUNK)
    try:
        want = [ref.generate(p, SamplingParams(max_tokens=10)).output for p in ps]
    finally:
        ref.close()
    e = build_local_engine(ckpt, attention_workers=2, expert_workers=1, prefill_chunk=CHUNK, call_timeout=1.5)
    try:
        w0 = worker(e, 0)
        orig, hung = w0.run_step, threading.Event()

        def run_step(*a, **kw):  # after a few steps, worker 0 stops answering (as under SIGSTOP), once
            if w0.calls > 6 and not hung.is_set():
                hung.set()
                time.sleep(4)
            return orig(*a, **kw)

        w0.run_step = run_step
        reqs = [e.submit(p, SamplingParams(max_tokens=10)) for p in ps]
        assert [r.wait(60).output for r in reqs] == want
        assert hung.is_set() and e.stats.recovered >= 1
        deadline = time.monotonic() + 10
        while (w0.sequences or e.pending_closes.get(0)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not w0.sequences  # closed once it answered again: nothing leaked
    finally:
        e.close()


def test_a_dead_routers_sequences_are_closed_when_its_lease_runs_out(ckpt):
    """A router that stops calling (dead, partitioned) loses its sequences after the lease; a live one, which
    heartbeats, keeps them; sequences opened without an owner never expire."""
    from expertmesh.worker.attention import AttentionWorker

    w = AttentionWorker(ckpt, kv_blocks=16, block_size=16, lease_seconds=1.5)
    free = w.pool.free_blocks
    params = SamplingParams(max_tokens=4)
    w.open_sequence("dead-1", params, reserve_tokens=64, owner="dead-router")
    w.open_sequence("live-1", params, reserve_tokens=64, owner="live-router")
    w.open_sequence("plain", params, reserve_tokens=16)
    for _ in range(16):  # the live router's heartbeat, every 0.2 s, for 3.2 s
        time.sleep(0.2)
        w.info(owner="live-router")
    assert set(w.sequences) == {"live-1", "plain"} and w.expired == 1
    assert w.pool.free_blocks == free - 4 - 1
    e = build_local_engine(ckpt, prefill_chunk=CHUNK, lease_seconds=1.5, health_interval=0.2)
    try:  # the engine heartbeats: its sequence outlives the lease
        req = e.submit(PROMPT, SamplingParams(max_tokens=3000))
        time.sleep(4)
        assert not req.done and worker(e).expired == 0 and len(worker(e).sequences) == 1
        e.cancel(req)
    finally:
        e.close()


def test_an_oversized_expert_call_is_refused_naming_the_limit(ckpt):
    import torch

    from expertmesh.wire.worker_api import ExpertRequestError
    from expertmesh.worker.expert import ExpertWorker

    w = ExpertWorker(ckpt, [(1, e) for e in range(16)], max_call_bytes=64 * 4 * 64 * 4)  # 64 rows of top-4
    h = torch.randn(65, ckpt.cfg.hidden_size)
    ids = torch.arange(4).repeat(65, 1)
    with pytest.raises(ExpertRequestError, match=r"hidden: 65 rows x 4 slots need 66,560 bytes .* limit of 65,536"):
        w.run(1, h, ids, torch.ones(65, 4))
    assert w.run(1, h[:64], ids[:64], torch.ones(64, 4)).shape == (64, ckpt.cfg.hidden_size)  # within: served


def test_the_default_checkpoint_cache_is_written_atomically(tmp_path, monkeypatch):
    from expertmesh.checkpoint import loader as checkpoint

    monkeypatch.setattr(checkpoint, "DEFAULT_CHECKPOINT_DIR", tmp_path)
    real = checkpoint.create_checkpoint

    def dies_half_way(cfg, path, **kw):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{ half")  # what a full disk leaves
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "create_checkpoint", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.default_checkpoint("tiny")
    assert list(tmp_path.iterdir()) == []  # nothing half-written stays behind
    broken = tmp_path / f"tiny-seed0-v{checkpoint.FORMAT_VERSION}"
    broken.mkdir()
    (broken / "config.json").write_text("{ half")  # left by an older version: replaced
    monkeypatch.setattr(checkpoint, "create_checkpoint", real)
    path = checkpoint.default_checkpoint("tiny")
    assert path == broken and Checkpoint(path).cfg.name == "tiny"


def test_a_blip_on_every_attention_worker_requeues_instead_of_failing(ckpt):
    """The only attention worker fails two steps in a row (a connection blip): its requests go back to the queue
    and replay once it answers — the same tokens, no error (before: every in-flight stream failed)."""
    from expertmesh.wire.worker_api import WorkerUnavailable

    ref = build_local_engine(ckpt, prefill_chunk=CHUNK)
    try:
        want = ref.generate(PROMPT, SamplingParams(max_tokens=12)).output
    finally:
        ref.close()
    e = build_local_engine(ckpt, prefill_chunk=CHUNK, health_interval=0.2)
    try:
        w = worker(e)
        orig, failures = w.run_step, []

        def run_step(*a, **kw):
            if w.calls > 5 and len(failures) < 2:
                failures.append(1)
                raise WorkerUnavailable("blip")
            return orig(*a, **kw)

        w.run_step = run_step
        assert e.generate(PROMPT, SamplingParams(max_tokens=12), timeout=60).output == want
        assert len(failures) == 2 and e.stats.recovered >= 1 and e.stats.requests_failed == 0
    finally:
        e.close()


@pytest.mark.parametrize("failure, kept", [("OutOfBlocks", True), ("NotFound", False), ("RuntimeError", False)])
def test_a_prefix_whose_open_fails_is_held_on_both_sides_or_on_neither(eng, failure, kept):
    """No room for it (OutOfBlocks): the prefix is still good — kept in the router's index and on the worker (a later
    request restores or reuses it); gone or broken: forgotten by the router and dropped on the worker. Never held
    by the worker alone (a leak), never indexed by the router alone (pinned to nothing)."""
    from expertmesh.wire import worker_api

    error = getattr(worker_api, failure, RuntimeError)
    eng.generate(PROMPT, SamplingParams(max_tokens=2))  # saves the prompt's chunks as prefixes
    w = worker(eng)
    orig, refused, held = w.open_sequence, [], []

    def refuse_prefixed(seq_id, params, *, prefix_key=None, **kw):
        if prefix_key is not None:
            refused.append(prefix_key)
            raise error(f"refused {prefix_key}")
        held.extend((k in w.prefixes, eng.kv.has(k)) for k in refused)  # the router's next try: both sides' view
        return orig(seq_id, params, **kw)

    w.open_sequence = refuse_prefixed
    try:
        assert len(eng.generate(PROMPT, SamplingParams(max_tokens=2), timeout=30).output) == 2
    finally:
        del w.open_sequence
    assert refused and held and all(h == (kept, kept) for h in held), held


def test_the_operator_folder_does_not_shadow_the_standard_library():
    """`python -m pip` from the repository root in a fresh venv puts the root first on sys.path; `-S` (no site, so
    nothing has imported `operator` yet) reproduces that: `collections` must still get the standard library's."""
    import subprocess
    import sys
    from pathlib import Path

    root = REPO
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONSAFEPATH"}
    code = "import collections, operator, sys; print(operator.__file__); print(operator.itemgetter(1)([0, 7]))"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    path, value = out.stdout.split()
    assert Path(path).parent != root / "operator" and value == "7"


def _serve(app, **timeouts):
    from expertmesh.entry.cluster import free_port
    from expertmesh.router.http import serve_http

    port = free_port()
    server, thread = serve_http(app, "127.0.0.1", port, **timeouts)
    return port, server, thread


def _read_until_closed(sock, limit: float) -> tuple[bytes, float]:
    sock.settimeout(limit)
    start, got = time.monotonic(), b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return got, time.monotonic() - start
        got += chunk


def test_slow_clients_get_408_and_the_router_keeps_serving(eng):
    """Headers trickled (slowloris) or a body that never completes: cut off after the request timeout with 408;
    before the fix, uvicorn waited forever (recv timed out here)."""
    import socket

    import httpx

    from expertmesh.router.http import build_app

    port, server, thread = _serve(build_app(eng), request_timeout=1.0, write_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:  # headers never finished
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            got, took = _read_until_closed(s, 10)
        assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got and took < 5, (got, took)
        with socket.create_connection(("127.0.0.1", port)) as s:  # a body shorter than its Content-Length
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b'content-length: 200\r\n\r\n{"model": '
            )
            got, took = _read_until_closed(s, 10)
        assert took < 5 and (got == b"" or got.startswith(b"HTTP/1.1 408")), (got, took)
        with socket.create_connection(("127.0.0.1", port)) as s:  # an idle connection that sends nothing
            got, took = _read_until_closed(s, 10)
        assert took < 5, took
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": eng.cfg.name, "prompt": "hi", "max_tokens": 2},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_client_that_stops_reading_a_stream_is_disconnected():
    """The server's send buffer stays full: after the write timeout the connection is aborted and the streaming
    handler sees the disconnect (its request would be cancelled) instead of waiting on the socket forever."""
    import asyncio
    import socket

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    ended = threading.Event()

    async def endless(request):
        async def chunks():
            try:
                while True:
                    yield b"x" * 65536
                    await asyncio.sleep(0)
            finally:
                ended.set()

        return StreamingResponse(chunks())

    port, server, thread = _serve(Starlette(routes=[Route("/s", endless)]), request_timeout=5.0, write_timeout=1.0)
    try:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")  # ... and never reads
        assert ended.wait(15), "the stream's generator still waits on a client that stopped reading"
        s.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
