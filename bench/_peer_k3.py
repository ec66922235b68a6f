"""`bench/peer.py --model k3`: expertmesh against llama.cpp on one Kimi K3-shaped model (issue #54, item 2).

vLLM's CPU build cannot serve `kimi_k3` (bench/peer.py's docstring says why); llama.cpp can, and it is what people
run on CPUs. One random-weight K3-shaped model (bench/_peer_k3_model.py: hidden 1024, 8 layers — 6 KDA, 2 NoPE
MLA — 64 routed MXFP4 experts top-4 on K3's latent MoE, 0.91B parameters) is served by

  expertmesh   `expertmesh up --checkpoint DIR --dtype D` (up's defaults: 1 attention worker, one expert worker
               per two cores), from the Kimi K3 Hugging Face directory as it is (compressed-tensors MXFP4 experts);
  llamacpp     llama.cpp's `llama-server` (bench/_peer_llamacpp.py: built from the sdist the K3 oracle uses) on the
               GGUF its own converter made from the same directory (experts MXFP4, the rest at D), 2 threads,
               as many parallel slots as the largest concurrency;
  inprocess    expertmesh's in-process deployment (unless --skip-inprocess), as in the dsv32 comparison.

The same client and rounds as the dsv32 comparison (bench/peer.py's `http_submit` / `run_round`: the official
`openai` package, `/v1/completions` streamed, greedy, token-id prompts drawn from the word tokens, fresh each
round and the same for every system in it, rounds interleaved with the order rotating). Before the rounds each
server is asked once, unstreamed, to complete a token-id prompt: both must report as many prompt tokens as were
sent (token-id prompts taken as they are, no BOS added) and return max_tokens tokens.

Greedy agreement with llama.cpp is reported, not required: ggml-cpu's MXFP4 matmul quantizes the activations to
Q8_0 and its bf16 matmul rounds them to bf16, so the two drift apart once a near-tie flips; the table shows the
identical requests and the mean length of the common prefix. expertmesh and in-process should agree exactly.
Seen here (bf16, first run): no identical request and common prefixes of 0-2 tokens; at the first token both rank
the same few words on top, with log-probs up to ~1.4 apart (a random 8-layer network magnifies rounding, and
expertmesh's bf16 logits tie at this vocabulary: steps of 1/32 at |logit| 4-8).
Writes bench/results/peer-k3.json (unless --out names another file) and prints the tables.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import platform
import random
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = ("expertmesh", "llamacpp", "inprocess")
SHORT = {"expertmesh": "em", "llamacpp": "llama", "inprocess": "inproc"}
UP_KV_BLOCKS = 512  # `expertmesh up --kv-blocks` default (16-token blocks)


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peer_systems = _sibling("_peer_systems")
peer_report = _sibling("_peer_report")
peer_llamacpp = _sibling("_peer_llamacpp")


def word_prompts(n: int, length: int, words: tuple[int, int], seed: tuple) -> list[list[int]]:
    """`n` prompts of `length` ids drawn from the word tokens [first, end) (no specials, no bare bytes)."""
    rng = random.Random(repr(seed))
    return [[rng.randrange(*words) for _ in range(length)] for _ in range(n)]


def kv_blocks_needed(concurrency: int, longest: int) -> int:
    """expertmesh's KV blocks (16 tokens) for `concurrency` sequences of `longest` tokens, at least up's default."""
    return max(UP_KV_BLOCKS, concurrency * (-(-longest // 16) + 1))


def common_prefix(a: list | None, b: list | None) -> int | None:
    if a is None or b is None:
        return None
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(a: list[dict], b: list[dict]) -> dict:
    """Identical requests, requests compared, and the mean common prefix (tokens) of a's and b's outputs."""
    same, total = peer_report.agreement(a, b)
    prefixes = [common_prefix(wa, wb) for ra, rb in zip(a, b) for wa, wb in zip(ra["words"], rb["words"]) if wa and wb]
    prefixes = [p for p in prefixes if p is not None]
    return {
        "identical": same,
        "compared": total,
        "mean_common_prefix": sum(prefixes) / len(prefixes) if prefixes else None,
    }


def check_prompt(server, prompt: list[int], max_tokens: int) -> dict:
    """One unstreamed completion of a token-id prompt: the prompt and completion token counts the server reports."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    usage = r.usage
    facts = {
        "sent": len(prompt),
        "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "completion_tokens": getattr(usage, "completion_tokens", None),
        "max_tokens": max_tokens,
    }
    facts["ok"] = facts["prompt_tokens"] == len(prompt) and facts["completion_tokens"] == max_tokens
    return facts


# ----------------------------------------------------------------------------------------------- report
def tables(result: dict) -> str:
    names = [s for s in SYSTEMS if s in result["systems"]]
    meta = result["meta"]
    lines = [
        f"output tokens/s (median over rounds [min-max]) and TTFT p50, dtype {meta['dtype']}, "
        f"{meta['max_tokens']} new tokens, {meta['rounds']} round(s) interleaved"
    ]
    fmt, both = peer_report.fmt, "llamacpp" in names and "expertmesh" in names

    def rate(n):
        return lambda sc: "{} [{}-{}]".format(*(fmt(sc["systems"][n][k]) for k in ("tok_s", "tok_s_min", "tok_s_max")))

    def ttft(n):
        return lambda sc: fmt(peer_report.safe_div(sc["systems"][n]["ttft_p50_ms"], 1000), ".2f")

    def ratio(key):
        return lambda sc: fmt(sc["ratios"].get(key), ".2f")

    columns = [("prompt", 6, lambda sc: str(sc["prompt_len"])), ("conc", 4, lambda sc: str(sc["concurrency"]))]
    columns += [(f"{SHORT[n]} tok/s", 20, rate(n)) for n in names]
    columns += [("em/llama", 8, ratio("expertmesh_over_llamacpp_tok_s"))] if both else []
    columns += [(f"TTFT {SHORT[n]} s", 13, ttft(n)) for n in names]
    columns += [("TTFT em/llama", 13, ratio("expertmesh_over_llamacpp_ttft_p50"))] if both else []
    columns += [("ITL em/llama", 12, ratio("expertmesh_over_llamacpp_itl_p50"))] if both else []
    hdr = " ".join(f"{title:>{width}}" for title, width, _ in columns)
    lines += [hdr, "-" * len(hdr)]
    lines += [" ".join(f"{fn(sc):>{width}}" for _, width, fn in columns) for sc in result["scenarios"]]
    lines += peer_report.latency_lines(result, names)
    if any(sc["agreement"] for sc in result["scenarios"]):
        lines += ["", "greedy outputs: identical requests / compared (mean common prefix, tokens)"]
        for sc in result["scenarios"]:
            parts = [
                f"{k} {v['identical']}/{v['compared']} ({fmt(v['mean_common_prefix'])})"
                for k, v in sc["agreement"].items()
            ]
            lines.append(f"  {sc['prompt_len']}x{sc['concurrency']}: " + "; ".join(parts))
    lines += peer_report.memory_lines(result, names)
    if "inprocess" in names:
        lines.append("(inprocess: this whole benchmark process — the engine plus the harness and its clients)")
    return "\n".join(lines)


def scenario_ratios(summ: dict) -> dict:
    ratios = {}
    pairs = (("expertmesh", "llamacpp"), ("expertmesh", "inprocess"))
    for a, b in pairs:
        if a in summ and b in summ:
            for key in ("tok_s", "ttft_p50_ms", "itl_p50_ms"):
                name = key.removesuffix("_ms")
                ratios[f"{a}_over_{b}_{name}"] = peer_report.ratio_of(summ[a][key], summ[b][key])
    return ratios


# ----------------------------------------------------------------------------------------------- run
def run(args, peer) -> int:
    """The k3 comparison with bench/peer.py's parsed `args`; `peer` is bench/peer.py (its client and rounds)."""
    log = peer_systems.log
    if getattr(args, "long", False):
        raise SystemExit("--long: the long-prompt scenarios compare DSA with vLLM (--model dsv32); not with --model k3")
    rounds = args.rounds or (1 if args.quick else 3)
    prompt_lens = [int(x) for x in (args.prompt_lens or ("50,200" if args.quick else "200,1000")).split(",") if x]
    concurrency = [int(x) for x in (args.concurrency or "1,8").split(",") if x]
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    out = args.out if args.out != HERE / "results" / "peer.json" else HERE / "results" / "peer-k3.json"
    cache = args.cache.expanduser().resolve()
    logdir = cache / "logs"
    load_start = os.getloadavg()
    notes: list[str] = []

    em_dir, model_facts = _sibling("_peer_k3_model").model_dir(cache, "k3", seed=args.seed, log=log)
    words = tuple(model_facts["word_ids"])
    longest = max(prompt_lens) + max_tokens
    try:
        binary, build_facts = peer_llamacpp.build_server(log=log)
        gguf, gguf_facts = peer_llamacpp.convert(em_dir, args.dtype, log=log)
    except peer_llamacpp.Unavailable as e:
        log(f"llama.cpp unavailable: {e}")
        binary = gguf = build_facts = gguf_facts = None
        notes.append(f"llama.cpp unavailable: {str(e).splitlines()[0]}")
    if args.install_only:
        return 0 if binary else 1

    up_args = tuple(shlex.split(args.up_args))
    kv_blocks = kv_blocks_needed(max(concurrency), longest)
    if kv_blocks > UP_KV_BLOCKS and "--kv-blocks" not in up_args:
        up_args += ("--kv-blocks", str(kv_blocks))  # room for every concurrent sequence, as llama.cpp's -c gives
    meta = {
        "model": "k3",
        "dtype": args.dtype,
        "up_args": list(up_args),
        "max_tokens": max_tokens,
        "rounds": rounds,
        "prompt_lens": prompt_lens,
        "concurrency": concurrency,
        "model_facts": {k: v for k, v in model_facts.items() if k != "special"},
        "expertmesh_dir": str(em_dir),
        "llamacpp_build": build_facts,
        "gguf": gguf_facts,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_start": load_start,
        },
        "quick": args.quick,
        "argv": sys.argv[1:],
    }
    servers: dict = {}
    submits, engine, systems, scenarios, checks = {}, None, {}, [], {}
    try:
        # start-ups one at a time, each alone on the machine (as far as this benchmark goes)
        em = servers["expertmesh"] = peer_systems.expertmesh_server(em_dir, args.dtype, logdir, up_args)
        log(f"starting expertmesh: {' '.join(em.cmd)}  (log {em.logfile})")
        em.start(args.startup_timeout)
        systems["expertmesh"] = {"startup_s": em.startup_s, "memory_idle": em.memory(), "cmd": em.cmd}
        log(f"expertmesh healthy in {em.startup_s:.1f} s")
        if binary is not None:
            port = peer_systems.free_port()
            slot_ctx = peer_llamacpp.slot_context(max(prompt_lens), max_tokens)
            cmd = peer_llamacpp.server_command(binary, gguf, port, max(concurrency), slot_ctx)
            ls = servers["llamacpp"] = peer_systems.Server("llamacpp", cmd, port, logdir / "llama-server.log")
            log(f"starting llama.cpp: {' '.join(cmd)}  (log {ls.logfile})")
            try:
                ls.start(args.startup_timeout)
                systems["llamacpp"] = {"startup_s": ls.startup_s, "memory_idle": ls.memory(), "cmd": cmd}
                log(f"llama.cpp healthy in {ls.startup_s:.1f} s")
            except peer_systems.Unavailable as e:
                ls.stop()
                del servers["llamacpp"]
                log(f"llama.cpp could not serve: {e}")
                notes.append(f"llama.cpp could not serve: {str(e).splitlines()[0]}")
        for name, server in servers.items():
            probe = word_prompts(1, 24, words, ("check", args.seed))[0]
            checks[name] = check_prompt(server, probe, 8)
            if not checks[name]["ok"]:
                notes.append(f"{name}: token-id prompt check {checks[name]}")
            log(f"{name}: token-id prompt check {checks[name]}")
            submits[name] = peer.http_submit(server, args.request_timeout)
        if not args.skip_inprocess:
            from expertmesh.chat.tokenizer import load_tokenizer

            before = peer_systems.memory([os.getpid()])
            kw = {"kv_blocks": kv_blocks} if "kv_blocks" in inspect.signature(peer.build_inprocess).parameters else {}
            engine, ifacts = peer.build_inprocess(em_dir, args.dtype, **kw)
            tok = load_tokenizer(em_dir)
            submits["inprocess"] = peer.inprocess_submit(engine, tuple(tok.eos_ids), tok, args.request_timeout)
            systems["inprocess"] = {**ifacts, "memory_idle": peer_systems.memory([os.getpid()])}
            systems["inprocess"]["memory_before_build"] = before
            log(f"in-process engine built in {ifacts['startup_s']:.1f} s ({ifacts['dtype']})")
        order = [s for s in SYSTEMS if s in submits]
        for name in order:  # warm-up: one short request each
            submits[name](word_prompts(1, 16, words, ("warmup", name))[0], 4)
            systems[name]["memory_peak"] = dict(systems[name]["memory_idle"])

        def sample_memory(name):
            m = servers[name].memory() if name in servers else peer_systems.memory([os.getpid()])
            peak = systems[name]["memory_peak"]
            for k in ("rss", "pss", "processes"):
                peak[k] = max(peak.get(k, 0), m[k])

        def measured_round(name, prompts):
            return peer.sampled_round(
                submits[name], prompts, max_tokens, args.request_timeout, lambda: sample_memory(name)
            )

        for plen in prompt_lens:
            for conc in concurrency:
                per = {n: [] for n in order}
                for r in range(rounds):
                    prompts = word_prompts(conc, plen, words, (args.seed, plen, conc, r))
                    rot = order[r % len(order) :] + order[: r % len(order)]
                    for name in rot:
                        res = measured_round(name, prompts)
                        per[name].append(res)
                        ttft = peer_report.quantile(res["ttft_s"], 0.5)
                        log(
                            f"{plen:>5}-token prompts x{conc} round {r + 1}/{rounds} {name:>10}: "
                            f"{res['tok_s']:7.2f} tok/s, TTFT p50 {peer_report.fmt(ttft, '.2f')} s"
                            + (f", {len(res['errors'])} errors: {res['errors'][0]}" if res["errors"] else "")
                        )
                summ = {n: peer_report.summarize(per[n]) for n in order}
                agree = {
                    f"{a}={b}": agreement(per[a], per[b])
                    for a, b in (("expertmesh", "llamacpp"), ("expertmesh", "inprocess"))
                    if a in per and b in per
                }
                scenarios.append(
                    {
                        "prompt_len": plen,
                        "concurrency": conc,
                        "systems": summ,
                        "ratios": scenario_ratios(summ),
                        "agreement": agree,
                    }
                )
    finally:
        for s in servers.values():
            s.stop()
        if engine is not None:
            engine.close()
    meta["machine"]["loadavg_end"] = os.getloadavg()
    meta["prompt_checks"] = checks
    result = {"meta": meta, "systems": systems, "scenarios": scenarios, "notes": notes}
    print()
    print(
        f"peer: k3 ({model_facts['parameters'] / 1e6:.0f}M parameters; GGUF "
        f"{(gguf_facts or {}).get('outtype', '-')} with routed experts "
        f"{'/'.join((gguf_facts or {}).get('routed_expert_types', ['-']))}), {os.cpu_count()} CPUs, "
        f"load average {load_start[0]:.1f} at the start, {meta['machine']['loadavg_end'][0]:.1f} at the end"
    )
    print(tables(result))
    for n in notes:
        print(f"note: {n}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0
