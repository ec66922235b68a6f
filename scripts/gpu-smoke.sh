#!/usr/bin/env bash
# GPU smoke test: on a machine with one CUDA GPU, in a few minutes,
#   1. installs expertmesh into the python that holds a CUDA torch (offline from ./.whl when there is no index),
#   2. runs every Triton kernel against its PyTorch reference on CUDA and prints MXFP4 GEMM and sparse-decode
#      bandwidth as a fraction of the device's copy bandwidth (bench/gpu_kernels.py --quick),
#   3. serves tiny and small with `expertmesh up --device cuda` (bf16) and compares with the fp32 CPU reference
#      (scripts/gpu_smoke.py: prompt log-probs within the bf16 tolerance, greedy tokens reported), and the
#      per-layer exchange over NCCL pairs (--transport collective) against gRPC: same tokens, no fallback.
# Without CUDA it fails at once, loudly. Never part of CI.   Usage: scripts/gpu-smoke.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-bench/results}}
mkdir -p "$OUT_DIR"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-smoke: FAILED: no CUDA device ($PY: torch.cuda.is_available() is False or torch is missing)." >&2
    echo "gpu-smoke: this script needs one NVIDIA GPU and a CUDA build of torch; it checks nothing on CPU." >&2
    exit 2
fi
"$PY" -c 'import torch; print("gpu-smoke: torch", torch.__version__, "on", torch.cuda.get_device_name(0))'

if ! "$PY" -c 'import expertmesh.router.http, triton' 2>/dev/null; then
    echo "gpu-smoke: installing expertmesh (torch left as it is)"
    if [ -d .whl ]; then        # no package index (the lent device machines): wheels carried in ./.whl
        "$PY" -m pip install -q --no-index --find-links .whl --no-build-isolation -e '.[gpu]'
    else
        "$PY" -m pip install -q -e '.[gpu]'
    fi
fi

start=$(date +%s)
echo "== kernels on CUDA vs their references; bandwidth vs the device's copy bandwidth"
"$PY" bench/gpu_kernels.py --quick --out "$OUT_DIR/gpu_kernels.json"
echo "== expertmesh up --device cuda vs the fp32 CPU reference"
"$PY" scripts/gpu_smoke.py --out "$OUT_DIR/gpu_smoke.json"
echo "gpu-smoke: passed in $(( $(date +%s) - start )) s"
