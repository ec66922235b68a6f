"""What this CPU offers the project's CPU paths, as oneDNN and ATen will see it — the Python side of
kernels/cpu/cpu_features.h, for the choices made in Python (which linear path a dtype takes, what `isa="auto"`
means for the linear kernel). `kernels/cpu_isa.py` reports it with the paths chosen from it.

`features()`: the CPU's instruction sets (cpuinfo, through torch.cpu.get_capabilities), each capped by whichever
of these is set: `ONEDNN_MAX_CPU_ISA` (or oneDNN's older `DNNL_MAX_CPU_ISA`: oneDNN dispatches as if the CPU had
no more), `ATEN_CPU_CAPABILITY` (ATen's vector level: default / avx2 / avx512) and this project's
`EXPERTMESH_CPU_ISA` (portable | avx2 | avx512 | auto: the most the project's own path choices may assume;
portable also turns oneDNN's prepacked copies off for every dtype). With them an AVX-512 machine runs what an
AVX2-only one (e.g. an AMD EPYC cloud CPU) would.

`onednn_prepacks(dtype)`: whether oneDNN's prepacked linear (`mkldnn._reorder_linear_weight` +
`_linear_pointwise`) runs for `dtype` here, decided by trying it once on a tiny weight, because flags cannot say
what the installed oneDNN accepts: it refuses bf16 without AVX512-BW/VL/DQ or AVX-NE-CONVERT (with a RuntimeError
at the first projection of every request, before this check)."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

ENV = "EXPERTMESH_CPU_ISA"
# what each forced level lets the project's choices assume
LEVELS = {
    "portable": frozenset(),
    "avx2": frozenset({"avx2"}),
    "avx512": frozenset({"avx2", "avx512"}),
    "auto": None,
}
_ALL = frozenset({"avx2", "avx512", "avx512_bf16", "amx", "avx_ne_convert"})
_AVX2 = frozenset({"avx2"})
_AVX512 = _AVX2 | {"avx512"}
_AVX512_BF16 = _AVX512 | {"avx512_bf16"}
_FP16 = _AVX512_BF16 | {"avx_ne_convert"}  # AVX10.1 / AVX512_CORE_FP16 includes AVX2_VNNI_2
# oneDNN's ISA names (dnnl::cpu_isa, upper case as the variable takes them) → what each allows
_ONEDNN_CAPS = {
    "SSE41": frozenset(),
    "AVX": frozenset(),
    "AVX2": _AVX2,
    "AVX2_VNNI": _AVX2,
    "AVX2_VNNI_2": _AVX2 | {"avx_ne_convert"},
    "AVX512_CORE": _AVX512,
    "AVX512_CORE_VNNI": _AVX512,
    "AVX512_CORE_BF16": _AVX512_BF16,
    "AVX512_CORE_FP16": _FP16,
    "AVX10_1_512": _FP16,
    "AVX512_CORE_AMX": _ALL,
    "AVX10_1_512_AMX": _ALL,
    "AVX512_CORE_AMX_FP16": _ALL,
    "AVX10_1_512_AMX_FP16": _ALL,
    "AVX10_2_512": _FP16,
    "AVX10_2_512_AMX_2": _ALL,
    "DEFAULT": _ALL,
}
# ATen's dispatch level (torch.backends.cpu.get_cpu_capability, which honours ATEN_CPU_CAPABILITY) → what it allows
_ATEN_CAPS = {"DEFAULT": frozenset(), "AVX2": _AVX2 | {"avx_ne_convert"}, "AVX512": _ALL}


@dataclass(frozen=True)
class Features:
    """Instruction sets the CPU paths may use here. `avx512`: F, BW, VL and DQ; `amx`: AMX-TILE and AMX-BF16 in the
    CPU (whether Linux grants the tile state is the C++ kernels' own check). `aten`: ATen's vector level; `caps`:
    the variables set that cap the CPU's own flags, as NAME=value."""

    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    avx_ne_convert: bool
    aten: str
    caps: tuple[str, ...]


def _cpu_flags() -> set[str]:
    """The CPU's own instruction sets (cpuinfo), in this module's names."""
    get = getattr(torch.cpu, "get_capabilities", None)
    has = get() if get is not None else {}
    flags = set()
    if has.get("avx2") and has.get("fma3"):
        flags.add("avx2")
    if all(has.get(f"avx512_{x}") for x in ("f", "bw", "vl", "dq")):
        flags.add("avx512")
    if has.get("avx512_bf16"):
        flags.add("avx512_bf16")
    if has.get("amx_tile") and has.get("amx_bf16"):
        flags.add("amx")
    if has.get("avx_ne_convert"):
        flags.add("avx_ne_convert")
    return flags


def forced_level() -> str | None:
    """EXPERTMESH_CPU_ISA's level, None when unset or auto; a ValueError naming the variable for any other value."""
    want = os.environ.get(ENV, "").strip().lower()
    if want not in LEVELS and want:
        raise ValueError(f"{ENV}: expected one of {', '.join(LEVELS)}, found {want!r}")
    return None if want in ("", "auto") else want


@functools.cache
def features() -> Features:
    """This CPU's instruction sets with every cap applied (once per process; `reset()` asks again)."""
    flags = _cpu_flags()
    caps = []
    onednn_var = next((v for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA") if os.environ.get(v, "").strip()), None)
    if onednn_var is not None:
        value = os.environ[onednn_var].strip()
        allowed = _ONEDNN_CAPS.get(value.upper())
        if allowed is not None:  # oneDNN ignores a name it does not know; so does this
            flags &= allowed
            caps.append(f"{onednn_var}={value}")
    aten = torch.backends.cpu.get_cpu_capability()
    # only where the variable is set: ATen's own choice on a CPU must not turn the project's kernels off
    if os.environ.get("ATEN_CPU_CAPABILITY", "").strip() and aten in _ATEN_CAPS:
        flags &= _ATEN_CAPS[aten]
        caps.append(f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY'].strip()}")
    level = forced_level()
    if level is not None:
        flags &= LEVELS[level]
        caps.append(f"{ENV}={level}")
    return Features(
        avx2="avx2" in flags,
        avx512="avx512" in flags,
        avx512_bf16="avx512_bf16" in flags,
        amx="amx" in flags,
        avx_ne_convert="avx_ne_convert" in flags,
        aten=aten,
        caps=tuple(caps),
    )


_TRIAL_ROWS = 16  # batch_invariant.ROW_TILE: the row count every prepacked call has


@functools.cache
def onednn_prepacks(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs for `dtype` (fp32 / bf16) here: tried once on a tiny weight (and its
    result checked), after the flags: bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, and EXPERTMESH_CPU_ISA=portable
    turns it off for every dtype."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    f = features()
    if forced_level() == "portable":
        return False
    if dtype == torch.bfloat16 and not (f.avx512 or f.avx_ne_convert):
        log.info("expertmesh: no bf16 oneDNN prepacked linear on this CPU (%s)", flag_words(f))
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=gen).to(dtype)
    x = torch.randn(_TRIAL_ROWS, 32, generator=gen).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _TRIAL_ROWS)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as exc:  # e.g. "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        log.info("expertmesh: oneDNN refuses the %s prepacked linear here (%s)", dtype, str(exc).splitlines()[0])
        return False
    return bool(torch.allclose(out.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2))


def reset() -> None:
    """Forget the probes' answers (tests changing the variables in process)."""
    features.cache_clear()
    onednn_prepacks.cache_clear()


def flag_words(f: Features) -> str:
    """e.g. "avx2 avx512 avx512_bf16 no-amx no-avx_ne_convert"."""
    names = ("avx2", "avx512", "avx512_bf16", "amx", "avx_ne_convert")
    return " ".join(n if getattr(f, n) else f"no-{n}" for n in names)
