"""llama.cpp as bench/peer.py's peer on Kimi K3 (`--model k3`): its `llama-server` built once from the llama.cpp
vendored in the llama-cpp-python sdist (the project's K3 oracle toolchain, scripts/k3_oracle.py), the peer model
converted to GGUF by llama.cpp's own converter, and the server's command line.

Build: scripts/k3_oracle.py's cache (default ~/.cache/expertmesh/llama.cpp-0.3.36, or $EXPERTMESH_K3_ORACLE_CACHE)
fetches and unpacks the sdist (sha256 checked); this module configures `build-server/` beside the oracle's
`build/` (CMake, Release, CPU only, -DGGML_NATIVE=ON: ggml picks the ISA this CPU has, static libraries, no UI,
no curl / OpenSSL, no tests or examples) and builds the one target `llama-server` (~200 compile steps: 15-60 min
on 2 shared cores). A rerun resumes an interrupted build.

Conversion: the vendored convert_hf_to_gguf.py through scripts/k3_oracle.py's `_prepare` (a copy without MTP
layers, with the stand-in `tokenization_kimi.py` its TikToken vocabulary is read with) and `_convert` (the
converter itself; an unknown pre-tokenizer hash converted as `kimi-k2`) subcommands, run with this interpreter.
`--outtype` follows the served dtype (bf16 for bfloat16, f32 for float32): the bf16 checkpoint's values either
way. The routed experts stay MXFP4 (the converter repacks compressed-tensors MXFP4 into ggml's MXFP4 blocks);
`gguf_types` reports what it produced.

Serving: `llama-server -m GGUF -t 2 -tb 2 -np SLOTS -c SLOTS x per-slot context --alias peer`, everything else
llama.cpp's defaults (flash attention auto, f16 K/V cache, its prompt cache and context checkpoints). ggml-cpu's
MXFP4 matmul quantizes the activations to Q8_0 (and its bf16 matmul rounds them to bf16), so greedy outputs are
compared, not required to match.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORACLE = ROOT / "scripts" / "k3_oracle.py"
SERVER_TARGET = "llama-server"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
OUTTYPE = {"bfloat16": "bf16", "float32": "f32"}
THREADS = 2


class Unavailable(RuntimeError):
    """llama.cpp cannot be built or the model cannot be converted here; the message says why."""


def _oracle():
    spec = importlib.util.spec_from_file_location("_peer_k3_oracle", ORACLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def oracle_cache() -> Path:
    oracle = _oracle()
    default = Path.home() / ".cache" / "expertmesh" / f"llama.cpp-{oracle.VERSION}"
    return Path(os.environ.get("EXPERTMESH_K3_ORACLE_CACHE", default)).expanduser().resolve()


def _tail(path: Path, n: int = 30) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return "\n  ".join(lines[-n:])


def _logged(cmd: list, logfile: Path, log) -> None:
    log("$ " + " ".join(str(c) for c in cmd) + f"  (output: {logfile})")
    with logfile.open("a") as f:
        rc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise Unavailable(f"failed ({rc}): {' '.join(str(c) for c in cmd[:3])} ...; {logfile}:\n  " + _tail(logfile))


def build_server(jobs: int = 2, log=print) -> tuple[Path, dict]:
    """(the llama-server binary, build facts), building it on first use."""
    oracle = _oracle()
    cache = oracle.Cache(oracle_cache(), jobs)
    cache.root.mkdir(parents=True, exist_ok=True)
    try:
        cache.fetch_sdist()
        cache.unpack()
    except (SystemExit, subprocess.CalledProcessError) as e:
        raise Unavailable(f"the llama-cpp-python {oracle.VERSION} sdist: {e}") from None
    build, logfile = cache.root / "build-server", cache.root / "build-server.log"
    binary = build / "bin" / SERVER_TARGET
    facts = {"source": f"llama-cpp-python {oracle.VERSION} sdist, vendor/llama.cpp", "build_dir": str(build)}
    if binary.exists() and (build / ".built").exists():
        return binary, {**facts, **json.loads((build / ".built").read_text())}
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise Unavailable(f"`{tool}` not found: llama-server cannot be built here")
    t0 = time.perf_counter()
    if not (build / "CMakeCache.txt").exists():
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _logged(["cmake", "-S", cache.llama, "-B", build, *gen, *CMAKE_FLAGS], logfile, log)
    _logged(["cmake", "--build", build, "--config", "Release", "-j", jobs, "--target", SERVER_TARGET], logfile, log)
    if not binary.exists():
        raise Unavailable(f"{binary}: not there after the build; {logfile}")
    built = {"cmake_flags": CMAKE_FLAGS, "build_s": round(time.perf_counter() - t0, 1)}
    (build / ".built").write_text(json.dumps(built))
    return binary, {**facts, **built}


def _oracle_step(*args, stdout=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    return subprocess.run(
        [sys.executable, str(ORACLE), *map(str, args)], env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True
    )


def convert_command(llama: Path, src: Path, gguf: Path, dtype: str) -> list[str]:
    """The converter's command line (scripts/k3_oracle.py's `_convert` runs convert_hf_to_gguf.py's main)."""
    if dtype not in OUTTYPE:
        raise ValueError(f"dtype: expected one of {', '.join(OUTTYPE)}, found {dtype!r}")
    return ["_convert", str(llama), str(src), "--outfile", str(gguf), "--outtype", OUTTYPE[dtype]]


def gguf_types(gguf: Path) -> dict:
    """{"experts": [types of the routed-expert tensors], "all": [every type]} of a GGUF (gguf-py's reader)."""
    llama = _oracle().Cache(oracle_cache(), 1).llama
    r = _oracle_step("_gguf-types", llama, gguf, stdout=subprocess.PIPE)
    if r.returncode:
        raise Unavailable(f"reading {gguf}: {r.stdout[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def convert(hf: Path, dtype: str, log=print) -> tuple[Path, dict]:
    """(GGUF of the K3 directory `hf` at `dtype`, facts), converted once beside `hf` (model-<outtype>.gguf)."""
    llama = _oracle().Cache(oracle_cache(), 1).llama
    gguf = hf.parent / f"model-{OUTTYPE[dtype]}.gguf"
    record = gguf.with_suffix(".json")
    if gguf.exists() and record.exists():
        return gguf, json.loads(record.read_text())
    if not (llama / "convert_hf_to_gguf.py").exists():
        raise Unavailable(f"{llama}: no convert_hf_to_gguf.py (the sdist is not unpacked: build llama-server first)")
    src, logfile = hf.parent / "for-gguf", hf.parent / f"convert-{OUTTYPE[dtype]}.log"
    t0 = time.perf_counter()
    log(f"converting {hf} to GGUF ({OUTTYPE[dtype]}, llama.cpp's convert_hf_to_gguf.py; log {logfile})")
    with logfile.open("w") as f:
        for step in (["_prepare", hf, src], convert_command(llama, src, gguf.with_suffix(".partial"), dtype)):
            r = _oracle_step(*step, stdout=f)
            if r.returncode:
                raise Unavailable(f"{step[0]} failed ({r.returncode}); {logfile}:\n  " + _tail(logfile))
    shutil.rmtree(src, ignore_errors=True)  # a full copy of the weights, only the converter reads it
    os.replace(gguf.with_suffix(".partial"), gguf)
    types = gguf_types(gguf)
    facts = {
        "gguf": str(gguf),
        "outtype": OUTTYPE[dtype],
        "routed_expert_types": types["experts"],
        "tensor_types": types["all"],
        "bytes": gguf.stat().st_size,
        "convert_s": round(time.perf_counter() - t0, 1),
    }
    record.write_text(json.dumps(facts, indent=1))
    log(f"GGUF: routed experts {types['experts']}, all tensors {types['all']}, {facts['bytes'] / 1e9:.2f} GB")
    return gguf, facts


def server_command(binary: Path, gguf: Path, port: int, slots: int, slot_context: int) -> list[str]:
    """llama-server with `slots` parallel slots of `slot_context` tokens each (it splits -c among the slots), 2
    threads for generation and for prompts, the model listed as `peer`."""
    return [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(THREADS),
        "-tb",
        str(THREADS),
        "-np",
        str(slots),
        "-c",
        str(slots * slot_context),
        "--alias",
        "peer",
        "--no-webui",
    ]


def slot_context(longest_prompt: int, max_tokens: int) -> int:
    """Per-slot context: the longest request, rounded up to 256 with room to spare."""
    need = longest_prompt + max_tokens + 16
    return -(-need // 256) * 256
