"""Decoding images off the router's event loop: a process pool against a thread pool (router/image_decode.py).

For each mode a fresh process serves the tiny model in process (router + workers) with the image decoder in that
mode, and sends `--requests` concurrent chat requests, each holding one `--side`×`--side` 1-bit PNG (a few KB that
decode to side² pixels), while a thread polls /health. Reported per mode: the time until every request was
answered, /health's worst latency, the serving process's peak resident memory growth (VmHWM) and, for processes,
the decoder processes' peak (RUSAGE_CHILDREN). Also `inline`: decoding on the event loop, as before #33.

    python bench/image_decode.py [--side 7000] [--requests 4] [--json bench/results/image_decode.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODES = ("process", "thread", "inline")


def png_1bit(width: int, height: int) -> bytes:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (width + 7) // 8)
    z = zlib.compressobj(9)
    data = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
        + chunk(b"IDAT", data)
        + chunk(b"IEND", b"")
    )


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def run_mode(mode: str, side: int, requests: int) -> dict:
    """One mode, in this (fresh) process."""
    import base64
    import resource
    import tempfile
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
    from expertmesh.entry.cluster import free_port
    from expertmesh.entry.local import build_local_engine
    from expertmesh.model.config import preset
    from expertmesh.router.http import build_app, serve_http
    from expertmesh.router.image_decode import ImageDecoder, decode_pixels

    ck = create_checkpoint(preset("tiny"), Path(tempfile.mkdtemp()) / "tiny", seed=0)
    engine = build_local_engine(Checkpoint(ck))
    decoder = ImageDecoder(2, processes=mode == "process")
    if mode == "inline":  # decode on the event loop itself (what main did)

        async def inline(data, source, resized, padded):
            return decode_pixels(data, source, resized, padded)

        decoder.decode = inline
    decoder.warm()
    port = free_port()
    srv, thread = serve_http(build_app(engine, image_decoder=decoder), "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    body = {
        "model": "tiny",
        "max_tokens": 1,
        "reasoning_effort": "none",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "?"},
                    {
                        "type": "image_url",
                        "image_url": {
                            "url": "data:image/png;base64," + base64.b64encode(png_1bit(side, side)).decode()
                        },
                    },
                ],
            }
        ],
    }
    httpx.post(
        url + "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "warm"}]}, timeout=120
    )
    time.sleep(1.0)
    before = peak_rss_mib()
    latencies, stop = [], threading.Event()

    def poll():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t = time.monotonic()
                c.get(url + "/health")
                latencies.append(time.monotonic() - t)
                stop.wait(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    start = time.monotonic()
    with ThreadPoolExecutor(requests) as pool:
        codes = list(
            pool.map(
                lambda _: httpx.post(url + "/v1/chat/completions", json=body, timeout=600).status_code, range(requests)
            )
        )
    took = time.monotonic() - start
    stop.set()
    poller.join()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    srv.should_exit = True
    decoder.close()
    engine.close()
    return {
        "mode": mode,
        "side": side,
        "requests": requests,
        "statuses": sorted(set(codes)),
        "seconds": round(took, 2),
        "health_worst_ms": round(max(latencies) * 1000, 1),
        "health_polls": len(latencies),
        "router_peak_growth_mib": round(peak_rss_mib() - before, 1),
        "decoder_peak_mib": round(children, 1) if mode == "process" else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", type=int, default=7000)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--json", default="bench/results/image_decode.json")
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_mode(args.one, args.side, args.requests)))
        return 0
    rows = []
    for mode in MODES:
        out = subprocess.run(
            [sys.executable, __file__, "--one", mode, "--side", str(args.side), "--requests", str(args.requests)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.requests} concurrent requests, one {args.side}×{args.side} 1-bit PNG each")
    print(f"{'mode':8} {'answered':>9} {'/health worst':>14} {'router peak +':>14} {'decoder peak':>13}")
    for r in rows:
        dec = f"{r['decoder_peak_mib']:.0f} MiB" if r["decoder_peak_mib"] is not None else "—"
        print(
            f"{r['mode']:8} {r['seconds']:>8.2f}s {r['health_worst_ms']:>12.0f}ms {r['router_peak_growth_mib']:>10.0f} "
            f"MiB {dec:>13}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
