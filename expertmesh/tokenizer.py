"""Tokenizers: the built-in byte tokenizer, or a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`).

Both offer the one small interface the router and the chat formats use:

    encode(text)                 plain text → ids (no BOS/EOS added)
    encode_prompt(text)          a raw completion prompt → ids, with the special tokens the checkpoint adds (BOS…)
    decode(ids, skip_special=True)
    stream_decoder(skip_special=True)   .feed(id) → new text, .flush() → the rest; never half a UTF-8 character
    special(token)               the id of a special-token string (ValueError when it is not one token)
    eos_ids                      the ids that end generation
    vocab_size                   ids are 0 .. vocab_size-1

Synthetic checkpoints have no tokenizer.json and use the byte tokenizer: ids 0..255 are the bytes of the UTF-8
text, the special tokens follow.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path

SPECIAL_TOKENS = (
    "<|pad|>", "<|bos|>", "<|eos|>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>",
    "<|think|>", "<|/think|>", "<|tool_call|>", "<|/tool_call|>",
    "<|tools|>", "<|/tools|>",
    "<|image|>", "<|/image|>", "<|image_pad|>",     # an image: start, one pad per image token, end
)
N_BYTES = 256
N_SPECIAL_SLOTS = 32  # room for more special tokens without changing the vocabulary size
VOCAB_SIZE = N_BYTES + N_SPECIAL_SLOTS


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files cannot be used; the message names the file and what was expected."""


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
            "image_start_id": "<|image|>", "image_end_id": "<|/image|>", "image_pad_id": "<|image_pad|>",
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
            raise ValueError(f"text is not valid Unicode: {e.reason} at character {e.start} "
                             f"({text[e.start:e.end]!r})") from None

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
                continue            # a model's padded vocabulary rows decode to nothing (as CheckpointTokenizer)
            text.append(out.decode("utf-8", errors="replace"))
            out.clear()
            if not skip_special and i in self.id_to_special:
                text.append(self.id_to_special[i])
        text.append(out.decode("utf-8", errors="replace"))
        return "".join(text)

    def decode_bytes(self, ids) -> bytes:
        """The raw bytes of the non-special ids (for streaming: decode once a UTF-8 sequence is complete)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < N_BYTES)

    def stream_decoder(self, *, skip_special: bool = True) -> "ByteStreamDecoder":
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


# ----------------------------------------------------------------------------------------------- tokenizer.json
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_json(path: Path, error=TokenizerError) -> dict:
    """A JSON object from `path`, or `error` naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise error(f"{path}: not a readable JSON file ({first_line(e)})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def token_content(value) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def added_token(value):
    """A named special token as transformers adds it: a dict keeps its flags, a string is special, not normalized."""
    from tokenizers import AddedToken
    if isinstance(value, dict):
        flags = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        return AddedToken(value["content"], special=True, **flags)
    return AddedToken(value, special=True, normalized=False)


class CheckpointTokenizer:
    """A checkpoint's tokenizer.json, set up the way transformers' AutoTokenizer (TokenizersBackend) sets it up,
    so prompts get exactly the ids the model saw in training:

    - special tokens named in tokenizer_config.json (bos_token, eos_token, …, additional/extra special tokens)
      are added as special tokens, as transformers adds them;
    - tokenizer.json's post-processor alone decides which special tokens `encode_prompt` adds: transformers 5
      ignores tokenizer_config.json's `add_bos_token` / `add_eos_token` when a tokenizer.json exists;
    - no truncation or padding; `clean_up_tokenization_spaces` only for non-BPE models (as transformers).

    EOS ids (generation stops at any): generation_config.json and config.json `eos_token_id` (an id or a list),
    then tokenizer_config.json `eos_token`.
    """

    def __init__(self, directory: str | Path):
        from tokenizers import AddedToken, Tokenizer
        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        try:
            self.backend = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise TokenizerError(f"{path}: not a Hugging Face tokenizers file ({first_line(e)})") from None
        config_path = self.directory / "tokenizer_config.json"
        self.config = read_json(config_path) if config_path.exists() else {}
        named = {name: self.config.get(name) for name in NAMED_SPECIAL_TOKENS}
        extra = self.config.get("extra_special_tokens")
        if isinstance(extra, dict):          # model-specific named tokens (e.g. image_token): named, like bos_token
            named.update(extra)
            extra = None
        self.named_special = {name: token_content(value) for name, value in named.items()}
        extras = [token_content(v) for v in (extra or self.config.get("additional_special_tokens") or [])]
        to_add = [added_token(value) for value in named.values() if token_content(value)]
        to_add += [AddedToken(t, special=True, normalized=False) for t in extras if t]
        if to_add:
            self.backend.add_special_tokens(to_add)
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = False
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.cleanup_spaces = bool(self.config.get("clean_up_tokenization_spaces")) and \
            type(self.backend.model).__name__ != "BPE"
        self.eos_ids = self._eos_ids()

    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            path = self.directory / name
            value = read_json(path).get("eos_token_id") if path.exists() else None
            for i in value if isinstance(value, list) else [value]:
                if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                    ids.append(i)
        eos = self.named_special.get("eos_token")
        if eos is not None and self.backend.token_to_id(eos) is not None and self.backend.token_to_id(eos) not in ids:
            ids.append(self.backend.token_to_id(eos))
        if not ids:
            raise TokenizerError(f"{self.directory}: no end-of-sequence token: expected eos_token_id in "
                                 f"generation_config.json or config.json, or eos_token in tokenizer_config.json")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"{self.directory}: eos_token_id {bad[0]} is outside the tokenizer's vocabulary "
                                 f"[0, {self.vocab_size})")
        return tuple(ids)

    @property
    def eos_id(self) -> int:
        """The first EOS id (callers that take one id; prefer `eos_ids`)."""
        return self.eos_ids[0]

    @property
    def template_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, … as a chat template sees them (transformers' special_tokens_map)."""
        return {name: value for name, value in self.named_special.items() if value is not None}

    def encode(self, text: str) -> list[int]:
        _check_unicode(text)
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """As `AutoTokenizer.from_pretrained(dir)(text)["input_ids"]`."""
        _check_unicode(text)
        return self.backend.encode(text, add_special_tokens=True).ids

    def encode_plain(self, text: str) -> list[int]:
        """Text that may contain special-token strings, tokenized as ordinary text (user input inside a chat)."""
        _check_unicode(text)
        if self.backend.normalizer is not None:
            text = self.backend.normalizer.normalize_str(text)
        pieces = [p for p, _ in self.backend.pre_tokenizer.pre_tokenize_str(text)] \
            if self.backend.pre_tokenizer is not None else [text]
        return [t.id for piece in pieces for t in self.backend.model.tokenize(piece)]

    def special(self, token: str) -> int:
        ids = self.backend.encode(token, add_special_tokens=False).ids
        if len(ids) != 1 or self.backend.id_to_token(ids[0]) != token:
            raise ValueError(f"{token!r} is not a single token of {self.directory / 'tokenizer.json'}")
        return ids[0]

    def decode(self, ids, *, skip_special: bool = True) -> str:
        """As transformers decodes: ids the tokenizer does not have (a model's padded vocabulary rows) are
        dropped."""
        ids = [i for i in map(int, ids) if 0 <= i < self.vocab_size]
        text = self.backend.decode(ids, skip_special_tokens=skip_special)
        return _clean_up_spaces(text) if self.cleanup_spaces else text

    def stream_decoder(self, *, skip_special: bool = True) -> "TokenStreamDecoder":
        return TokenStreamDecoder(self, skip_special)


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode: {e.reason} at character {e.start} "
                         f"({text[e.start:e.end]!r})") from None


def _clean_up_spaces(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class TokenStreamDecoder:
    """Token ids → text as they arrive, for any tokenizer.json.

    Decoding one token at a time is wrong for most tokenizers (a byte-level token may hold half a character; a
    SentencePiece token's leading space depends on what precedes it), so each step decodes a short window that
    starts one emitted token back and emits only the text beyond that token's, and waits while the window's text
    ends in U+FFFD (an incomplete UTF-8 sequence). `flush` emits what is left, U+FFFD included."""

    def __init__(self, tok: CheckpointTokenizer, skip_special: bool):
        self.tok, self.skip_special = tok, skip_special
        self.ids: list[int] = []
        self.prefix = 0      # the window starts here: the last token already emitted (context for its successor)
        self.read = 0        # ids before this are emitted

    def _text(self, ids) -> str:
        return self.tok.decode(ids, skip_special=self.skip_special)

    def feed(self, token: int) -> str:
        self.ids.append(int(token))
        done = self._text(self.ids[self.prefix:self.read])
        text = self._text(self.ids[self.prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        done = self._text(self.ids[self.prefix:self.read])
        text = self._text(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]


def load_tokenizer(checkpoint_dir: str | Path | None = None) -> ByteTokenizer | CheckpointTokenizer:
    """The checkpoint's tokenizer.json when it has one, else the byte tokenizer (synthetic checkpoints)."""
    if checkpoint_dir is not None and (Path(checkpoint_dir) / "tokenizer.json").exists():
        return CheckpointTokenizer(checkpoint_dir)
    return ByteTokenizer()


AnyTokenizer = ByteTokenizer | CheckpointTokenizer
