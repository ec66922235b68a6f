"""What the router hardening tests (tests/router/test_hardening_*.py, #33) send to the shared deployment
(tests/support/api_deployment.py) and how they watch it: request bodies, a /health poller, a process's peak RSS."""

from __future__ import annotations

import base64
import threading
import time

import httpx

from support.api_deployment import API_KEY


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class HealthPoller:
    """GET /health in a loop from a thread while a test runs: the slowest answer (and whether every one came)."""

    def __init__(self, url: str):
        self.url, self.latencies, self.failures = url + "/health", [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
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


def post(c, path: str, body: dict, timeout: float = 120, key: str = API_KEY):
    return httpx.post(c.http_url + path, json=body, timeout=timeout, headers={"authorization": f"Bearer {key}"})
