"""Expert-worker calls the transports are compared on: random inputs and bitwise equality of the answers."""

import numpy as np
import torch

SUBSET = [(1, 0), (1, 1), (1, 5), (2, 3)]  # a partial expert shard (layer, expert)


def expert_call(cfg, n, k, seed, held=None):
    """Random hidden [n, H], ascending expert ids [n, k] with −1 holes (from `held` when given), weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(sorted(held) if held is not None else range(cfg.moe.n_routed_experts))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]].sort().values for _ in range(n)])
    ids = torch.where(torch.rand(n, k, generator=g) < 0.3, torch.full_like(ids, -1), ids)
    return torch.randn(n, cfg.hidden_size, generator=g), ids, torch.rand(n, k, generator=g)


def same(a: torch.Tensor, b) -> None:
    """Bitwise equality: dtype, shape and every byte (`b` may be the numpy array a torch-free client decodes)."""
    b = torch.from_numpy(b) if isinstance(b, np.ndarray) else b
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
