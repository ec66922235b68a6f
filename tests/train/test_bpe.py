"""The byte-level BPE trained for the embedded default: TikToken's rank layout, deterministic training, a
tokenizer directory that TikTokenTokenizer loads and K3Chat renders with, tiktoken's encoding equal to a plain
reference BPE, and English compressed to more than 3 bytes a token on text it was not trained on."""

from __future__ import annotations

import json

import pytest
import regex

from expertmesh.chat.format import Message
from expertmesh.chat.k3 import K3Chat
from expertmesh.chat.tiktoken_tokenizer import KIMI_PATTERN, TikTokenTokenizer
from expertmesh.train.bpe import N_RESERVED, SPECIALS, pretoken_counts, train_ranks, write_tokenizer
from expertmesh.train.corpus import definition_sentence, held_out, load_wordnet, plain_documents, wordnet_dir

SMALL = [
    "The sea is a division of an ocean or a large body of salt water partially enclosed by land.",
    "A dog is a member of the genus Canis that has been domesticated by man since prehistoric times.",
    "To breathe is to draw air into, and expel out of, the lungs. I can breathe better when the air is clean.",
    "café naïve 東京の天気 don't we'll 1234567 🌍 — “quoted” text\n\n  indented\ttabs",
]
HELD_OUT_PARAGRAPH = (
    "Yesterday my neighbour walked along the harbour with her two children. They watched the fishing boats come "
    "back in the late afternoon, counted the gulls on the pier and bought bread from the small bakery near the "
    "station. In the evening the wind grew stronger, and rain began to fall on the old stone houses by the water."
)


@pytest.fixture(scope="module")
def wordnet():
    return load_wordnet(wordnet_dir())


@pytest.fixture(scope="module")
def trained(wordnet, tmp_path_factory):
    """2,000 ranks from a third of the WordNet paragraphs (held-out synsets are never in them)."""
    ranks = train_ranks(plain_documents(wordnet)[::3], 2000)
    directory = tmp_path_factory.mktemp("tokenizer")
    return ranks, write_tokenizer(directory, ranks), TikTokenTokenizer(directory)


def held_out_text(wordnet) -> str:
    sentences = [definition_sentence(s) for s in wordnet if held_out(s) and s.definition]
    return HELD_OUT_PARAGRAPH + "\n" + " ".join(sentences[:300])


def reference_encode(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """BPE by the book: merge the adjacent pair whose joined bytes have the lowest rank, until none is a token."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while True:
        joined = [(ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not joined:
            return [ranks[p] for p in parts]
        _, i = min(joined)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def reference_train(texts: list[str], n_ranks: int) -> dict[bytes, int]:
    """BPE training by the book: recount every pair after each merge; the most frequent pair wins, ties to the
    smaller pair of byte strings; a merge whose bytes are already a token adds no rank."""
    words = {}
    for piece in (p for t in texts for p in regex.compile(KIMI_PATTERN, flags=regex.V1).findall(t)):
        key = tuple(bytes([b]) for b in piece.encode())
        words[key] = words.get(key, 0) + 1
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < n_ranks:
        pairs = {}
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + n
        if not pairs:
            break
        a, b = min(pairs, key=lambda pair: (-pairs[pair], pair))
        ranks.setdefault(a + b, len(ranks))
        merged = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i : i + 2] == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return ranks


def test_ranks_are_dense_bytes_first_and_training_is_deterministic():
    ranks = train_ranks(SMALL * 3, 400)
    assert sorted(ranks.values()) == list(range(len(ranks))) and 300 < len(ranks) <= 400
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert train_ranks(SMALL * 3, 400) == ranks
    assert train_ranks(list(reversed(SMALL)) * 3, 400) == ranks  # counts, not text order, decide
    assert list(train_ranks(SMALL, 300)) == list(ranks)[:300]  # fewer ranks: the same first merges
    assert ranks == reference_train(SMALL * 3, 400)
    with pytest.raises(ValueError, match="256 byte tokens"):
        train_ranks(SMALL, 255)


def test_incremental_training_equals_the_reference_on_wordnet_text(wordnet):
    documents = plain_documents(wordnet)[::800]
    assert train_ranks(documents, 500) == reference_train(documents, 500)


def test_merges_stay_inside_pre_tokens():
    ranks = train_ranks(["ab cd " * 50 + "x\n\ny " * 50], 300)
    pieces = set(pretoken_counts(["ab cd " * 50 + "x\n\ny " * 50]))
    assert pieces == {b"ab", b" ab", b" cd", b" x", b"\n\n", b"y", b" "}
    assert all(any(t in p for p in pieces) for t in ranks if len(t) > 1)
    assert b"b " not in ranks and b"d x" not in ranks and b"x\n" not in ranks


def test_pre_tokens_follow_the_serving_pattern_with_class_intersection():
    # `&&` inside a class (intersection) needs regex's V1 semantics: letters stay one pre-token
    assert list(pretoken_counts(["The Sea's 東京 tide"])) == [b"The", b" Sea's", b" ", "東京".encode(), b" tide"]
    assert regex.compile(KIMI_PATTERN, flags=regex.V1).findall("Hello world") == ["Hello", " world"]


def test_written_directory_loads_round_trips_and_compresses_held_out_english(wordnet, trained):
    ranks, ids, tok = trained
    assert tok.n_base == len(ranks) == 2000 and tok.vocab_size == 2000 + N_RESERVED == 2256
    assert ids == {token: 2000 + offset for offset, token in SPECIALS.items()}
    assert tok.special("<|end_of_msg|>") == 2002 and tok.special("[PAD]") == 2021
    assert tok.id_to_special[2003] == "<|reserved_token_2003|>" and tok.eos_ids
    text = held_out_text(wordnet)
    encoded = tok.encode_plain(text)
    assert tok.decode(encoded) == text
    assert len(encoded) < len(text.encode()) / 3, len(text.encode()) / len(encoded)
    paragraph = tok.encode_plain(HELD_OUT_PARAGRAPH)
    assert len(paragraph) < len(HELD_OUT_PARAGRAPH.encode()) / 3
    config = json.loads((tok.directory / "tokenizer_config.json").read_text())
    assert config["num_reserved_special_tokens"] == 256 and config["tokenizer_class"] == "TikTokenTokenizer"
    assert config["added_tokens_decoder"]["2005"]["content"] == "<|open|>"


def test_tiktoken_encoding_equals_the_reference_bpe(wordnet, trained):
    ranks, _, tok = trained
    text = held_out_text(wordnet) + " " + " ".join(SMALL)
    pieces = regex.compile(KIMI_PATTERN, flags=regex.V1).findall(text)
    distinct = list(dict.fromkeys(pieces))
    assert len(distinct) > 300
    for piece in distinct:
        assert tok.encoding.encode_ordinary(piece) == reference_encode(piece.encode(), ranks), piece
    # the whole text: tiktoken's own pre-tokenization splits where ours does
    assert tok.encode_plain(text) == [t for p in pieces for t in reference_encode(p.encode(), ranks)]


def test_k3_chat_renders_with_the_written_directory(trained):
    _, ids, tok = trained
    chat = K3Chat(tok)
    messages = [
        Message("user", "Tell me about the sea."),
        Message(
            "assistant",
            "The sea is a division of an ocean or a large body of salt water partially enclosed by land.",
            reasoning="The user asks about the sea. A sea is a kind of body of water.",
        ),
    ]
    options = dict(add_generation_prompt=False, thinking=True, thinking_effort="high")
    rendered = chat.render_ids(messages, **options)
    assert tok.decode(rendered, skip_special=False) == chat.render_text(messages, **options)
    assert rendered.count(ids["<|end_of_msg|>"]) == 3  # the thinking-effort system message, user, assistant
    assert {ids["<|open|>"], ids["<|close|>"], ids["<|sep|>"]} <= set(rendered)
    assert max(rendered) < tok.vocab_size
    assert "partially enclosed by land." in tok.decode(rendered)
