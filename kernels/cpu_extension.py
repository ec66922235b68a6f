"""C++ CPU kernels built on first use: one translation unit per extension, compiled with
`torch.utils.cpp_extension.load` (-O3, no FP contraction, OpenMP for at::parallel_for) into the torch extensions
directory (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions), once per process; later processes load the
cached library. A build is named after a hash of its source and of the shared headers it includes (kernels/cpu/,
e.g. cpu_features.h: the CPU-feature probes), so checkouts with different versions of a kernel sharing one cache
never rebuild over each other or load the other's library."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

# -fopenmp: at::parallel_for is inline OpenMP in torch's CPU builds (without it the pragma is ignored and a kernel
# runs on one thread); the library links libgomp.so.1, the runtime torch itself has loaded.
CFLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
INCLUDE_DIR = Path(__file__).parent / "cpu"  # headers shared by the kernels' sources, on every build's include path


OFF = ("0", "off", "false", "no", "torch")  # values of a kernel's switch that turn it off (its PyTorch path runs)


def switched_on(variable: str) -> bool:
    """A kernel's environment switch (e.g. EXPERTMESH_CPU_NORM_KERNEL): on unless set to one of OFF."""
    return os.environ.get(variable, "1").strip().lower() not in OFF


def shared_headers(source: Path) -> list[Path]:
    """The headers of INCLUDE_DIR that `source` includes (by name), sorted."""
    text = Path(source).read_bytes()
    return [h for h in sorted(INCLUDE_DIR.glob("*.h")) if f'#include "{h.name}"'.encode() in text]


def build_name(prefix: str, source: Path) -> str:
    """`prefix` + the first 12 hex digits of the SHA-256 of the source, then of each shared header it includes (torch
    rebuilds when a source changes, not when a header does: the name changes instead)."""
    digest = hashlib.sha256(Path(source).read_bytes())
    for header in shared_headers(source):
        digest.update(header.read_bytes())
    return f"{prefix}_{digest.hexdigest()[:12]}"


def build_ops(prefix: str, source: Path, namespace: str):
    """Build (or load the cached build of) `source` and return its op namespace `torch.ops.<namespace>`; raises
    what the build raises."""
    from torch.utils.cpp_extension import load as cpp_load

    cpp_load(
        name=build_name(prefix, source),
        sources=[str(source)],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        extra_include_paths=[str(INCLUDE_DIR)],
        is_python_module=False,
        verbose=False,
    )
    return getattr(torch.ops, namespace)


class LazyExtension:
    """An extension built once per process on first `load()`; a failure is logged once (callers keep their PyTorch
    path) and remembered."""

    def __init__(self, prefix: str, source: Path, namespace: str, what: str, probe: str):
        self.prefix, self.source, self.namespace, self.what, self.probe = prefix, Path(source), namespace, what, probe
        self._lock = threading.Lock()
        self._tried = False
        self.ops = None
        self.build_seconds: float | None = None
        self.build_error: str | None = None

    def load(self):
        if self._tried:
            return self.ops
        with self._lock:
            if self._tried:
                return self.ops
            t0 = time.perf_counter()
            try:
                ops = build_ops(self.prefix, self.source, self.namespace)
                getattr(ops, self.probe)  # resolves the op: fails here, not later
                self.ops = ops
            except Exception as exc:  # no compiler / ninja, a build error, an unloadable library
                text = str(exc).strip()
                self.build_error = f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
                logging.getLogger(__name__).warning(
                    "expertmesh: the %s could not be built (%s); using the PyTorch path", self.what, self.build_error
                )
            self.build_seconds = time.perf_counter() - t0
            self._tried = True
            return self.ops
