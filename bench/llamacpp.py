"""llama.cpp's MXFP4 CPU matmuls at our shapes, for the `mxfp4cpu` side-by-side in bench/kernels.py (issue #21).

Builds ggml's CPU backend and `test-backend-ops` from the llama.cpp sources vendored in the `llama-cpp-python`
sdist on PyPI, then runs `test-backend-ops perf -b CPU -o MUL_MAT,MUL_MAT_ID` and parses its console lines.
Never used by CI or the tests: every step that cannot be done (no cmake / compiler, no registry access, a build
error, an sdist whose sources no longer match the patch) ends in `Unavailable` with one clear message, and the
bench prints it and carries on without the llama.cpp columns.

What is built, exactly
  * the sdist `llama-cpp-python==$EXPERTMESH_LLAMACPP_VERSION` (default 0.3.36), fetched once with
    `pip download --no-deps --no-binary :all:` into the cache dir ($EXPERTMESH_LLAMACPP_DIR, default
    ~/.cache/expertmesh/llama.cpp); only vendor/llama.cpp/ggml/ and tests/test-backend-ops.cpp are extracted;
  * a wrapper CMake project in <cache>/build-<version>/ that adds vendor/llama.cpp/ggml as a subdirectory and
    compiles a patched copy of test-backend-ops.cpp (it includes only ggml headers, so libllama / common are not
    built): Release, -DGGML_NATIVE=ON (ggml's own ISA detection, AVX2 / AVX-512 as this CPU has them), OpenMP on,
    ggml's tests / examples off, `cmake --build --target test-backend-ops -j 2` (~30 compile units, ~6.5 min on
    2 busy cores).

The patch to the copy (the sdist's tree is left as extracted; the patched copy and PATCH.txt sit in the build dir):
  1. threads: upstream sets the CPU backend to hardware_concurrency()/2 threads (1 on a 2-core box); the copy reads
     $EXPERTMESH_GGML_THREADS instead when it is set.
  2. four cases prepended to make_test_cases_perf() (upstream's perf list has MXFP4 MUL_MAT only at 4096x14336 and
     MXFP4 MUL_MAT_ID only at gpt-oss's 32 experts top-4 2880x2880; both are still run, as `upstream nearest`):
       MUL_MAT    mxfp4 x f32  m=2304 n=1 k=7168 bs=[1,1]     one full-2.8t expert projection, one token
       MUL_MAT    mxfp4 x f32  m=2304 n=1 k=7168 bs=[32,1]    32 different projections per op (282 MB, > L3)
       MUL_MAT_ID mxfp4 x f32  32 experts, top-4, m=1024 n=1 k=1024   small preset w13 (gate|up, 2I x H)
       MUL_MAT_ID mxfp4 x f32  32 experts, top-4, m=1024 n=1 k=512    small preset w2 (down, H x I)
Cache residency: test-backend-ops perf repeats one node many times inside one graph on the same tensors, so a
single 2304x7168 matrix (8.8 MB) and the 4 experts a MUL_MAT_ID call picks (expert ids are re-drawn only between
graph runs) stay cache-resident. The bs=[32,1] case is the cold one (each op streams 32 matrices); the bench
compares our cold numbers with it and our warm numbers (same weights repeated) with the single-matrix case.
Numerics differ by design: ggml quantises the f32 activations to Q8_0 and does integer dot products
(vec_dot_mxfp4_q8_0); ours keeps the activations in fp32.

    python bench/llamacpp.py [--threads 1,2] [--build-only]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = os.environ.get("EXPERTMESH_LLAMACPP_VERSION", "0.3.36")
CACHE = Path(os.environ.get("EXPERTMESH_LLAMACPP_DIR", Path.home() / ".cache" / "expertmesh" / "llama.cpp"))
JOBS = int(os.environ.get("EXPERTMESH_LLAMACPP_JOBS", "2"))

# (key, what it is, test case C++ added to the perf list or None for upstream's own, op, prefix of its params);
# keys are what bench/kernels.py looks up
CASES = [
    (
        "proj_warm",
        "MUL_MAT mxfp4 2304x7168 n=1",
        "new test_mul_mat(GGML_TYPE_MXFP4, GGML_TYPE_F32, 2304, 1, 7168, {1, 1}, {1, 1})",
        "MUL_MAT",
        "type_a=mxfp4,type_b=f32,m=2304,n=1,k=7168,bs=[1,1],nr=[1,1],",
    ),
    (
        "proj_cold32",
        "MUL_MAT mxfp4 2304x7168 n=1 bs=[32,1]",
        "new test_mul_mat(GGML_TYPE_MXFP4, GGML_TYPE_F32, 2304, 1, 7168, {32, 1}, {1, 1})",
        "MUL_MAT",
        "type_a=mxfp4,type_b=f32,m=2304,n=1,k=7168,bs=[32,1],nr=[1,1],",
    ),
    (
        "small_w13",
        "MUL_MAT_ID mxfp4 E32 top4 1024x1024 n=1",
        "new test_mul_mat_id(GGML_TYPE_MXFP4, GGML_TYPE_F32, 32, 4, false, 1024, 1, 1024)",
        "MUL_MAT_ID",
        "type_a=mxfp4,type_b=f32,n_mats=32,n_used=4,b=0,m=1024,n=1,k=1024,",
    ),
    (
        "small_w2",
        "MUL_MAT_ID mxfp4 E32 top4 1024x512 n=1",
        "new test_mul_mat_id(GGML_TYPE_MXFP4, GGML_TYPE_F32, 32, 4, false, 1024, 1, 512)",
        "MUL_MAT_ID",
        "type_a=mxfp4,type_b=f32,n_mats=32,n_used=4,b=0,m=1024,n=1,k=512,",
    ),
    # upstream's own nearest MXFP4 perf cases (unpatched), reported alongside
    (
        "upstream_mm_4096x14336",
        "upstream MUL_MAT mxfp4 4096x14336 n=1",
        None,
        "MUL_MAT",
        "type_a=mxfp4,type_b=f32,m=4096,n=1,k=14336,bs=[1,1],nr=[1,1],",
    ),
    (
        "upstream_mmid_2880",
        "upstream MUL_MAT_ID mxfp4 E32 top4 2880x2880 n=1",
        None,
        "MUL_MAT_ID",
        "type_a=mxfp4,type_b=f32,n_mats=32,n_used=4,b=0,m=2880,n=1,k=2880,",
    ),
]
PARAMS_FILTER = (
    r"type_a=mxfp4,type_b=f32,(n_mats=32,n_used=4,b=0,)?"
    r"m=(2304|1024|4096|2880),n=1,k=(7168|1024|512|14336|2880),"
)
PARAMS_OURS = r"type_a=mxfp4,type_b=f32,(n_mats=32,n_used=4,b=0,)?m=(2304|1024),n=1,k=(7168|1024|512),"

THREADS_NEEDLE = "ggml_backend_set_n_threads_fn(backend.get(), std::max<int>(1, N_THREADS/2));"
THREADS_PATCH = (
    'ggml_backend_set_n_threads_fn(backend.get(), getenv("EXPERTMESH_GGML_THREADS") ? '
    'std::max<int>(1, atoi(getenv("EXPERTMESH_GGML_THREADS"))) : std::max<int>(1, N_THREADS/2));'
    "  // expertmesh patch"
)
PERF_NEEDLE = (
    "static std::vector<std::unique_ptr<test_case>> make_test_cases_perf() {\n"
    "    std::vector<std::unique_ptr<test_case>> test_cases;\n"
)

CMAKELISTS = """cmake_minimum_required(VERSION 3.14)
project(expertmesh_llamacpp_bench C CXX)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
add_subdirectory({ggml} ggml)
add_executable(test-backend-ops test-backend-ops.cpp)
target_link_libraries(test-backend-ops PRIVATE ggml)
"""

LINE = re.compile(r"^\s*(MUL_MAT(?:_ID)?)\((.*)\):\s+(\d+) runs -\s+([0-9.]+) us/run")


class Unavailable(RuntimeError):
    """llama.cpp's test-backend-ops cannot be built or run here; the message says why."""


def _run(cmd: list[str], log: Path, **kw) -> None:
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if r.returncode != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise Unavailable(
            f"`{' '.join(map(str, cmd[:4]))} ...` failed (rc {r.returncode}); log {log}:\n  " + "\n  ".join(tail)
        )


def _sdist() -> Path:
    d = CACHE / "sdist"
    found = sorted(d.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if found:
        return found[0]
    d.mkdir(parents=True, exist_ok=True)
    print(f"llama.cpp: downloading the llama-cpp-python=={VERSION} sdist into {d} (once)", flush=True)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(d),
            f"llama-cpp-python=={VERSION}",
        ],
        CACHE / "download.log",
        timeout=1800,
    )
    found = sorted(d.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        raise Unavailable(f"pip download left no llama_cpp_python-{VERSION}.tar.gz in {d}")
    return found[0]


def _sources() -> Path:
    """vendor/llama.cpp of the extracted sdist (ggml/ and tests/test-backend-ops.cpp only)."""
    root = CACHE / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (root / "ggml" / "CMakeLists.txt").exists() and (root / "tests" / "test-backend-ops.cpp").exists():
        return root
    sdist = _sdist()
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix + "ggml/") or m.name == prefix + "tests/test-backend-ops.cpp"
        ]
        if not members:
            raise Unavailable(f"{sdist} has no {prefix}ggml/")
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(CACHE / "src", members=members, **kw)
    return root


def patch_source(text: str) -> str:
    """The test-backend-ops.cpp copy: thread count from $EXPERTMESH_GGML_THREADS, our cases first in the perf list."""
    if THREADS_NEEDLE not in text or PERF_NEEDLE not in text:
        raise Unavailable(
            f"test-backend-ops.cpp of llama-cpp-python {VERSION} does not match the patch "
            "(set EXPERTMESH_LLAMACPP_VERSION=0.3.36, the version it was written for)"
        )
    added = "".join(
        f"    test_cases.emplace_back({cpp});   // expertmesh: {what}\n" for _, what, cpp, _, _ in CASES if cpp
    )
    return text.replace(THREADS_NEEDLE, THREADS_PATCH).replace(
        PERF_NEEDLE, PERF_NEEDLE + "    // expertmesh patch: our shapes (bench/llamacpp.py)\n" + added
    )


def build() -> Path:
    """Path of the patched test-backend-ops binary, building it if needed (minutes, once)."""
    build_dir = CACHE / f"build-{VERSION}"
    exe = build_dir / "out" / "bin" / "test-backend-ops"
    for tool in ("cmake", "c++", "cc"):
        if shutil.which(tool) is None:
            raise Unavailable(f"`{tool}` is not on PATH (cmake: `pip install cmake`; a C/C++ compiler: the OS)")
    src = _sources()
    patched = patch_source((src / "tests" / "test-backend-ops.cpp").read_text())
    copy = build_dir / "test-backend-ops.cpp"
    if exe.exists() and copy.exists() and copy.read_text() == patched:
        return exe  # built from this very patch (a changed patch rebuilds one TU)
    build_dir.mkdir(parents=True, exist_ok=True)
    copy.write_text(patched)
    (build_dir / "CMakeLists.txt").write_text(CMAKELISTS.replace("{ggml}", (src / "ggml").as_posix()))
    (build_dir / "PATCH.txt").write_text(__doc__)
    log = build_dir / "build.log"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.perf_counter()
    print(f"llama.cpp: building ggml CPU + test-backend-ops in {build_dir} ({JOBS} jobs; log {log})", flush=True)
    _run(
        [
            "cmake",
            "-S",
            str(build_dir),
            "-B",
            str(build_dir / "out"),
            *gen,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DGGML_BUILD_TESTS=OFF",
            "-DGGML_BUILD_EXAMPLES=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
            f"-DCMAKE_RUNTIME_OUTPUT_DIRECTORY={build_dir / 'out' / 'bin'}",
        ],
        log,
        timeout=600,
    )
    _run(
        ["cmake", "--build", str(build_dir / "out"), "--target", "test-backend-ops", "-j", str(JOBS)], log, timeout=3600
    )
    if not exe.exists():
        raise Unavailable(f"the build finished without {exe}; see {log}")
    print(f"llama.cpp: built in {time.perf_counter() - t0:.0f} s", flush=True)
    return exe


def parse(output: str) -> list[dict]:
    """test-backend-ops perf console lines → [{op, params, runs, us}]."""
    rows = []
    for line in output.splitlines():
        m = LINE.match(line)
        if m:
            rows.append({"op": m[1], "params": m[2], "runs": int(m[3]), "us": float(m[4])})
    return rows


def _key(op: str, params: str) -> str | None:
    for key, _, _, case_op, prefix in CASES:
        if op == case_op and params.startswith(prefix):
            return key
    return None


def run(threads: int, exe: Path | None = None, upstream: bool = True) -> dict[str, dict]:
    """{key: {op, params, runs, us, threads}} for our four cases (and upstream's two nearest), at `threads`.
    Each case runs for >= 1 s after its tensors are filled (the cold one fills 282 MB: seconds)."""
    exe = exe or build()
    env = dict(os.environ, EXPERTMESH_GGML_THREADS=str(threads))
    cmd = [str(exe), "perf", "-b", "CPU", "-o", "MUL_MAT,MUL_MAT_ID", "-p", PARAMS_FILTER if upstream else PARAMS_OURS]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise Unavailable(f"test-backend-ops perf exited {r.returncode}:\n{(r.stdout + r.stderr)[-2000:]}")
    out = {}
    for row in parse(r.stdout):
        key = _key(row["op"], row["params"])
        if key is not None and key not in out:
            out[key] = {**row, "threads": threads}
    missing = [k for k, _, cpp, _, _ in CASES if cpp and k not in out]
    if missing:
        raise Unavailable(f"test-backend-ops perf printed no line for {missing}:\n{r.stdout[-2000:]}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", default="1,2")
    p.add_argument("--build-only", action="store_true")
    args = p.parse_args(argv)
    try:
        exe = build()
        print(f"llama.cpp: {exe}")
        if args.build_only:
            return 0
        for t in [int(s) for s in args.threads.split(",") if s]:
            for key, row in run(t, exe).items():
                print(
                    f"threads={t}  {key:24s} {row['us']:10.2f} us/run  {row['runs']:6d} runs  "
                    f"{row['op']}({row['params']})"
                )
    except Unavailable as exc:
        print(f"llama.cpp: unavailable: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
