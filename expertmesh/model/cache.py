"""What a sequence keeps between steps (per layer: the latent cache of MLA / DSA layers, the recurrent state of KDA
layers) and where its tokens sit in a step's flat batch (`Segment`).

Shapes: L tokens cached, T a segment's tokens, nH heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DSACache:
    """One sequence's MLA / DSA-layer cache in token order: latent entries (c_kv ‖ roped k) and, for DSA layers,
    the indexer keys (None for MLA layers)."""

    latent: torch.Tensor  # [L, kv_lora + rope]
    index_k: torch.Tensor | None = None  # [L, Di]

    def append(self, latent: torch.Tensor, index_k: torch.Tensor | None) -> None:
        self.latent = torch.cat([self.latent, latent])
        if index_k is not None:
            self.index_k = torch.cat([self.index_k, index_k])

    def pages(self, upto: int | None = None) -> CachePages:
        """The cache as one page (what the paged decode kernels read; same bits as any paging of it). `upto`: only
        the first `upto` entries — what a decode step at that length saw (a verify row's own context)."""
        n = self.latent.shape[0] if upto is None else upto
        dev = self.latent.device
        return CachePages(
            self.latent[:n][None],
            None if self.index_k is None else self.index_k[:n][None],
            torch.zeros(1, 1, dtype=torch.int32, device=dev),
            torch.tensor([n], dtype=torch.int32, device=dev),
        )

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries (speculation's rollback: a rejected position's latent and indexer key
        are gone, so no later selection can see them)."""
        self.latent = self.latent[:length]
        if self.index_k is not None:
            self.index_k = self.index_k[:length]


@dataclass
class CachePages:
    """A latent cache as the paged decode kernels take it (kernels/dsa: dsa_decode_paged, mla_decode_paged)."""

    latent: torch.Tensor  # [num_blocks, block_size, kv_lora + rope]
    index_k: torch.Tensor | None  # [num_blocks, block_size, Di] (DSA layers)
    block_table: torch.Tensor  # [1, n_pages] int32
    context_lens: torch.Tensor  # [1] int32


@dataclass
class KDACache:
    """One sequence's KDA-layer state: the recurrent state and the short convolutions' last inputs."""

    state: torch.Tensor  # [nH, Dk, Dv] fp32
    conv: torch.Tensor  # [kernel - 1, 3 · nH · D]: q, k, v projections before the conv
    # after a verify segment (speculation): (state, conv) after each of its positions, from cache position `start`
    verified: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    verified_start: int = 0

    def roll_back(self, length: int) -> None:
        """Back to the state after the first `length` tokens, one of the last verify segment's positions."""
        j = length - self.verified_start - 1
        if not 0 <= j < len(self.verified):
            raise ValueError(
                f"length {length}: no KDA state kept for it (the last verify covered positions "
                f"{self.verified_start} .. {self.verified_start + len(self.verified) - 1})"
            )
        self.state, self.conv = self.verified[j]
        self.verified = []


@dataclass
class SequenceCache:
    """Everything a sequence keeps between steps: one entry per layer and the number of tokens seen."""

    layers: list
    length: int = 0

    def roll_back(self, length: int) -> None:
        """Forget every position from `length` on, after a verify segment (speculation): latent caches and indexer
        keys truncated, KDA recurrent and conv state back to those after position length - 1 (kept by the verify
        for each of its positions: no replay)."""
        if not 0 < length <= self.length:
            raise ValueError(f"length {length}: expected 1 .. {self.length}")
        for entry in self.layers:
            if isinstance(entry, KDACache):
                if length < self.length:
                    entry.roll_back(length)
                entry.verified = []
            else:
                entry.truncate(length)
        self.length = length

    def kda_states_at(self, length: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        """Each KDA layer's (state, conv) after the first `length` tokens — those the last verify kept for that
        position, or the current ones at the cache's length — keyed by layer; None where neither holds it."""
        out = {}
        for i, entry in enumerate(self.layers):
            if not isinstance(entry, KDACache):
                continue
            j = length - entry.verified_start - 1
            if entry.verified and 0 <= j < len(entry.verified):
                out[i] = entry.verified[j]
            elif length == self.length:
                out[i] = (entry.state, entry.conv)
            else:
                return None
        return out


@dataclass
class Segment:
    """One sequence's run of tokens inside a step's flat batch: rows [start, start + length), cache positions
    cache.length .. cache.length + length - 1."""

    start: int
    length: int
    cache: SequenceCache
    # speculation's verify: each row computes exactly what a one-token decode step at its position would (KDA
    # token by token in the recurrent form, keeping each position's state; MLA/DSA through the decode kernel over
    # the cache up to the row's own position), so accepting a prefix leaves the bits plain decoding gives
    verify: bool = False
