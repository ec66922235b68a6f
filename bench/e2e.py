"""End-to-end serving benchmark: in-process engine vs the multi-process deployment (gRPC on loopback), side by
side in one run, counting tokens the same way on both sides (one token event each, no stop token, the same
prompts and max_tokens), and what moves where:

  * router bytes per token — TCP payload bytes on the router's sockets to its workers (`ss -tin`, bytes_sent +
    bytes_received of the router process's connections to worker ports) and the router's own counter of
    serialized worker messages, per token fed through the model (prompt + generated);
  * attention↔expert bytes per token per MoE layer (the attention workers' count of tensor bytes on their expert
    calls) against the least the exchange could send: the hidden state once and one combined row back
    (2·H·b), and against the per-slot scheme (hidden to each of top-k experts, a row back from each: 2·H·K·b);
  * a projection for full-2.8t: 16 expert pods, batch 256 per attention worker, random group-limited routing
    through the real gate function, rows per token and bytes per step from the exchange's own assignment
    (worker/exchange.py) on the planner's 16-pod plan, group-aware and not; implied time at 100 / 400 Gb/s.

  * the per-layer expert exchange over each `--transport` side by side (gRPC vs collective: torch.distributed
    pairs, gloo on loopback): tokens/s of the deployment at c=1 and c=32, and the time of one MoE layer's exchange
    (ExpertExchange.moe: assignment, calls, combine) at decode batch sizes against the same expert worker
    processes, the two transports' routed sums checked bit-identical.

    python bench/e2e.py [--quick] [--presets tiny,small] [--transport grpc,collective] [--out bench/results/e2e.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
from expertmesh.model.config import preset
from expertmesh.wire.sampling_params import SamplingParams


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


def _run(submit, concurrency: int, prompt_len: int, max_tokens: int) -> dict:
    """`submit(prompt, max_tokens)` yields one item per generated token; measure TTFT and decode rate."""
    prompts = _prompts(concurrency, prompt_len, seed=concurrency)
    ttft, decode_rates, tokens = [], [], 0
    t0 = time.perf_counter()

    def one(p):
        start = time.perf_counter()
        first = None
        n = 0
        for _ in submit(p, max_tokens):
            n += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return first - start, (n - 1) / (end - first) if n > 1 and end > first else 0.0, n

    with ThreadPoolExecutor(concurrency) as pool:
        for a, b, n in pool.map(one, prompts):
            ttft.append(a)
            decode_rates.append(b)
            tokens += n
    wall = time.perf_counter() - t0
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "per_seq_tok_s": statistics.mean(decode_rates),
        "total_tok_s": tokens / wall,
        "tokens": tokens,
    }


def _params(max_tokens: int) -> SamplingParams:
    """Greedy, stopping at EOS as the router's gRPC Generate does when no stop token is given: both sides
    produce the same tokens, so the same count (checked in main)."""
    from expertmesh.chat.tokenizer import ByteTokenizer

    return SamplingParams(max_tokens=max_tokens, temperature=0, stop_token_ids=tuple(ByteTokenizer().eos_ids))


def bench_inprocess(ckpt, concurrencies, prompt_len, max_tokens):
    from expertmesh.entry.local import build_local_engine

    eng = build_local_engine(ckpt, attention_workers=1, expert_workers=2, max_running=64, max_waiting=256)

    def submit(p, n):
        return eng.submit(p, _params(n)).stream(300)

    try:
        _run(submit, 1, prompt_len, 4)  # warm-up
        return {c: _run(submit, c, prompt_len, max_tokens) for c in concurrencies}
    finally:
        eng.close()


def _router_tcp_bytes(pid: int, worker_ports: set[int]) -> int:
    """bytes_sent + bytes_received over the process's established TCP connections to `worker_ports`."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True).stdout
    total = 0
    for head, info in zip(*[iter(out.splitlines())] * 2):
        if f"pid={pid}," not in head:
            continue
        peer = head.split()[3] if head.split()[0].isdigit() else head.split()[4]
        if int(peer.rsplit(":", 1)[1]) not in worker_ports:
            continue
        for key in ("bytes_sent", "bytes_received"):
            m = re.search(rf"\b{key}:(\d+)", info)
            total += int(m.group(1)) if m else 0
    return total


def bench_multiprocess(ckpt_dir, concurrencies, prompt_len, max_tokens, transport="grpc"):
    import grpc
    import httpx

    from expertmesh.entry.cluster import LocalCluster, free_port
    from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2

    cfg = Checkpoint(ckpt_dir).cfg
    grpc_port = free_port()
    cluster = LocalCluster(
        ckpt_dir, attention_workers=1, expert_workers=2, http_port=free_port(), grpc_port=grpc_port, transport=transport
    )
    cluster.start()
    if transport == "collective":
        _wait_pairs(cluster, 1)
    client = httpx.Client(base_url=cluster.http_url, timeout=300)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = router_pb2_grpc.RouterStub(channel)
    router = next(c for c in cluster.children if c.name == "router")
    worker_ports = {int(c.address.rsplit(":", 1)[1]) for c in cluster.children if c.name != "router"}

    def submit(prompt, n):
        req = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=prompt), params=sampling_pb2.SamplingParams(max_tokens=n, temperature=0)
        )
        for ev in stub.Generate(req, timeout=300):
            if ev.HasField("token"):
                yield 1

    def counters():
        text = client.get("/metrics").text

        def total(name):
            return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

        return {
            "messages": total("expertmesh_worker_message_bytes_total"),
            "exchange": total("expertmesh_expert_exchange_bytes_total"),
            "tokens": total("expertmesh_prompt_tokens_total") + total("expertmesh_generation_tokens_total"),
            "tcp": _router_tcp_bytes(router.proc.pid, worker_ports),
        }

    try:
        list(submit([1, 2, 3], 2))
        out = {}
        for c in concurrencies:
            a = counters()
            out[c] = _run(submit, c, prompt_len, max_tokens)
            b = counters()
            fed = max(1.0, b["tokens"] - a["tokens"])
            out[c].update(
                router_tcp_per_token=(b["tcp"] - a["tcp"]) / fed,
                router_messages_per_token=(b["messages"] - a["messages"]) / fed,
                exchange_per_token_layer=(b["exchange"] - a["exchange"]) / fed / cfg.n_moe_layers,
            )
        return out
    finally:
        channel.close()
        client.close()
        cluster.stop()


def _wait_pairs(cluster, n: int, timeout: float = 60.0) -> None:
    """Until every expert worker serves `n` collective pairs (they form in the background after connect)."""
    from expertmesh.wire.clients import RemoteExpert

    deadline = time.monotonic() + timeout
    for c in cluster.workers:
        if c.name.startswith("expert-"):
            with RemoteExpert(c.address, timeout=5) as e:
                while e.transport_counts()["collective_pairs"] < n:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{c.name}: collective pairs not formed within {timeout:g} s")
                    time.sleep(0.1)


def bench_exchange(ckpt_dir, batches, transports, reps: int) -> list[dict]:
    """One MoE layer's exchange (ExpertExchange.moe) from this process to 2 expert worker processes at decode
    batch sizes, over each transport against the same workers (they serve both); gate-routed random tokens."""
    import numpy as np
    import torch

    from expertmesh.entry.cluster import LocalCluster, free_port
    from expertmesh.kernels.moe.combine import present_groups
    from expertmesh.model.moe import route_tokens
    from expertmesh.placement.replica_table import ReplicaTable
    from expertmesh.wire.clients import RemoteExpert
    from expertmesh.worker.collective import CollectiveExpert
    from expertmesh.worker.exchange import ExpertExchange

    cfg = Checkpoint(ckpt_dir).cfg
    E, layer = cfg.moe.n_routed_experts, cfg.moe_layers[0]
    cluster = LocalCluster(
        ckpt_dir,
        attention_workers=1,
        expert_workers=2,
        http_port=free_port(),
        grpc_port=free_port(),
        transport="collective",
    )
    cluster.start()
    rows, exchanges = [], {}
    try:
        from expertmesh.placement.plan import PlacementPlan

        plan = PlacementPlan.from_json(cluster.plan_path.read_text())
        table = ReplicaTable.from_placement(plan, cfg.moe_layers, E)
        addresses = [c.address for c in sorted(cluster.workers, key=lambda c: c.name) if c.name.startswith("expert-")]
        for t in transports:
            clients = [RemoteExpert(a, timeout=30) for a in addresses]
            if t == "collective":
                clients = [CollectiveExpert(c) for c in clients]
                deadline = time.monotonic() + 60
                while not all(c.formed for c in clients):
                    if time.monotonic() > deadline:
                        raise TimeoutError("collective pairs not formed within 60 s")
                    time.sleep(0.05)
            exchanges[t] = ExpertExchange(clients, table, n_experts=E, n_groups=cfg.moe.combine_groups)
        g = torch.Generator().manual_seed(0)
        for b in batches:
            hidden = torch.randn(b, cfg.hidden_size, generator=g)
            ids, w = route_tokens(torch.randn(b, E, generator=g), torch.zeros(E), cfg)
            results, row = {}, {"batch": b}
            for t, ex in exchanges.items():
                for _ in range(3):  # warm-up
                    results[t], failed = ex.moe(layer, hidden, ids, w)
                    assert not failed, failed
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    ex.moe(layer, hidden, ids, w)
                    times.append(time.perf_counter() - t0)
                row[f"{t}_us_p50"] = 1e6 * statistics.median(times)
                row[f"{t}_us_p90"] = 1e6 * float(np.percentile(times, 90))
            ref = next(iter(results.values()))
            if any(not torch.equal(r, ref) for r in results.values()):
                raise RuntimeError(f"batch {b}: the transports' routed sums differ")
            sorted_ids = ids.sort(1).values
            present = present_groups(sorted_ids, E // cfg.moe.combine_groups, cfg.moe.combine_groups).numpy()
            row["calls"] = len(ex.assign(layer, sorted_ids.numpy(), present, set())[0])
            rows.append(row)
        wire = _bench_wire({t: ex.clients[0] for t, ex in exchanges.items()}, layer, cfg.hidden_size, reps)
        if "collective" in exchanges:
            assert all(c.grpc_calls == 0 for c in exchanges["collective"].clients), "a collective call fell back"
    finally:
        for ex in exchanges.values():
            ex.close()
        cluster.stop()
    return rows, wire


def _bench_wire(
    clients: dict, layer: int, hidden_size: int, reps: int, sizes=(64 * 2**10, 2**20, 16 * 2**20)
) -> list[dict]:
    """The transports alone: hidden states of `size` bytes to one expert worker with every slot −1 (nothing to
    compute, an empty answer) — the outbound wire cost of a call, without the experts' work."""
    import torch

    rows = []
    for size in sizes:
        n = max(1, size // (4 * hidden_size))
        hidden = torch.randn(n, hidden_size)
        ids, w = torch.full((n, 1), -1, dtype=torch.int64), torch.zeros(n, 1)
        row = {"bytes": n * hidden_size * 4}
        for t, client in clients.items():
            call = (
                (lambda: client.run(layer, hidden, ids, w, rows=0))
                if t == "collective"
                else (lambda: client.run(layer, hidden, ids, w))
            )
            call()
            times = []
            for _ in range(max(3, reps // (4 if size > 2**20 else 1))):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            row[f"{t}_ms_p50"] = 1e3 * statistics.median(times)
        rows.append(row)
    return rows


def exchange_bounds(cfg, dtype_bytes: int = 4) -> tuple[int, int]:
    """(least, per-slot) bytes per token per MoE layer: the experts' input row (hidden state, or its latent) out once
    and one row back, vs that row to each of the top-k experts and one row back from each."""
    h = cfg.expert_hidden_size * dtype_bytes
    return 2 * h, 2 * h * cfg.moe.top_k


def project_full(batch: int = 256, pods: int = 16, seed: int = 0, cfg=None) -> list[dict]:
    """Bytes per step per attention worker for full-2.8t (or `cfg`; bf16 on the wire) from the exchange's own
    assignment. Rows are the experts' width: the latent of a latent MoE."""
    import numpy as np
    import torch

    from expertmesh.model.moe import route_tokens
    from expertmesh.placement.planner import ClusterShape, plan_placement
    from expertmesh.placement.replica_table import ReplicaTable
    from expertmesh.worker.exchange import ExpertExchange

    cfg = cfg or preset("full-2.8t")
    E, K, H = cfg.moe.n_routed_experts, cfg.moe.top_k, cfg.expert_hidden_size
    G = cfg.moe.combine_groups
    g = torch.Generator().manual_seed(seed)
    ids = route_tokens(torch.randn(batch, E, generator=g), torch.zeros(E), cfg)[0].sort(1).values.numpy()
    rows_out = []
    for grouped in (True, False):
        plan = plan_placement(cfg, ClusterShape(pods, 8, 141 * 2**30, 0), 32, group_aware=grouped)
        layer = cfg.moe_layers[0]
        table = ReplicaTable.from_placement(plan, [layer], E)
        ex = ExpertExchange([object()] * pods, table, n_experts=E, n_groups=G)
        present = np.zeros((batch, G), dtype=bool)
        present[np.arange(batch)[:, None], ids // (E // G)] = True
        calls, missing = ex.assign(layer, ids, present, set())
        ex.pool.shutdown()
        assert not missing
        sent_rows = sum(len(c.rows) for c in calls)
        back_rows = sum(len(c.out_token) for c in calls)
        per_layer = sent_rows * (H * 2 + K * 12) + back_rows * H * 2  # hidden bf16 + ids int64 + weights fp32
        step = per_layer * cfg.n_moe_layers
        rows_out.append(
            {
                "plan": "group-aware" if grouped else "free",
                "pods_per_token": sent_rows / batch,
                "rows_back_per_token": back_rows / batch,
                "bytes_per_layer": per_layer,
                "bytes_per_step": step,
                "ms_at_100gbps": step * 8 / 100e9 * 1e3,
                "ms_at_400gbps": step * 8 / 400e9 * 1e3,
                "imbalance": plan.figures.imbalance,
            }
        )
    return rows_out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--out", default="bench/results/e2e.json")
    p.add_argument(
        "--transport",
        default="grpc",
        help="comma-separated per-layer exchange transports to run side by side: grpc,collective",
    )
    p.add_argument("--exchange-batches", default="1,8,32,128", help="decode batch sizes of the exchange table")
    args = p.parse_args(argv)
    transports = [t for t in args.transport.split(",") if t]
    if not transports or any(t not in ("grpc", "collective") for t in transports):
        p.error(f"--transport: expected grpc and/or collective, found {args.transport!r}")
    batches = [int(b) for b in args.exchange_batches.split(",")]
    concurrencies = [1, 4] if args.quick else [1, 32]
    rows, exchange_rows, wire_rows, tmp = [], [], [], Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    for name in args.presets.split(","):
        cfg = preset(name)
        d = create_checkpoint(cfg, tmp / name, seed=0)
        ckpt = Checkpoint(d)
        max_tokens = 8 if args.quick else 32
        inproc = bench_inprocess(ckpt, concurrencies, 16, max_tokens)
        multi = {t: bench_multiprocess(str(d), concurrencies, 16, max_tokens, t) for t in transports}
        least, per_slot = exchange_bounds(cfg)
        for c, t in ((c, t) for c in concurrencies for t in transports):
            a, b = inproc[c], multi[t][c]
            if a["tokens"] != b["tokens"]:
                raise RuntimeError(f"{name} c={c}: {a['tokens']} tokens in process, {b['tokens']} over {t}")
            rows.append(
                {
                    "preset": name,
                    "concurrency": c,
                    "transport": t,
                    "inproc_tok_s": a["total_tok_s"],
                    "multi_tok_s": b["total_tok_s"],
                    "ratio_multi_over_inproc": b["total_tok_s"] / a["total_tok_s"],
                    "inproc_ttft_ms": a["ttft_p50_ms"],
                    "multi_ttft_ms": b["ttft_p50_ms"],
                    "router_tcp_bytes_per_token": b["router_tcp_per_token"],
                    "router_message_bytes_per_token": b["router_messages_per_token"],
                    "exchange_bytes_per_token_layer": b["exchange_per_token_layer"],
                    "exchange_least": least,
                    "exchange_per_slot": per_slot,
                }
            )
        if len(transports) > 1:
            layer_rows, wire = bench_exchange(str(d), batches, transports, reps=20 if args.quick else 100)
            exchange_rows += [{"preset": name, **r} for r in layer_rows]
            wire_rows += [{"preset": name, **r} for r in wire]
    hdr = (
        f"{'preset':6} {'conc':>4} {'transport':>10} {'inproc tok/s':>12} {'multi tok/s':>11} {'ratio':>6} "
        f"{'TTFT in ms':>10} "
        f"{'TTFT mp ms':>10} {'router TCP B/tok':>16} {'router msg B/tok':>16} {'exch B/tok/layer':>16} "
        f"{'least':>6} {'per-slot':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['preset']:6} {r['concurrency']:>4} {r['transport']:>10} {r['inproc_tok_s']:>12.1f} "
            f"{r['multi_tok_s']:>11.1f} "
            f"{r['ratio_multi_over_inproc']:>6.2f} {r['inproc_ttft_ms']:>10.1f} {r['multi_ttft_ms']:>10.1f} "
            f"{r['router_tcp_bytes_per_token']:>16.0f} {r['router_message_bytes_per_token']:>16.0f} "
            f"{r['exchange_bytes_per_token_layer']:>16.0f} {r['exchange_least']:>6} {r['exchange_per_slot']:>8}"
        )
    if exchange_rows:
        print(
            "\none MoE layer's expert exchange from an attention process to 2 expert worker processes on loopback "
            "(ExpertExchange.moe: assign, calls, combine; routed sums bit-identical across transports), µs"
        )
        hdr = (
            f"{'preset':6} {'batch':>5} {'calls':>5} "
            + " ".join(f"{t + ' p50':>15} {t + ' p90':>15}" for t in transports)
            + f" {'grpc/coll':>9}"
        )
        print(hdr)
        print("-" * len(hdr))
        for r in exchange_rows:
            ratio = r["grpc_us_p50"] / r["collective_us_p50"] if {"grpc", "collective"} <= set(transports) else 0
            print(
                f"{r['preset']:6} {r['batch']:>5} {r['calls']:>5} "
                + " ".join(f"{r[t + '_us_p50']:>15.0f} {r[t + '_us_p90']:>15.0f}" for t in transports)
                + f" {ratio:>9.2f}"
            )
    if wire_rows:
        print(
            "\nthe wire alone: one call's hidden states to one expert worker, nothing to compute (all slots -1), "
            "median ms and MB/s"
        )
        hdr = f"{'preset':6} {'MiB':>6} " + " ".join(f"{t + ' ms':>14} {t + ' MB/s':>16}" for t in transports)
        print(hdr)
        print("-" * len(hdr))
        for r in wire_rows:
            print(
                f"{r['preset']:6} {r['bytes'] / 2**20:>6.2f} "
                + " ".join(
                    f"{r[t + '_ms_p50']:>14.2f} {r['bytes'] / r[t + '_ms_p50'] / 1e3:>16.0f}" for t in transports
                )
            )
    projection = project_full()
    print(
        "\nfull-2.8t projection: 16 expert pods x 8 GPUs, 32 redundant/layer, batch 256 per attention worker, bf16 "
        "on the wire, per attention worker (the step's weight-read limit on H200s is ~11.5 ms, issue #14)"
    )
    hdr = (
        f"{'plan':12} {'pods/token':>10} {'rows back/token':>15} {'MB/layer':>9} {'GB/step':>8} "
        f"{'ms @100Gb/s':>11} {'ms @400Gb/s':>11} {'imbalance':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in projection:
        print(
            f"{r['plan']:12} {r['pods_per_token']:>10.2f} {r['rows_back_per_token']:>15.2f} "
            f"{r['bytes_per_layer'] / 1e6:>9.1f} {r['bytes_per_step'] / 1e9:>8.2f} {r['ms_at_100gbps']:>11.1f} "
            f"{r['ms_at_400gbps']:>11.1f} {r['imbalance']:>9.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"serving": rows, "exchange": exchange_rows, "wire": wire_rows, "projection_full_2_8t": projection},
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
