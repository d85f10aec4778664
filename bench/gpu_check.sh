#!/usr/bin/env bash
# Everything that needs a GPU, in one run on a single CUDA GPU (an H200 or any other), in under 8 minutes:
#   1. Triton kernels: correctness vs eager, forward+backward speed-up, fused cross-entropy peak memory
#      (bench/kernels_gpu.sh: the kernel bench and the kernel tests on CUDA, at most 270 s);
#   2. the cost pass on CUDA vs the h200 roofline per block, on a reference VLM at realistic widths,
#      with the roofline's calibration factors fitted and the error before and after;
#   3. optimize() with Triton kernels and the stage chain's parity with the unsplit model, on CUDA
#      (2 and 3: python -m bench.studies.gpu_check, at most 150 s).
#
#   bash bench/gpu_check.sh [--out DIR]     # results in DIR, else $OUT (the device tool's folder), else bench/results/gpu_check
#   bash bench/gpu_check.sh --dry-run       # no GPU: the same checks on the CPU at tiny sizes (what CI runs)
#
# Writes gpu_check.txt (everything printed), gpu_check.json (cost and parity figures) and the kernel
# results (kernels/ on a GPU, kernels.json in a dry run). Exit status 0 only if every part passed.
# Nothing is downloaded; the package runs from this checkout through PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
DEST="${OUT:-$PWD/bench/results/gpu_check}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) DEST="$2"; shift ;;
    *) echo "usage: bash bench/gpu_check.sh [--dry-run] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
LOG="$DEST/gpu_check.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)

{
  echo "# omnibal-compile GPU check$([ $DRY -eq 1 ] && echo ' (dry run on the CPU)'), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  [ $DRY -eq 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
} 2>&1 | tee "$LOG"

if [ $DRY -eq 1 ]; then
  echo "## kernels: correctness on the CPU at small shapes (speed and memory figures need a GPU)" | tee -a "$LOG"
  timeout 150 "$PY" -m omnibal_compile.cli bench kernels --kernels-vocab 2048 --kernels-loss-tokens 128 \
    --kernels-loss-hidden 64 --json "$DEST/kernels.json" 2>&1 | tee -a "$LOG"
  kernels_rc=${PIPESTATUS[0]}
else
  echo "## kernels: bench/kernels_gpu.sh (results in $DEST/kernels)" | tee -a "$LOG"
  OUT="$DEST/kernels" bash bench/kernels_gpu.sh 2>&1 | tee -a "$LOG"
  kernels_rc=${PIPESTATUS[0]}
fi

echo "## cost pass vs roofline, calibration fit, optimize() and stage-chain parity" | tee -a "$LOG"
timeout 150 "$PY" -m bench.studies.gpu_check --out "$DEST" $([ $DRY -eq 1 ] && echo --dry-run) 2>&1 | tee -a "$LOG"
model_rc=${PIPESTATUS[0]}

echo "kernels exit $kernels_rc, model checks exit $model_rc; $(( $(date +%s) - start )) s; results in $DEST" | tee -a "$LOG"
[ "$kernels_rc" -eq 0 ] && [ "$model_rc" -eq 0 ]
