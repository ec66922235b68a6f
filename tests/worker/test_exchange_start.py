"""The expert exchange's per-layer start in numpy (worker/exchange.py: the cut of torch's per-op cost at decode sizes)
is kernels/moe/combine.py's definition: the same slot order (stable, absent slots −1 kept in place), the same weights
in that order, the same groups present — and each call's request is what the torch selection gave."""

import numpy as np
import torch

from expertmesh.kernels.moe.combine import present_groups, sort_slots
from expertmesh.placement.replica_table import ReplicaTable
from expertmesh.worker.exchange import ExpertExchange

E, G, K, H = 16, 4, 4, 8


class Silent:
    """A client whose calls never leave (start only: nothing is received)."""

    def post(self, layer, hidden, ids, weights, out_dtype, rows):
        self.sent = (hidden.clone(), ids.clone(), weights.clone(), out_dtype, rows)
        return None  # "no pair formed": the exchange would go over its pool; the request was still built


def test_the_numpy_start_is_the_torch_definition():
    table = ReplicaTable((1,), (np.arange(E) // (E // G) % 2).reshape(1, E, 1).astype(np.int64))
    ex = ExpertExchange([Silent(), Silent()], table, n_experts=E, n_groups=G)
    ex._submit = lambda job, c, attempt: None  # only the job's arrays here
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        n = 1 + trial % 7
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
        if trial % 3 == 0:
            ids[0, trial % K] = -1  # an absent slot
        weights = torch.rand(n, K, generator=g)
        job = ex.start(1, torch.randn(n, H, generator=g), ids, weights)
        want_ids, want_w = sort_slots(ids, weights.float())
        assert np.array_equal(job.ids, want_ids.numpy()), trial
        assert torch.equal(torch.from_numpy(job.w_np), want_w), trial
        assert np.array_equal(job.present, present_groups(want_ids, E // G, G).numpy()), trial


def test_a_calls_request_is_the_torch_selection():
    table = ReplicaTable((1,), (np.arange(E) // (E // G) % 2).reshape(1, E, 1).astype(np.int64))
    ex = ExpertExchange([Silent(), Silent()], table, n_experts=E, n_groups=G)
    g = torch.Generator().manual_seed(5)
    for n in (1, 3, 9):
        hidden = torch.randn(n, H, generator=g)
        ids, weights = sort_slots(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]), torch.rand(n, K))
        present = present_groups(ids, E // G, G).numpy()
        calls, _ = ex.assign(1, ids.numpy(), present, set())
        for c in calls:
            for copy in (True, False):
                sent, call_ids, w, out_dtype = ex._request(c, hidden, weights.numpy(), torch.bfloat16, copy=copy)
                rows = torch.from_numpy(c.rows)
                assert torch.equal(sent, hidden[rows]) and torch.equal(call_ids, torch.from_numpy(c.ids))
                assert torch.equal(w, torch.where(call_ids >= 0, weights[rows], torch.zeros(())))
                assert w.dtype == torch.float32 and out_dtype == torch.bfloat16
