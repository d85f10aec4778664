#!/usr/bin/env bash
# Kernel bench and the interpreter-free kernel tests on a lent GPU, in under 5 minutes (timeouts:
# 150 s bench, 120 s tests; most of the test time is compiling each kernel per dtype and block size).
#
#   bash bench/kernels_gpu.sh            # results in $OUT (the device tool's folder) or bench/results/
#
# Writes kernels_gpu.txt (everything printed) and kernels_gpu.json (the bench figures). The GPU
# image has torch, triton, pytest, networkx and numpy but no network: nothing is downloaded; the
# package runs from this checkout through PYTHONPATH (`pip install -e .` would need the network
# for its build backend's isolation). TRITON_INTERPRET is unset so the compiled kernels run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST="${OUT:-$PWD/bench/results}"
mkdir -p "$DEST"
LOG="$DEST/kernels_gpu.txt"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  echo "# omnibal-compile kernels on GPU, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "triton", "networkx", "numpy", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing on this machine: {missing}; carry them as wheels (see the device README)")
import torch, triton
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton.__version__}")
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible")
PY
} 2>&1 | tee "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

echo "## omnibal-compile bench kernels" | tee -a "$LOG"
timeout 150 "$PY" -m omnibal_compile.cli bench kernels --json "$DEST/kernels_gpu.json" 2>&1 | tee -a "$LOG"
bench_rc=${PIPESTATUS[0]}

echo "## kernel tests on CUDA (compiled Triton, no interpreter)" | tee -a "$LOG"
timeout 120 "$PY" -m pytest tests/test_kernels.py tests/test_kernel_pass.py -x -p no:cacheprovider -k "not package_works" 2>&1 | tee -a "$LOG"
test_rc=${PIPESTATUS[0]}

echo "bench exit $bench_rc, tests exit $test_rc; results in $DEST" | tee -a "$LOG"
[ "$bench_rc" -eq 0 ] && [ "$test_rc" -eq 0 ]
