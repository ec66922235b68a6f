"""The fused CPU MXFP4 kernels (`kernels/moe/cpu/mxfp4_moe.cpp`): the grouped MoE expert GEMM and the dense MXFP4
GEMV/GEMM it is built from, decoding E2M1 nibbles in registers and scaling each 32-block inside the dot product.

The C++ source is built on first use with `torch.utils.cpp_extension.load` (one translation unit, -O3) into the
torch extensions directory (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions), once per process; later
processes load the cached library. The build is named after a hash of the source (`build_name()`), so checkouts
with different versions of the kernel sharing one cache never rebuild over each other or load the other's library.
Without a compiler (or ninja), or when the build fails, `load()` returns None after logging one warning and callers
keep the PyTorch path. `EXPERTMESH_CPU_KERNEL=0` turns it off.

Numerics (see the C++ header comment): fp32, each output element reduced in one fixed order (16 lanes over
element pairs, per-block scale, fixed lane tree) that depends only on its own row and token, so results are
batch-invariant by construction and the AVX-512, AVX2 and portable paths give the same bits. bf16 activations
go in as they are: on CPUs with AVX512-BF16 (`isa="avx512bf16"`, what auto picks there) the gate/up GEMM reads them
with the bf16 dot-product instruction, whose pair sums are the FMA path's (both products are exact in fp32), so the
bits are those of widening x to fp32 first, on every path — barring fp32 subnormals, which that instruction
flushes to zero. The order differs
from the reference's (dequantise, then a BLAS GEMM), so the two agree to fp32 rounding (a relative error of a
few 1e-7 per dot product), not bitwise. One more difference: a block whose dequantised value overflows fp32
(scale 0xFD/0xFE with a large code) is inf in the reference; here the scale multiplies the block's partial sum,
so the result stays finite when the true value is.

bf16 activations on CPUs with AMX-BF16 (and Linux granting the tile state) take `isa="amx"` under auto
(`bf16_isa()`; EXPERTMESH_CPU_MOE_ISA chooses): ANOTHER order, the tile unit's. Each weight is decoded to its exact
bf16 value (scale folded in), each output summed as TDPBF16PS does (per 32-block, even and odd products apart,
then added to the accumulator; subnormals flushed) and h rounded to bf16 between the GEMMs:
`naive.moe_expert_outputs_tile_order` spells it out and the tests hold both of its routes to it bit for bit —
experts with 9+ rows on the tile unit (weights as A tiles, 16 rows of activations as B), 1-8 rows on the vector
units emulating it (a tile costs the same for 1 row as for 16). A process runs one path for all calls, so rows stay
batch-invariant. `bench/moe_cpu.py` (one expert worker's share of bench/peer.py's model, 2 threads) measured
amx / avx512bf16 ms: 1024 tokens 15.1 / 61.0 (4.0x), 256 tokens 5.8 / 15.0 (2.6x), 64 tokens 2.7 / 3.9,
16 tokens 1.23 / 1.51, 8 tokens 0.71 / 0.81, 1 token 0.077 / 0.079; cold (a decoding worker's 7 layers x 64
experts, fresh experts every call) 1 token 0.268 / 0.274, 2 tokens 0.519 / 0.536.

The activation (SwiGLU, or SiTU: `kernels.activation`) runs between the two GEMMs elementwise with the kernel's own
exp and tanh (Cephes' expf / tanhf in plain IEEE operations: `gated_activation`), vectorised on AVX-512 / AVX2 and
the same bits on every vector path and the scalar loop; the AMX path keeps the scalar libm functions. Both round
differently from ATen's SIMD silu / sigmoid / tanh (within a few ulp), another fp32-rounding-level difference from
the reference. The vector activation took a 500-token SiTU call (K3 peer shape, 2 threads) from 91-92 ms with libm
to 62 ms (`cpu_kernel.moe_expert_outputs`, median of 5); on CPU the shared experts and dense MLPs run it too
(`kernels.moe.cpu_activation_runs`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from expertmesh.kernels import cpu_extension
from expertmesh.kernels.activation import SWIGLU, GatedActivation, check_activation
from expertmesh.kernels.moe.experts import MXFP4Experts
from expertmesh.kernels.moe.naive import check_moe_inputs
from expertmesh.kernels.mxfp4.naive import check_mxfp4

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "mxfp4_moe.cpp"
EXTENSION = "expertmesh_mxfp4_cpu"  # build name prefix; the library's op namespace is NAMESPACE
NAMESPACE = "expertmesh_mxfp4_cpu"  # TORCH_LIBRARY(...) in the source
ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4, "amx": 5}
_ACT = {"swiglu": 0, "situ": 1}  # the C++ Act codes

_lock = threading.Lock()
_tried = False
_ops = None
build_seconds: float | None = None  # wall time of this process's load (build, or cached load)
build_error: str | None = None


def enabled() -> bool:
    """False when `EXPERTMESH_CPU_KERNEL` is 0/off/false/torch."""
    return cpu_extension.switched_on("EXPERTMESH_CPU_KERNEL")


def build_name() -> str:
    """The build's name: EXTENSION + the first 12 hex digits of the source's SHA-256."""
    return cpu_extension.build_name(EXTENSION, SOURCE)


def load():
    """The extension's op namespace (`torch.ops.expertmesh_mxfp4_cpu`), or None when it cannot be built.

    Builds (or loads the cached build) once per process; a failure is logged once and remembered."""
    global _tried, _ops, build_seconds, build_error
    if _tried:
        return _ops
    with _lock:
        if _tried:
            return _ops
        t0 = time.perf_counter()
        try:
            _ops = cpu_extension.build_ops(EXTENSION, SOURCE, NAMESPACE)
            _ops.best_isa()  # resolves the ops: fails here, not later
        except Exception as exc:  # no compiler / ninja, a build error, an unloadable library
            _ops = None
            build_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            log.warning(
                "expertmesh: the fused CPU MXFP4 kernel could not be built (%s); using the PyTorch path", build_error
            )
        build_seconds = time.perf_counter() - t0
        _tried = True
        return _ops


def available() -> bool:
    """The kernel is enabled and built (building it now if it was not tried yet)."""
    return enabled() and load() is not None


def best_isa() -> str:
    """The best vector path on this CPU (avx512bf16, avx512, avx2 or portable): all give the same bits, and it is
    what `isa="auto"` runs for fp32 activations (bf16 ones: `bf16_isa()`)."""
    ops = _require()
    return {v: k for k, v in ISAS.items()}[int(ops.best_isa())]


def amx_runs() -> bool:
    """Whether the tile-unit path (isa amx) runs here: AMX-BF16 in the CPU, and Linux grants the tile state."""
    return bool(_require().amx_runs())


_bf16_isa: str | None = None


def bf16_isa() -> str:
    """The path `isa="auto"` runs for bf16 activations in this process, resolved once: EXPERTMESH_CPU_MOE_ISA when set
    (any key of ISAS but auto; ValueError naming it when unknown or not on this CPU), else amx where it runs, else
    `best_isa()`. amx sums in another order than the vector paths (the C++ header), so one process uses one."""
    global _bf16_isa
    if _bf16_isa is None:
        want = os.environ.get("EXPERTMESH_CPU_MOE_ISA", "").strip().lower()
        if want:
            if want not in ISAS or want == "auto":
                raise ValueError(
                    f"EXPERTMESH_CPU_MOE_ISA: expected one of {', '.join(k for k in ISAS if k != 'auto')}"
                    f", found {want!r}"
                )
            if want == "amx" and not amx_runs():
                raise ValueError("EXPERTMESH_CPU_MOE_ISA=amx: this CPU (or its operating system) offers no AMX-BF16")
            _bf16_isa = want
        else:
            _bf16_isa = "amx" if amx_runs() else best_isa()
    return _bf16_isa


def _require():
    ops = load()
    if ops is None:
        raise RuntimeError(f"the fused CPU MXFP4 kernel is not available ({build_error})")
    return ops


def _isa(isa: str) -> int:
    if isa not in ISAS:
        raise ValueError(f"isa: expected one of {', '.join(ISAS)}, found {isa!r}")
    return ISAS[isa]


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, *, isa: str = "auto") -> torch.Tensor:
    """x [..., K] floating @ W^T with W [N, K] in MXFP4 (blocks uint8 [N, K/2], scales uint8 [N, K/32]) → [..., N]
    in x.dtype, computed in fp32 with the fixed per-element order (row-batch-invariant). CPU tensors only.
    isa amx: x rounded to bf16, summed in the tile unit's order (`kernels.linear.naive.matmul_in_tile_order`)."""
    K = check_mxfp4(blocks, scales)
    if blocks.dim() != 2:
        raise ValueError(f"blocks: expected rank 2 [N,K/2], found rank {blocks.dim()}")
    if x.shape[-1] != K:
        raise ValueError(f"x: expected last dim {K} (as the weight), found {list(x.shape)}")
    ops = _require()
    lead = x.shape[:-1]
    xf = x.reshape(-1, K)
    xf = (xf.to(torch.bfloat16) if isa == "amx" else xf.float()).contiguous()
    y = torch.empty(xf.shape[0], blocks.shape[0], dtype=torch.float32)
    ops.mxfp4_linear(xf, blocks.contiguous(), scales.contiguous(), y, _isa(isa))
    return y.reshape(*lead, blocks.shape[0]).to(x.dtype)


def moe_expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: MXFP4Experts,
    *,
    out: torch.Tensor | None = None,
    isa: str = "auto",
    activation: GatedActivation = SWIGLU,
    fp32_output: bool = False,
) -> torch.Tensor:
    """The fused grouped expert GEMM (CPU). Contract: `expertmesh.kernels.moe.naive.moe_expert_outputs`.
    bf16 x goes in as it is (the AVX512-BF16 tiles read it; the other paths widen it: the same bits either way);
    `isa="auto"` runs `bf16_isa()` for it — amx on CPUs with AMX-BF16 (the order of
    `naive.moe_expert_outputs_tile_order`: weights decoded to bf16, tile-unit sums, h rounded to bf16);
    `fp32_output` (without `out`): return the fp32 result as computed, before the rounding to x's dtype."""
    s = check_moe_inputs(x, topk_ids, experts, out)
    act = check_activation(activation)
    ops = _require()
    if isa == "auto" and x.dtype == torch.bfloat16:
        isa = bf16_isa()
    if isa == "amx" and x.dtype != torch.bfloat16:
        raise ValueError(f"x: isa amx takes bfloat16 activations, found {x.dtype}")
    code = _isa(isa)
    target = out if out is not None and out.dtype == torch.float32 else torch.empty(s.T, s.K, s.H, dtype=torch.float32)
    ops.moe_expert_outputs(
        (x if x.dtype == torch.bfloat16 else x.float()).contiguous(),
        topk_ids.contiguous(),
        *experts.contiguous(),
        target,
        code,
        _ACT[act.kind],
        act.beta,
        act.linear_beta,
    )
    if out is None:
        return target if fp32_output else target.to(x.dtype)
    if target is not out:
        out.copy_(target)
    return out


def gated_activation(
    gate: torch.Tensor, up: torch.Tensor, activation: GatedActivation = SWIGLU, *, isa: str = "auto"
) -> torch.Tensor:
    """act(gate, up) as the kernel's vector paths compute it between their two GEMMs (any isa but amx, which keeps
    libm's): gate, up [T, I] → fp32 [T, I]. Every isa gives the same bits, elementwise (a row's bits never depend on
    the batch); within a few ulp of `kernels.activation.gated_act`, the reference. On CPU the shared experts and
    dense MLPs take it too (`expertmesh.model.layers.GatedMLP`)."""
    act = check_activation(activation)
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"up: expected the shape of gate [T, I] {list(gate.shape)}, found {list(up.shape)}")

    def rows(t: torch.Tensor) -> torch.Tensor:
        t = t.float()
        return t if t.stride(-1) == 1 else t.contiguous()

    return _require().gated_activation(rows(gate), rows(up), _isa(isa), _ACT[act.kind], act.beta, act.linear_beta)


def group_partials(outputs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """The canonical per-(row, group) partial sums in C++: the same fp32 operations in the same order as
    `kernels.moe.combine.group_partials_torch`, so the same bits, without a dozen tensor ops per slot column.
    Contract: `kernels.moe.combine.group_partials` (n_groups is implied by the ids)."""
    return _require().group_partials(
        outputs.float().contiguous(), ids.long().contiguous(), weights.float().contiguous(), int(group_size)
    )


def fold_rows(
    tokens: torch.Tensor, groups: torch.Tensor, rows: torch.Tensor, n_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """The routed sum from the present P_g in C++: the same fp32 adds in the same order as
    `kernels.moe.combine.fold_rows_torch`, so the same bits, in one pass over the rows (threads split tokens).
    Contract: `kernels.moe.combine.fold_rows`; dtype float32 or bfloat16 (the rounding of each P_g)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype: expected torch.float32 or torch.bfloat16, found {dtype}")
    if not (rows.dtype == dtype == torch.bfloat16):  # bf16 rows are read as they are only when bf16 is the rounding
        rows = rows.float()
    return _require().fold_rows(
        tokens.long().contiguous(),
        groups.long().contiguous(),
        rows.contiguous(),
        int(n_tokens),
        dtype == torch.bfloat16,
    )
