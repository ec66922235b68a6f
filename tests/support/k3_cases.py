"""The Kimi-K3 chat oracle, tests/data/k3/chat_cases.json (written by scripts/k3_chat_oracle.py from the
llama-cpp-python 0.3.36 template): the tokenizer it rendered with, its conversations with their text, ids and
assistant outputs, and the cases' messages as the router hands them to a chat format."""

import json
from dataclasses import dataclass

from expertmesh.chat.format import Message, ToolCall
from support.paths import DATA

K3_ORACLE: dict = json.loads((DATA / "k3" / "chat_cases.json").read_text())
K3_CASES: list[dict] = K3_ORACLE["cases"]


@dataclass
class Image:  # what the renderer reads of router.prepared_image.PreparedImage
    tokens: int
    source_size: tuple[int, int]


def to_messages(raw: list[dict], images=None) -> list[Message]:
    """The oracle's OpenAI-shaped messages as the router hands them to a chat format."""
    out, queue = [], [Image(i["tokens"], tuple(i["size"])) for i in images or ()]
    for m in raw:
        calls = [
            ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()
        ]
        content, parts = m.get("content") or "", None
        if isinstance(content, list):
            parts = [p["text"] if p["type"] == "text" else queue.pop(0) for p in content]
            content = "".join(p for p in parts if isinstance(p, str))
        out.append(
            Message(
                m["role"],
                content,
                reasoning=m.get("reasoning_content"),
                tool_calls=calls,
                tool_call_id=m.get("tool_call_id"),
                parts=parts,
            )
        )
    return out


def options(case: dict) -> dict:
    """A case's render options, its tools included."""
    return {**case["options"], "tools": case["tools"]}


def phase(case: dict) -> str:
    """Where the case's generation prompt leaves the model: in its reasoning when thinking is on."""
    return "reasoning" if case["options"]["thinking"] else "content"
