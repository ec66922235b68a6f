"""Tokenizers: the built-in byte tokenizer, a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), or a
checkpoint's `tiktoken.model` (Kimi K2 / K3's TikToken vocabulary).

All offer the one small interface the router and the chat formats use:

    encode(text)                 plain text → ids (no BOS/EOS added)
    encode_prompt(text)          a raw completion prompt → ids, with the special tokens the checkpoint adds (BOS…)
    decode(ids, skip_special=True)
    stream_decoder(skip_special=True)   .feed(id) → new text, .flush() → the rest; never half a UTF-8 character
    special(token)               the id of a special-token string (ValueError when it is not one token)
    eos_ids                      the ids that end generation
    vocab_size                   ids are 0 .. vocab_size-1

The byte tokenizer lives here; chat/hf_tokenizer.py and chat/tiktoken_tokenizer.py hold the checkpoint tokenizers
(over chat/tokenizer_files.py), and `load_tokenizer` picks one. Synthetic checkpoints have no tokenizer.json and use
the byte tokenizer: ids 0..255 are the bytes of the UTF-8 text, the special tokens follow (the layout is
expertmesh/model/byte_vocab.py, which the presets' vocabulary size comes from). Every tokenizer also gives each id's
bytes (`decode_bytes`: what the id adds to decoded text, b"" for a special token) and its special tokens
(`id_to_special`), which constrained decoding (expertmesh/chat/grammar.py) reads.
"""

from __future__ import annotations

import codecs
from pathlib import Path

from expertmesh.chat.hf_tokenizer import CheckpointTokenizer
from expertmesh.chat.tiktoken_tokenizer import TikTokenTokenizer
from expertmesh.model.byte_vocab import N_BYTES, SPECIAL_TOKENS, VOCAB_SIZE


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, special tokens at 256 onwards."""

    def __init__(self) -> None:
        self.special_to_id = {tok: N_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.id_to_special = {i: tok for tok, i in self.special_to_id.items()}
        self.vocab_size = VOCAB_SIZE

    def __getattr__(self, name: str) -> int:  # tok.eos_id, tok.think_end_id, ...
        aliases = {
            "pad_id": "<|pad|>",
            "bos_id": "<|bos|>",
            "eos_id": "<|eos|>",
            "system_id": "<|system|>",
            "user_id": "<|user|>",
            "assistant_id": "<|assistant|>",
            "tool_id": "<|tool|>",
            "end_id": "<|end|>",
            "think_start_id": "<|think|>",
            "think_end_id": "<|/think|>",
            "tool_call_start_id": "<|tool_call|>",
            "tool_call_end_id": "<|/tool_call|>",
            "tools_start_id": "<|tools|>",
            "tools_end_id": "<|/tools|>",
            "image_start_id": "<|image|>",
            "image_end_id": "<|/image|>",
            "image_pad_id": "<|image_pad|>",
        }
        if name in aliases:
            return self.special_to_id[aliases[name]]
        raise AttributeError(name)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode(self, text: str) -> list[int]:
        """Plain text only: special-token strings inside `text` stay ordinary bytes (no injection).
        Text that is not valid Unicode (a lone surrogate) raises ValueError saying where."""
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ValueError(
                f"text is not valid Unicode: {e.reason} at character {e.start} ({text[e.start : e.end]!r})"
            ) from None

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id] + self.encode(text)

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
                continue  # a model's padded vocabulary rows decode to nothing (as CheckpointTokenizer)
            text.append(out.decode("utf-8", errors="replace"))
            out.clear()
            if not skip_special and i in self.id_to_special:
                text.append(self.id_to_special[i])
        text.append(out.decode("utf-8", errors="replace"))
        return "".join(text)

    def decode_bytes(self, ids) -> bytes:
        """The raw bytes of the non-special ids (for streaming: decode once a UTF-8 sequence is complete)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < N_BYTES)

    def stream_decoder(self, *, skip_special: bool = True) -> ByteStreamDecoder:
        return ByteStreamDecoder(self, skip_special)


class ByteStreamDecoder:
    """Byte tokens → text as soon as each UTF-8 sequence is complete."""

    def __init__(self, tok: ByteTokenizer, skip_special: bool):
        self.tok, self.skip_special = tok, skip_special
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        if 0 <= token < N_BYTES:
            return self.utf8.decode(bytes([token]))
        if self.skip_special or token not in self.tok.id_to_special:
            return ""
        return self.utf8.decode(b"", final=True) + self.tok.id_to_special[token]

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)


def load_tokenizer(checkpoint_dir: str | Path | None = None) -> ByteTokenizer | CheckpointTokenizer | TikTokenTokenizer:
    """The checkpoint's own tokenizer: `tiktoken.model` (Kimi K2 / K3) when it has one, else `tokenizer.json`,
    else the byte tokenizer (synthetic checkpoints)."""
    if checkpoint_dir is not None and (Path(checkpoint_dir) / "tiktoken.model").exists():
        return TikTokenTokenizer(checkpoint_dir)
    if checkpoint_dir is not None and (Path(checkpoint_dir) / "tokenizer.json").exists():
        return CheckpointTokenizer(checkpoint_dir)
    return ByteTokenizer()


AnyTokenizer = ByteTokenizer | CheckpointTokenizer | TikTokenTokenizer
