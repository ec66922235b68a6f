"""Build (or load) the C++ CPU kernels a worker runs before it serves, not on its first request: a fresh machine
compiles each one (tens of seconds on two cores), and even a cached build costs ninja's up-to-date check and the
library load (about a second each) — time a first request would otherwise wait, past any client's deadline.
A kernel that cannot be built logs once and its callers keep the PyTorch path, as on a lazy first use."""

from __future__ import annotations

import logging
import time

from expertmesh.kernels.cpu_isa import cpu_isa
from expertmesh.kernels.dsa import cpu_kernel as dsa_kernel
from expertmesh.kernels.kda import cpu_kernel as kda_kernel
from expertmesh.kernels.linear import cpu_kernel as linear_kernel
from expertmesh.kernels.moe import cpu_kernel as moe_kernel
from expertmesh.kernels.norm import cpu_kernel as norm_kernel

log = logging.getLogger(__name__)

ATTENTION = {
    "linear": linear_kernel.available,
    "norm": norm_kernel.available,
    "kda step": kda_kernel.available,
    "paged attention": dsa_kernel.available,
    "dense attention (AMX)": dsa_kernel.dense_available,
}
EXPERT = {"mxfp4": moe_kernel.available}


def load(kernels: dict) -> dict[str, bool]:
    """Load every kernel of `kernels` (name → its module's `available`) → {name: available}; logs the seconds."""
    t0 = time.perf_counter()
    ready = {name: bool(available()) for name, available in kernels.items()}
    log.info(
        "CPU kernels ready in %.1f s: %s",
        time.perf_counter() - t0,
        ", ".join(f"{n} {'yes' if ok else 'no (PyTorch path)'}" for n, ok in ready.items()),
    )
    log.info("CPU paths: %s", cpu_isa().describe())  # which instruction sets, and the path of bf16 / fp32 projections
    return ready
