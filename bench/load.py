"""Load / backpressure benchmark: N concurrent streaming clients against the router's HTTP API.

Each client loops for a bounded time: a streaming /v1/completions request with a random prompt (4..200 token
ids) and a random output length (4..64 tokens); on 429 it backs off briefly and tries again. Reported:
throughput (requests/s, output tokens/s), p50/p99 time to first token and inter-token latency (client side,
per SSE chunk; server side from the /metrics histograms), errors by kind, KV blocks free before vs after the
load (after the queue drained), and the serving process's RSS before / after a warm-up round and at the end.

    python bench/load.py [--quick] [--inprocess | --multiprocess] [--clients 64] [--seconds 30]
                         [--out bench/results/load.json]

`--inprocess` (default): in-process engine behind the real HTTP server on loopback (the load clients share
the process, so its RSS includes them). `--multiprocess`: `LocalCluster` (router + workers as processes;
RSS is the router process's). `run_load(base_url, clients, seconds, ...)` is what tests/router/test_load.py reuses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import httpx

ERROR_KINDS = ("429", "503", "5xx", "4xx", "timeout", "stream_error", "other")
KV_LINE = re.compile(r"^expertmesh_kv_blocks\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$")
BUCKET_LINE = re.compile(r'^(?P<name>\w+)_bucket\{le="(?P<le>[^"]+)"\}\s+(?P<value>\S+)$')


# ----------------------------------------------------------------------------------------------- probes
def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default): psutil when installed, else /proc VmRSS."""
    pid = os.getpid() if pid is None else pid
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def kv_blocks(metrics_text: str) -> dict[str, int]:
    """{"free": n, "total": n} summed over attention workers, from the `expertmesh_kv_blocks` gauge."""
    free = used = 0
    for line in metrics_text.splitlines():
        m = KV_LINE.match(line)
        if m is None:
            continue
        value = int(float(m["value"]))
        if 'state="free"' in m["labels"]:
            free += value
        elif 'state="used"' in m["labels"]:
            used += value
    return {"free": free, "total": free + used}


def histogram_buckets(metrics_text: str, name: str) -> list[tuple[float, float]]:
    """Cumulative (upper bound, count) pairs of an unlabelled Prometheus histogram."""
    out = []
    for line in metrics_text.splitlines():
        m = BUCKET_LINE.match(line)
        if m is not None and m["name"] == name:
            out.append((float(m["le"]), float(m["value"])))
    return sorted(out)


def histogram_quantile(before: list, after: list, q: float) -> float | None:
    """Quantile of the observations made between two scrapes (linear inside the bucket, as Prometheus does)."""
    b = dict(before)
    delta = [(le, c - b.get(le, 0.0)) for le, c in after]
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return None
    rank, lo, prev = q * total, 0.0, 0.0
    for le, c in delta:
        if c >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * ((rank - prev) / (c - prev) if c > prev else 0.0)
        lo, prev = le, c
    return lo


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (None when empty)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def openai_error_shaped(body: bytes) -> bool:
    """`{"error": {"message": str, "type": str, "param": ..., "code": ...}}`"""
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and isinstance(err.get("type"), str)
        and {"param", "code"} <= set(err)
    )


def wait_idle(base_url: str, timeout: float = 120.0, headers: dict | None = None) -> dict:
    """Poll /health until nothing runs or waits; returns the last /health body (raises on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(base_url + "/health", headers=headers, timeout=10).json()
        if h["running"] == 0 and h["waiting"] == 0:
            return h
        if time.monotonic() > deadline:
            raise TimeoutError(f"router not idle after {timeout:.0f}s: {h}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------- load
async def _client(
    i: int,
    http: httpx.AsyncClient,
    model: str,
    stop_at: float,
    stats: dict,
    *,
    seed: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    backoff: float,
) -> None:
    rng = random.Random(seed * 100_003 + i)
    while time.monotonic() < stop_at:
        n_prompt = rng.randint(*prompt_range)
        body = {
            "model": model,
            "prompt": [rng.randrange(256) for _ in range(n_prompt)],
            "max_tokens": rng.randint(*output_range),
            "temperature": 0.8,
            "seed": rng.randrange(2**31),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        stats["sent"] += 1
        t0 = time.perf_counter()
        chunk_times: list[float] = []
        try:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    data = await r.aread()
                    elapsed = time.perf_counter() - t0
                    kind = (
                        str(r.status_code) if r.status_code in (429, 503) else "5xx" if r.status_code >= 500 else "4xx"
                    )
                    stats["errors"][kind] += 1
                    if r.status_code == 429:
                        stats["rejected_latency_s"].append(elapsed)
                        if not openai_error_shaped(data):
                            stats["bad_error_bodies"] += 1
                            _example(stats, "429", data)
                        await asyncio.sleep(backoff * (0.5 + rng.random()))  # jittered back-off
                    else:
                        _example(stats, kind, f"{r.status_code} {data[:300]!r}")
                    continue
                usage, done, failed = None, False, False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        done = True
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        stats["errors"]["stream_error"] += 1
                        _example(stats, "stream_error", event["error"])
                        failed = True
                        continue
                    if event.get("usage"):
                        usage = event["usage"]
                    if any(c.get("text") for c in event.get("choices") or []):
                        chunk_times.append(time.perf_counter())
                if failed:
                    continue
                if not done:
                    stats["errors"]["other"] += 1
                    _example(stats, "other", "stream ended without [DONE]")
                    continue
        except httpx.TimeoutException as e:
            stats["errors"]["timeout"] += 1
            _example(stats, "timeout", repr(e))
            continue
        except Exception as e:  # connection reset, bad JSON in a chunk, ...
            stats["errors"]["other"] += 1
            _example(stats, "other", repr(e))
            continue
        stats["completed"] += 1
        stats["output_tokens"] += int((usage or {}).get("completion_tokens", 0))
        stats["prompt_tokens"] += n_prompt
        if chunk_times:
            stats["ttft_s"].append(chunk_times[0] - t0)
            stats["itl_s"].extend(b - a for a, b in zip(chunk_times, chunk_times[1:]))


def _example(stats: dict, kind: str, what) -> None:
    ex = stats["examples"].setdefault(kind, [])
    if len(ex) < 3:
        ex.append(what if isinstance(what, (str, dict)) else repr(what))


async def _load(base_url: str, clients: int, seconds: float, **kw) -> dict:
    stats = {
        "sent": 0,
        "completed": 0,
        "output_tokens": 0,
        "prompt_tokens": 0,
        "ttft_s": [],
        "itl_s": [],
        "rejected_latency_s": [],
        "bad_error_bodies": 0,
        "errors": {k: 0 for k in ERROR_KINDS},
        "examples": {},
    }
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    timeout = httpx.Timeout(kw.pop("request_timeout"), connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout, headers=kw.pop("headers")) as http:
        model = kw.pop("model") or (await http.get("/v1/models")).json()["data"][0]["id"]
        stop_at = time.monotonic() + seconds
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(i, http, model, stop_at, stats, **kw) for i in range(clients)))
        stats["wall_s"] = time.perf_counter() - t0
    return stats


def run_load(
    base_url: str,
    clients: int = 64,
    seconds: float = 30.0,
    *,
    prompt_range: tuple[int, int] = (4, 200),
    output_range: tuple[int, int] = (4, 64),
    seed: int = 0,
    model: str | None = None,
    request_timeout: float = 60.0,
    backoff: float = 0.05,
    server_pid: int | None = None,
    api_key: str | None = None,
    drain_timeout: float = 120.0,
) -> dict:
    """Run `clients` concurrent streaming clients for `seconds` (in-flight requests then finish), wait until
    the router is idle, and return the figures (plain data; `errors` counts by kind in ERROR_KINDS).

    `server_pid`: the process whose RSS to report (default: this one). KV figures come from /metrics and are
    summed over attention workers; `kv_free_after` is read once nothing runs or waits."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    metrics_before = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    kv_before = kv_blocks(metrics_before)
    rss_before = rss_bytes(server_pid)
    stats = asyncio.run(
        _load(
            base_url,
            clients,
            seconds,
            prompt_range=prompt_range,
            output_range=output_range,
            seed=seed,
            model=model,
            request_timeout=request_timeout,
            backoff=backoff,
            headers=headers,
        )
    )
    t_drain = time.perf_counter()
    wait_idle(base_url, drain_timeout, headers)
    drain_s = time.perf_counter() - t_drain
    metrics_after = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    kv_after = kv_blocks(metrics_after)
    server_q = {}
    for short, name in (
        ("ttft", "expertmesh_time_to_first_token_seconds"),
        ("itl", "expertmesh_inter_token_latency_seconds"),
    ):
        b, a = histogram_buckets(metrics_before, name), histogram_buckets(metrics_after, name)
        for q in (0.5, 0.99):
            v = histogram_quantile(b, a, q)
            server_q[f"server_{short}_p{int(q * 100)}_ms"] = None if v is None else 1000 * v
    wall = stats["wall_s"]
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    return {
        "clients": clients,
        "seconds": seconds,
        "wall_s": wall,
        "drain_s": drain_s,
        "sent": stats["sent"],
        "completed": stats["completed"],
        "requests_per_s": stats["completed"] / wall if wall else 0.0,
        "output_tokens": stats["output_tokens"],
        "output_tokens_per_s": stats["output_tokens"] / wall if wall else 0.0,
        "prompt_tokens": stats["prompt_tokens"],
        "ttft_p50_ms": ms(quantile(stats["ttft_s"], 0.5)),
        "ttft_p99_ms": ms(quantile(stats["ttft_s"], 0.99)),
        "itl_p50_ms": ms(quantile(stats["itl_s"], 0.5)),
        "itl_p99_ms": ms(quantile(stats["itl_s"], 0.99)),
        **server_q,
        "rejected_p50_ms": ms(quantile(stats["rejected_latency_s"], 0.5)),
        "rejected_max_ms": ms(max(stats["rejected_latency_s"], default=None)),
        "errors": stats["errors"],
        "bad_error_bodies": stats["bad_error_bodies"],
        "examples": stats["examples"],
        "kv_free_before": kv_before["free"],
        "kv_free_after": kv_after["free"],
        "kv_total": kv_after["total"],
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_bytes(server_pid),
    }


# ----------------------------------------------------------------------------------------------- deployments
class InProcess:
    """In-process engine (in-process workers) behind the real HTTP server on loopback."""

    def __init__(self, checkpoint, *, attention_workers: int, expert_workers: int, max_running: int, max_waiting: int):
        from expertmesh.entry.cluster import free_port
        from expertmesh.entry.local import build_local_engine
        from expertmesh.router.http import build_app, serve_http

        self.engine = build_local_engine(
            checkpoint,
            attention_workers=attention_workers,
            expert_workers=expert_workers,
            max_running=max_running,
            max_waiting=max_waiting,
        )
        port = free_port()
        self.server, self.thread = serve_http(build_app(self.engine), "127.0.0.1", port)
        self.url, self.pid = f"http://127.0.0.1:{port}", os.getpid()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.close()


class MultiProcess:
    """`LocalCluster`: router + workers as processes (the router's RSS is reported)."""

    def __init__(self, checkpoint, *, attention_workers: int, expert_workers: int, max_running: int, max_waiting: int):
        from expertmesh.entry.cluster import LocalCluster, free_port

        # the router process has no --max-running flag: it runs with the Engine's default
        self.cluster = LocalCluster(
            checkpoint,
            attention_workers=attention_workers,
            expert_workers=expert_workers,
            http_port=free_port(),
            grpc_port=free_port(),
            router_args=["--max-waiting", str(max_waiting)],
        )
        self.cluster.start()
        self.url, self.pid = self.cluster.http_url, self.cluster.router.proc.pid

    def close(self) -> None:
        self.cluster.stop()


# ----------------------------------------------------------------------------------------------- report
def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(rounds: dict[str, dict], rss: dict[str, int]) -> str:
    cols = list(rounds)
    rows = [
        ("clients × seconds", lambda r: f"{r['clients']} × {r['seconds']:g}"),
        ("requests sent / completed", lambda r: f"{r['sent']} / {r['completed']}"),
        ("requests/s", lambda r: _fmt(r["requests_per_s"], ".2f")),
        ("output tokens/s", lambda r: _fmt(r["output_tokens_per_s"], ".1f")),
        ("TTFT p50 / p99 ms (client)", lambda r: f"{_fmt(r['ttft_p50_ms'])} / {_fmt(r['ttft_p99_ms'])}"),
        ("ITL p50 / p99 ms (client)", lambda r: f"{_fmt(r['itl_p50_ms'])} / {_fmt(r['itl_p99_ms'])}"),
        ("TTFT p50 / p99 ms (server)", lambda r: f"{_fmt(r['server_ttft_p50_ms'])} / {_fmt(r['server_ttft_p99_ms'])}"),
        ("ITL p50 / p99 ms (server)", lambda r: f"{_fmt(r['server_itl_p50_ms'])} / {_fmt(r['server_itl_p99_ms'])}"),
        ("429 latency p50 / max ms", lambda r: f"{_fmt(r['rejected_p50_ms'])} / {_fmt(r['rejected_max_ms'])}"),
        *((f"errors: {k}", (lambda k: lambda r: str(r["errors"][k]))(k)) for k in ERROR_KINDS),
        ("429 bodies not OpenAI-shaped", lambda r: str(r["bad_error_bodies"])),
        ("KV free before → after / total", lambda r: f"{r['kv_free_before']} → {r['kv_free_after']} / {r['kv_total']}"),
        ("drain after load, s", lambda r: _fmt(r["drain_s"], ".2f")),
    ]
    width = max(len(name) for name, _ in rows)
    colw = max(22, *(len(c) for c in cols))
    lines = [
        f"{'figure':<{width}}  " + "  ".join(f"{c:>{colw}}" for c in cols),
        "-" * width + "  " + "  ".join("-" * colw for _ in cols),
    ]
    lines += [f"{name:<{width}}  " + "  ".join(f"{fn(rounds[c]):>{colw}}" for c in cols) for name, fn in rows]
    mib = 2**20
    lines.append("(KV blocks not free after the load are held by the prefix cache, evicted on demand)")
    lines.append("")
    lines.append("RSS of the serving process: " + ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in rss.items()))
    if "after_warmup" in rss and "end" in rss:
        growth = (rss["end"] - rss["after_warmup"]) / rss["after_warmup"]
        lines.append(f"RSS growth after warm-up: {100 * growth:+.2f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--inprocess", dest="mode", action="store_const", const="inprocess")
    mode.add_argument("--multiprocess", dest="mode", action="store_const", const="multiprocess")
    p.add_argument("--quick", action="store_true", help="8 clients, 5 s rounds (smoke run)")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default 64; --quick 8)")
    p.add_argument(
        "--seconds", type=float, default=None, help="load duration of the measured round (default 30; --quick 5)"
    )
    p.add_argument("--warmup-seconds", type=float, default=None, help="warm-up round (default: a third of --seconds)")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the synthetic --preset one)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--attention-workers", type=int, default=1)
    p.add_argument("--expert-workers", type=int, default=2)
    p.add_argument("--max-running", type=int, default=64, help="in-process only")
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "load.json"))
    args = p.parse_args(argv)
    mode = args.mode or "inprocess"
    clients = args.clients or (8 if args.quick else 64)
    seconds = args.seconds or (5.0 if args.quick else 30.0)
    warmup = args.warmup_seconds if args.warmup_seconds is not None else max(2.0, seconds / 3)

    if args.checkpoint:
        checkpoint = args.checkpoint
    else:
        from expertmesh.checkpoint.loader import default_checkpoint

        checkpoint = str(default_checkpoint(args.preset))
    kw = dict(
        attention_workers=args.attention_workers,
        expert_workers=args.expert_workers,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
    )
    deployment = InProcess(checkpoint, **kw) if mode == "inprocess" else MultiProcess(checkpoint, **kw)
    rss = {"start": rss_bytes(deployment.pid)}
    try:
        load = dict(request_timeout=args.request_timeout, server_pid=deployment.pid)
        rounds = {"warm-up": run_load(deployment.url, clients, warmup, seed=args.seed, **load)}
        rss["after_warmup"] = rss_bytes(deployment.pid)
        rounds["measured"] = run_load(deployment.url, clients, seconds, seed=args.seed + 1, **load)
        rss["end"] = rss_bytes(deployment.pid)
    finally:
        deployment.close()
    print(
        f"load: {mode}, checkpoint {checkpoint}, {args.attention_workers} attention + {args.expert_workers} expert "
        f"workers, max_waiting {args.max_waiting}"
        + (f", max_running {args.max_running}" if mode == "inprocess" else "")
    )
    print(table(rounds, rss))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"mode": mode, "checkpoint": checkpoint, "args": vars(args), "rounds": rounds, "rss_bytes": rss}, indent=1
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
