"""A tiny Kimi K3 tokenizer directory, written the same way on every run: `tiktoken.model` (a byte-level BPE whose
ranks are learned here from a few sentences of chat, tool and JSON text, with multi-byte UTF-8 merges so that
tokens can hold pieces of a character), `tokenizer_config.json` (K3's special tokens in `added_tokens_decoder`,
placed among reserved ids the way Kimi's vocabularies place them after the BPE ranks) and, optionally, a K3
`config.json`. scripts/k3_chat_oracle.py renders its expected ids with this directory; tests/chat/test_k3_render.py
checks that the directory it writes is still the one the data was made with (`tokenizer_digest`)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

CORPUS = [
    "The weather in Paris is sunny today, and tomorrow it will rain in Oslo.",
    "You are a helpful assistant. Use the tools when they help; answer briefly.",
    "Let me think step by step: the user wants the weather, so I should call the tool first.",
    'message role="assistant" role="user" role="system" role="tool" type="tool-declare" index="1" index="2"',
    'think response tools call tool="get_weather" argument key="city" type="string" type="number" type="object"',
    '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}',
    "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n[]\n```",
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel)",
    "The system is invoked with `tool_choice=required`. You MUST call tools in the next message.",
    "Your response must be raw JSON data without markdown code blocks or any additional formatting.",
    "18 degrees and sunny; 12 degrees with rain. 1234567890 3.14159 true false null",
    "café naïve Ça va très bien ✓ 日本語のテキスト 天气很好 東京 🌍🚀 Привет мир مرحبا",
]
N_MERGES = 420
# K3's special tokens at their offsets after the BPE ranks; the other ids up to N_RESERVED are reserved tokens
SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    5: "<|open|>",
    6: "<|close|>",
    7: "<|sep|>",
    10: "<|kimi_image_placeholder|>",
    11: "<|media_begin|>",
    12: "<|media_content|>",
    13: "<|media_end|>",
    14: "<|media_pad|>",
    20: "[UNK]",
    21: "[PAD]",
}
N_RESERVED = 64


def train_ranks() -> dict[bytes, int]:
    """Byte-level BPE over CORPUS: all 256 bytes, then the most frequent adjacent pair merged, N_MERGES times
    (ties broken by the pair's bytes, so the result never depends on dict order)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter()
    for line in CORPUS * 3 + CORPUS[-1:] * 12:  # the non-ASCII line weighs more: merges inside characters
        for w in re.findall(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+", line):
            words[tuple(bytes([b]) for b in w.encode("utf-8"))] += 1
    for _ in range(N_MERGES):
        pairs: Counter = Counter()
        for w, count in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        merged: Counter = Counter()
        for w, count in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def special_ids(n_base: int) -> dict[str, int]:
    return {token: n_base + offset for offset, token in SPECIALS.items()}


def write_k3_tokenizer(directory: Path, *, config: bool = True) -> dict[str, int]:
    """Write the tiny K3 tokenizer (and, with `config`, a kimi_k3 config.json naming <|end_of_msg|> as EOS) into
    `directory`; returns the special tokens' ids."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = train_ranks()
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    ids = special_ids(len(ranks))
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in sorted(ids.items(), key=lambda kv: kv[1])
    }
    tokenizer_config = {
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "num_reserved_special_tokens": N_RESERVED,
        "tokenizer_class": "TikTokenTokenizer",
        "model_max_length": 1048576,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")
    if config:
        (directory / "config.json").write_text(
            json.dumps(
                {
                    "model_type": "kimi_k3",
                    "architectures": ["KimiK3ForConditionalGeneration"],
                    "eos_token_id": ids["<|end_of_msg|>"],
                    "media_placeholder_token_id": ids["<|media_pad|>"],
                    "text_config": {"model_type": "kimi_linear", "vocab_size": len(ranks) + N_RESERVED},
                },
                indent=1,
            )
            + "\n"
        )
    return ids


def tokenizer_digest(directory: Path) -> str:
    """SHA-256 over the two tokenizer files (what the oracle's expected ids depend on)."""
    h = hashlib.sha256()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        h.update((Path(directory) / name).read_bytes())
    return h.hexdigest()
