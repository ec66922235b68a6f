"""What a sequence keeps between steps (per layer: the latent cache of MLA / DSA layers, the recurrent state of KDA
layers) and where its tokens sit in a step's flat batch (`Segment`).

Shapes: L tokens cached, T a segment's tokens, nH heads.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def pages(self) -> CachePages:
        """The cache as one page (what the paged decode kernels read; same bits as any paging of it)."""
        n, dev = self.latent.shape[0], self.latent.device
        return CachePages(
            self.latent[None],
            None if self.index_k is None else self.index_k[None],
            torch.zeros(1, 1, dtype=torch.int32, device=dev),
            torch.tensor([n], dtype=torch.int32, device=dev),
        )


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


@dataclass
class SequenceCache:
    """Everything a sequence keeps between steps: one entry per layer and the number of tokens seen."""

    layers: list
    length: int = 0


@dataclass
class Segment:
    """One sequence's run of tokens inside a step's flat batch: rows [start, start + length), cache positions
    cache.length .. cache.length + length - 1."""

    start: int
    length: int
    cache: SequenceCache
