#!/usr/bin/env python3
"""Write tests/data/k3/oracle.json: what llama.cpp's kimi-k3 computes from the tiny Kimi K3 checkpoints.

tests/model/test_k3_oracle.py serves the same checkpoints (tests/support/k3_checkpoint.py writes them, deterministically) with
expertmesh and compares against this file; CI does not build llama.cpp. Run this once when the checkpoint
recipe changes:

    python scripts/k3_oracle.py [--cache DIR] [--jobs N] [--out tests/data/k3/oracle.json]

What it does, reusing whatever a previous run left in the cache (default ~/.cache/expertmesh/llama.cpp-0.3.36,
or $EXPERTMESH_K3_ORACLE_CACHE; a rerun resumes an interrupted one):
1. downloads the llama-cpp-python 0.3.36 sdist with pip (sha256 checked) and unpacks its vendored llama.cpp;
2. builds libllama and llama-quantize (CMake, CPU only, Release; 10-20 minutes on 2 cores), and compiles
   scripts/k3_oracle_driver.cpp against them;
3. makes a Python venv in the cache for llama.cpp's converter: torch==2.13.0 first, then numpy, safetensors,
   transformers 4.57.6, tiktoken and the sdist's own gguf-py (pip honours PIP_INDEX_URL / PIP_EXTRA_INDEX_URL,
   e.g. https://download.pytorch.org/whl/cpu for a CPU-only torch);
4. for each variant (bf16 experts; compressed-tensors MXFP4 experts) writes the tiny checkpoint with
   tests/support/k3_checkpoint.py, copies it for conversion (no MTP layers; a stand-in `tokenization_kimi.py`, the remote
   code the converter loads the TikToken vocabulary with), converts it with the vendored convert_hf_to_gguf.py
   to an f32 GGUF (the MXFP4 experts stay MXFP4 there and are re-expanded to F32 with `llama-quantize
   --allow-requantize`: ggml-cpu's MXFP4 matmul quantizes the activations to Q8_0, which is not the math
   compared), and runs the driver: flash attention off, f32 K/V cache, greedy tokens and per-position log-probs
   for a few token-id prompts (one longer than llama.cpp's 64-token KDA chunk);
5. writes the JSON: per variant the checkpoint recipe and config, a digest of its tensors, each prompt's ids,
   the greedy continuation, and every prompt position's log-prob of the next prompt token with its top 5.

The top level of this file needs only the standard library; the `_prepare` / `_convert` / `_gguf-types`
subcommands run inside the cache's venv.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT_WRITER = REPO / "tests" / "support" / "k3_checkpoint.py"
DRIVER_SOURCE = REPO / "scripts" / "k3_oracle_driver.cpp"
DEFAULT_OUT = REPO / "tests" / "data" / "k3" / "oracle.json"

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TORCH = "torch==2.13.0"
CONVERTER_DEPS = ["numpy~=2.2.6", "safetensors>=0.4", "transformers==4.57.6", "tiktoken>=0.7"]
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DBUILD_SHARED_LIBS=ON",
]
BUILD_TARGETS = ["llama", "llama-quantize"]

VARIANTS = ("bf16", "mxfp4")
SEED = 0
N_GEN = 20
TOP = 5
PROMPT_LENGTHS = (24, 40, 100)  # 100 > 64: crosses llama.cpp's KDA chunk
PROMPT_SEED = 2


def log(msg: str) -> None:
    print(f"[k3_oracle {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def run_logged(cmd: list, logfile: Path) -> None:
    """`cmd` with its output appended to `logfile`; the end of that shown if it fails."""
    log("$ " + " ".join(str(c) for c in cmd) + f"  (output: {logfile})")
    with open(logfile, "a") as f:
        rc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.stderr.write(logfile.read_text()[-6000:])
        raise SystemExit(f"failed ({rc}): {cmd[0]} ... (full output in {logfile})")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- cache
class Cache:
    """The cache directory: dl/ (the sdist), llama-cpp-python/ (unpacked), build/ (CMake), venv/, bin/ (the
    driver), work/ (checkpoints, GGUFs). The same layout as /work/k3ref's scratch area, so either reuses the
    other's build."""

    def __init__(self, root: Path, jobs: int):
        self.root = root
        self.jobs = jobs
        self.sdist = root / "dl" / SDIST
        self.src = root / "llama-cpp-python"
        self.llama = self.src / "vendor" / "llama.cpp"
        self.build = root / "build"
        self.venv = root / "venv"
        self.python = self.venv / "bin" / "python"
        self.driver = root / "bin" / "k3_oracle_driver"
        self.work = root / "work"

    def fetch_sdist(self) -> None:
        if self.sdist.exists() and sha256(self.sdist) == SDIST_SHA256:
            return
        self.sdist.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / "dl.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={VERSION}",
                "-d",
                tmp,
            ]
        )
        got = tmp / SDIST
        if not got.exists() or sha256(got) != SDIST_SHA256:
            raise SystemExit(f"{got}: missing or not the expected sdist (sha256 {SDIST_SHA256})")
        os.replace(got, self.sdist)
        shutil.rmtree(tmp, ignore_errors=True)

    def unpack(self) -> None:
        if (self.llama / "convert_hf_to_gguf.py").exists():
            return
        tmp = self.root / "llama-cpp-python.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        log(f"unpacking {self.sdist.name}")
        with tarfile.open(self.sdist) as tar:
            try:
                tar.extractall(tmp, filter="data")
            except TypeError:  # Python without extraction filters
                tar.extractall(tmp)
        top = tmp / f"llama_cpp_python-{VERSION}"
        shutil.rmtree(self.src, ignore_errors=True)
        os.replace(top, self.src)
        shutil.rmtree(tmp, ignore_errors=True)

    def build_llama(self) -> None:
        if not (self.build / "CMakeCache.txt").exists():
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            run_logged(["cmake", "-S", self.llama, "-B", self.build, *gen, *CMAKE_FLAGS], self.root / "build.log")
        t = time.time()
        run_logged(
            ["cmake", "--build", self.build, "--config", "Release", "-j", str(self.jobs), "--target", *BUILD_TARGETS],
            self.root / "build.log",
        )
        log(f"llama.cpp build step: {time.time() - t:.0f} s")

    def tool(self, name: str) -> Path:
        for p in (self.build / "bin" / name, self.build / "bin" / "Release" / name):
            if p.exists():
                return p
        raise SystemExit(f"{name} not found under {self.build}/bin")

    def libdir(self) -> Path:
        for pattern in ("libllama.so", "libllama.dylib"):
            found = sorted(self.build.rglob(pattern))
            if found:
                return found[0].parent
        raise SystemExit(f"libllama not found under {self.build}")

    def compile_driver(self) -> None:
        libdir = self.libdir()
        stamp = self.driver.with_suffix(".stamp")
        want = hashlib.sha256(DRIVER_SOURCE.read_bytes() + str(libdir).encode()).hexdigest()
        if self.driver.exists() and stamp.exists() and stamp.read_text() == want:
            return
        self.driver.parent.mkdir(parents=True, exist_ok=True)
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"
        tmp = self.driver.with_suffix(".partial")
        run(
            [
                cxx,
                "-O2",
                "-std=c++17",
                "-I",
                self.llama / "include",
                "-I",
                self.llama / "ggml" / "include",
                DRIVER_SOURCE,
                "-L",
                libdir,
                "-lllama",
                "-lggml",
                "-lggml-base",
                f"-Wl,-rpath,{libdir}",
                "-o",
                tmp,
            ]
        )
        os.replace(tmp, self.driver)
        stamp.write_text(want)

    def venv_ready(self) -> bool:
        if not self.python.exists():
            return False
        probe = (
            "import torch, numpy, safetensors, transformers, tiktoken, gguf;"
            "assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__;"
            "assert transformers.__version__ == '4.57.6', transformers.__version__"
        )
        return subprocess.run([str(self.python), "-c", probe], capture_output=True).returncode == 0

    def make_venv(self) -> None:
        if self.venv_ready():
            return
        if not self.python.exists():
            run([sys.executable, "-m", "venv", self.venv])
        pip = [self.python, "-m", "pip", "install", "--quiet"]
        run([*pip, TORCH])  # torch pinned first: the rest must not pull another one
        run([*pip, *CONVERTER_DEPS, TORCH])
        run([*pip, self.llama / "gguf-py", TORCH])
        if not self.venv_ready():
            raise SystemExit(f"{self.venv}: the converter's packages did not install")

    def prepare(self) -> None:
        self.fetch_sdist()
        self.unpack()
        self.build_llama()
        self.compile_driver()
        self.make_venv()


# ----------------------------------------------------------------------------------------------- per variant
def in_venv(cache: Cache, *args, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests"))
    env.pop("PYTHONSAFEPATH", None)
    return run([cache.python, *args], env=env, **kw)


def prompts_for(special: dict[str, int]) -> list[list[int]]:
    """Token-id prompts: ordinary ids below the first special id, the shortest wrapped in K3's message markers."""
    n_base = min(special.values())
    rng = random.Random(PROMPT_SEED)
    out = []
    for n in PROMPT_LENGTHS:
        ids = [rng.randrange(n_base) for _ in range(n)]
        if n == PROMPT_LENGTHS[0]:
            ids[0], ids[5], ids[-2], ids[-1] = (
                special["<|open|>"],
                special["<|sep|>"],
                special["<|close|>"],
                special["<|sep|>"],
            )
        out.append(ids)
    return out


def oracle_variant(cache: Cache, variant: str) -> dict:
    work = cache.work / variant
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hf, src = work / "hf", work / "for-gguf"
    recipe = {"experts": variant, "seed": SEED, "mtp": False, "with_indexer": False}
    out = in_venv(
        cache, CHECKPOINT_WRITER, hf, "--experts", variant, "--seed", SEED, stdout=subprocess.PIPE, text=True
    ).stdout
    digest = json.loads(out.strip().splitlines()[-1])["tensor_digest"]
    config = json.loads((hf / "config.json").read_text())
    text = config["text_config"]
    special = {
        v["content"]: int(k)
        for k, v in json.loads((hf / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()
    }
    in_venv(cache, Path(__file__).resolve(), "_prepare", hf, src)
    gguf = work / "model.f32.gguf"
    conv_log = work / "convert.log"
    with open(conv_log, "w") as f:
        try:
            in_venv(
                cache,
                Path(__file__).resolve(),
                "_convert",
                cache.llama,
                src,
                "--outfile",
                gguf,
                "--outtype",
                "f32",
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        except subprocess.CalledProcessError:
            sys.stderr.write(conv_log.read_text()[-4000:])
            raise
    types = json.loads(
        in_venv(
            cache, Path(__file__).resolve(), "_gguf-types", cache.llama, gguf, stdout=subprocess.PIPE, text=True
        ).stdout
    )
    expected = "MXFP4" if variant == "mxfp4" else "F32"
    if types["experts"] != [expected]:
        raise SystemExit(f"{gguf}: routed experts are {types['experts']}, expected {expected}")
    run_gguf = gguf
    if variant == "mxfp4":
        run_gguf = work / "model.dequant-f32.gguf"
        with open(work / "quantize.log", "w") as f:
            run(
                [cache.tool("llama-quantize"), "--allow-requantize", gguf, run_gguf, "F32"],
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        types_run = json.loads(
            in_venv(
                cache, Path(__file__).resolve(), "_gguf-types", cache.llama, run_gguf, stdout=subprocess.PIPE, text=True
            ).stdout
        )
        if types_run["all"] != ["F32"]:
            raise SystemExit(f"{run_gguf}: tensor types {types_run['all']}, expected F32 only")

    prompts = prompts_for(special)
    cmd = [cache.driver, run_gguf, "--n-gen", N_GEN, "--top", TOP, "--threads", 2]
    for p in prompts:
        cmd += ["--prompt", ",".join(map(str, p))]
    if os.environ.get("K3_ORACLE_DUMP_LOGITS"):
        cmd += ["--dump-logits", work / "logits"]
    with open(work / "driver.log", "w") as f:
        result = json.loads(run(cmd, stdout=subprocess.PIPE, stderr=f, text=True).stdout)
    if result["n_vocab"] != text["vocab_size"]:
        raise SystemExit(f"llama.cpp vocab {result['n_vocab']} != config vocab_size {text['vocab_size']}")
    stops = {text["eos_token_id"], special.get("[EOS]"), special.get("<|end_of_msg|>")} - {None}
    entries = []
    for p, r in zip(prompts, result["results"]):
        assert r["prompt"] == p
        if stops & set(r["greedy"]):
            raise SystemExit(
                f"greedy continuation of a {len(p)}-token prompt holds a stop token "
                f"{sorted(stops & set(r['greedy']))}: pick other prompts (PROMPT_SEED)"
            )
        entries.append(
            {
                "ids": p,
                "greedy": r["greedy"],
                "greedy_logprobs": [round(x, 6) for x in r["greedy_logprobs"]],
                # how far each greedy choice is from a tie (the smallest top-1 minus top-2 log-prob over the steps)
                "greedy_min_margin": round(min(row[0][1] - row[1][1] for row in r["greedy_top"]), 6),
                "prompt_logprobs": [round(x, 6) for x in r["prompt_logprobs"]],
                "prompt_top5": [[[t, round(lp, 6)] for t, lp in row] for row in r["prompt_top"]],
            }
        )
    return {
        "recipe": recipe,
        "tensor_digest": digest,
        "config": config,
        "gguf": {"routed_experts_converted": expected, "routed_experts_run": "F32"},
        "prompts": entries,
    }


# ----------------------------------------------------------------------------------------------- venv side
TOKENIZATION_KIMI = r'''
"""Stand-in for Kimi's tokenization_kimi.py (remote code), as much of it as llama.cpp's converter touches:
`.model._mergeable_ranks`, `.special_tokens`, `.eos_id`, `.encode()`. Written by scripts/k3_oracle.py."""
import json
import os

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

# Only the BPE ranks, the special tokens and the EOS id reach the GGUF (whose pre-tokenizer is kimi-k2 whatever
# this says; the prompts are token ids): a plain split is enough here.
PAT_STR = r"""\s+|\S+"""


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]",
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        here = os.path.dirname(vocab_file)
        ranks = load_tiktoken_bpe(vocab_file)
        cfg = json.load(open(os.path.join(here, "tokenizer_config.json")))
        vocab_size = json.load(open(os.path.join(here, "config.json")))["text_config"]["vocab_size"]
        names = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), vocab_size)}
        self.model = tiktoken.Encoding(name="tiny_k3", pat_str=PAT_STR, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.eos_id = self.special_tokens.get("[EOS]", self.special_tokens.get(eos_token))
        self.bos_id = self.special_tokens.get("[BOS]")
        self.n_words = self.model.n_vocab
        self.decoder = {i: self.model.decode_single_token_bytes(i) for i in range(self.n_words)}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens, **kwargs)

    @property
    def vocab_size(self):
        return self.n_words

    def get_vocab(self):
        return {self.decoder[i].decode("latin-1"): i for i in range(self.n_words)}

    def encode(self, text, add_special_tokens=False, **kwargs):
        return self.model.encode(text, allowed_special="all")

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t].decode("latin-1") for t in self.model.encode(text, allowed_special="all")]

    def _convert_token_to_id(self, token):
        return self.get_vocab().get(token, self.special_tokens.get(token, 0))

    def _convert_id_to_token(self, index):
        return self.decoder[index].decode("latin-1")

    def convert_tokens_to_string(self, tokens):
        return b"".join(t.encode("latin-1") for t in tokens).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def prepare_for_gguf(src: Path, dst: Path) -> None:
    """The copy llama.cpp converts: MTP layers (layers ≥ num_hidden_layers) dropped, the stand-in remote-code
    tokenizer added and named in tokenizer_config.json's auto_map."""
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    n_layers = config["text_config"]["num_hidden_layers"]
    config["text_config"]["num_nextn_predict_layers"] = 0
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    layer = re.compile(r"\.layers\.(\d+)\.")
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            kept = {
                n: sf.get_tensor(n) for n in sf.keys() if not ((m := layer.search(n)) and int(m.group(1)) >= n_layers)
            }
        save_file(kept, str(dst / f.name), metadata={"format": "pt"})
        weight_map |= {n: f.name for n in kept}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("tiktoken.model", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    tok["tokenizer_class"] = "TikTokenTokenizer"
    (dst / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
    (dst / "tokenization_kimi.py").write_text(TOKENIZATION_KIMI)


def convert(llama: Path, argv: list[str]) -> None:
    """The vendored convert_hf_to_gguf.py, with one change: a vocabulary whose pre-tokenizer hash it does not
    know (any tiny test vocabulary) is converted as "kimi-k2", what the real K2/K3 vocabulary hashes to."""
    sys.path[:0] = [str(llama), str(llama / "gguf-py")]
    import convert_hf_to_gguf as conv
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "kimi-k2"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = [str(llama / "convert_hf_to_gguf.py"), *argv]
    conv.main()


def gguf_types(llama: Path, path: Path) -> None:
    sys.path.insert(0, str(llama / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(str(path))
    experts = sorted({t.tensor_type.name for t in reader.tensors if "_exps." in t.name})
    print(json.dumps({"experts": experts, "all": sorted({t.tensor_type.name for t in reader.tensors})}))


# ----------------------------------------------------------------------------------------------- main
def compact_json(data) -> str:
    """Indented JSON with every list of numbers (and of [id, logprob] pairs) on one line."""
    import re

    text = json.dumps(data, indent=1)
    flat = re.compile(r"\[[\s\d.eE+\-,]*\]")  # a list holding only numbers
    text = flat.sub(lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text)
    pairs = re.compile(r"\[(\s*\[[^\[\]]*\],?)+\s*\]")  # a list of flat lists
    return pairs.sub(lambda m: re.sub(r"\s*\n\s*", "", m.group(0)).replace("],[", "], ["), text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_prepare":
        prepare_for_gguf(Path(argv[1]), Path(argv[2]))
        return 0
    if argv and argv[0] == "_convert":
        convert(Path(argv[1]), argv[2:])
        return 0
    if argv and argv[0] == "_gguf-types":
        gguf_types(Path(argv[1]), Path(argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_cache = os.environ.get(
        "EXPERTMESH_K3_ORACLE_CACHE", str(Path.home() / ".cache" / "expertmesh" / f"llama.cpp-{VERSION}")
    )
    ap.add_argument(
        "--cache",
        default=default_cache,
        help="sdist, llama.cpp build, converter venv, work files (default %(default)s; env EXPERTMESH_K3_ORACLE_CACHE)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel build jobs")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON to write (default %(default)s)")
    ap.add_argument("--variant", action="append", choices=VARIANTS, help="only these (default: all)")
    a = ap.parse_args(argv)
    start = time.time()
    cache = Cache(Path(a.cache).expanduser().resolve(), a.jobs)
    cache.root.mkdir(parents=True, exist_ok=True)
    cache.prepare()
    log(f"toolchain ready after {time.time() - start:.0f} s")
    variants = {}
    for v in a.variant or VARIANTS:
        variants[v] = oracle_variant(cache, v)
        log(f"{v}: greedy {[p['greedy'][:8] for p in variants[v]['prompts']]}")
    if len(variants) == 2:
        # one model in two storage forms: llama.cpp must see the same f32 weights, hence the same numbers
        a_, b_ = (variants[v]["prompts"] for v in VARIANTS)
        delta = max(abs(x - y) for p, q in zip(a_, b_) for x, y in zip(p["prompt_logprobs"], q["prompt_logprobs"]))
        same = all(p["greedy"] == q["greedy"] for p, q in zip(a_, b_))
        log(f"bf16 vs mxfp4 through llama.cpp: greedy identical {same}, max |Δ prompt logprob| {delta:.3g}")
        if not same or delta > 1e-4:
            raise SystemExit("the bf16 and mxfp4 variants disagree through llama.cpp: the MXFP4 packing is wrong")
    data = {
        "about": "llama.cpp (kimi-k3) on the tiny Kimi K3 checkpoints of tests/support/k3_checkpoint.py; written by "
        "scripts/k3_oracle.py, read by tests/model/test_k3_oracle.py",
        "llama_cpp": {
            "source": f"llama-cpp-python {VERSION} sdist, vendor/llama.cpp",
            "sdist_sha256": SDIST_SHA256,
            "gguf": "convert_hf_to_gguf.py --outtype f32; MXFP4 experts re-expanded with llama-quantize "
            "--allow-requantize ... F32",
            "run": "CPU, flash attention off, f32 K/V cache, whole prompt in one batch, then greedy one "
            "token at a time (scripts/k3_oracle_driver.cpp)",
        },
        "prompt_logprobs": "entry i: log p(ids[i+1] | ids[:i+1]); prompt_top5 entry i: the 5 likeliest "
        "[id, logprob] at that position",
        "variants": variants,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.variant and out.exists():  # a partial rerun keeps the other variants
        old = json.loads(out.read_text())
        data["variants"] = {**old.get("variants", {}), **variants}
    out.write_text(compact_json(data) + "\n")
    log(f"wrote {out} ({out.stat().st_size} bytes) in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
