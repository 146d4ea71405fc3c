#!/usr/bin/env bash
# One-shot GPU check of the Triton kernels (run on a CUDA machine from the repo root).
#   OUT=/some/dir bash kernels/gpu_check.sh
# Writes into $OUT: env.txt, bench.txt + bench.json (correctness at realistic sizes and
# timings, bf16 and fp8 KV caches; decode_bandwidth.txt: the decode HBM fractions), pytest.txt (tests/kernels, not slow, on CUDA), pytest_slow.txt if time allows,
# cuda_graphs.txt + cuda_graphs.json (decode steps/s with and without CUDA graphs on a
# Llama-3-8B-shaped random model, HBM fraction, replay == eager tokens) and
# pytest_graphs.txt (tests/runtime/test_cuda_graphs.py on CUDA), pytest_lora.txt + lora_bench.txt
# (the multi-LoRA kernels on CUDA and their timing against the torch path), pytest_kv_offload.txt
# (the host-memory KV tier on CUDA).
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
timeout "${BENCH_TIMEOUT:-270}" $PY -m tokenlane.kernels.bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
echo "bench exit: ${PIPESTATUS[0]}"
# Decode bandwidth (batch >= 32, context >= 4k) as a fraction of the copy bandwidth, bf16 and
# fp8 caches side by side (target >= 0.85 each).
$PY - "$OUT/bench.json" <<'PYEOF' 2>&1 | tee "$OUT/decode_bandwidth.txt"
import json, sys
try:
    t = json.load(open(sys.argv[1]))["targets"]
except (OSError, KeyError, ValueError) as exc:
    sys.exit(f"no bench targets: {exc}")
for name, key in (("bf16 cache", "decode_bw_min_frac"), ("fp8 cache", "decode_fp8_bw_min_frac")):
    v = t.get(key)
    print(f"decode bandwidth, {name}: " + ("not measured" if v is None else
          f"{100 * v:.1f}% of copy bandwidth (target {100 * t['decode_bw_target']:.0f}%): "
          f"{'met' if v >= t['decode_bw_target'] else 'NOT met'}"))
if t.get("decode_fp8_min_speedup_vs_bf16") is not None:
    print(f"fp8 decode vs bf16 decode: >= {t['decode_fp8_min_speedup_vs_bf16']:.2f}x faster")
PYEOF

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

if [ -z "${ONLY_GRAPHS:-}" ]; then
# The host-memory KV tier (engine.kvOffload) on CUDA: pinned pool, copies on a side stream,
# greedy outputs with the tier equal to without it, and the evicted prefix restored.
echo "== host KV tier (CUDA) =="
timeout "${OFFLOAD_TEST_TIMEOUT:-120}" $PY -m pytest tests/runtime/test_kv_host_tier_model.py -m gpu -q \
  -p no:cacheprovider -o addopts="--import-mode=importlib" 2>&1 | tee "$OUT/pytest_kv_offload.txt" | tail -5
echo "pytest kv offload exit: ${PIPESTATUS[0]}"
# Multi-LoRA (kernels/lora.py): the segmented shrink/expand kernels against the reference on
# CUDA, then one timing at Llama-3-8B's q/k/v shapes (64 rows over 4 adapters of rank 16, bf16):
# the Triton kernels against the torch path (one matmul per segment).
echo "== LoRA kernels =="
TOKENLANE_TRITON_AUTOTUNE=0 timeout "${LORA_TEST_TIMEOUT:-120}" $PY -m pytest tests/kernels/test_lora_kernels.py -q \
  -p no:cacheprovider -o addopts="--import-mode=importlib" 2>&1 | tee "$OUT/pytest_lora.txt" | tail -5
echo "pytest lora exit: ${PIPESTATUS[0]}"
timeout 120 $PY - <<'PYEOF' 2>&1 | tee "$OUT/lora_bench.txt"
import torch
from tokenlane.kernels.lora import add_lora, lora_segments
dev, dt, S, R, T, K, widths = "cuda", torch.bfloat16, 8, 64, 64, 4096, (4096, 1024, 1024)
a = torch.randn(S, 3 * R, K, device=dev, dtype=dt) / 64
bs = [torch.randn(S, R, n, device=dev, dtype=dt) / 8 for n in widths]
scaling = torch.full((S, 3), 2.0, device=dev)
x = torch.randn(T, K, device=dev, dtype=dt)
y = torch.zeros(T, sum(widths), device=dev, dtype=dt)
segs = lora_segments([(i, 1, i % 4) for i in range(T)], T, [16] * S, dev)
for backend in ("triton", "torch"):
    outs = list(y.split(widths, dim=1))
    for _ in range(3):
        add_lora(outs, x, a, bs, scaling, segs, backend)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        add_lora(outs, x, a, bs, scaling, segs, backend)
    end.record(); torch.cuda.synchronize()
    print(f"LoRA qkv, 64 rows / 4 adapters r16, bf16, {backend}: {start.elapsed_time(end) / 50 * 1e3:.1f} us")
PYEOF
fi
