#!/usr/bin/env bash
# One-shot GPU check of the Triton kernels (run on a CUDA machine from the repo root).
#   OUT=/some/dir bash kernels/gpu_check.sh
# Writes into $OUT: env.txt, bench.txt + bench.json (correctness at realistic sizes and
# timings), pytest.txt (tests/kernels, not slow, on CUDA), pytest_slow.txt if time allows,
# cuda_graphs.txt + cuda_graphs.json (decode steps/s with and without CUDA graphs on a
# Llama-3-8B-shaped random model, HBM fraction, replay == eager tokens) and
# pytest_graphs.txt (tests/runtime/test_cuda_graphs.py on CUDA).
#   OUT=/some/dir ONLY_GRAPHS=1 bash kernels/gpu_check.sh   # the CUDA-graph part alone (~5 min)
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

if [ -z "${ONLY_GRAPHS:-}" ]; then
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
fi

echo "== CUDA graphs: decode bench (engine.cudaGraphs) =="
timeout "${GRAPH_TIMEOUT:-300}" $PY -m tokenlane.bench.cuda_graph_bench --json "$OUT/cuda_graphs.json" \
  ${GRAPH_ARGS:-} 2>&1 | tee "$OUT/cuda_graphs.txt"
echo "cuda graph bench exit: ${PIPESTATUS[0]}"
TOKENLANE_TRITON_AUTOTUNE=0 timeout "${GRAPH_TEST_TIMEOUT:-120}" $PY -m pytest tests/runtime/test_cuda_graphs.py \
  -m "not slow" -q -p no:cacheprovider -o addopts="--import-mode=importlib" 2>&1 | tee "$OUT/pytest_graphs.txt" | tail -5
echo "pytest graphs exit: ${PIPESTATUS[0]}"
