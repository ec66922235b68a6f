"""The expert exchange (worker/exchange.py) and the canonical grouped combine (kernels/moe/combine.py): the routed
sum has the same bits whichever worker, replica or split of a group computed it, in fp32 and bf16."""

import numpy as np
import pytest
import torch

from expertmesh.kernels.moe.combine import fold_groups, fold_rows, fold_rows_torch, group_partials, grouped_combine
from expertmesh.placement.replica_table import ReplicaTable
from expertmesh.worker.exchange import ExpertExchange

E, G, K, H = 16, 4, 4, 8
LAYER = 1


def expert_out(hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A stand-in expert: y = tanh(x · (e + 1) / 4) + e / 16, per (row, expert), fp32 [n, K, H]."""
    e = ids.clamp(min=0).float()[..., None]
    return torch.tanh(hidden.float()[:, None, :] * (e + 1) / 4) + e / 16


class FakeExpert:
    """ExpertWorker.run's contract over `expert_out`, holding `held` experts; `fail` raises ConnectionError."""

    def __init__(self, held, fail=False):
        self.held, self.fail, self.calls = set(held), fail, 0

    def run(self, layer, hidden, ids, weights, out_dtype=torch.float32):
        if self.fail:
            raise ConnectionError("gone")
        assert layer == LAYER and all(int(e) in self.held for e in ids[ids >= 0])
        self.calls += 1
        y = torch.where((ids >= 0)[..., None], expert_out(hidden, ids), torch.zeros(()))
        return group_partials(y, ids, weights, E // G, G).to(out_dtype)


def routed(n, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    # group-limited like the model: 2 groups per token, K distinct experts inside them
    ids = torch.stack(
        [
            torch.cat([grp * 4 + torch.randperm(4, generator=g)[:2] for grp in torch.randperm(G, generator=g)[:2]])
            for _ in range(n)
        ]
    )
    ids = torch.stack([torch.randperm(E, generator=g)[:K] if i % 5 == 4 else r for i, r in enumerate(ids)])
    weights = torch.rand(n, K, generator=g) * 2.5
    return hidden, ids, weights


def reference(hidden, ids, weights, dtype=torch.float32):
    return grouped_combine(expert_out(hidden, ids), ids, weights, n_experts=E, n_groups=G, dtype=dtype)


def table_of(holders: dict[int, list[int]]) -> ReplicaTable:
    """{expert: [workers]} → a one-layer ReplicaTable."""
    width = max(len(v) for v in holders.values())
    t = np.full((1, E, width), -1, dtype=np.int64)
    for e, ws in holders.items():
        t[0, e, : len(ws)] = ws
    return ReplicaTable((LAYER,), t)


def exchange(holders, fail=()):
    workers = sorted({w for ws in holders.values() for w in ws})
    clients = [FakeExpert([e for e, ws in holders.items() if w in ws], fail=w in fail) for w in workers]
    return ExpertExchange(clients, table_of(holders), n_experts=E, n_groups=G), clients


LAYOUTS = {
    "groups whole on one worker": {e: [e // 4 % 2] for e in range(E)},
    "groups split across workers": {e: [e % 3] for e in range(E)},
    "every expert on two workers": {e: [e % 3, (e + 1) % 3] for e in range(E)},
    "hot experts replicated": {e: [e // 4 % 2] + ([2] if e in (1, 6, 11) else []) for e in range(E)},
}


def test_the_combine_does_not_depend_on_slot_order_and_is_the_sum():
    hidden, ids, weights = routed(40, 0)
    out = expert_out(hidden, ids)
    ref = grouped_combine(out, ids, weights, n_experts=E, n_groups=G)
    perm = torch.randperm(K)
    assert torch.equal(grouped_combine(out[:, perm], ids[:, perm], weights[:, perm], n_experts=E, n_groups=G), ref)
    assert torch.allclose(ref, (out * weights[..., None]).sum(1), rtol=1e-5, atol=1e-6)
    assert torch.equal(grouped_combine(out[7:9], ids[7:9], weights[7:9], n_experts=E, n_groups=G), ref[7:9])
    bf = grouped_combine(out, ids, weights, n_experts=E, n_groups=G, dtype=torch.bfloat16)
    assert not torch.equal(bf, ref) and torch.allclose(bf, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fold", [fold_rows, fold_rows_torch])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fold_of_the_rows_that_arrived_is_the_masked_fold(dtype, fold):
    """fold_rows / fold_groups against the definition spelled out per token: acc = +0, then acc + round(P_g) for the
    groups present, ascending (absent groups' garbage — NaN here — never read; -0 and wide-range values kept)."""
    gen = torch.Generator().manual_seed(5)
    for T in (1, 2, 37):
        partials = torch.randn(T, G, 24, generator=gen) * torch.exp2(torch.randint(-20, 20, (T, G, 1), generator=gen))
        present = torch.rand(T, G, generator=gen) < 0.5
        present[0] = False
        present[0, G - 1] = True
        partials[~present] = float("nan")
        partials[-1, :, :2] = -0.0
        want = torch.zeros(T, 24)
        for t in range(T):
            for g in range(G):
                if present[t, g]:
                    want[t] = want[t] + partials[t, g].to(dtype).float()
        assert torch.equal(fold_groups(partials, present, dtype).view(torch.int32), want.view(torch.int32))
        tokens, groups = present.nonzero(as_tuple=True)
        shuffled = torch.randperm(len(tokens), generator=gen)  # rows may arrive in any order
        rows = partials[tokens, groups][shuffled]
        for sent in (rows, rows.to(dtype)):  # rows as fp32 or as they travel
            got = fold(tokens[shuffled].numpy(), groups[shuffled].numpy(), sent, T, dtype)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layout_gives_the_reference_bits(layout, dtype):
    hidden, ids, weights = routed(64, 1)
    ex, clients = exchange(LAYOUTS[layout])
    got, failed = ex.moe(LAYER, hidden.to(dtype), ids, weights)
    assert failed == {}
    assert torch.equal(got, reference(hidden.to(dtype), ids, weights, dtype))
    assert sum(c.calls for c in clients) <= len(clients)  # one call per expert worker per layer
    assert ex.load_stats()[LAYER] == np.bincount(ids.ravel().numpy(), minlength=E).tolist()


def test_whole_groups_come_back_as_one_row_each():
    hidden, ids, weights = routed(32, 2)
    ex, _ = exchange(LAYOUTS["groups whole on one worker"])
    calls, missing = ex.assign(LAYER, ids.sort(1).values.numpy(), _present(ids), set())
    assert missing == {}
    rows = sum(len(c.out_token) for c in calls)
    assert rows == int(_present(ids).sum()) < ids.numel()  # ≤ topk_group rows per token, not top_k
    assert all((c.out_k < 0).all() for c in calls)


def test_the_whole_group_assignment_is_the_general_one():
    """assign's fast path (every group to compute has a live holder of the whole group, no partial holders) gives
    exactly the calls of the general path — same workers, request rows, ids, answer rows — for any batch, any
    (token, group) pairs still to do and any workers down; it stands aside where it does not apply."""
    rng = np.random.default_rng(9)
    whole_layouts = {
        "groups whole on one worker": LAYOUTS["groups whole on one worker"],
        "whole groups on two of three workers": {e: [e // 4 % 3, (e // 4 + 1) % 3] for e in range(E)},
    }
    fields = ("rows", "ids", "out_token", "out_group", "out_k")
    for name, holders in whole_layouts.items():
        ex, clients = exchange(holders)
        for trial in range(60):
            n = int(rng.integers(1, 40))
            _, ids, _ = routed(n, 100 + trial)
            ids = ids.sort(1).values.numpy()
            todo = _present(torch.from_numpy(ids)) & (rng.random((n, G)) < (1.0 if trial % 2 else 0.7))
            down = {int(rng.integers(len(clients)))} if trial % 3 == 0 and len(clients) == 3 else set()
            fast = ex._assign_whole_groups(LAYER, ids, todo, down)
            calls, missing = ex._assign(LAYER, ids, todo, down)
            assert fast is not None and missing == {}, (name, trial)
            assert [c.worker for c in fast] == [c.worker for c in calls], (name, trial)
            for a, b in zip(fast, calls):
                for f in fields:
                    x, y = getattr(a, f), getattr(b, f)
                    assert x.dtype == y.dtype and np.array_equal(x, y), (name, trial, f)
    for name in ("groups split across workers", "hot experts replicated"):
        ex, _ = exchange(LAYOUTS[name])
        _, ids, _ = routed(8, 1)
        assert ex._assign_whole_groups(LAYER, ids.sort(1).values.numpy(), _present(ids), set()) is None, name
    ex, _ = exchange(LAYOUTS["groups whole on one worker"])
    _, ids, _ = routed(8, 1)
    assert ex._assign_whole_groups(LAYER, ids.sort(1).values.numpy(), _present(ids), {0}) is None  # no live holder


def _present(ids):
    p = np.zeros((ids.shape[0], G), dtype=bool)
    p[np.arange(ids.shape[0])[:, None], ids.numpy() // (E // G)] = True
    return p


def test_a_lost_worker_fails_over_to_replicas_in_the_same_call_with_the_same_bits():
    hidden, ids, weights = routed(48, 3)
    ex, clients = exchange(LAYOUTS["every expert on two workers"], fail={1})
    got, failed = ex.moe(LAYER, hidden, ids, weights)
    assert failed == {} and ex.down == {1}
    assert torch.equal(got, reference(hidden, ids, weights))
    got2, _ = ex.moe(LAYER, hidden, ids, weights)  # marked down: not called again
    assert torch.equal(got2, got) and clients[1].calls == 0


def test_experts_without_a_live_replica_fail_only_their_tokens_naming_them():
    hidden, ids, weights = routed(48, 4)
    ex, _ = exchange(LAYOUTS["groups split across workers"], fail={2})
    got, failed = ex.moe(LAYER, hidden, ids, weights)
    lost = {e for e in range(E) if e % 3 == 2}
    hit = [t for t in range(48) if set(ids[t].tolist()) & lost]
    assert sorted(failed) == hit and 0 < len(hit) < 48
    t = hit[0]
    assert str(sorted(set(ids[t].tolist()) & lost)) in failed[t]
    ok = [t for t in range(48) if t not in failed]
    assert torch.equal(got[ok], reference(hidden, ids, weights)[ok])
