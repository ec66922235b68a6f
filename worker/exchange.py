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

from expertmesh.kernels.moe.combine import fold_rows
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
    whole: bool = False  # every answer row is a whole group's P_g (out_k all −1)


@dataclass
class _Layer:
    """One MoE layer in flight: what was sent, and what is still to compute (`todo`)."""

    layer: int
    hidden: torch.Tensor  # [N, H] as given (its dtype goes on the wire)
    host: torch.Tensor  # the same on the host
    ids: np.ndarray  # [N, K] ascending per row
    w_np: np.ndarray  # [N, K] fp32 gate weights, in the ids' order
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
        self._live_holders: dict[tuple[int, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}
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
        warm), the live holders of each (layer, workers down) computed once. None where it does not apply."""
        if self._whole.get(layer) is None:
            return None
        holders, n_live = self._live_holders_of(layer, down)
        tok, grp = np.nonzero(todo)  # (token, group) pairs, row-major
        live_n = n_live[grp]
        if not live_n.all():
            return None
        worker = holders[grp, (tok + grp) % live_n]  # [P]
        assigned = np.full(todo.shape, -1, dtype=np.int64)
        assigned[tok, grp] = worker
        slot_worker = np.take_along_axis(assigned, ids // self.group_size, 1)  # [N, K]
        calls = []
        for w in np.unique(worker).tolist():
            mine = worker == w
            t = tok[mine]  # ascending (row-major)
            rows = t[np.concatenate(([True], t[1:] != t[:-1]))]
            calls.append(
                _Call(
                    w,
                    rows,
                    np.where(slot_worker[rows] == w, ids[rows], -1),
                    t,
                    grp[mine],
                    np.full(len(t), -1, dtype=np.int64),
                    whole=True,
                )
            )
        return calls

    def _live_holders_of(self, layer: int, down: set[int]) -> tuple[np.ndarray, np.ndarray]:
        """→ ([G, W] each group's live whole holders first, in worker order; [G] how many), per (layer, down)."""
        key = (layer, tuple(sorted(down)))
        found = self._live_holders.get(key)
        if found is None:
            live = self._whole[layer].copy()  # [G, W]
            live[:, list(key[1])] = False
            found = (np.argsort(~live, axis=1, kind="stable"), live.sum(1))
            if len(self._live_holders) > 256:  # bounded: down sets come and go
                self._live_holders.clear()
            self._live_holders[key] = found
        return found

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
        # kernels/moe/combine.py's sort_slots and present_groups, in numpy: a decode step's few rows cost torch's
        # per-op overhead many times over (the same stable order, so the same rows)
        ids = topk_ids.cpu().numpy()
        order = np.argsort(ids, axis=1, kind="stable")
        ids = np.take_along_axis(ids, order, 1)
        w_np = np.take_along_axis(topk_weights.cpu().float().numpy(), order, 1)
        present = np.zeros((ids.shape[0], self.n_groups), dtype=bool)  # [N, G]
        valid = ids >= 0
        present[np.nonzero(valid)[0], ids[valid] // self.group_size] = True
        job = _Layer(layer, hidden, hidden.cpu(), ids, w_np, present, present.copy(), span, trace_ctx)
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
            # sent from this thread now: the rows may be the hidden states themselves, not a copy
            sent, ids, w, out_dtype = self._request(c, job.host, job.w_np, job.hidden.dtype, copy=False)
            try:
                posted = client.post(job.layer, sent, ids, w, out_dtype, len(c.out_token))
            except Exception as e:  # as a pool call that failed (finish redoes a ConnectionError)
                failed = Future()
                failed.set_exception(e)
                return failed
            if posted is not None:
                return _Answer(self, c, posted, sent, ids, w)
        return self.pool.submit(self._run, job.layer, c, job.host, job.w_np, job.hidden.dtype, job.trace_ctx, attempt)

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
                if c.whole and not lost:  # the common case: every row a whole group's P_g, all kept
                    got_tokens.append(c.out_token)
                    got_groups.append(c.out_group)
                    got_rows.append(out)
                    todo[c.out_token, c.out_group] = False
                    continue
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
        routed = job.ids[job.ids >= 0]
        counts = np.bincount(routed, minlength=self.n_experts) if routed.size else None
        with self.lock:
            if counts is not None:
                self.load[layer] += counts
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
    def _request(c: _Call, hidden: torch.Tensor, weights: np.ndarray, dtype: torch.dtype, *, copy: bool = True):
        """A call's tensors → (hidden rows, ids, gate weights, answer dtype). `weights`: [N, K] fp32 numpy (the
        selection in numpy: torch's per-op overhead dominates at decode sizes). `copy` False: every row of
        `hidden` in order is `hidden` itself."""
        n = hidden.shape[0]
        every_row = not copy and len(c.rows) == n and bool((c.rows == np.arange(n)).all())
        ids = torch.from_numpy(c.ids)
        w = torch.from_numpy(np.where(c.ids >= 0, weights[c.rows], np.float32(0)))
        # fragments are folded here in fp32; whole-group rows may travel in the activation dtype (the fold
        # rounds every P_g through it anyway)
        out_dtype = dtype if c.whole or not (c.out_k >= 0).any() else torch.float32
        return (hidden if every_row else hidden[torch.from_numpy(c.rows)]), ids, w, out_dtype

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
