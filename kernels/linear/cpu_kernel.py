"""The row-invariant bf16 linear / bmm CPU kernel (`kernels/linear/cpu/row_invariant_linear.cpp`).

Every output element is one fp32 accumulator over the K pairs in order, odd element first, rounded to bf16
once — the exact per-lane arithmetic of AVX512-BF16's VDPBF16PS, which the fast path issues for 16 output columns
at a time (register tiles of up to 6 rows × 64 columns). The order depends only on K, never on the number of rows,
a row's position, the tiling or the thread count (threads split column groups and row chunks, never K), so a
row's result is bitwise the same in any batch: no row padding is needed. The portable path computes the same
steps one element at a time and gives the same bits except where a product or partial sum is an fp32 subnormal
(VDPBF16PS flushes those); `isa="auto"` picks one path per process, from the CPU.

Four fast paths. `avx512bf16` runs the steps above with VDPBF16PS. `avx512` (AVX-512 F/BW/VL without BF16:
Skylake to Ice Lake servers) and `avx2` (AVX2 + FMA: AVX2-only EPYCs) run the same steps on fp32 FMAs: a packed
(even, odd) pair splits into two fp32 vectors by a mask and a shift, and since a bf16 product is exact in fp32,
fma(x_odd, w_odd, acc) then fma(x_even, w_even, acc) rounds where the portable loop does — its bits exactly (they
keep IEEE subnormals; they differ from it only where a product is itself an fp32 subnormal). `amx` (AMX-BF16) sums
in the tile unit's own order, found bitwise on this project's CPU and spelled out in `naive.matmul_in_tile_order`:
K in blocks of 16 pairs, in each block the even and the odd products summed apart in fp32, then c = c + (S_even +
S_odd). Calls of 3+ rows run TDPBF16PS tiles; calls of 1-2 rows (decode), where a 16-row tile would be mostly empty
and a bmm would pack its weight per call, run that same order on the vector units (two FMA chains per column
vector, subnormals flushed as the tile unit does): the same bits either way, so rows stay batch-invariant, and
one-row calls cost what VDPBF16PS costs. `isa="auto"` resolves once per process, so every call of a process runs
the same arithmetic: `EXPERTMESH_CPU_LINEAR_ISA` (a key of ISAS) when set, else the first of amx (AMX-BF16 and the
tile state granted by Linux), avx512bf16, avx512, avx2 that the CPU has, else portable — "has" as
`kernels.cpu_features` sees it (EXPERTMESH_CPU_ISA, ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY cap it). On this
project's AMX CPU AMX computes a 256-row call of the benchmark model's projections 5-6x faster than VDPBF16PS; on a
CPU without AVX512-BF16 the `avx512` path replaces oneDNN's bf16 (emulated there, and padded to 16 rows a call):
bench/linear_cpu.py.

`available()` is true only where a fast path runs: elsewhere the kernel would be slower than oneDNN and callers
keep their path. `EXPERTMESH_CPU_LINEAR_KERNEL=0` turns it off. Built on first use (kernels/cpu_extension.py); a
failed build logs one warning and `available()` is False.

Weights: `linear` takes `pack_weight(w)` (kernels/linear/naive.py; N padded to 64 and K to even: for the model's
projections the same size as the weight), which `kernels.batch_invariant` makes once per parameter in place of
oneDNN's packed copy. `bmm` reads w [B, K, N] where it is (unit stride along N), no cached copy: a call with
more than 6 rows packs each 64-column slice once into a per-thread buffer (K × 128 bytes) for its row tiles.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from expertmesh.kernels import cpu_features
from expertmesh.kernels.cpu_extension import LazyExtension, switched_on
from expertmesh.kernels.linear.naive import GROUP, check_bmm_inputs, check_linear_inputs, pack_bmm_weight, pack_weight

__all__ = [
    "available",
    "built",
    "best_isa",
    "default_isa",
    "runs",
    "enabled",
    "linear",
    "linear_fp32",
    "bmm",
    "bmm_packed",
    "pack_weight",
    "pack_bmm_weight",
    "ISAS",
    "EXTENSION",
]

EXTENSION = LazyExtension(
    "expertmesh_linear_cpu",
    Path(__file__).parent / "cpu" / "row_invariant_linear.cpp",
    "expertmesh_linear_cpu",
    what="CPU row-invariant linear kernel",
    probe="linear",
)
ISAS = {"auto": 0, "portable": 1, "avx512": 2, "avx512bf16": 3, "amx": 4, "avx2": 5}
FAST_ISAS = ("amx", "avx512bf16", "avx512", "avx2")  # fastest first; `portable` is the reference


def enabled() -> bool:
    """False when `EXPERTMESH_CPU_LINEAR_KERNEL` is 0/off/false/no/torch."""
    return switched_on("EXPERTMESH_CPU_LINEAR_KERNEL")


def built() -> bool:
    """The extension is built (building it now if it was not tried yet), enabled or not."""
    return EXTENSION.load() is not None


_fast: bool | None = None


def available() -> bool:
    """Enabled, built, and a fast path (AMX-BF16, AVX512-BF16, AVX-512 or AVX2 FMA) runs on this CPU."""
    global _fast
    if not enabled():
        return False
    if _fast is None:
        _fast = built() and default_isa() in FAST_ISAS
    return _fast


def fp32_available() -> bool:
    """The fp32 linear's vector path runs here (AVX-512, as `kernels.cpu_features` allows it): only then does it beat
    oneDNN; its portable loop is the reference, not a path for a whole fp32 model. (Asked per fp32 projection:
    every part is cached.)"""
    return available() and cpu_features.features().avx512 and _f32_vector()


@functools.cache
def _f32_vector() -> bool:
    """The CPU itself has the fp32 linear's AVX-512 path (a fact of the hardware: asked of the kernel once)."""
    return bool(_require().f32_vector())


def _require():
    ops = EXTENSION.load()
    if ops is None:
        raise RuntimeError(f"the CPU row-invariant linear kernel is not available ({EXTENSION.build_error})")
    return ops


def best_isa() -> str:
    """The kernel's own choice on this CPU: amx, avx512bf16, avx512, avx2 or portable."""
    return {v: k for k, v in ISAS.items()}[int(_require().best_isa())]


def runs(isa: str) -> bool:
    """Whether the path `isa` (a key of ISAS) runs on this CPU and operating system."""
    return bool(_require().isa_runs(ISAS[isa]))


def _isa(isa: str) -> int:
    if isa not in ISAS:
        raise ValueError(f"isa: expected one of {', '.join(ISAS)}, found {isa!r}")
    return ISAS[default_isa() if isa == "auto" else isa]


_default: str | None = None


def default_isa() -> str:
    """The path `isa="auto"` runs in this process: EXPERTMESH_CPU_LINEAR_ISA when set (a key of ISAS; refused with
    the variable named when this CPU has no such path), else the kernel's own choice within what
    `kernels.cpu_features` allows (portable where it allows not even AVX2: `available()` is then False)."""
    global _default
    if _default is None:
        want = os.environ.get("EXPERTMESH_CPU_LINEAR_ISA", "").strip().lower()
        if want and want not in ISAS:
            raise ValueError(f"EXPERTMESH_CPU_LINEAR_ISA: expected one of {', '.join(ISAS)}, found {want!r}")
        if want and want != "auto":
            if not runs(want):
                raise ValueError(
                    f"EXPERTMESH_CPU_LINEAR_ISA={want}: this CPU (or its operating system) has no such path"
                )
            _default = want
        else:
            _default = _capped(best_isa())
    return _default


def _capped(isa: str) -> str:
    """`isa` lowered to what `cpu_features.features()` allows (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY or
    EXPERTMESH_CPU_ISA capping this CPU: the kernel then runs what it would on the CPU they describe)."""
    f = cpu_features.features()
    if isa == "amx" and not f.amx:
        isa = "avx512bf16"
    if isa == "avx512bf16" and not (f.avx512 and f.avx512_bf16):
        isa = "avx512"
    if isa == "avx512" and not f.avx512:
        isa = "avx2"
    if isa == "avx2" and not f.avx2:
        isa = "portable"
    return isa


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dim (a copy only when it has not)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def linear(x: torch.Tensor, w_packed: torch.Tensor, n: int, k: int, *, isa: str = "auto") -> torch.Tensor:
    """x [..., K] bf16 @ W^T (W [N, K] given as `pack_weight(W)`) → [..., N] bf16. CPU tensors."""
    check_linear_inputs(x, w_packed, n, k)
    if x.device.type != "cpu":
        raise ValueError(f"x: expected a CPU tensor, found {x.device}")
    ops = _require()
    if x.dim() == 2:
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        ops.linear(_rows(x), w_packed, n, k, out, _isa(isa))
        return out
    flat = _rows(x.reshape(-1, k))
    out = torch.empty(flat.shape[0], n, dtype=torch.bfloat16)
    ops.linear(flat, w_packed, n, k, out, _isa(isa))
    return out.reshape(*x.shape[:-1], n)


def linear_fp32(x: torch.Tensor, w: torch.Tensor, *, vector: bool | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ w [N, K]^T fp32 → [..., N] fp32, each element summed in the one order of
    `naive.linear_fp32_in_lane_order` (it depends only on K: a row's bits are the same in any batch). `vector`:
    the AVX-512 path (default where the CPU has it) or the portable one; the same bits. CPU tensors."""
    if x.dtype != torch.float32 or w.dtype != torch.float32 or w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"linear_fp32: expected x [..., K] and w [N, K] fp32, found x {x.dtype} {list(x.shape)}, "
            f"w {w.dtype} {list(w.shape)}"
        )
    if x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"linear_fp32: expected CPU tensors, found {x.device}, {w.device}")
    ops = _require()
    flat = _rows(x.reshape(-1, x.shape[-1]))
    out = torch.empty(flat.shape[0], w.shape[0], dtype=torch.float32)
    ops.linear_f32(flat, w.contiguous(), out, _f32_vector() if vector is None else vector)
    return out.reshape(*x.shape[:-1], w.shape[0])


def bmm_packed(x: torch.Tensor, w_packed: torch.Tensor, n: int, k: int, *, isa: str = "auto") -> torch.Tensor:
    """`bmm`(x, w) with w [B, K, N] given as `naive.pack_bmm_weight(w)`: the same bits, the weight read from
    contiguous memory (`bmm` packs each column group per call from K strided rows). CPU tensors."""
    b = x.shape[0] if x.dim() == 3 else None
    want = (b, -(-n // GROUP), -(-k // 2), GROUP, 2)
    if x.dim() != 3 or x.dtype != torch.bfloat16 or x.shape[2] != k:
        raise ValueError(f"x: expected a bfloat16 [B, M, K={k}] tensor, found {x.dtype} {list(x.shape)}")
    if w_packed.dtype != torch.bfloat16 or tuple(w_packed.shape) != want:
        raise ValueError(
            f"w_packed: expected a bfloat16 {list(want)} tensor (pack_bmm_weight of a [B, K={k}, "
            f"N={n}] weight), found {w_packed.dtype} {list(w_packed.shape)}"
        )
    if x.device.type != "cpu" or w_packed.device.type != "cpu":
        raise ValueError(f"bmm_packed: expected CPU tensors, found {x.device}, {w_packed.device}")
    out = torch.empty(x.shape[0], x.shape[1], n, dtype=torch.bfloat16)
    _require().bmm_packed(_rows(x), w_packed, n, k, out, _isa(isa))
    return out


def bmm(x: torch.Tensor, w: torch.Tensor, *, isa: str = "auto") -> torch.Tensor:
    """x [B, M, K] bf16 @ w [B, K, N] bf16 → [B, M, N] bf16. `x` and `w` may be strided views (copied only when
    their last dim is not unit-stride). CPU tensors."""
    check_bmm_inputs(x, w)
    if x.device.type != "cpu":
        raise ValueError(f"x: expected a CPU tensor, found {x.device}")
    ops = _require()
    out = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=torch.bfloat16)
    ops.bmm(_rows(x), _rows(w), out, _isa(isa))
    return out
