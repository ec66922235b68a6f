"""`expertmesh chat`: stream an answer from a running router (OpenAI-compatible HTTP); without a prompt, an
interactive multi-turn session that keeps the whole history (reasoning included) so the prefix cache hits."""

from __future__ import annotations

import json
import os
import sys

import httpx

from expertmesh.runtime.argtypes import positive_int


def stream_chat(
    url: str,
    model: str,
    messages: list[dict],
    *,
    thinking: str,
    max_tokens: int,
    api_key: str | None,
    out=None,
    err=None,
    temperature: float = 0.0,
) -> dict:
    """Send one chat turn; print reasoning (dimmed, to `err`) and the answer (to `out`) as they stream (default:
    sys.stderr / sys.stdout as they are at the call, not at import). Returns the assistant message to append to the
    history."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "max_tokens": max_tokens,
        "thinking_budget": thinking,
        "temperature": temperature,
        "stream_options": {"include_usage": True},
    }
    reasoning, content, calls, usage = [], [], [], None
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        with client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                try:
                    msg = r.json()["error"]["message"]
                except Exception:
                    msg = r.text
                raise RuntimeError(f"HTTP {r.status_code}: {msg}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("reasoning_content"):
                        reasoning.append(delta["reasoning_content"])
                        err.write(delta["reasoning_content"])
                        err.flush()
                    if delta.get("content"):
                        if not content and reasoning:
                            err.write("\n")
                        content.append(delta["content"])
                        out.write(delta["content"])
                        out.flush()
                    calls += delta.get("tool_calls") or []
    out.write("\n")
    if usage:
        details = usage.get("completion_tokens_details") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        err.write(
            f"[{usage['prompt_tokens']} prompt ({cached} cached), {usage['completion_tokens']} completion "
            f"({details.get('reasoning_tokens', 0)} reasoning) tokens]\n"
        )
    msg = {"role": "assistant", "content": "".join(content)}
    if reasoning:  # sent back only when there was some: a template may render "" and no reasoning differently
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return msg


def run(args) -> int:
    api_key = args.api_key or os.environ.get("EXPERTMESH_API_KEY")
    model = args.model
    if model is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            model = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            print(f"expertmesh chat: error: --url {args.url}: cannot list the router's models ({e})", file=sys.stderr)
            return 2
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    prompts = [args.prompt] if args.prompt else None
    while True:
        if prompts is not None:
            if not prompts:
                return 0
            text = prompts.pop(0)
        else:
            try:
                text = input("you> ")
            except EOFError:
                return 0
            if text.strip() in ("/exit", "/quit"):
                return 0
            if not text.strip():
                continue
        history.append({"role": "user", "content": text})
        try:
            history.append(
                stream_chat(
                    args.url, model, history, thinking=args.thinking, max_tokens=args.max_tokens, api_key=api_key
                )
            )
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"expertmesh chat: {e}", file=sys.stderr)
            history.pop()
            if prompts is not None:
                return 1


def add_arguments(p) -> None:
    p.add_argument("prompt", nargs="?", help="one prompt; without it, an interactive session")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the router's first model")
    p.add_argument("--thinking", choices=["low", "high", "max"], default="high")
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--system", default=None)
    p.add_argument("--api-key", default=None, help="default: $EXPERTMESH_API_KEY")
