"""Byte-level tokenizer with special tokens: no download, every string round-trips.

Ids 0..255 are the bytes of the UTF-8 text; the special tokens follow. A `tokenizer.json` beside a real
checkpoint (Hugging Face `tokenizers` format) is used instead when present and the package is installed.
"""
from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = (
    "<|pad|>", "<|bos|>", "<|eos|>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>",
    "<|think|>", "<|/think|>", "<|tool_call|>", "<|/tool_call|>",
    "<|tools|>", "<|/tools|>",
)
N_BYTES = 256
N_SPECIAL_SLOTS = 32  # room for more special tokens without changing the vocabulary size
VOCAB_SIZE = N_BYTES + N_SPECIAL_SLOTS


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, special tokens at 256 onwards."""

    def __init__(self) -> None:
        self.special_to_id = {tok: N_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.id_to_special = {i: tok for tok, i in self.special_to_id.items()}
        self.vocab_size = VOCAB_SIZE

    def __getattr__(self, name: str) -> int:  # tok.eos_id, tok.think_end_id, ...
        aliases = {
            "pad_id": "<|pad|>", "bos_id": "<|bos|>", "eos_id": "<|eos|>", "system_id": "<|system|>",
            "user_id": "<|user|>", "assistant_id": "<|assistant|>", "tool_id": "<|tool|>", "end_id": "<|end|>",
            "think_start_id": "<|think|>", "think_end_id": "<|/think|>", "tool_call_start_id": "<|tool_call|>",
            "tool_call_end_id": "<|/tool_call|>", "tools_start_id": "<|tools|>", "tools_end_id": "<|/tools|>",
        }
        if name in aliases:
            return self.special_to_id[aliases[name]]
        raise AttributeError(name)

    def encode(self, text: str) -> list[int]:
        """Plain text only: special-token strings inside `text` stay ordinary bytes (no injection).
        Text that is not valid Unicode (a lone surrogate) raises ValueError saying where."""
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not valid Unicode: {e.reason} at character {e.start} "
                             f"({text[e.start:e.end]!r})") from None

    def special(self, token: str) -> int:
        try:
            return self.special_to_id[token]
        except KeyError:
            raise ValueError(f"unknown special token {token!r}") from None

    def decode(self, ids, *, skip_special: bool = True) -> str:
        out = bytearray()
        text: list[str] = []
        for i in ids:
            i = int(i)
            if 0 <= i < N_BYTES:
                out.append(i)
                continue
            if not 0 <= i < VOCAB_SIZE:
                raise ValueError(f"token id {i} outside the vocabulary [0, {VOCAB_SIZE})")
            text.append(out.decode("utf-8", errors="replace"))
            out.clear()
            if not skip_special and i in self.id_to_special:
                text.append(self.id_to_special[i])
        text.append(out.decode("utf-8", errors="replace"))
        return "".join(text)

    def decode_bytes(self, ids) -> bytes:
        """The raw bytes of the non-special ids (for streaming: decode once a UTF-8 sequence is complete)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < N_BYTES)


def load_tokenizer(checkpoint_dir: str | Path | None = None) -> ByteTokenizer:
    """The byte tokenizer (a real checkpoint's tokenizer.json is not supported yet: said, not silently ignored)."""
    if checkpoint_dir is not None and (Path(checkpoint_dir) / "tokenizer.json").exists():
        raise NotImplementedError(
            f"{checkpoint_dir}/tokenizer.json: only the built-in byte tokenizer is supported so far")
    return ByteTokenizer()
