"""CPU benchmark of `paged_attention_cpu`'s decode paths: one SDPA per sequence, decodes
grouped by length (SDPA per group), and the C kernel (`native`, kernels/csrc/attention_decode.c).

    python -m tokenlane.kernels.cpu_attention_bench [--json out.json] [--threads 1]
        [--cache-dtype bfloat16] [--rounds 5] [--steps 5] [--quick]

Decode batches shaped like the 19M reference model's layers (8 query heads, 4 KV heads,
head_dim 32, 16-token blocks scattered over a pool twice the size needed, fp32 queries):
S in {16, 64} sequences with contexts drawn from U[16, 640] and U[500, 900]. Each case is
first checked against `reference.paged_attention_ref`, then timed in alternating rounds
(per-sequence, grouped, native, per-sequence, ...) so all see the same machine load. A round
runs `--steps` steps of 4 layer calls each; every step brings new metadata tensors, so its
first layer builds the plan and the other three reuse it, as in the engine. Reports ms per
layer call (median over rounds) as wall time and as the process's CPU time (every thread's;
less sensitive to a shared, busy host), and the speed-ups. `native` is left out where no C
compiler is present.

    python -m tokenlane.kernels.cpu_attention_bench --fp8-vs-bf16 [--json out.json]

times each decode path (grouped SDPA, native) over the same batch stored in a bf16 cache and
in fp8 caches (e4m3, e5m2; per-layer scales, as engine.kvCacheDtype fp8_* stores them) in
alternating rounds, and prints the fp8 times with their ratio to bf16's.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

from tokenlane.kernels import cpu_native
from tokenlane.kernels.cpu_attention import paged_attention_cpu
from tokenlane.kernels.reference import is_fp8, paged_attention_ref, quantize_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 8, 4, 32, 16, 4
CASES = [(16, 16, 640), (64, 16, 640), (16, 500, 900), (64, 500, 900)]  # (S, min ctx, max ctx)
QUICK_CASES = [(4, 16, 64)]  # --quick: a smoke test of the script
FP8_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def decode_batch(num_seqs, lo, hi, cache_dtype, seed=0):
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(num_seqs)]
    needed = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = 2 * sum(needed)
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    # fp8: the scale maps 4 sigma to the format's largest value.
    kv_scale = 4.0 / torch.finfo(cache_dtype).max if is_fp8(cache_dtype) else 1.0
    key_cache = quantize_kv(torch.randn(shape, generator=gen), cache_dtype, kv_scale)
    value_cache = quantize_kv(torch.randn(shape, generator=gen), cache_dtype, kv_scale)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(num_seqs, max(needed), dtype=torch.int32)
    for s, n in enumerate(needed):
        tables[s, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=tables,
                seq_lens=torch.tensor(lens, dtype=torch.int32),
                query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
                scale=HEAD_DIM**-0.5, kv_scales=dict(k_scale=kv_scale, v_scale=kv_scale))


def paths() -> dict[str, dict]:
    """Name -> paged_attention_cpu keywords of each decode path measured here."""
    out = {"per_sequence": dict(batch_decodes=False), "grouped": dict(batch_decodes=True)}
    if cpu_native.available():
        out["native"] = dict(native=True)
    return out


def run_steps(batch, steps, path, out):
    """`steps` x LAYERS calls; new metadata tensors per step. Returns (wall s, CPU s)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        tables, lens = batch["block_tables"].clone(), batch["seq_lens"].clone()
        qsl = batch["query_start_loc"].clone()
        for _ in range(LAYERS):
            paged_attention_cpu(batch["query"], batch["key_cache"], batch["value_cache"], tables,
                                lens, qsl, batch["scale"], out, **path, **batch["kv_scales"])
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_case(num_seqs, lo, hi, cache_dtype, rounds, steps):
    batch = decode_batch(num_seqs, lo, hi, cache_dtype)
    args = [batch[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
                               "query_start_loc", "scale")]
    ref = paged_attention_ref(*args)
    out = torch.empty_like(batch["query"])
    errors = {}
    for name, path in paths().items():
        got = paged_attention_cpu(*args, torch.full_like(out, float("nan")), **path)
        errors[name] = float((got - ref).abs().max())
    times = {name: {"wall": [], "cpu": []} for name in paths()}
    calls = steps * LAYERS
    for _ in range(rounds):
        for name, path in paths().items():
            wall, cpu = run_steps(batch, steps, path, out)
            times[name]["wall"].append(wall / calls * 1e3)
            times[name]["cpu"].append(cpu / calls * 1e3)
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    result = {
        "seqs": num_seqs, "context": [lo, hi],
        "mean_context": statistics.mean(batch["seq_lens"].tolist()),
        "max_abs_error": errors,
        "ms_per_layer_median": med,
        # grouped over per-sequence; native over grouped
        "speedup_wall": med["per_sequence"]["wall"] / med["grouped"]["wall"],
        "speedup_cpu": med["per_sequence"]["cpu"] / med["grouped"]["cpu"],
        "rounds_ms_per_layer": times,
    }
    if "native" in med:
        result["native_speedup_wall"] = med["grouped"]["wall"] / med["native"]["wall"]
        result["native_speedup_cpu"] = med["grouped"]["cpu"] / med["native"]["cpu"]
    return result


def bench_fp8_case(num_seqs, lo, hi, rounds, steps):
    """The grouped and native decode paths over bf16 and fp8 caches of one batch."""
    dtypes = {"bfloat16": torch.bfloat16, **FP8_CACHE_DTYPES}
    batches = {name: decode_batch(num_seqs, lo, hi, dtype) for name, dtype in dtypes.items()}
    measured = {name: path for name, path in paths().items() if name != "per_sequence"}
    errors, times = {}, {}
    for cache, batch in batches.items():
        args = [batch[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
                                   "query_start_loc", "scale")]
        ref = paged_attention_ref(*args, **batch["kv_scales"])
        for name, path in measured.items():
            got = paged_attention_cpu(*args, torch.full_like(batch["query"], float("nan")), **path,
                                      **batch["kv_scales"])
            errors[f"{cache}/{name}"] = float((got - ref).abs().max())
            times[f"{cache}/{name}"] = []
    out = torch.empty_like(batches["bfloat16"]["query"])
    for _ in range(rounds):
        for cache, batch in batches.items():
            for name, path in measured.items():
                wall, _ = run_steps(batch, steps, path, out)
                times[f"{cache}/{name}"].append(wall / (steps * LAYERS) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {f"{cache}/{name}": med[f"bfloat16/{name}"] / med[f"{cache}/{name}"]
              for cache in FP8_CACHE_DTYPES for name in measured}
    return {"seqs": num_seqs, "context": [lo, hi], "ms_per_layer_median": med,
            "speedup_vs_bf16": ratios, "max_abs_error": errors, "rounds_ms_per_layer": times}


def main_fp8(args) -> int:
    results = []
    names = [n for n in paths() if n != "per_sequence"]
    print(f"torch {torch.__version__}, {args.threads} thread(s), fp32 queries; decode ms per layer "
          f"call (wall, median of {args.rounds} rounds); x = bf16 time / fp8 time")
    print("| S | context | path | bf16 | fp8_e4m3 | x | fp8_e5m2 | x | max err |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for num_seqs, lo, hi in QUICK_CASES if args.quick else CASES:
        r = bench_fp8_case(num_seqs, lo, hi, args.rounds, args.steps)
        m, x = r["ms_per_layer_median"], r["speedup_vs_bf16"]
        for name in names:
            print(f"| {num_seqs} | U[{lo}, {hi}] | {name} | {m[f'bfloat16/{name}']:.3f} | "
                  f"{m[f'fp8_e4m3/{name}']:.3f} | {x[f'fp8_e4m3/{name}']:.2f}x | "
                  f"{m[f'fp8_e5m2/{name}']:.3f} | {x[f'fp8_e5m2/{name}']:.2f}x | "
                  f"{max(v for k, v in r['max_abs_error'].items() if k.endswith(name)):.1e} |", flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                       "threads": args.threads, "mode": "fp8-vs-bf16", "cases": results}, f, indent=1)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--cache-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps (x4 layer calls) per round")
    parser.add_argument("--quick", action="store_true", help="one tiny case, to check the script")
    parser.add_argument("--fp8-vs-bf16", action="store_true",
                        help="the decode paths over bf16 and fp8 caches of the same batches")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.fp8_vs_bf16:
        return main_fp8(args)
    cache_dtype = getattr(torch, args.cache_dtype)
    results = []
    print(f"torch {torch.__version__}, {args.threads} thread(s), fp32 queries, "
          f"{args.cache_dtype} cache; ms per layer call, median of {args.rounds} rounds")
    native = "native" in paths()
    if not native:
        print(f"(native left out: {cpu_native.load_error()})")
    print("| S | context | per-seq wall | grouped wall | speed-up | per-seq CPU | grouped CPU "
          "| speed-up |" + (" native wall | vs grouped | native CPU | vs grouped |" if native else "")
          + " max err |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|" + ("---:|" * 4 if native else "") + "---:|")
    for num_seqs, lo, hi in QUICK_CASES if args.quick else CASES:
        r = bench_case(num_seqs, lo, hi, cache_dtype, args.rounds, args.steps)
        m = r["ms_per_layer_median"]
        row = (f"| {num_seqs} | U[{lo}, {hi}] | {m['per_sequence']['wall']:.2f} | "
               f"{m['grouped']['wall']:.2f} | {r['speedup_wall']:.2f}x | "
               f"{m['per_sequence']['cpu']:.2f} | {m['grouped']['cpu']:.2f} | "
               f"{r['speedup_cpu']:.2f}x |")
        if native:
            row += (f" {m['native']['wall']:.2f} | {r['native_speedup_wall']:.2f}x | "
                    f"{m['native']['cpu']:.2f} | {r['native_speedup_cpu']:.2f}x |")
        print(row + f" {max(r['max_abs_error'].values()):.1e} |", flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "machine": platform.processor() or
                       platform.machine(), "threads": args.threads,
                       "cache_dtype": args.cache_dtype, "cases": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
