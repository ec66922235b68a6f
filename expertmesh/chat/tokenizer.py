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

Synthetic checkpoints have no tokenizer.json and use the byte tokenizer: ids 0..255 are the bytes of the UTF-8
text, the special tokens follow. Every tokenizer also gives each id's bytes (`decode_bytes`: what the id adds to
decoded text, b"" for a special token) and its special tokens (`id_to_special`), which constrained decoding
(expertmesh/chat/grammar.py) reads.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import re
from functools import cached_property, lru_cache
from pathlib import Path

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<|think|>",
    "<|/think|>",
    "<|tool_call|>",
    "<|/tool_call|>",
    "<|tools|>",
    "<|/tools|>",
    "<|image|>",
    "<|/image|>",
    "<|image_pad|>",  # an image: start, one pad per image token, end
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


class NamedSpecials:
    """What a checkpoint's tokenizer derives from its `eos_ids` and tokenizer_config.json's named tokens."""

    eos_ids: tuple[int, ...]
    named_special: dict[str, str | None]

    @property
    def eos_id(self) -> int:
        """The first EOS id (callers that take one id; prefer `eos_ids`)."""
        return self.eos_ids[0]

    @property
    def template_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, … as a chat template sees them (transformers' special_tokens_map)."""
        return {name: value for name, value in self.named_special.items() if value is not None}


class CheckpointTokenizer(NamedSpecials):
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
        if isinstance(extra, dict):  # model-specific named tokens (e.g. image_token): named, like bos_token
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
        self.cleanup_spaces = (
            bool(self.config.get("clean_up_tokenization_spaces")) and type(self.backend.model).__name__ != "BPE"
        )
        self.eos_ids = self._eos_ids()

    def _eos_ids(self) -> tuple[int, ...]:
        eos = self.named_special.get("eos_token")
        return checkpoint_eos_ids(
            self.directory, self.backend.token_to_id(eos) if eos is not None else None, self.vocab_size
        )

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
        pieces = (
            [p for p, _ in self.backend.pre_tokenizer.pre_tokenize_str(text)]
            if self.backend.pre_tokenizer is not None
            else [text]
        )
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

    def stream_decoder(self, *, skip_special: bool = True) -> TokenStreamDecoder:
        return TokenStreamDecoder(self, skip_special)

    @cached_property
    def id_to_special(self) -> dict[int, str]:
        """The special tokens (added tokens marked special: BOS, EOS, role markers …) by id."""
        return {
            i: t.content
            for i, t in self.backend.get_added_tokens_decoder().items()
            if t.special and 0 <= i < self.vocab_size
        }

    @cached_property
    def _id_bytes(self) -> list[bytes]:
        """Each id's bytes as it contributes to decoded text (see `decode_bytes`), computed once."""
        decoder = self.backend.decoder
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
        kinds = decoder_kinds(spec)
        space = next((d.get("replacement") for d in _flat_decoders(spec) if d.get("type") == "Metaspace"), None)
        space = space or next(
            (
                d["pattern"].get("String")
                for d in _flat_decoders(spec)
                if d.get("type") == "Replace" and isinstance(d.get("pattern"), dict) and d.get("content") == " "
            ),
            None,
        )
        added = self.backend.get_added_tokens_decoder()
        out = [b""] * self.vocab_size
        for i in range(self.vocab_size):
            if i in added:
                out[i] = b"" if added[i].special else added[i].content.encode("utf-8")
                continue
            piece = self.backend.id_to_token(i)
            if piece is not None:
                out[i] = piece_bytes(
                    piece,
                    byte_level="ByteLevel" in kinds,
                    byte_fallback="ByteFallback" in kinds,
                    space=space,
                    word_piece="WordPiece" in kinds,
                )
        return out

    def decode_bytes(self, ids) -> bytes:
        """The bytes `ids` decode to, token by token: a byte-level BPE token through GPT-2's byte ↔ character
        table (a token may hold part of a UTF-8 character), a SentencePiece byte-fallback token (`<0x0A>`) as its
        byte and ▁ as a space, an added token that is not special as its text; a special token (and an id outside
        the vocabulary) as nothing. Constrained decoding (chat/grammar.py) reads one id at a time."""
        table = self._id_bytes
        return b"".join(table[i] for i in map(int, ids) if 0 <= i < len(table))


def _flat_decoders(spec: dict) -> list[dict]:
    """A tokenizer.json `decoder` (maybe a Sequence) as its list of decoders."""
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        return [d for sub in spec.get("decoders") or [] for d in _flat_decoders(sub)]
    return [spec]


def decoder_kinds(spec: dict) -> set[str]:
    return {d.get("type") for d in _flat_decoders(spec)}


@lru_cache(maxsize=1)
def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte → the byte."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def piece_bytes(
    piece: str, *, byte_level: bool, byte_fallback: bool, space: str | None, word_piece: bool = False
) -> bytes:
    """One vocabulary entry's bytes in decoded text, by the tokenizer's decoder kind."""
    if byte_level:
        table = byte_level_table()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode("utf-8")
    if byte_fallback and (m := _BYTE_FALLBACK.fullmatch(piece)):
        return bytes([int(m.group(1), 16)])
    if word_piece:
        return (piece[2:] if piece.startswith("##") else " " + piece).encode("utf-8")
    return (piece.replace(space, " ") if space else piece).encode("utf-8")


def checkpoint_eos_ids(directory: Path, named_eos: int | None, vocab_size: int) -> tuple[int, ...]:
    """The ids that end generation: generation_config.json and config.json `eos_token_id` (an id or a list; a
    wrapper config's `text_config` when the top level has none), then the id of tokenizer_config.json's
    `eos_token` (`named_eos`)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        config = read_json(path) if path.exists() else {}
        value = config.get("eos_token_id")
        if value is None and isinstance(config.get("text_config"), dict):
            value = config["text_config"].get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    if named_eos is not None and named_eos not in ids:
        ids.append(named_eos)
    if not ids:
        raise TokenizerError(
            f"{directory}: no end-of-sequence token: expected eos_token_id in "
            f"generation_config.json or config.json, or eos_token in tokenizer_config.json"
        )
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(
            f"{directory}: eos_token_id {bad[0]} is outside the tokenizer's vocabulary [0, {vocab_size})"
        )
    return tuple(ids)


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"text is not valid Unicode: {e.reason} at character {e.start} ({text[e.start : e.end]!r})"
        ) from None


def _clean_up_spaces(text: str) -> str:
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
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
        self.prefix = 0  # the window starts here: the last token already emitted (context for its successor)
        self.read = 0  # ids before this are emitted

    def _text(self, ids) -> str:
        return self.tok.decode(ids, skip_special=self.skip_special)

    def feed(self, token: int) -> str:
        self.ids.append(int(token))
        done = self._text(self.ids[self.prefix : self.read])
        text = self._text(self.ids[self.prefix :])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        done = self._text(self.ids[self.prefix : self.read])
        text = self._text(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]


# ----------------------------------------------------------------------------------------------- tiktoken.model
# Kimi K2's pre-tokenizer (`pat_str` of its tokenization_kimi.py; llama.cpp's `kimi-k2` pre-tokenizer): Han runs,
# cased words with English contractions, numbers in threes, punctuation runs, newlines, spaces.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_RESERVED_SPECIAL_TOKENS = 256  # tokenization_kimi.py: the ids after the BPE ranks, named or reserved
TIKTOKEN_MAX_ENCODE_CHARS = 400_000  # tokenization_kimi.py encodes in windows of this many characters ...
MAX_RUN_CHARS = 25_000  # ... each split where whitespace / non-whitespace runs grow longer


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model`: one `base64(token bytes) rank` per line, ranks 0 .. N-1 (the BPE merges are implicit in
    them). TokenizerError names the file and line that is wrong."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot be read ({first_line(e)})") from None
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected 'base64 rank'")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{path}:{n}: not a tiktoken rank line ({first_line(e)})") from None
        if token in ranks:
            raise TokenizerError(f"{path}:{n}: token {token!r} appears twice (ranks {ranks[token]} and {rank})")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be 0 .. {len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: byte 0x{missing[0]:02x} has no token (a byte-level BPE needs all 256)")
    return ranks


@lru_cache(maxsize=4)
def _long_runs(limit: int) -> re.Pattern:
    return re.compile(rf"\s{{{limit + 1},}}|\S{{{limit + 1},}}")


def split_long_runs(text: str, limit: int = MAX_RUN_CHARS):
    """`text` cut so that no piece holds more than `limit` consecutive whitespace or non-whitespace characters,
    where tokenization_kimi.py cuts it (its `_split_whitespaces_or_nonwhitespaces`: a run is cut every `limit`
    characters from its start; tiktoken is quadratic on one long piece)."""
    start = 0
    for m in _long_runs(limit).finditer(text):
        for cut in range(m.start() + limit, m.end(), limit):
            yield text[start:cut]
            start = cut
    yield text[start:]


class TikTokenTokenizer(NamedSpecials):
    """A checkpoint's `tiktoken.model` with `tokenizer_config.json`, set up as Kimi's `tokenization_kimi.py`
    (TikTokenTokenizer, what vLLM and transformers load with trust_remote_code) sets it up:

    - the BPE ranks of tiktoken.model are ids 0 .. N-1; the `KIMI_RESERVED_SPECIAL_TOKENS` ids after them (or
      tokenizer_config.json `num_reserved_special_tokens`) are special tokens: those named in `added_tokens_decoder`
      by their content, the rest `<|reserved_token_{id}|>`;
    - Kimi K2's pre-tokenizer regex (`KIMI_PATTERN`), text encoded in 400,000-character windows and runs longer
      than 25,000 characters cut, as tokenization_kimi.py does (llama.cpp does not cut: beyond those lengths the
      two differ, and this follows the checkpoint's own tokenizer);
    - no BOS or EOS is added (`encode_prompt` == `encode`): K3's prompts start with its first message.

    Special-token strings in text: `encode` recognizes them (tokenization_kimi.py's `encode` does, and so does a
    raw /v1/completions prompt here, as with a tokenizer.json); `encode_plain` never does, and is what the chat
    format uses for every piece of user, tool and assistant text. That follows K3's own renderer as vLLM runs it
    (`apply_chat_template(tokenize=True)`: structural markers are special ids, message text is ordinary text),
    not llama.cpp, which renders the Jinja template to one string and tokenizes it with special-token parsing, so
    a user who types `<|open|>` there injects the control token.

    EOS ids: as CheckpointTokenizer (config.json `eos_token_id` — for K3 `<|end_of_msg|>` — then the
    `eos_token` of tokenizer_config.json, `[EOS]`).
    """

    def __init__(self, directory: str | Path):
        import tiktoken

        self.directory = Path(directory)
        ranks = read_tiktoken_ranks(self.directory / "tiktoken.model")
        config_path = self.directory / "tokenizer_config.json"
        self.config = read_json(config_path) if config_path.exists() else {}
        self.n_base = len(ranks)
        named = self._added_tokens(config_path)
        n_reserved = self.config.get("num_reserved_special_tokens", KIMI_RESERVED_SPECIAL_TOKENS)
        if not isinstance(n_reserved, int) or isinstance(n_reserved, bool) or n_reserved < 0:
            raise TokenizerError(
                f"{config_path}: num_reserved_special_tokens: expected a non-negative integer, found {n_reserved!r}"
            )
        self.vocab_size = max([self.n_base + n_reserved] + [i + 1 for i in named])
        self.id_to_special = {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(self.n_base, self.vocab_size)}
        self.special_to_id = {t: i for i, t in self.id_to_special.items()}
        if len(self.special_to_id) != len(self.id_to_special):
            seen: dict[str, int] = {}
            for i, t in self.id_to_special.items():
                if t in seen:
                    raise TokenizerError(f"{config_path}: added_tokens_decoder: {t!r} is both id {seen[t]} and {i}")
                seen[t] = i
        self.named_special = {name: token_content(self.config.get(name)) for name in NAMED_SPECIAL_TOKENS}
        self._bytes = [b""] * self.n_base
        for token, rank in ranks.items():
            self._bytes[rank] = token
        self.encoding = tiktoken.Encoding(
            name=f"expertmesh:{self.directory.name}",
            pat_str=KIMI_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_to_id,
        )
        eos = self.named_special.get("eos_token")
        self.eos_ids = checkpoint_eos_ids(self.directory, self.special_to_id.get(eos) if eos else None, self.vocab_size)

    def _added_tokens(self, config_path: Path) -> dict[int, str]:
        raw = self.config.get("added_tokens_decoder") or {}
        if not isinstance(raw, dict):
            raise TokenizerError(f"{config_path}: added_tokens_decoder: expected an object of id → token")
        named: dict[int, str] = {}
        for key, value in raw.items():
            content = token_content(value)
            try:
                i = int(key)
            except ValueError:
                i = -1
            if i < self.n_base or content is None:
                raise TokenizerError(
                    f"{config_path}: added_tokens_decoder[{key!r}]: expected an id ≥ "
                    f"{self.n_base} (after tiktoken.model's ranks) with a token `content`"
                )
            named[i] = content
        return named

    def _windows(self, text: str):
        _check_unicode(text)
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            yield from split_long_runs(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS])

    def encode(self, text: str) -> list[int]:
        """Text → ids, special-token strings in it becoming their tokens (tokenization_kimi.py's `encode`)."""
        return [t for piece in self._windows(text) for t in self.encoding.encode(piece, allowed_special="all")]

    def encode_plain(self, text: str) -> list[int]:
        """Text → ids, special-token strings in it tokenized as ordinary text (message text inside a chat)."""
        return [t for piece in self._windows(text) for t in self.encoding.encode_ordinary(piece)]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def special(self, token: str) -> int:
        try:
            return self.special_to_id[token]
        except KeyError:
            raise ValueError(
                f"{token!r} is not a special token of {self.directory / 'tokenizer_config.json'}"
            ) from None

    def token_bytes(self, i: int) -> bytes:
        """The bytes of an ordinary (BPE) id; b"" for a special id or one outside the vocabulary."""
        return self._bytes[i] if 0 <= i < self.n_base else b""

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self.token_bytes(int(i)) for i in ids)

    def decode(self, ids, *, skip_special: bool = True) -> str:
        """As tokenization_kimi.py decodes: the bytes of the ordinary ids as UTF-8 (invalid sequences as U+FFFD),
        each special token as its string (or nothing when `skip_special`; a skipped one does not cut the bytes
        around it), ids outside the vocabulary (a model's padded rows) dropped."""
        out: list[str] = []
        buf = bytearray()
        for i in map(int, ids):
            if 0 <= i < self.n_base:
                buf += self._bytes[i]
            elif not skip_special and i in self.id_to_special:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                out.append(self.id_to_special[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def stream_decoder(self, *, skip_special: bool = True) -> TikTokenStreamDecoder:
        return TikTokenStreamDecoder(self, skip_special)


class TikTokenStreamDecoder:
    """TikToken ids → text as soon as each UTF-8 sequence is complete (a token may hold part of a character);
    the concatenation equals `decode` of all the ids."""

    def __init__(self, tok: TikTokenTokenizer, skip_special: bool):
        self.tok, self.skip_special = tok, skip_special
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        token = int(token)
        if 0 <= token < self.tok.n_base:
            return self.utf8.decode(self.tok.token_bytes(token))
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
