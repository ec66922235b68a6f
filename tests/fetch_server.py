"""A loopback HTTP server for checkpoint fetch tests: serves a directory with Range support, and can misbehave on
purpose — fail the first requests of a path with 503, cut a response off after some bytes, serve slowly — so
retries, resumption and progress can be tested against real sockets."""
from __future__ import annotations

import http.server
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


@dataclass
class Faults:
    fail: dict = field(default_factory=dict)      # path → how many requests to answer 503
    cut: dict = field(default_factory=dict)       # path → cut the next response off after this many bytes (once)
    delay: float = 0.0                            # seconds to sleep per 64 KiB chunk served (slow link)
    requests: list = field(default_factory=list)  # (path, Range header or None, status)
    auth: Optional[Callable[[str, dict], bool]] = None  # (url path, headers) → allowed; else 403


class FileServer:
    def __init__(self, root: Path, faults: Optional[Faults] = None):
        self.root, self.faults = Path(root), faults or Faults()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                path = self.path.split("?", 1)[0].lstrip("/")
                rng = self.headers.get("Range")
                f = server.faults
                if f.auth is not None and not f.auth(self.path, dict(self.headers)):
                    f.requests.append((path, rng, 403))
                    self.send_error(403)
                    return
                if f.fail.get(path, 0) > 0:
                    f.fail[path] -= 1
                    f.requests.append((path, rng, 503))
                    self.send_error(503)
                    return
                p = server.root / path
                if not p.is_file():
                    f.requests.append((path, rng, 404))
                    self.send_error(404)
                    return
                data = p.read_bytes()
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
                for i in range(0, len(body), 65536):
                    if f.delay:
                        time.sleep(f.delay)
                    self.wfile.write(body[i:i + 65536])
                if cut is not None:
                    self.close_connection = True

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="fetch-server")

    def __enter__(self) -> "FileServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
