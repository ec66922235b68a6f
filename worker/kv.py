"""Paged KV storage of an attention worker: fixed-size token blocks shared by all MLA / DSA layers.

One block holds `block_size` consecutive tokens of one sequence in every latent-KV layer (MLA latent entries,
and indexer keys in DSA layers). Blocks are reference counted so that a cached prefix and the sequences forked from it share
the full blocks of the prefix; a partly filled block is never shared (it is copied on fork).
"""

from __future__ import annotations

import threading

import torch

from expertmesh.model.cache import CachePages
from expertmesh.model.config import ModelConfig
from expertmesh.wire.worker_api import OutOfBlocks


class BlockPool:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, *, device="cpu", dtype: torch.dtype = torch.float32
    ):
        """The pool in the worker's dtype (bf16 on GPUs, fp32 on the CPU reference) on its device."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: both must be positive")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_layers = cfg.latent_kv_layers
        d_latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        alloc = torch.empty if torch.device(device).type == "meta" else torch.zeros
        self.latent = {i: alloc(num_blocks, block_size, d_latent, dtype=dtype, device=device) for i in self.kv_layers}
        self.index_k = {
            i: alloc(num_blocks, block_size, cfg.indexer.head_dim, dtype=dtype, device=device)
            for i in self.kv_layers
            if cfg.layer_types[i] == "dsa"
        }
        self.refcount = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        # the free list and the counts have a lock of their own: a hand-off lands (its blocks taken and written)
        # while a step runs on other blocks (AttentionWorker.import_sequence)
        self.lock = threading.Lock()

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        with self.lock:
            if not self.free:
                raise OutOfBlocks(f"KV pool exhausted: all {self.num_blocks} blocks of {self.block_size} tokens in use")
            b = self.free.pop()
            self.refcount[b] = 1
            return b

    def retain(self, block: int) -> None:
        with self.lock:
            self.refcount[block] += 1

    def release(self, block: int) -> None:
        with self.lock:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free.append(block)
            elif self.refcount[block] < 0:
                raise RuntimeError(f"KV block {block} released more often than retained")


class PagedSequenceKV:
    """One sequence's block table. `layer_cache(i)` gives the per-layer view the model's DSA attention uses."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0

    def blocks_needed(self, extra_tokens: int) -> int:
        total = -(-(self.length + extra_tokens) // self.pool.block_size)
        return max(0, total - len(self.blocks))

    def reserve(self, extra_tokens: int) -> None:
        for _ in range(self.blocks_needed(extra_tokens)):
            self.blocks.append(self.pool.allocate())

    def write(self, layer: int, start: int, latent: torch.Tensor, index_k: torch.Tensor | None) -> None:
        """Tokens start .. start+n-1 of `layer` into their pages (one indexed store per tensor)."""
        bs = self.pool.block_size
        n = latent.shape[0]
        if n and start // bs == (start + n - 1) // bs:  # inside one block (every decode step): slice stores
            block, off = self.blocks[start // bs], start % bs
            self.pool.latent[layer][block, off : off + n] = latent
            if index_k is not None:
                self.pool.index_k[layer][block, off : off + n] = index_k
            return
        dev = self.pool.latent[layer].device
        pos = torch.arange(start, start + n, device=dev)
        blocks = torch.tensor(self.blocks, dtype=torch.int64, device=dev)[pos // bs]
        self.pool.latent[layer][blocks, pos % bs] = latent
        if index_k is not None:
            self.pool.index_k[layer][blocks, pos % bs] = index_k

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [0, length) of `layer` as contiguous [length, D] tensors (an exact copy of the pages); no
        indexer keys (None) in an MLA layer."""
        n_blocks = -(-length // self.pool.block_size)
        idx = torch.tensor(self.blocks[:n_blocks], dtype=torch.int64, device=self.pool.latent[layer].device)
        lat = self.pool.latent[layer].index_select(0, idx).reshape(-1, self.pool.latent[layer].shape[-1])
        if layer not in self.pool.index_k:
            return lat[:length], None
        ik = self.pool.index_k[layer].index_select(0, idx).reshape(-1, self.pool.index_k[layer].shape[-1])
        return lat[:length], ik[:length]

    def fork(self, length: int) -> PagedSequenceKV:
        """A new table sharing this one's first `length` tokens (full blocks shared, a partial block copied)."""
        bs = self.pool.block_size
        child = PagedSequenceKV(self.pool)
        full = length // bs
        for b in self.blocks[:full]:
            self.pool.retain(b)
            child.blocks.append(b)
        if length % bs:
            src, dst = self.blocks[full], self.pool.allocate()
            for layer in self.pool.kv_layers:
                self.pool.latent[layer][dst] = self.pool.latent[layer][src]
                if layer in self.pool.index_k:
                    self.pool.index_k[layer][dst] = self.pool.index_k[layer][src]
            child.blocks.append(dst)
        child.length = length
        return child

    def free(self) -> None:
        for b in self.blocks:
            self.pool.release(b)
        self.blocks = []
        self.length = 0


class PagedDSACache:
    """Drop-in for `model.DSACache` backed by the sequence's pages: append writes, reads gather (once per
    append: attention reads both tensors right after)."""

    def __init__(self, kv: PagedSequenceKV, layer: int):
        self.kv, self.layer = kv, layer
        self.length = kv.length
        self._view: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(self, latent: torch.Tensor, index_k: torch.Tensor | None) -> None:
        self.kv.write(self.layer, self.length, latent, index_k)
        self.length += latent.shape[0]
        self._view = None

    def pages(self, upto: int | None = None):
        """The pool's pages for this layer with the sequence's block table (decode reads them in place); `upto`:
        its first `upto` tokens only (a verify row's own context, speculation)."""
        length = self.length if upto is None else upto
        n_blocks = -(-length // self.kv.pool.block_size)
        pool = self.kv.pool
        dev = pool.latent[self.layer].device
        return CachePages(
            pool.latent[self.layer],
            pool.index_k.get(self.layer),
            torch.tensor([self.kv.blocks[:n_blocks]], dtype=torch.int32, device=dev),
            torch.tensor([length], dtype=torch.int32, device=dev),
        )

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (speculation's rollback). The blocks stay reserved; the rows past
        `length` are outside every later context length (no decode or indexer selection reads them) and are
        overwritten as the sequence grows."""
        self.length = length
        self._view = None

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._view is None:
            self._view = self.kv.read(self.layer, self.length)
        return self._view

    @property
    def latent(self) -> torch.Tensor:
        return self._read()[0]

    @property
    def index_k(self) -> torch.Tensor:
        return self._read()[1]
