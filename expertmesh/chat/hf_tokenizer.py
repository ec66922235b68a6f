"""A checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), set up as transformers' AutoTokenizer sets it up, with
each id's bytes in decoded text (for constrained decoding) and a streaming decoder."""

from __future__ import annotations

import json
import re
from functools import cached_property, lru_cache
from pathlib import Path

from expertmesh.chat.tokenizer_files import (
    NAMED_SPECIAL_TOKENS,
    NamedSpecials,
    TokenizerError,
    added_token,
    check_unicode,
    checkpoint_eos_ids,
    first_line,
    read_json,
    token_content,
)


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
        check_unicode(text)
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """As `AutoTokenizer.from_pretrained(dir)(text)["input_ids"]`."""
        check_unicode(text)
        return self.backend.encode(text, add_special_tokens=True).ids

    def encode_plain(self, text: str) -> list[int]:
        """Text that may contain special-token strings, tokenized as ordinary text (user input inside a chat)."""
        check_unicode(text)
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
