"""The CPU a process runs on, as its CPU paths see it, and the linear path each dtype takes there: one line for logs
and benchmarks (`cpu_isa().describe()`, e.g. "avx2 avx512 avx512_bf16 no-amx no-avx_ne_convert (aten AVX512);
linear bf16: row-invariant kernel avx512bf16, fp32: row-invariant kernel fp32"). The flags and the oneDNN trial are
`kernels.cpu_features`'; the choice of path is `kernels.batch_invariant`'s."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from expertmesh.kernels import batch_invariant, cpu_features


@dataclass(frozen=True)
class CpuIsa:
    """What `cpu_features.features()` found (capped by ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY /
    EXPERTMESH_CPU_ISA, named in `caps`), whether oneDNN's prepacked linear runs per dtype, and the linear path of
    a bf16 and an fp32 parameter."""

    avx2: bool
    avx512: bool  # F, BW, VL, DQ
    avx512_bf16: bool
    amx: bool
    avx_ne_convert: bool
    aten: str
    caps: tuple[str, ...]
    onednn_bf16_prepack: bool
    onednn_fp32_prepack: bool
    linear_bf16: str
    linear_fp32: str

    def describe(self) -> str:
        caps = f" [{' '.join(self.caps)}]" if self.caps else ""
        flags = cpu_features.flag_words(self)
        return f"{flags} (aten {self.aten}){caps}; linear bf16: {self.linear_bf16}, fp32: {self.linear_fp32}"


@functools.cache
def cpu_isa() -> CpuIsa:
    """This process's CPU paths, probed once (building or loading the linear kernel if that has not happened)."""
    f = cpu_features.features()
    return CpuIsa(
        avx2=f.avx2,
        avx512=f.avx512,
        avx512_bf16=f.avx512_bf16,
        amx=f.amx,
        avx_ne_convert=f.avx_ne_convert,
        aten=f.aten,
        caps=f.caps,
        onednn_bf16_prepack=cpu_features.onednn_prepacks(torch.bfloat16),
        onednn_fp32_prepack=cpu_features.onednn_prepacks(torch.float32),
        linear_bf16=batch_invariant.linear_path(torch.bfloat16),
        linear_fp32=batch_invariant.linear_path(torch.float32),
    )
