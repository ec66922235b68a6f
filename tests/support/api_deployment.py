"""One `expertmesh up`-style deployment (router + 1 attention + 2 expert workers as processes, on loopback, on the
shared tiny checkpoint) that the public-API test files share: starting it takes seconds, so the session starts it
once (the `api_deployment` fixture in tests/conftest.py) instead of once per file.

Its settings are the union of what those files test: a non-default per-image byte limit and image count (so a test
can tell the flags are read), a 1 MiB response store, a 2 s image-fetch deadline, a 3 s client write deadline, and
two image hosts on the fetch allow-list — a static file server (`files_dir`, allowed as 127.0.0.1 only) and a
drip server (allowed as 127.0.0.1 and localhost). A test that needs other serving settings (context, budgets,
pools, TLS, processes it kills) starts its own deployment."""

from __future__ import annotations

import functools
import http.server
import struct
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from expertmesh.entry.cluster import LocalCluster, free_port

API_KEY = "sk-test-api-deployment"
MAX_IMAGE_BYTES = 1_000_000  # above every image the hardening tests send in one piece (≤ ~0.6 MB)
MAX_IMAGES_PER_REQUEST = 20  # the hardening tests send 16 images to reach the context check
FETCH_TIMEOUT_S = 2
CLIENT_WRITE_TIMEOUT_S = 3
STORED_RESPONSES_MIB = 1


def png_1bit(width: int, height: int) -> bytes:
    """A black 1-bit PNG of width × height written directly (Pillow would hold every pixel to write it): a few KB
    for tens of millions of pixels."""

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


def _serve(handler) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def drip_server() -> http.server.ThreadingHTTPServer:
    """An HTTP server for image URLs: /drip… sends a PNG one byte every 0.2 s (a slow-drip body), anything else at
    once."""
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

    return _serve(Handler)


def file_server(directory: Path) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a: None
    return _serve(handler)


@dataclass
class ApiDeployment:
    cluster: LocalCluster
    files_dir: Path  # served by `files_port` (write what a test fetches here)
    files_port: int
    drip_port: int

    @property
    def http_url(self) -> str:
        return self.cluster.http_url

    @property
    def grpc_port(self) -> int:
        return self.cluster.grpc_port


@contextmanager
def api_deployment(checkpoint_dir: Path, root: Path):
    files_dir = root / "www"
    files_dir.mkdir(parents=True, exist_ok=True)
    files, drip = file_server(files_dir), drip_server()
    files_port, drip_port = files.server_address[1], drip.server_address[1]
    cluster = LocalCluster(
        checkpoint_dir,
        attention_workers=1,
        expert_workers=2,
        http_port=free_port(),
        grpc_port=free_port(),
        extra_env={"EXPERTMESH_API_KEY": API_KEY},
        router_args=[
            *("--max-image-bytes", str(MAX_IMAGE_BYTES)),
            *("--max-images-per-request", str(MAX_IMAGES_PER_REQUEST)),
            *("--stored-responses-mib", str(STORED_RESPONSES_MIB)),
            *("--image-fetch-timeout", str(FETCH_TIMEOUT_S)),
            *("--client-write-timeout", str(CLIENT_WRITE_TIMEOUT_S)),
            "--image-fetch-allow",
            f"127.0.0.1:{files_port},127.0.0.1:{drip_port},localhost:{drip_port}",
        ],
    )
    try:
        with cluster:
            yield ApiDeployment(cluster, files_dir, files_port, drip_port)
    finally:
        files.shutdown()
        drip.shutdown()
