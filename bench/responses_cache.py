"""Cached prompt tokens per turn of a multi-turn session: chat completions vs the Responses API.

One in-process router (tiny model, two layers), the official openai client, a 5-turn conversation (a long system
prompt, a user message per turn, sampled answers with reasoning: the tiny model's random tokens, which include
byte sequences that are not valid UTF-8 and so do not survive a round trip through text). Per follow-up turn,
cached / prompt tokens for each way a client can carry the history:

- chat, keeps reasoning: sends back `content` + `reasoning_content` as text;
- chat, strips reasoning (reasoning memory on): what the Agents SDK / LangChain send; the router puts it back;
- chat, strips reasoning (reasoning memory off): the prompt no longer holds the reasoning the model generated;
- responses, previous_response_id: the server keeps the exact tokens.

    python bench/responses_cache.py [--turns 5] [--json bench/results/responses_cache.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import openai

from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.model.config import preset
from expertmesh.router.http import build_app, serve_http

SYSTEM = "You are a careful assistant; think step by step before answering. " * 4


def chat_session(client, turns: int, *, keep_reasoning: bool, seed: int) -> list[float]:
    messages = [{"role": "system", "content": SYSTEM}]
    ratios = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what comes next?"})
        r = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, seed=seed + turn, reasoning_effort="medium"
        )
        if turn:
            ratios.append(r.usage.prompt_tokens_details.cached_tokens / r.usage.prompt_tokens)
        m = r.choices[0].message
        history = {"role": "assistant", "content": m.content or ""}
        if keep_reasoning:
            history["reasoning_content"] = m.reasoning_content
        messages.append(history)
    return ratios


def responses_session(client, turns: int) -> list[float]:
    prev, ratios = None, []
    for turn in range(turns):
        r = client.responses.create(
            model="tiny",
            instructions=SYSTEM,
            input=f"Question {turn}: what comes next?",
            previous_response_id=prev,
            max_output_tokens=24,
            reasoning={"effort": "medium"},
        )
        if turn:
            ratios.append(r.usage.input_tokens_details.cached_tokens / r.usage.input_tokens)
        prev = r.id
    return ratios


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = preset("tiny").model_copy(update={"layer_types": ("kda", "dsa")})
    ck = create_checkpoint(cfg, Path(tempfile.mkdtemp()) / "tiny", seed=0)
    engine = build_local_engine(Checkpoint(ck), attention_workers=1, expert_workers=1)
    servers, columns = [], {}
    try:
        for memory in (True, False):
            port = free_port()
            servers.append(serve_http(build_app(engine, reasoning_memory=memory), "127.0.0.1", port))
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
            if memory:
                columns["chat, keeps reasoning"] = chat_session(client, args.turns, keep_reasoning=True, seed=100)
                columns["chat, strips (memory on)"] = chat_session(client, args.turns, keep_reasoning=False, seed=200)
                columns["responses, previous_response_id"] = responses_session(client, args.turns)
            else:
                columns["chat, strips (memory off)"] = chat_session(client, args.turns, keep_reasoning=False, seed=200)
    finally:
        for srv, thread in servers:
            srv.should_exit = True
            thread.join(timeout=10)
        engine.close()
    names = list(columns)
    print("cached / prompt tokens per follow-up turn")
    print("turn  " + "  ".join(f"{n:>32}" for n in names))
    for i in range(args.turns - 1):
        print(f"{i + 2:>4}  " + "  ".join(f"{columns[n][i]:>32.3f}" for n in names))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"turns": args.turns, "cached_over_prompt": columns}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
