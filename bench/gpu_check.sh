#!/usr/bin/env bash
# Everything that needs a GPU, in one run on a single CUDA GPU (an H200 or any other), in under 8 minutes:
#   1. Triton kernels: correctness vs eager, forward+backward speed-up, fused cross-entropy peak memory
#      (bench/kernels_gpu.sh: the kernel bench and the kernel tests on CUDA, at most 270 s);
#   2. the cost pass on CUDA vs the h200 roofline per block, on a reference VLM at realistic widths,
#      with the roofline's calibration factors fitted and the error before and after;
#   3. optimize() with Triton kernels and the stage chain's parity with the unsplit model, on CUDA
#      (2 and 3: python -m bench.studies.gpu_check, at most 150 s);
#   4. a 1-rank `omnibal-compile run --device cuda` of a real-width VLM (one 1024-wide ViT layer, two
#      4096-wide LLM layers, vocabulary 32000) in the default precision (auto: bf16, TF32), --kernels
#      triton vs --kernels eager: losses within 1e-2 of each other, step time, tokens/s, peak memory, MFU
#      against the GPU's datasheet peak (python -m bench.studies.gpu_train, at most 300 s).
#   Liger-Kernel, when installed, is timed next to the Triton kernels in part 1; else the log says it is not.
#
#   bash bench/gpu_check.sh [--out DIR]     # results in DIR, else $OUT (the device tool's folder), else bench/results/gpu_check
#   bash bench/gpu_check.sh --dry-run       # no GPU: the same checks on the CPU at tiny sizes (what CI runs)
#
# Writes gpu_check.txt (everything printed), gpu_check.json (cost and parity figures), gpu_train.json (the
# training runs) and the kernel results (kernels/ on a GPU, kernels.json in a dry run). Copy the figures into
# the "GPU check" section of bench/RESULTS.md. Exit status 0 only if every part passed; 2 when no GPU is
# present (and --dry-run not given): nothing is measured then.
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
if [ $DRY -eq 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "no GPU present (torch sees no CUDA device): nothing measured. Run this on a CUDA machine, or" \
       "bash bench/gpu_check.sh --dry-run to check the same steps on the CPU" | tee "$LOG"
  exit 2
fi

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

echo "## training run: omnibal-compile run, --kernels triton vs eager, MFU" | tee -a "$LOG"
timeout 300 "$PY" -m bench.studies.gpu_train --out "$DEST" $([ $DRY -eq 1 ] && echo --dry-run) 2>&1 | tee -a "$LOG"
train_rc=${PIPESTATUS[0]}

echo "kernels exit $kernels_rc, model checks exit $model_rc, training exit $train_rc; $(( $(date +%s) - start )) s; results in $DEST" | tee -a "$LOG"
# The results page's section (bench/RESULTS.md, "GPU check"): paste it over the one there after a GPU run.
{
  echo "## GPU check (bench/gpu_check.sh)"
  echo
  echo "- command: \`bash bench/gpu_check.sh$([ $DRY -eq 1 ] && echo ' --dry-run')\`"
  echo "- figures: $([ $DRY -eq 1 ] && echo 'DRY RUN on the CPU at tiny sizes: no GPU figure' || echo 'measured on a GPU')"
  echo "- exit: kernels $kernels_rc, model checks $model_rc, training $train_rc; $(( $(date +%s) - start )) s"
  echo
  echo '```text'
  cat "$LOG"
  echo '```'
} > "$DEST/RESULTS_section.md"
echo "wrote $DEST/RESULTS_section.md: paste it over the \"GPU check\" section of bench/RESULTS.md" | tee -a "$LOG"
[ "$kernels_rc" -eq 0 ] && [ "$model_rc" -eq 0 ] && [ "$train_rc" -eq 0 ]
