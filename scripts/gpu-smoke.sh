#!/usr/bin/env bash
# GPU smoke test: on a machine with one CUDA GPU (an H100 box with 16 cores), in about 8 minutes,
#   1. installs expertmesh into the python that holds a CUDA torch (offline from ./.whl when there is no index),
#   2. scripts/gpu_smoke.py: tiny Kimi K3 and K3+DSA checkpoints (MXFP4 experts, vision tower, MTP layer) against the
#      fp32 CPU reference — the forward in process with every Triton kernel listed as it launches, the vision tower,
#      the MTP layer and speculation with it, the hand-off's pinned host copies, `expertmesh up --device cuda` (bf16),
#      the expert exchange over NCCL pairs with a prefill pool handing every request off to the decode worker, and
#      the pre-K3 tiny preset — each step PASS / FAIL as it ends, a summary at the end (JSON in OUT_DIR),
#   3. bench/gpu_kernels.py --quick: every Triton kernel against its PyTorch reference at full-size layer shapes, and
#      MXFP4 GEMM / sparse-decode bandwidth as a fraction of the device's copy bandwidth.
# Without CUDA it fails at once, loudly. Never part of CI.
#
#   scripts/gpu-smoke.sh [OUT_DIR]            on the GPU
#   scripts/gpu-smoke.sh --dry-run [OUT_DIR]  the same steps of gpu_smoke.py on CPU (fp32; the in-process steps with
#                                             every Triton kernel forced under TRITON_INTERPRET=1), no GPU needed
# GPU_SMOKE_ARGS adds arguments to gpu_smoke.py (e.g. "--steps forward,serve:k3 --keep-going");
# GPU_SMOKE_SECONDS bounds it (default 360 on the GPU, 900 for the dry run; interrupted then, the summary printed
# and its JSON keeping the finished steps); the kernel bench gets 120 s more.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
OUT_DIR=${1:-${OUT:-bench/results}}
SECONDS_LIMIT=${GPU_SMOKE_SECONDS:-$([ "$DRY_RUN" = 1 ] && echo 900 || echo 360)}
mkdir -p "$OUT_DIR"
# shellcheck disable=SC2086  # GPU_SMOKE_ARGS is a list of arguments
run_smoke() { timeout -s INT -k 30 "$SECONDS_LIMIT" "$PY" scripts/gpu_smoke.py "$@" ${GPU_SMOKE_ARGS:-}; }

if [ "$DRY_RUN" = 1 ]; then
    export TRITON_INTERPRET=1
    echo "gpu-smoke: dry run on CPU (no CUDA calls)"
    run_smoke --device cpu --budget-s "$SECONDS_LIMIT" --out "$OUT_DIR/gpu_smoke_dry_run.json"
    exit
fi
export TRITON_INTERPRET=0

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-smoke: FAILED: no CUDA device ($PY: torch.cuda.is_available() is False or torch is missing)." >&2
    echo "gpu-smoke: this script needs one NVIDIA GPU and a CUDA build of torch; --dry-run runs its steps on CPU." >&2
    exit 2
fi
"$PY" -c 'import torch; print("gpu-smoke: torch", torch.__version__, "on", torch.cuda.get_device_name(0), "×", torch.cuda.device_count())'

if ! "$PY" -c 'import expertmesh.router.http, triton, safetensors' 2>/dev/null; then
    echo "gpu-smoke: installing expertmesh (torch left as it is)"
    if [ -d .whl ]; then        # no package index (the lent device machines): wheels carried in ./.whl
        "$PY" -m pip install -q --no-index --find-links .whl --no-build-isolation -e '.[gpu]'
    else
        "$PY" -m pip install -q -e '.[gpu]'
    fi
fi

start=$(date +%s)
status=0
echo "== K3 / K3+DSA on CUDA vs the fp32 CPU reference (scripts/gpu_smoke.py)"
run_smoke --device cuda --budget-s $((SECONDS_LIMIT - 60)) --out "$OUT_DIR/gpu_smoke.json" || status=$?
echo "== kernels on CUDA vs their references; bandwidth vs the device's copy bandwidth"
timeout -s INT -k 10 120 "$PY" bench/gpu_kernels.py --quick --out "$OUT_DIR/gpu_kernels.json" || status=$((status ? status : $?))
echo "gpu-smoke: $([ "$status" = 0 ] && echo passed || echo "FAILED (status $status)") in $(( $(date +%s) - start )) s"
exit "$status"
