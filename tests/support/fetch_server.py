"""A loopback HTTP(S) server for checkpoint fetch tests: serves a directory with Range support, and can misbehave on
purpose — fail the first requests of a path with 503, cut a response off after some bytes, serve slowly, redirect
(to another origin: a second server on another port), send more bytes than the file has (or never stop), pad a JSON
body with whitespace — so retries, resumption, bounds and progress can be tested against real sockets."""

from __future__ import annotations

import http.server
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Faults:
    fail: dict = field(default_factory=dict)  # path → how many requests to answer 503
    cut: dict = field(default_factory=dict)  # path → cut the next response off after this many bytes (once)
    delay: float = 0.0  # seconds to sleep per 64 KiB chunk served (slow link)
    requests: list = field(default_factory=list)  # (path, Range header or None, status)
    auth: Callable[[str, dict], bool] | None = None  # (url path, headers) → allowed; else 403
    redirect: dict = field(default_factory=dict)  # path → Location to answer 302 with (every request)
    oversize: dict = field(default_factory=dict)  # path → bytes sent after the file's own (None: without end), or
    #                                               as a redirect's body; no Content-Length, the body ends when the
    #                                               connection closes
    pad: dict = field(default_factory=dict)  # path → spaces sent before the file's bytes (None: without end);
    #                                               no Content-Length (a JSON body that is huge yet parses)
    headers: list = field(default_factory=list)  # (path, {header: value}) of every request
    sent: dict = field(default_factory=dict)  # path → body bytes written


class FileServer:
    def __init__(self, root: Path, faults: Faults | None = None, tls: tuple[Path, Path] | None = None):
        """`tls`: (certificate, key) PEM files — the server speaks HTTPS."""
        self.root, self.faults = Path(root), faults or Faults()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _body(self, path: str, chunks) -> None:
                f = server.faults
                try:
                    for chunk in chunks:
                        if f.delay:
                            time.sleep(f.delay)
                        self.wfile.write(chunk)
                        f.sent[path] = f.sent.get(path, 0) + len(chunk)
                except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                    pass  # the client stopped reading

            def do_GET(self):
                path = self.path.split("?", 1)[0].lstrip("/")
                rng = self.headers.get("Range")
                f = server.faults
                f.headers.append((path, dict(self.headers)))
                if f.auth is not None and not f.auth(self.path, dict(self.headers)):
                    f.requests.append((path, rng, 403))
                    self.send_error(403)
                    return
                if f.fail.get(path, 0) > 0:
                    f.fail[path] -= 1
                    f.requests.append((path, rng, 503))
                    self.send_error(503)
                    return
                if path in f.redirect:
                    f.requests.append((path, rng, 302))
                    self.send_response(302)
                    self.send_header("Location", f.redirect[path])
                    if path not in f.oversize:
                        self.send_header("Content-Length", "0")
                    self.end_headers()
                    if path in f.oversize:  # a body with the redirect
                        self.close_connection = True
                        self._body(path, _unbounded(b"", f.oversize[path], 0))
                    return
                p = server.root / path
                if not p.is_file():
                    f.requests.append((path, rng, 404))
                    self.send_error(404)
                    return
                data = p.read_bytes()
                if path in f.oversize or path in f.pad:
                    f.requests.append((path, rng, 200))
                    self.send_response(200)
                    self.end_headers()
                    self.close_connection = True
                    self._body(path, _unbounded(data, f.oversize.get(path, 0), f.pad.get(path, 0)))
                    return
                start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                status = 206 if rng else 200
                f.requests.append((path, rng, status))
                self.send_response(status)
                self.send_header("Content-Length", str(len(data) - start))
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                body = data[start:]
                cut = f.cut.pop(path, None)
                if cut is not None:
                    body = body[:cut]
                self._body(path, (body[i : i + 65536] for i in range(0, len(body), 65536)))
                if cut is not None:
                    self.close_connection = True

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="fetch-server")

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _unbounded(data: bytes, extra: int | None, pad: int | None):
    """`pad` spaces, the file, then `extra` more bytes; None: that part never ends."""

    def run(n: int | None, chunk: bytes):
        while n is None or n > 0:
            piece = chunk if n is None else chunk[:n]
            yield piece
            if n is not None:
                n -= len(piece)

    yield from run(pad, b" " * 65536)
    for i in range(0, len(data), 65536):
        yield data[i : i + 65536]
    yield from run(extra, bytes(range(256)) * 256)
