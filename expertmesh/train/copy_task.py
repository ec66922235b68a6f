"""Copy tasks: the ability to take up a word from the context, which 3.7M corpus tokens alone did not teach this
architecture (the first models/k3-tiny answered "Tell me about the sea." about an invented noun).

- `ChatCopy` (the recipe's, train/loop.py): K3 chat turns about a random one-token word of the vocabulary — "Tell
  me about the tarn." → reasoning "The user asks about the tarn." → "The tarn is" — with the loss on the word's
  later occurrences only. A random word cannot be guessed from what usually follows "about the": the only way down
  is to copy it, which the corpus's own conversations (about real, partly predictable nouns) then reuse.
- `copy_batch` (bench/copy_learning.py): `seq` filler tokens (ids FILLERS) with one noun (ids NOUNS) at a random
  place, then MARKER; the target after the marker is the noun — the same ability without a tokenizer, for
  comparing architectures.
"""

from __future__ import annotations

import random
import re

import torch
import torch.nn.functional as F

from expertmesh.chat.format import Message

FILLERS, NOUNS, MARKER = range(0, 200), range(1000, 2000), 500

# (question, reasoning, answer): the corpus's own phrasings (train/corpus.py) around "the <word>"
TEMPLATES = (
    ("Tell me about the {}.", "The user asks about the {}.", "The {} is"),
    ("What is the {}?", "The user asks about the {}.", "The {} is"),
    ("Can you tell me about the {}?", "The question is about the {}.", "The {} is"),
)


def copy_batch(batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """[batch, seq + 2] int64: fillers with one noun at a random place (not the last 4), the marker, the noun."""
    if seq < 5:
        raise ValueError(f"seq: expected >= 5 (the noun is placed before the last 4 fillers), found {seq}")
    x = torch.randint(FILLERS.start, FILLERS.stop, (batch, seq + 2), generator=g)
    noun = torch.randint(NOUNS.start, NOUNS.stop, (batch,), generator=g)
    x[torch.arange(batch), torch.randint(0, seq - 4, (batch,), generator=g)] = noun
    x[:, -2], x[:, -1] = MARKER, noun
    return x


class ChatCopy:
    """Batches of K3 chat turns about random words (deterministic for `seed`). `chat`: a K3Chat over the
    tokenizer being trained."""

    def __init__(self, chat, seed: int):
        tokenizer = chat.tokenizer
        # one-token lower-case words (" tarn"): rendered inside a sentence they stay that one token
        self.words = [t for t in range(tokenizer.vocab_size) if re.fullmatch(r" [a-z]{3,}", tokenizer.decode([t]))]
        if not self.words:
            raise ValueError("copy task: the vocabulary has no one-token lower-case words")
        self.chat, self.tokenizer = chat, tokenizer
        self.rng = random.Random(seed)
        self.batches = 0

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [rows, T] int64, each row's word id [rows]): one template a batch (rows of one length), the
        thinking section in three batches of four."""
        question, reasoning, answer = TEMPLATES[self.batches % len(TEMPLATES)]
        thinking = self.batches % 4 != 3
        self.batches += 1
        ids, words = [], []
        for _ in range(rows):
            word_id = self.rng.choice(self.words)
            word = self.tokenizer.decode([word_id])[1:]
            turn = Message("assistant", answer.format(word), reasoning=reasoning.format(word) if thinking else None)
            msgs = [Message("user", question.format(word)), turn]
            ids.append(self.chat.render_ids(msgs, thinking=thinking, add_generation_prompt=False))
            words.append(word_id)
        n = min(map(len, ids))
        return torch.tensor([r[:n] for r in ids]), torch.tensor(words)

    @staticmethod
    def copies(tokens: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """[B, T-1] bool: the positions whose next token is the row's word after its first occurrence."""
        targets = tokens[:, 1:]
        first = (tokens == words[:, None]).float().argmax(1)  # the word's first position in each row
        return (targets == words[:, None]) & (torch.arange(targets.shape[1])[None] >= first[:, None])

    @staticmethod
    def loss(logits_of, tokens: torch.Tensor, words: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Cross-entropy at the copies (`copies`) and their top-1 accuracy; `logits_of(tokens [B, T])` → logits
        [B, T, V]."""
        logits, targets = logits_of(tokens[:, :-1]), tokens[:, 1:]
        copies = ChatCopy.copies(tokens, words)
        picked = logits[copies]
        return F.cross_entropy(picked, targets[copies]), (picked.argmax(-1) == targets[copies]).float().mean().item()
