"""A byte-level BPE in TikToken's format, trained on the corpus, and the Kimi K3 tokenizer directory around it.

Ranks 0..255 are the single bytes (rank == byte value); then each merged token in the order it was merged. Text is
pre-tokenized with the serving tokenizer's own pattern (`KIMI_PATTERN`), so a merge never crosses a pre-token
boundary and what serving encodes is what training saw. Training counts the distinct pre-tokens once, then merges
the most frequent adjacent pair (ties: the smaller pair of byte strings) and updates the pair counts only in the
words that held the merged pair — the standard incremental algorithm, a few seconds for ~10 MB of text.

    ranks = train_ranks(texts, 3840)
    ids = write_tokenizer(directory, ranks)   # tiktoken.model + tokenizer_config.json, K3's special tokens
    TikTokenTokenizer(directory)              # loads it (expertmesh.chat.tiktoken_tokenizer)
"""

from __future__ import annotations

import base64
import heapq
import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex

from expertmesh.chat.tiktoken_tokenizer import KIMI_PATTERN

N_RESERVED = 256  # K3's num_reserved_special_tokens: the vocabulary is the BPE ranks + 256 special ids
# K3's published tokenizer_config.json layout: these special tokens at these offsets after the BPE ranks; the other
# ids up to N_RESERVED are reserved (`<|reserved_token_{id}|>`)
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


def pretoken_counts(texts: Iterable[str]) -> Counter[bytes]:
    """How often each pre-token (KIMI_PATTERN's pieces, as UTF-8) occurs in `texts`."""
    pattern = regex.compile(KIMI_PATTERN, flags=regex.V1)  # V1: `&&` in a class is intersection (as in tiktoken)
    pieces: Counter[str] = Counter()
    for text in texts:
        pieces.update(pattern.findall(text))
    return Counter({piece.encode("utf-8"): n for piece, n in pieces.items()})


def train_ranks(texts: Iterable[str], n_ranks: int) -> dict[bytes, int]:
    """Token bytes → rank, 0 .. n_ranks-1 (fewer when the text runs out of pairs to merge): the 256 bytes, then
    the merged tokens in merge order. Deterministic for the same texts (in any order)."""
    if n_ranks < 256:
        raise ValueError(f"n_ranks: a byte-level BPE needs at least the 256 byte tokens, asked for {n_ranks}")
    counts = pretoken_counts(texts)
    tokens = [bytes([b]) for b in range(256)]  # id == rank → bytes
    ranks = {t: i for i, t in enumerate(tokens)}
    words = [list(word) for word in sorted(counts)]  # each word as its token ids; a byte's id is its value
    freqs = [counts[word] for word in sorted(counts)]
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # pair → words that held it (may be stale)
    for i, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freq
            where[pair].add(i)
    heap = [(-n, tokens[a], tokens[b], a, b) for (a, b), n in pair_counts.items()]
    heapq.heapify(heap)
    while len(tokens) < n_ranks and heap:
        negative, bytes_a, bytes_b, a, b = heapq.heappop(heap)
        if pair_counts.get((a, b), 0) != -negative or negative == 0:
            continue  # stale entry: the pair's count changed since it was pushed
        merged = bytes_a + bytes_b
        new = ranks.get(merged)  # the same bytes may already be a token, reached by another pair
        if new is None:
            new = ranks[merged] = len(tokens)
            tokens.append(merged)
        delta: dict[tuple[int, int], int] = defaultdict(int)
        for i in where.pop((a, b)):
            word, freq = words[i], freqs[i]
            out, j, hit = [], 0, False
            while j < len(word):
                if j + 1 < len(word) and word[j] == a and word[j + 1] == b:
                    out.append(new)
                    j, hit = j + 2, True
                else:
                    out.append(word[j])
                    j += 1
            if not hit:
                continue
            for pair in zip(word, word[1:]):
                delta[pair] -= freq
            for pair in zip(out, out[1:]):
                delta[pair] += freq
                where[pair].add(i)
            words[i] = out
        for pair, change in delta.items():
            if change:
                pair_counts[pair] += change
                if pair_counts[pair] > 0:
                    heapq.heappush(heap, (-pair_counts[pair], tokens[pair[0]], tokens[pair[1]], *pair))
                else:
                    del pair_counts[pair]
    return ranks


def special_ids(n_base: int) -> dict[str, int]:
    return {token: n_base + offset for offset, token in SPECIALS.items()}


def write_tokenizer(directory: Path, ranks: dict[bytes, int]) -> dict[str, int]:
    """Write `tiktoken.model` (`base64(token) rank` lines in rank order) and `tokenizer_config.json` (K3's special
    tokens at SPECIALS offsets after the ranks, N_RESERVED special ids in all) into `directory`; returns the
    special tokens' ids."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"ranks: expected each of 0 .. {len(ranks) - 1} once")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
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
    return ids
