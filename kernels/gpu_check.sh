#!/usr/bin/env bash
# One-shot GPU check of the Triton kernels (run on a CUDA machine from the repo root).
#   OUT=/some/dir bash kernels/gpu_check.sh
# Writes into $OUT: env.txt, bench.txt + bench.json (correctness at realistic sizes and
# timings), pytest.txt (tests/kernels, not slow, on CUDA), pytest_slow.txt if time allows.
# tokenlane need not be installed: the package is assembled from the folders under /tmp.
set -u
OUT=${OUT:-/tmp/tokenlane-gpu}
mkdir -p "$OUT"
ROOT=$(pwd)
PKG=/tmp/tokenlane-pkg
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r "$ROOT/cli" "$PKG/tokenlane"
ln -s "$ROOT/kernels" "$PKG/tokenlane/kernels"
ln -s "$ROOT/runtime" "$PKG/tokenlane/runtime"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  nvidia-smi -L; date -u
  $PY -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== bench =="
timeout "${BENCH_TIMEOUT:-210}" $PY -m tokenlane.kernels.bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
echo "bench exit: ${PIPESTATUS[0]}"

echo "== pytest tests/kernels (CUDA, not slow) =="
TOKENLANE_TRITON_AUTOTUNE=0 timeout "${TEST_TIMEOUT:-150}" $PY -m pytest tests/kernels -m "not slow" -q -x \
  -p no:cacheprovider -o addopts="--import-mode=importlib" 2>&1 | tee "$OUT/pytest.txt" | tail -25
echo "pytest exit: ${PIPESTATUS[0]}"

if [ -n "${RUN_SLOW:-}" ]; then
  TOKENLANE_TRITON_AUTOTUNE=0 timeout "${SLOW_TIMEOUT:-60}" $PY -m pytest tests/kernels -m slow -q \
    -p no:cacheprovider -o addopts="--import-mode=importlib" 2>&1 | tee "$OUT/pytest_slow.txt" | tail -5
fi
