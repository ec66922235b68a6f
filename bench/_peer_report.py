"""bench/peer.py's statistics and tables: per-system summaries of its rounds (tokens/s, TTFT and inter-token latency
quantiles), output agreement between systems, and the printed comparison: the scenarios, the long prompts side by
side, one-request decode against the physical limit, start-up and memory."""

from __future__ import annotations

import statistics

SYSTEMS = ("expertmesh", "vllm", "inprocess")
SHORT = {"expertmesh": "em", "vllm": "vLLM", "inprocess": "inproc"}


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def summarize(rounds: list[dict]) -> dict:
    ttft = [t for r in rounds for t in r["ttft_s"]]
    itl = [t for r in rounds for t in r["itl_s"]]
    rates = [r["tok_s"] for r in rounds if r["tokens"]]  # a round whose every request failed has no rate
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    return {
        "tok_s": statistics.median(rates) if rates else None,
        "tok_s_min": min(rates, default=None),
        "tok_s_max": max(rates, default=None),
        "ttft_p50_ms": ms(quantile(ttft, 0.5)),
        "ttft_p99_ms": ms(quantile(ttft, 0.99)),
        "itl_p50_ms": ms(quantile(itl, 0.5)),
        "itl_p99_ms": ms(quantile(itl, 0.99)),
        "requests": sum(len(r["words"]) for r in rounds),
        "short_requests": sum(r["short"] for r in rounds),
        "chunks_not_tokens": sum(r["chunks_not_tokens"] for r in rounds),
        "errors": [e for r in rounds for e in r["errors"]],
        "rounds": [{k: r[k] for k in ("wall_s", "tokens", "tok_s")} for r in rounds],
    }


def agreement(a: list[dict], b: list[dict]) -> tuple[int, int]:
    """(requests with the same output words, requests compared) over matching rounds."""
    same = total = 0
    for ra, rb in zip(a, b):
        for wa, wb in zip(ra["words"], rb["words"]):
            if wa is not None and wb is not None:
                total += 1
                same += wa == wb
    return same, total


# ----------------------------------------------------------------------------------------------- report
def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def ratio_of(a, b) -> float | None:
    return a / b if a is not None and b else None


def tables(result: dict) -> str:
    names = [s for s in SYSTEMS if s in result["systems"]]
    dtype = result["meta"]["dtype"]
    lines = [
        f"output tokens/s (median over rounds [min-max]) and TTFT p50, dtype {dtype}, "
        f"{result['meta']['max_tokens']} new tokens, {result['meta']['rounds']} round(s) interleaved"
    ]
    both, inproc = "vllm" in names and "expertmesh" in names, "inprocess" in names and "expertmesh" in names

    def ratio(key, spec):
        return lambda sc: fmt(sc["ratios"].get(key), spec)

    def rate(n):
        return lambda sc: "{} [{}-{}]".format(*(fmt(sc["systems"][n][k]) for k in ("tok_s", "tok_s_min", "tok_s_max")))

    def ttft(n):
        return lambda sc: fmt(safe_div(sc["systems"][n]["ttft_p50_ms"], 1000), ".2f")

    columns = [("prompt", 6, lambda sc: str(sc["prompt_len"])), ("conc", 4, lambda sc: str(sc["concurrency"]))]
    columns += [(f"{SHORT[n]} tok/s", 20, rate(n)) for n in names]
    columns += [("em/vLLM", 7, ratio("expertmesh_over_vllm_tok_s", ".2f"))] if both else []
    columns += [("em/inproc", 9, ratio("expertmesh_over_inprocess_tok_s", ".2f"))] if inproc else []
    columns += [(f"TTFT {SHORT[n]} s", 13, ttft(n)) for n in names]
    columns += [("TTFT em/vLLM", 12, ratio("expertmesh_over_vllm_ttft_p50", ".1f"))] if both else []
    hdr = " ".join(f"{title:>{width}}" for title, width, _ in columns)
    lines += [hdr, "-" * len(hdr)]
    lines += [" ".join(f"{fn(sc):>{width}}" for _, width, fn in columns) for sc in result["scenarios"]]
    lines += latency_lines(result, names)
    if any(sc["agreement"] for sc in result["scenarios"]):
        lines += [
            "",
            "greedy outputs identical (requests): "
            + "; ".join(
                f"{sc['prompt_len']}x{sc['concurrency']}: "
                + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in sc["agreement"].items())
                for sc in result["scenarios"]
            ),
        ]
    lines += long_prompts(result, names)
    lines += limit_table(result, names)
    lines += memory_lines(result, names)
    if "inprocess" in names:
        lines.append("(inprocess: this whole benchmark process — the engine plus the harness and its clients)")
    return "\n".join(lines)


def long_prompts(result: dict, names: list[str]) -> list[str]:
    """TTFT and decode ITL side by side for the scenarios past index_topk (one request each)."""
    long = [sc for sc in result["scenarios"] if sc.get("dsa_selects") and sc["concurrency"] == 1]
    if not long:
        return []
    topk = result["meta"].get("index_topk")
    lines = [
        "",
        f"long prompts, one request: expertmesh's DSA attends to the {topk} tokens its indexer picks, vLLM's MLA "
        "to every token (greedy outputs may differ: agreement informative only)",
    ]
    hdr = (
        f"{'prompt':>6} "
        + " ".join(f"{'TTFT ' + SHORT[n] + ' s':>13}" for n in names)
        + " "
        + " ".join(f"{'ITL ' + SHORT[n] + ' ms':>13}" for n in names)
        + f" {'ITL em/vLLM':>11} {'TTFT em/vLLM':>12}  agreement"
    )
    lines += [hdr, "-" * len(hdr)]
    for sc in long:
        sy = sc["systems"]
        lines.append(
            f"{sc['prompt_len']:>6} "
            + " ".join(f"{fmt(safe_div(sy[n]['ttft_p50_ms'], 1000), '.2f'):>13}" for n in names)
            + " "
            + " ".join(f"{fmt(sy[n]['itl_p50_ms'], '.1f'):>13}" for n in names)
            + f" {fmt(sc['ratios'].get('expertmesh_over_vllm_itl_p50'), '.2f'):>11}"
            + f" {fmt(sc['ratios'].get('expertmesh_over_vllm_ttft_p50'), '.2f'):>12}  "
            + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in sc["agreement"].items())
        )
    return lines


def limit_table(result: dict, names: list[str]) -> list[str]:
    """One request's decode rate (1 / ITL p50) against bandwidth ÷ the weight bytes a token reads."""
    limit = result.get("limit") or {}
    best = limit.get("best_bytes_per_s") or {}
    rows = [sc for sc in result["scenarios"] if sc.get("limit")]
    if not best or not rows:
        return []
    threads = sorted(best, key=int)
    lines = [
        "",
        "physical limit: copy bandwidth "
        + ", ".join(f"{best[t] / 1e9:.1f} GB/s on {t} thread{'s' if t != '1' else ''}" for t in threads)
        + " (read + written, best of the run); weight bytes per decoded token: "
        + ", ".join(
            f"{SHORT[n]} {limit['bytes_per_token'][n]['total'] / 1e6:.0f} MB"
            for n in names
            if n in limit["bytes_per_token"]
        ),
        "decode at one request as a fraction of bandwidth ÷ bytes per token (the KV cache read is not counted)",
    ]
    hdr = f"{'prompt':>6} {'system':>10} {'ITL p50 ms':>10} {'decode tok/s':>12} " + " ".join(
        f"{'limit ' + t + 'T tok/s':>15} {'of ' + t + 'T':>7}" for t in threads
    )
    lines += [hdr, "-" * len(hdr)]
    for sc in rows:
        for n in names:
            lim, s = sc["limit"].get(n) or {}, sc["systems"][n]
            per_token = limit["bytes_per_token"][n]["total"]
            lines.append(
                f"{sc['prompt_len']:>6} {n:>10} {fmt(s['itl_p50_ms'], '.1f'):>10} "
                f"{fmt(lim.get('decode_tok_s'), '.1f'):>12} "
                + " ".join(
                    f"{best[t] / per_token:>15.1f} {fmt(lim.get(f'fraction_{t}_threads'), '.2f'):>7}" for t in threads
                )
            )
    return lines


def safe_div(a, b):
    return None if a is None else a / b


def latency_lines(result: dict, names: list[str]) -> list[str]:
    """The latency table (TTFT and ITL p50 / p99 per scenario and system), with a blank line and its title first."""
    lines = ["", "latency p50 / p99, ms (TTFT: request sent → first token; ITL: gap between streamed tokens)"]
    hdr = (
        f"{'prompt':>6} {'conc':>4} {'system':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'short':>5} {'errors':>6}"
    )
    lines += [hdr, "-" * len(hdr)]
    for sc in result["scenarios"]:
        for n in names:
            s = sc["systems"][n]
            lines.append(
                f"{sc['prompt_len']:>6} {sc['concurrency']:>4} {n:>10} {fmt(s['ttft_p50_ms'], '.0f'):>9} "
                f"{fmt(s['ttft_p99_ms'], '.0f'):>9} {fmt(s['itl_p50_ms'], '.1f'):>8} "
                f"{fmt(s['itl_p99_ms'], '.1f'):>8} {s['short_requests']:>5} {len(s['errors']):>6}"
            )
    return lines


def memory_lines(result: dict, names: list[str]) -> list[str]:
    """The start-up and memory table (RSS and PSS idle / peak per system), with a blank line and its title first."""
    lines = ["", "start-up and memory (RSS summed over each system's processes; PSS counts shared pages once)"]
    hdr = (
        f"{'system':>10} {'start-up s':>10} {'procs':>5} {'RSS idle GB':>11} {'RSS peak GB':>11} "
        f"{'PSS idle GB':>11} {'PSS peak GB':>11}"
    )
    lines += [hdr, "-" * len(hdr)]
    for n in names:
        s = result["systems"][n]
        m0, m1 = s.get("memory_idle") or {}, s.get("memory_peak") or {}
        lines.append(
            f"{n:>10} {fmt(s.get('startup_s'), '.1f'):>10} {m1.get('processes', '-'):>5} "
            f"{fmt(safe_div(m0.get('rss'), 1e9), '.2f'):>11} {fmt(safe_div(m1.get('rss'), 1e9), '.2f'):>11} "
            f"{fmt(safe_div(m0.get('pss'), 1e9), '.2f'):>11} {fmt(safe_div(m1.get('pss'), 1e9), '.2f'):>11}"
        )
    return lines
