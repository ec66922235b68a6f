"""The expert exchange, run by each attention worker at every MoE layer: its (token, slot) pairs go straight to
the expert workers that hold them, one call per expert worker, concurrently; the answers are combined here.

Who computes what (`assign`): a token's slots are taken per expert group (routing is group-limited, and a
group-aware plan keeps a group's experts on one pod). When some live expert worker holds all of a token's slots
in a group, one of them (rotating by token and group, to spread over replicas) gets the whole group and returns
its pre-reduced partial sum P_g: one row per (token, group) instead of one per slot. Otherwise each slot of the
group goes alone ("fragments") to a live holder and comes back as its own row; P_g is folded here from the
fragments in ascending expert id — the same sequence of fp32 operations, so the same bits
(kernels/moe/combine.py). The routed sum then folds the groups in ascending order. Which worker or replica
computed what never changes a bit, so greedy tokens are identical across layouts, replicas and failover.

Failures: a call that fails with ConnectionError (unreachable, past its deadline) marks that expert worker down
and its groups are assigned again among the live replicas in the same step; tokens with an expert that has no
live replica are reported as failed rows (their requests end with a message naming the experts), the others go
on. A worker marked down is probed (gRPC health) every `probe_interval` seconds and taken back once it answers.
Clients may use another transport for the tensors (worker/collective.CollectiveExpert: a point-to-point pair); a
redo after a failure always goes over gRPC (`run_grpc`). Over a formed pair a call is split: `start` sends it from
the step's own thread and `finish` receives the answer there — no pool thread between (on a loaded 2-core machine
each hop cost a fraction of a millisecond per layer); gRPC calls run on the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from expertmesh.kernels.moe.combine import fold_rows, present_groups, sort_slots
from expertmesh.placement.replica_table import ReplicaTable
from expertmesh.runtime import telemetry

log = logging.getLogger("expertmesh.worker")


@dataclass
class _Call:
    """One expert worker's share of a layer: request rows, and where each answer row goes."""

    worker: int
    rows: np.ndarray  # [n] token index of each request row
    ids: np.ndarray  # [n, K] ascending per row, −1 = not in this call
    out_token: np.ndarray  # [R] token of each answer row
    out_group: np.ndarray  # [R] group of each answer row
    out_k: np.ndarray  # [R] slot column of a fragment (one slot of a split group), −1 for a whole group


@dataclass
class _Layer:
    """One MoE layer in flight: what was sent, and what is still to compute (`todo`)."""

    layer: int
    hidden: torch.Tensor  # [N, H] as given (its dtype goes on the wire)
    host: torch.Tensor  # the same on the host
    ids: np.ndarray  # [N, K] ascending per row
    w_t: torch.Tensor  # [N, K] fp32, in the ids' order
    present: np.ndarray  # [N, G] groups each token has slots in
    todo: np.ndarray  # [N, G] (token, group) pairs not computed yet
    span: object = None  # the exchange's span, while tracing
    trace_ctx: object = None
    jobs: list = field(default_factory=list)  # (call, future) of the last attempt
    failed: dict = field(default_factory=dict)  # token → why


class ExpertExchange:
    def __init__(
        self,
        clients: list,
        table: ReplicaTable,
        *,
        n_experts: int,
        n_groups: int,
        probe_interval: float = 1.0,
        retries: int = 2,
    ):
        """`clients`: expert workers in plan ordinal order, each with run(layer, hidden, ids, weights, out_dtype)
        (in process: ExpertWorker; remote: RemoteExpert), and optionally health() for probing."""
        self.clients = clients
        self.table = table
        self.n_experts, self.n_groups = n_experts, n_groups
        self.group_size = n_experts // n_groups
        self.retries = retries
        self.down: set[int] = set()
        self.last_error: dict[int, str] = {}
        self.lock = threading.Lock()
        self.load = {l: np.zeros(n_experts, dtype=np.int64) for l in table.moe_layers}
        self.bytes_sent = self.bytes_received = 0
        self._holds = {l: table.holds(l, len(clients)) for l in table.moe_layers}
        self._whole = {l: self._whole_holders(h) for l, h in self._holds.items()}
        self.pool = ThreadPoolExecutor(max_workers=max(2, len(clients)), thread_name_prefix="exchange")
        self.probe_interval = probe_interval
        self.closed = False
        if any(hasattr(c, "health") for c in clients):
            threading.Thread(target=self._probe, name="exchange-probe", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            if hasattr(c, "close"):
                c.close()

    def mark_down(self, worker: int, error: Exception) -> None:
        with self.lock:
            if worker not in self.down:
                log.warning("expert worker %d marked down: %s", worker, error)
            self.down.add(worker)
            # what requests may be told: no addresses (those are in the log)
            self.last_error[worker] = f"expert worker {worker} unreachable or past its deadline"

    def _probe(self) -> None:
        while not self.closed:
            time.sleep(self.probe_interval)
            for w in sorted(self.down):
                try:
                    ok = self.clients[w].health() == "SERVING"
                except Exception:
                    ok = False
                if ok:
                    log.info("expert worker %d is back", w)
                    with self.lock:
                        self.down.discard(w)

    # ------------------------------------------------------------------ who computes what
    def _whole_holders(self, holds: np.ndarray) -> np.ndarray | None:
        """holds bool [W, E] → bool [G, W] (worker w holds all of group g), where every worker that holds an expert
        of a group holds the whole group (a group-aware plan without partial replicas); None otherwise."""
        by_group = holds.reshape(holds.shape[0], self.n_groups, self.group_size)
        whole, some = by_group.all(2), by_group.any(2)
        return whole.T.copy() if np.array_equal(whole, some) else None

    def assign(
        self, layer: int, ids: np.ndarray, todo: np.ndarray, down: set[int]
    ) -> tuple[list[_Call], dict[int, set[int]]]:
        """ids [N, K] ascending per row; todo bool [N, G] the (token, group) pairs still to compute
        → (one _Call per expert worker with work, {token: experts without a live holder})."""
        calls = self._assign_whole_groups(layer, ids, todo, down)
        return (calls, {}) if calls is not None else self._assign(layer, ids, todo, down)

    def _assign_whole_groups(self, layer: int, ids: np.ndarray, todo: np.ndarray, down: set[int]) -> list[_Call] | None:
        """`assign` where every group to compute has a live holder of the whole group and no worker holds part of
        one (the common case: a group-aware plan, nothing down): each (token, group) goes whole to the same
        worker `_assign` picks — the ((token + group) mod holders)-th live holder in worker order — in a few array
        operations instead of its general ones (inside `up`'s decode steps 0.29 -> 0.17 ms a layer; 97 -> 34 us
        warm). None where it does not apply."""
        whole = self._whole.get(layer)
        if whole is None:
            return None
        live = whole.copy()  # [G, W]
        live[:, sorted(down)] = False
        n_live = live.sum(1)  # [G]
        tok, grp = np.nonzero(todo)  # (token, group) pairs, row-major
        if (n_live[grp] == 0).any():
            return None
        holders = np.argsort(~live, axis=1, kind="stable")  # [G, W] live holders first, in order
        worker = holders[grp, (tok + grp) % n_live[grp]]  # [P]
        assigned = np.full(todo.shape, -1, dtype=np.int64)
        assigned[tok, grp] = worker
        slot_worker = np.take_along_axis(assigned, ids // self.group_size, 1)  # [N, K]
        calls = []
        for w in np.unique(worker).tolist():
            mine = worker == w
            rows = np.unique(tok[mine])
            calls.append(
                _Call(
                    w,
                    rows,
                    np.where(slot_worker[rows] == w, ids[rows], -1),
                    tok[mine],
                    grp[mine],
                    np.full(int(mine.sum()), -1, dtype=np.int64),
                )
            )
        return calls

    def _assign(
        self, layer: int, ids: np.ndarray, todo: np.ndarray, down: set[int]
    ) -> tuple[list[_Call], dict[int, set[int]]]:
        """`assign` in general: replicas of part of a group, fragments, experts without a live holder."""
        N, K = ids.shape
        G, W = self.n_groups, len(self.clients)
        holds = self._holds[layer].copy()
        for w in down:
            holds[w] = False
        grp = ids // self.group_size  # [N, K]
        live = holds[:, ids]  # [W, N, K]
        slot_todo = todo[np.arange(N)[:, None], grp]  # [N, K]
        in_g = (grp[:, :, None] == np.arange(G)) & slot_todo[:, :, None]  # [N, K, G]
        need = in_g.sum(1)  # [N, G]
        have = np.einsum("wnk,nkg->wng", live.astype(np.int32), in_g.astype(np.int32))
        full = (have == need[None]) & (need[None] > 0)  # [W, N, G]
        n_full = full.sum(0)
        pick = (np.arange(N)[:, None] + np.arange(G)[None, :]) % np.maximum(n_full, 1)
        whole = np.where(n_full > 0, np.argmax(full & (full.cumsum(0) == pick[None] + 1), axis=0), -1)  # [N, G]
        # slots of groups no single live worker holds whole: each to one of its own holders
        frag = slot_todo & (np.take_along_axis(n_full, grp, 1) == 0)  # [N, K]
        n_live = live.sum(0)  # [N, K]
        pick_k = (np.arange(N)[:, None] + np.arange(K)[None, :]) % np.maximum(n_live, 1)
        frag_w = np.where(frag & (n_live > 0), np.argmax(live & (live.cumsum(0) == pick_k[None] + 1), axis=0), -1)
        missing: dict[int, set[int]] = {}
        for t, k in zip(*np.nonzero(frag & (n_live == 0))):
            missing.setdefault(int(t), set()).add(int(ids[t, k]))
        slot_whole = np.take_along_axis(whole, grp, 1)  # [N, K] worker of a whole group
        # fragments of one (token, group) on one worker go in separate request rows (rank 0, 1, ...): a row has
        # at most one slot per group that is not whole, so the worker's per-(row, group) sum of it is that slot alone
        rank = np.zeros((N, K), dtype=np.int64)
        for k in range(1, K):
            same = frag[:, :k] & (frag_w[:, :k] == frag_w[:, k : k + 1]) & (grp[:, :k] == grp[:, k : k + 1])
            rank[:, k] = same.sum(1)
        calls = []
        for w in range(W):
            whole_here = slot_todo & ~frag & (slot_whole == w)  # [N, K]
            frag_here = frag & (frag_w == w)
            slot_row = np.where(whole_here, 0, np.where(frag_here, rank, -1))  # request row rank of each slot
            R = int(slot_row.max()) + 1
            if R <= 0:
                continue
            rows_t, rows_r = np.nonzero((slot_row[:, :, None] == np.arange(R)).any(1))  # (token, rank) rows
            sel = slot_row[rows_t] == rows_r[:, None]  # [n, K]
            call_ids = np.where(sel, ids[rows_t], -1)
            n = len(rows_t)
            row_of, k_of = np.nonzero(sel)
            groups = np.zeros((n, G), dtype=bool)
            groups[row_of, grp[rows_t[row_of], k_of]] = True
            frag_k = np.full((n, G), -1, dtype=np.int64)
            is_frag = frag_here[rows_t[row_of], k_of]
            frag_k[row_of[is_frag], grp[rows_t[row_of[is_frag]], k_of[is_frag]]] = k_of[is_frag]
            rr, gg = np.nonzero(groups)  # answer rows, row-major
            calls.append(_Call(w, rows_t, call_ids, rows_t[rr], gg, frag_k[rr, gg]))
        return calls, missing

    # ------------------------------------------------------------------ one MoE layer
    def moe(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """hidden [N, H] (the activation dtype: what goes on the wire), topk_ids / topk_weights [N, K]
        → (routed sum fp32 [N, H] in the canonical order, {token: why it failed})."""
        return self.finish(self.start(layer, hidden, topk_ids, topk_weights))

    def start(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> _Layer:
        """Send a layer's calls and return at once (the caller computes its shared experts meanwhile); `finish`
        waits for the answers, redoes what failed and combines."""
        span = trace_ctx = None
        if telemetry.tracing_enabled():
            from opentelemetry import context, trace

            span = telemetry.tracer().start_span("expert_exchange", attributes={"expertmesh.layer": layer})
            trace_ctx = trace.set_span_in_context(span, context.get_current())
        ids_t, w_t = sort_slots(topk_ids.cpu(), topk_weights.cpu().float())
        present = present_groups(ids_t, self.group_size, self.n_groups).numpy()  # [N, G]
        job = _Layer(layer, hidden, hidden.cpu(), ids_t.numpy(), w_t, present, present.copy(), span, trace_ctx)
        self._send(job, 0)
        return job

    def _send(self, job: _Layer, attempt: int) -> None:
        with self.lock:
            down = set(self.down)
        calls, missing = self.assign(job.layer, job.ids, job.todo, down)
        for t, experts in missing.items():
            job.failed.setdefault(t, f"experts without a live replica in layer {job.layer}: {sorted(experts)}")
            job.todo[t] = False
        job.jobs = [(c, self._submit(job, c, attempt)) for c in calls]

    def _submit(self, job: _Layer, c: _Call, attempt: int):
        """Start one call → something with result(): over a formed pair (a client with `post`), sent from this
        thread now and received by `finish`'s thread — no thread hop either way; otherwise on the pool."""
        client = self.clients[c.worker]
        if attempt == 0 and hasattr(client, "post"):
            sent, ids, w, out_dtype = self._request(c, job.host, job.w_t, job.hidden.dtype)
            try:
                posted = client.post(job.layer, sent, ids, w, out_dtype, len(c.out_token))
            except Exception as e:  # as a pool call that failed (finish redoes a ConnectionError)
                failed = Future()
                failed.set_exception(e)
                return failed
            if posted is not None:
                return _Answer(self, c, posted, sent, ids, w)
        return self.pool.submit(self._run, job.layer, c, job.host, job.w_t, job.hidden.dtype, job.trace_ctx, attempt)

    def finish(self, job: _Layer) -> tuple[torch.Tensor, dict[int, str]]:
        try:
            return self._finish(job)
        finally:
            if job.span is not None:
                job.span.end()

    def _finish(self, job: _Layer) -> tuple[torch.Tensor, dict[int, str]]:
        N, H = job.hidden.shape
        layer, todo = job.layer, job.todo
        # the P_g that arrived: whole rows as they came, and P_g summed here from per-slot fragments
        got_tokens, got_groups, got_rows = [], [], []
        summed: dict[tuple[int, int], torch.Tensor] = {}
        for attempt in range(self.retries + 1):
            if attempt:
                self._send(job, attempt)
            results, lost = [], set()
            for c, fut in job.jobs:
                try:
                    results.append((c, fut.result()))
                except ConnectionError as e:  # unreachable / deadline: its groups go to replicas
                    self.mark_down(c.worker, e)
                    lost.update(zip(c.out_token.tolist(), c.out_group.tolist()))
            fragments = []
            for c, out in results:
                keep = (
                    np.ones(len(c.out_token), dtype=bool)
                    if not lost
                    else np.array(
                        [(t, g) not in lost for t, g in zip(c.out_token.tolist(), c.out_group.tolist())], dtype=bool
                    )
                )
                whole = keep & (c.out_k < 0)
                got_tokens.append(c.out_token[whole])
                got_groups.append(c.out_group[whole])
                got_rows.append(out if whole.all() else out[torch.from_numpy(whole)])
                todo[c.out_token[whole], c.out_group[whole]] = False
                sel = np.flatnonzero(keep & (c.out_k >= 0))
                fragments += [(int(c.out_k[i]), int(c.out_token[i]), int(c.out_group[i]), out[i]) for i in sel]
            for _k, t, g, row in sorted(fragments, key=lambda f: f[0]):  # P_g from its slots, ascending id
                summed[t, g] = summed.get((t, g), torch.zeros(H)) + row.float()
                todo[t, g] = False
            if not lost:
                break
        for t in np.flatnonzero(todo.any(1)).tolist():
            job.failed.setdefault(
                t,
                f"expert workers failed for layer {layer}: "
                + "; ".join(self.last_error.get(w, "") for w in sorted(self.down)),
            )
        with self.lock:
            np.add.at(self.load[layer], job.ids.ravel(), 1)
        if summed:
            got_tokens.append(np.array([t for t, _ in summed], dtype=np.int64))
            got_groups.append(np.array([g for _, g in summed], dtype=np.int64))
            got_rows.append(torch.stack(list(summed.values())))
        if not got_rows:
            return torch.zeros(N, H), job.failed
        rows = got_rows[0] if len(got_rows) == 1 else torch.cat([r.float() for r in got_rows])
        # a (token, group) missing (its experts failed) adds nothing, as its zero P_g would
        return fold_rows(np.concatenate(got_tokens), np.concatenate(got_groups), rows, N, job.hidden.dtype), job.failed

    def _run(
        self,
        layer: int,
        c: _Call,
        hidden: torch.Tensor,
        weights: torch.Tensor,
        dtype: torch.dtype,
        trace_ctx=None,
        attempt: int = 0,
    ) -> torch.Tensor:
        if trace_ctx is not None:  # the pool thread joins the step's trace: the call carries traceparent
            from opentelemetry import context

            token = context.attach(trace_ctx)
            try:
                return self._call(layer, c, hidden, weights, dtype, attempt)
            finally:
                context.detach(token)
        return self._call(layer, c, hidden, weights, dtype, attempt)

    @staticmethod
    def _request(c: _Call, hidden: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype):
        """A call's tensors → (hidden rows, ids, gate weights, answer dtype)."""
        rows = torch.from_numpy(c.rows)
        ids = torch.from_numpy(c.ids)
        w = torch.where(ids >= 0, weights[rows], torch.zeros(()))
        # fragments are folded here in fp32; whole-group rows may travel in the activation dtype (the fold
        # rounds every P_g through it anyway)
        out_dtype = torch.float32 if (c.out_k >= 0).any() else dtype
        return hidden[rows], ids, w, out_dtype

    def _call(
        self, layer: int, c: _Call, hidden: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, attempt: int = 0
    ) -> torch.Tensor:
        sent, ids, w, out_dtype = self._request(c, hidden, weights, dtype)
        client = self.clients[c.worker]
        if hasattr(client, "run_grpc"):  # a collective transport (worker/collective.py): a redo goes over gRPC
            out = (
                client.run_grpc(layer, sent, ids, w, out_dtype)
                if attempt
                else client.run(layer, sent, ids, w, out_dtype, rows=len(c.out_token))
            )
        else:
            out = client.run(layer, sent, ids, w, out_dtype)
        return self._answered(c, out, sent, ids, w)

    def _answered(
        self, c: _Call, out: torch.Tensor, sent: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """A call's answer, checked and counted."""
        if out.shape[0] != len(c.out_token):
            raise RuntimeError(f"expert worker {c.worker}: {out.shape[0]} answer rows, expected {len(c.out_token)}")
        with self.lock:
            self.bytes_sent += sent.numel() * sent.element_size() + ids.numel() * 8 + w.numel() * 4
            self.bytes_received += out.numel() * out.element_size()
        return out

    def load_stats(self) -> dict[int, list[int]]:
        with self.lock:
            return {l: v.tolist() for l, v in self.load.items()}


class _Answer:
    """A call posted over a pair (worker/collective.Posted): result() receives, checks and counts its answer."""

    def __init__(self, exchange: ExpertExchange, c: _Call, posted, sent, ids, w):
        self.exchange, self.c, self.posted, self.sent, self.ids, self.w = exchange, c, posted, sent, ids, w

    def result(self) -> torch.Tensor:
        return self.exchange._answered(self.c, self.posted.result(), self.sent, self.ids, self.w)


class ExchangeExperts:
    """One step's RoutedExpertsBackend (expertmesh/model/moe.py) for the model's own layer loop: the routed experts
    over `exchange`, the shared experts meanwhile on `threads`' decode count (worker/threads.py). Rows whose
    experts had no live replica collect in `failed_rows` (row → why; the first reason a row met)."""

    def __init__(self, exchange: ExpertExchange | None, threads):
        self.exchange, self.threads = exchange, threads
        self.failed_rows: dict[int, str] = {}

    def start(self, layer: int, moe, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype):
        return self.exchange.start(layer, z, ids, weights), z.device

    def overlap(self, rows: int):
        return self.threads.rows(rows)

    def finish(self, pending) -> torch.Tensor:
        sent, device = pending
        routed, failed = self.exchange.finish(sent)
        for row, why in failed.items():
            self.failed_rows.setdefault(row, why)
        return routed.to(device)
