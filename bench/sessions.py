"""Agent sessions that outlive device memory: the prefix cache with and without its lower tiers (issues #35, #53).

An agent-fleet workload through the official openai client against `expertmesh up` (the embedded tiny model, real
processes on loopback): each session sends a ~200-char system prompt and a ~400-char task, then per turn appends the
assistant message it got back (content + reasoning) and a ~400-char tool result, `--turns` turns, greedy,
reasoning_effort=low, `--concurrency` sessions at once. For each deployment — device only, device + host, device +
host + disk (a small host tier so the disk sees traffic) — and each fleet size in `--sessions`, side by side in one
run: the cached ratio (cached / prompt tokens over turns 2..N), the prompt tokens recomputed over those turns,
per-turn latency p50 / p90 and the tier traffic the router counts (hits by tier, demotions, drops). Then the
full-2.8t arithmetic: KV + KDA state per 128K-token session, sessions per node of host memory, restore time at
PCIe / NVMe bandwidth against the prefill it replaces. The cluster tier (#53): `--deployments pair,store` runs two
attention workers without and with Mooncake's store, `pair-kill,store-kill` the same with the worker holding most
prefixes SIGKILLed once the first fleet's first sessions have had a turn (its sessions' next turns: recomputed, or restored from the store).

    python bench/sessions.py [--sessions 2,16] [--turns 5] [--kv-blocks 512] [--kv-host-gib 1]
                             [--json bench/results/sessions.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from expertmesh.checkpoint.loader import default_checkpoint
from expertmesh.entry.cluster import LocalCluster, free_port
from expertmesh.model.config import preset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' own helpers (PYTHONSAFEPATH omits it)
from _report import sequence_cache_bytes, write_json  # noqa: E402

WORDS = (
    "build",
    "test",
    "deploy",
    "cache",
    "token",
    "layer",
    "router",
    "worker",
    "expert",
    "shard",
    "queue",
    "batch",
    "latency",
    "memory",
    "tier",
    "disk",
    "host",
    "restore",
    "plan",
    "session",
    "agent",
    "tool",
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    }
]


def text(rng: random.Random, chars: int) -> str:
    out = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:chars]


def session(client, seed: int, turns: int, tool_chars: int, max_tokens: int, on_turn=None) -> list[dict]:
    """One agent session; per turn: prompt / cached tokens, seconds and the reply (content, reasoning, tool calls).
    `on_turn()`: called after each turn (the kill runs count them)."""
    rng = random.Random(seed)
    messages = [
        {"role": "system", "content": f"Agent {seed}. " + text(rng, 190)},
        {"role": "user", "content": "Task: " + text(rng, 394)},
    ]
    out = []
    for turn in range(turns):
        start = time.perf_counter()
        r = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0, reasoning_effort="low"
        )
        seconds = time.perf_counter() - start
        details = r.usage.prompt_tokens_details
        out.append(
            {
                "turn": turn + 1,
                "prompt": r.usage.prompt_tokens,
                "seconds": seconds,
                "cached": details.cached_tokens if details else 0,
            }
        )
        m = r.choices[0].message
        out[-1]["reply"] = [
            m.content,
            getattr(m, "reasoning_content", None),
            [c.model_dump() for c in m.tool_calls or ()],
        ]
        reply = {"role": "assistant", "content": m.content or ""}
        if getattr(m, "reasoning_content", None):
            reply["reasoning_content"] = m.reasoning_content
        result = "Tool result: " + text(rng, tool_chars)
        if m.tool_calls:
            reply["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            messages += [reply] + [{"role": "tool", "tool_call_id": c.id, "content": result} for c in m.tool_calls]
        else:
            messages += [reply, {"role": "user", "content": result}]
        if on_turn is not None:
            on_turn()
    return out


def router_counters(url: str) -> dict[str, float]:
    """The router's prefix-cache counters (/metrics): hits by tier, evictions by action."""
    body = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    out = {}
    for name, label in (("expertmesh_prefix_hits_total", "tier"), ("expertmesh_prefix_evictions_total", "action")):
        for m in re.finditer(rf'^{name}{{{label}="(\w+)"}} ([0-9.e+]+)$', body, re.MULTILINE):
            out[f"{name.removeprefix('expertmesh_prefix_').removesuffix('_total')}.{m.group(1)}"] = float(m.group(2))
    return out


def worker_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    """Each attention worker's tier counters (/metrics) by its URL: per tier hits, demotions, restore bytes and
    seconds, drops, rejected files; the cluster store's own (store.puts, store.gets, ...). A worker that does not
    answer (killed) is left out."""
    out: dict[str, dict[str, float]] = {}
    for url in urls:
        try:
            body = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        except OSError:
            continue
        mine = out[url] = {}
        for m in re.finditer(
            r'^expertmesh_kv_tier_(\w+)_total{tier="(\w+)",worker="[^"]*"} ([0-9.e+]+)$', body, re.MULTILINE
        ):
            mine[f"{m.group(2)}.{m.group(1)}"] = float(m.group(3))
        for m in re.finditer(r'^expertmesh_kv_store_(\w+)_total{worker="[^"]*"} ([0-9.e+]+)$', body, re.MULTILINE):
            mine[f"store.{m.group(1)}"] = float(m.group(2))
        for m in re.finditer(
            r'^expertmesh_kv_tier_prefixes{tier="device",worker="[^"]*"} ([0-9.e+]+)$', body, re.MULTILINE
        ):
            mine["device.prefixes"] = float(m.group(1))
    return out


def counter_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """The workers' counters gained between two reads, summed over the workers that answered both times."""
    out: dict[str, float] = {}
    for url in before.keys() & after.keys():
        for k, v in after[url].items():
            out[k] = out.get(k, 0.0) + v - before[url].get(k, 0.0)
    return out


def run_fleet(cluster, sessions: int, args, seed0: int, kill_after: int | None = None) -> dict:
    """One fleet of `sessions` sessions; `kill_after`: once that many turns are done (mid-run), SIGKILL the attention
    worker holding the most prefixes on its device (placement may have put every session on one)."""
    url = cluster.http_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800)
    before = router_counters(url)
    before_w = worker_counters(cluster.metrics_urls)
    done, lock = [0], threading.Lock()

    def on_turn():
        with lock:
            done[0] += 1
            if done[0] == kill_after:
                held = [worker_counters([u]).get(u, {}).get("device.prefixes", 0) for u in cluster.metrics_urls]
                victim = max(range(len(held)), key=lambda i: held[i])
                print(f"killing attention-{victim} after {done[0]} turns (device prefixes: {held})", flush=True)
                cluster.kill(f"attention-{victim}")

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        turns = [
            t
            for s in pool.map(
                lambda i: session(client, seed0 + i, args.turns, args.tool_chars, args.max_tokens, on_turn),
                range(sessions),
            )
            for t in s
        ]
    wall = time.perf_counter() - start
    after = router_counters(url)
    after_w = worker_counters(cluster.metrics_urls)
    later = [t for t in turns if t["turn"] > 1]
    prompt, cached = sum(t["prompt"] for t in later), sum(t["cached"] for t in later)
    lat = sorted(t["seconds"] for t in turns)
    return {
        "sessions": sessions,
        "transcripts": [t["reply"] for t in turns],
        "cached_ratio": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "recomputed_tokens": prompt - cached,
        "p50_s": statistics.median(lat),
        "p90_s": lat[min(len(lat) - 1, int(0.9 * len(lat)))],
        "wall_s": wall,
        "tiers": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(after)},
        "worker_tiers": {
            k: v for k, v in sorted(counter_deltas(before_w, after_w).items()) if not k.startswith("device.")
        },
    }


def full_scale(
    host_tib: float = 1.5,
    pcie_gbs: float = 50.0,
    nvme_gbs: float = 7.0,
    tokens: int = 128 * 1024,
    flops: float = 400e12,
) -> dict:
    """The full-2.8t arithmetic for one `tokens`-token session (bf16 KV, fp32 KDA state)."""
    kv, state = sequence_cache_bytes(tokens)
    total = kv + state
    prefill_s = 2 * preset("full-2.8t").active_params * tokens / flops
    return {
        "tokens": tokens,
        "kv_bytes": kv,
        "kda_state_bytes": state,
        "session_bytes": total,
        "sessions_per_host": int(host_tib * 2**40 // total),
        "host_tib": host_tib,
        "restore_pcie_s": total / (pcie_gbs * 1e9),
        "restore_nvme_s": total / (nvme_gbs * 1e9),
        "prefill_s": prefill_s,
        "prefill_flops_assumed": flops,
        "pcie_gbs": pcie_gbs,
        "nvme_gbs": nvme_gbs,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="2,16", help="fleet sizes, comma-separated (the first is the baseline)")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--tool-chars", type=int, default=400, help="characters of each tool result")
    p.add_argument("--concurrency", type=int, default=4, help="sessions running at once")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens of each turn")
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--kv-host-gib", type=float, default=1.0)
    p.add_argument(
        "--disk-host-gib",
        type=float,
        default=0.004,
        help="the host tier of the +disk deployment (small, so that the disk tier sees traffic)",
    )
    p.add_argument("--kv-disk-gib", type=float, default=1.0)
    p.add_argument("--kv-store-gib", type=float, default=0.25, help="the cluster tier's memory (pair runs)")
    p.add_argument(
        "--deployments",
        default="device,host,disk",
        help="which of device,host,disk,pair,store,pair-kill,store-kill to run (pair: two attention workers, no "
        "lower tier; store: two with the Mooncake cluster tier; -kill: one SIGKILLed mid-run)",
    )
    p.add_argument("--json", default="bench/results/sessions.json")
    args = p.parse_args(argv)
    fleets = [int(s) for s in args.sessions.split(",")]
    checkpoint = default_checkpoint("tiny")
    disk_dir = Path(tempfile.mkdtemp(prefix="expertmesh-kv-disk-"))
    deployments = {
        "device": ("device only", {}),
        "host": (f"+host {args.kv_host_gib:g} GiB", {"kv_host_gib": args.kv_host_gib}),
        "disk": (
            f"+host {args.disk_host_gib:g} +disk {args.kv_disk_gib:g} GiB",
            {"kv_host_gib": args.disk_host_gib, "kv_disk_dir": disk_dir, "kv_disk_gib": args.kv_disk_gib},
        ),
    }
    # the router learns which keys reached the store from the workers' listings: read every 0.5 s (default 5 s),
    # so that a worker killed seconds after its saves has its store keys known
    pair = {"attention_workers": 2, "router_args": ["--prefix-index-refresh-s", "0.5"]}
    store = pair | {"kv_store": "mooncake", "kv_store_gib": args.kv_store_gib}
    deployments |= {
        "pair": ("2 workers", pair),
        "store": ("2 workers + cluster tier", store),
        "pair-kill": ("2 workers, one killed", pair),
        "store-kill": ("2 + cluster tier, one killed", store),
    }
    results = {}
    for name in args.deployments.split(","):
        label, tiers = deployments[name]
        # killed once the first sessions running have each had a turn: their next turns need what it held
        kill_after = (lambda n: min(n, args.concurrency)) if name.endswith("-kill") else (lambda n: None)
        with LocalCluster(
            checkpoint,
            **({"attention_workers": 1} | tiers),
            expert_workers=2,
            http_port=free_port(),
            grpc_port=free_port(),
            threads=None,
            kv_blocks=args.kv_blocks,
            prefill_chunk=64,
            prefill_tokens=256,
            attention_metrics=True,
        ) as cluster:
            results[label] = [
                run_fleet(cluster, n, args, seed0=1000 * (k + 1), kill_after=kill_after(n) if k == 0 else None)
                for k, n in enumerate(fleets)
            ]
        print(f"{label}: done", flush=True)

    print(f"\n{args.turns} turns, --kv-blocks {args.kv_blocks}, cached ratio over turns 2..{args.turns}")
    print(
        f"{'deployment':<28} {'sessions':>8} {'cached':>7} {'vs ' + str(fleets[0]):>6} {'recomputed':>16} "
        f"{'p50 s':>6} {'p90 s':>6}  tier traffic"
    )
    for label, rows in results.items():
        base = rows[0]["cached_ratio"]
        for r in rows:
            r["vs_baseline"] = r["cached_ratio"] / base if base else 0.0
            traffic = " ".join(f"{k}={v:g}" for k, v in r["tiers"].items() if v)
            print(
                f"{label:<28} {r['sessions']:>8} {r['cached_ratio']:>7.3f} {r['vs_baseline']:>6.2f} "
                f"{r['recomputed_tokens']:>7,} of {r['prompt_tokens']:>6,} {r['p50_s']:>6.2f} {r['p90_s']:>6.2f}"
                f"  {traffic}"
            )
    print(
        "\nworker tier traffic (host / disk / store): demotions in (store: puts), hits (restores), MiB and seconds "
        "restored, drops (workers still up at the end)"
    )
    for label, rows in results.items():
        for r in rows:
            w = r["worker_tiers"]
            cells = [
                f"{t}: {w.get(f'{t}.demotions', 0):g} in, {w.get(f'{t}.hits', 0):g} hits, "
                f"{w.get(f'{t}.restore_bytes', 0) / 2**20:.1f} MiB / {w.get(f'{t}.restore_seconds', 0):.3f} s, "
                f"{w.get(f'{t}.dropped', 0):g} dropped"
                for t in ("host", "disk", "store")
                if any(k.startswith(f"{t}.") and v for k, v in w.items())
            ]
            print(f"{label:<28} {r['sessions']:>8}  " + (" | ".join(cells) or "-"))

    # greedy: every deployment must give every session the same replies, whatever tier its prefixes came from
    for k, n in enumerate(fleets):
        same = len({json.dumps(rows[k]["transcripts"]) for rows in results.values()}) == 1
        print(f"{n} sessions: transcripts identical across {', '.join(results)}: {'yes' if same else 'NO'}")

    full = full_scale()
    gib = 2**30
    print(
        f"\nfull-2.8t, one {full['tokens'] // 1024}K-token session: KV {full['kv_bytes'] / gib:.2f} GiB + KDA state "
        f"{full['kda_state_bytes'] / 2**20:.1f} MiB = {full['session_bytes'] / gib:.2f} GiB; "
        f"{full['host_tib']:g} TiB of host memory holds {full['sessions_per_host']} sessions"
    )
    print(
        f"restore: {full['restore_pcie_s']:.2f} s over PCIe Gen5 x16 ({full['pcie_gbs']:g} GB/s), "
        f"{full['restore_nvme_s']:.2f} s from NVMe ({full['nvme_gbs']:g} GB/s); the prefill it replaces: "
        f"2 x 104B active x {full['tokens']:,} tokens = {full['prefill_s']:.0f} s at an assumed "
        f"{full['prefill_flops_assumed'] / 1e12:.0f} TFLOP/s sustained (one GPU's bf16 dense peak ~40% MFU; "
        f"attention FLOPs left out, which only lengthens the prefill)"
    )
    write_json(args.json, args, results=results, full_2_8t=full)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
