"""The chat-body walk: the project files a chat completion's body passes through on its way from the HTTP handler to
the engine's `submit` (its preparation), recorded by a profiler (an in-process tiny deployment; one request with a
system prompt, a tool and a thinking effort). Prints JSON: distinct files, stops (a call into another file than the
last one's), returns (stops in a file already visited) and the path.

    PYTHONSAFEPATH=1 .venv/bin/python scripts/chat_walk.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from fastapi.testclient import TestClient

from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
from expertmesh.entry.local import build_local_engine
from expertmesh.model.config import preset
from expertmesh.router.http import build_app

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("router", "expertmesh", "worker", "kernels", "protos", "operator")
BODY = {
    "model": "tiny",
    "messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "reasoning_effort": "low",
    "max_tokens": 2,
    "temperature": 0,
}


def walk() -> list[str]:
    ckpt = create_checkpoint(
        preset("tiny").model_copy(update={"layer_types": ("kda", "dsa")}), Path(tempfile.mkdtemp()) / "t", seed=0
    )
    engine = build_local_engine(Checkpoint(ckpt), attention_workers=1, expert_workers=1)
    client = TestClient(build_app(engine))
    stops: list[str] = []
    state = {"on": False, "done": False}
    submit = type(engine).submit

    def recording_submit(self, *a, **kw):
        state["done"] = True
        return submit(self, *a, **kw)

    def profile(frame, event, arg):
        if event != "call" or state["done"]:
            return
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(str(REPO)):
            return
        rel = os.path.relpath(path, REPO)
        if rel.split("/")[0] not in FOLDERS:
            return
        if frame.f_code.co_name == "chat" and rel == "router/openai_api.py":
            state["on"] = True
        if state["on"] and (not stops or stops[-1] != rel):
            stops.append(rel)

    assert client.post("/v1/chat/completions", json=BODY).status_code == 200  # warm: lazy imports
    type(engine).submit = recording_submit
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        response = client.post("/v1/chat/completions", json=BODY)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        type(engine).submit = submit
        engine.close()
    assert response.status_code == 200, response.text
    return stops


if __name__ == "__main__":
    path = walk()
    returns = sum(1 for i, stop in enumerate(path) if stop in path[:i])
    print(json.dumps({"files": len(set(path)), "stops": len(path), "returns": returns, "path": path}))
    os._exit(0)  # the in-process workers' threads need not wind down
