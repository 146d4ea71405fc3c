"""GPU benchmark of the Triton paged attention: correctness at realistic sizes, then speed.

    python -m tokenlane.kernels.bench --json out.json [--quick]

On a CUDA device, with Llama-3-8B-like attention (32 query heads, 8 KV heads, head_dim 128,
bf16, 16-token pages scattered over the cache):

1. correctness: the kernel against the torch reference (on the smaller cases, the reference
   loops over sequences in Python) and against dense `scaled_dot_product_attention` (all cases);
2. the device's copy bandwidth, measured with a large device-to-device copy (read + write);
3. decode timings (`triton.testing.do_bench`, median): achieved KV-read bytes/s against that
   bandwidth, and dense SDPA on the same problem (contiguous K/V, no paging) for comparison;
4. prefill timings against dense causal SDPA;
5. mixed prefill + decode batches against the sum of their parts;
6. decode over fp8 caches (engine.kvCacheDtype fp8_e4m3 / fp8_e5m2; bf16 queries, per-layer
   scales): correctness against the torch reference, bandwidth over the bytes read, and the
   time against the same decode over the bf16 cache (half the bytes: up to 2x faster).

Targets: decode >= 85% of copy bandwidth at batch >= 32 and context >= 4k, faster
than dense SDPA, for the bf16 and the fp8 caches; mixed within 1.3x of its parts. Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import torch

from tokenlane.kernels.reference import paged_attention_ref

DECODE_CASES = [  # (batch, context)
    (1, 128), (1, 4096), (1, 32768), (8, 32768), (16, 8192), (32, 4096), (32, 16384),
    (64, 4096), (64, 32768), (128, 4096), (256, 1024), (256, 4096),
]
QUICK_DECODE_CASES = [(1, 4096), (1, 32768), (32, 4096), (64, 4096), (256, 1024)]
FP8_DECODE_CASES = [(1, 32768), (32, 4096), (32, 16384), (64, 4096), (128, 4096), (256, 4096)]
QUICK_FP8_DECODE_CASES = [(32, 4096), (64, 4096)]
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
PREFILL_CASES = [  # (batch, prompt length): fresh prompts, no cached context
    (1, 4096), (4, 2048), (1, 16384),
]
MIXED_CASES = [  # (prefill chunks, chunk length, chunk context, decodes, decode context)
    (2, 512, 2048, 64, 4096),
    (1, 2048, 2048, 128, 2048),
    (4, 256, 8192, 32, 8192),
]
SPLIT_SWEEP_CASES = [(8, 32768), (16, 8192), (32, 4096)]
SPLIT_SWEEP_VALUES = [1, 2, 4, 8, 16]
REFERENCE_MAX_SCORES = 2**28  # run the reference (fp32 scores per sequence) up to this size


def _paged_batch(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                 device, gen):
    """Random K/V for every sequence, scattered into shuffled pages of one cache."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device,
                            dtype=dtype, generator=gen)
    value_cache = torch.randn_like(key_cache)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    width = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    start = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[start : start + nb]
        start += nb
    query = torch.randn(sum(query_lens), num_heads, head_dim, device=device, dtype=dtype,
                        generator=gen)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()),
                       dtype=torch.int32, device=device)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache,
                block_tables=block_tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                query_start_loc=qsl, scale=head_dim**-0.5,
                max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def _dense_kv(batch, seq):
    """Gather each sequence's pages into dense [1, Hkv, L, D] K/V (for SDPA / checks)."""
    kc, vc, bt = batch["key_cache"], batch["value_cache"], batch["block_tables"]
    block_size = kc.shape[1]
    n = int(batch["seq_lens"][seq])
    blocks = bt[seq, : math.ceil(n / block_size)].long()
    k = kc[blocks].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
    v = vc[blocks].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
    return k, v


def _sdpa_reference(batch, seq_lens, query_lens):
    """Dense SDPA per sequence (causal relative to the context), for checking."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q_all = batch["query"]
    out = torch.empty_like(q_all)
    start = 0
    for s, (n, ql) in enumerate(zip(seq_lens, query_lens)):
        k, v = _dense_kv(batch, s)
        q = q_all[start : start + ql].transpose(0, 1).unsqueeze(0)
        if ql == n:  # a fresh prompt: plain causal (no materialized mask)
            o = sdpa(q, k, v, is_causal=ql > 1, scale=batch["scale"], enable_gqa=True)
        else:
            q_pos = torch.arange(n - ql, n, device=q.device)[:, None]
            mask = torch.arange(n, device=q.device)[None, :] <= q_pos
            o = sdpa(q, k, v, attn_mask=mask, scale=batch["scale"], enable_gqa=True)
        out[start : start + ql] = o[0].transpose(0, 1)
        start += ql
    return out


def _run_kernel(batch, out=None):
    from tokenlane.kernels.triton_kernels import paged_attention_triton

    return paged_attention_triton(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens"], batch["query_start_loc"], batch["scale"], out,
        max_query_len=batch["max_query_len"], max_seq_len=batch["max_seq_len"],
        k_scale=batch.get("k_scale", 1.0), v_scale=batch.get("v_scale", 1.0),
    )


def _quantized(batch, dtype):
    """The batch with its caches in an fp8 format (scales that map 4 sigma to the format's max)."""
    from tokenlane.kernels.reference import quantize_kv

    scale = 4.0 / torch.finfo(dtype).max
    return dict(batch, key_cache=quantize_kv(batch["key_cache"], dtype, scale),
                value_cache=quantize_kv(batch["value_cache"], dtype, scale), k_scale=scale, v_scale=scale)


def _sdpa_best(bench, q, k, v, **kw):
    """Fastest of torch's SDPA backends that accepts the problem: (ms, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    best = (float("inf"), None)
    names = ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]
    for name in names + ["MATH"]:
        backend = getattr(SDPBackend, name, None)
        if backend is None or (name == "MATH" and best[1] is not None):
            continue
        try:
            with sdpa_kernel([backend]):
                sdpa(q, k, v, enable_gqa=True, **kw)
                ms = bench(lambda: sdpa(q, k, v, enable_gqa=True, **kw))
        except RuntimeError:
            continue
        if ms < best[0]:
            best = (ms, name.lower())
    return best


def _plan(triton_kernels, batch, H, Hkv, device):
    return triton_kernels.plan_launch(
        batch["query"].shape[0], batch["seq_lens"].shape[0], H, Hkv, batch["max_query_len"],
        batch["max_seq_len"], device)


def _err(a, b):
    return float((a.float() - b.float()).abs().max())


def measure_copy_bandwidth(bench, device, gib=4.0):
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    _empty_cache(device)
    return 2 * n / (ms * 1e-3)  # bytes read + written per second


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def kv_bytes(seq_lens, num_kv_heads, head_dim, elem):
    return 2 * sum(seq_lens) * num_kv_heads * head_dim * elem


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenlane.kernels.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--profile-host", action="store_true",
                        help="cProfile the host side of a small launch")
    parser.add_argument("--no-sweep", action="store_true", help="skip the split-KV sweep")
    parser.add_argument("--no-fp8", action="store_true", help="skip the fp8-cache decodes")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU smoke test of this script under TRITON_INTERPRET=1 (tiny sizes, "
                        "meaningless timings)")
    args = parser.parse_args(argv)

    if args.dry_run:
        return _dry_run(args)
    if not torch.cuda.is_available():
        print("bench: no CUDA device; the kernels are tested on the CPU by "
              "`pytest tests/kernels` under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    return run_benchmarks(args, bench, torch.device("cuda"), triton.__version__)


def _dry_run(args) -> int:
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    def bench(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    global DECODE_CASES, QUICK_DECODE_CASES, PREFILL_CASES, MIXED_CASES, SPLIT_SWEEP_CASES
    global SPLIT_SWEEP_VALUES
    global FP8_DECODE_CASES, QUICK_FP8_DECODE_CASES
    DECODE_CASES = QUICK_DECODE_CASES = [(1, 40), (3, 70)]
    FP8_DECODE_CASES = QUICK_FP8_DECODE_CASES = [(3, 70)]
    SPLIT_SWEEP_CASES, SPLIT_SWEEP_VALUES = [(2, 300)], [1, 2]
    PREFILL_CASES = [(1, 33)]
    MIXED_CASES = [(2, 9, 30, 3, 50)]
    args.heads, args.kv_heads, args.head_dim = 4, 2, 64
    return run_benchmarks(args, bench, torch.device("cpu"), triton.__version__, copy_gib=0.01)


def run_benchmarks(args, bench, device, triton_version, copy_gib=4.0) -> int:
    from tokenlane.kernels import triton_kernels

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_name, num_sms = props.name, props.multi_processor_count
    else:
        device_name, num_sms = "cpu (interpreter dry run)", 1
    dtype = getattr(torch, args.dtype)
    elem = torch.finfo(dtype).bits // 8
    H, Hkv, D, BS = args.heads, args.kv_heads, args.head_dim, args.block_size
    gen = torch.Generator(device=device).manual_seed(0)
    results = dict(
        device=device_name, sms=num_sms, torch=torch.__version__, triton=triton_version, python=platform.python_version(),
        heads=H, kv_heads=Hkv, head_dim=D, block_size=BS, dtype=args.dtype,
        autotune=triton_kernels.AUTOTUNE, decode=[], decode_fp8=[], prefill=[], mixed=[], failures=[],
    )
    t0 = time.time()
    copy_bw = measure_copy_bandwidth(bench, device, copy_gib)
    results["copy_bandwidth_GBps"] = copy_bw / 1e9
    print(f"device {device_name} ({num_sms} SMs), torch {torch.__version__}, "
          f"triton {triton_version}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write)")
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3

    def check(name, batch, seq_lens, query_lens, out):
        row = {}
        dense = _sdpa_reference(batch, seq_lens, query_lens)
        row["max_err_vs_sdpa"] = _err(out, dense)
        if max(n * q for n, q in zip(seq_lens, query_lens)) * H <= REFERENCE_MAX_SCORES \
                and sum(seq_lens) <= 2**20:
            ref = paged_attention_ref(batch["query"], batch["key_cache"], batch["value_cache"],
                                      batch["block_tables"], batch["seq_lens"],
                                      batch["query_start_loc"], batch["scale"])
            row["max_err_vs_ref"] = _err(out, ref)
        ok = (not torch.isnan(out).any()) and all(
            v <= tol + 1e-2 * (k == "max_err_vs_sdpa") for k, v in row.items())
        row["correct"] = bool(ok)
        if not ok:
            results["failures"].append({"case": name, **row})
        return row

    # ---- decode ----
    print(f"\n{'decode':>8} {'batch':>5} {'ctx':>6} {'splits':>6} {'us':>9} {'GB/s':>7} "
          f"{'%copy':>6} {'sdpa us':>9} {'vs sdpa':>7} {'err':>8} {'ok':>3}")
    for batch_size, ctx in (QUICK_DECODE_CASES if args.quick else DECODE_CASES):
        seq_lens, query_lens = [ctx] * batch_size, [1] * batch_size
        batch = _paged_batch(seq_lens, query_lens, H, Hkv, D, BS, dtype, device, gen)
        out = torch.full_like(batch["query"], float("nan"))
        _run_kernel(batch, out)  # compiles / autotunes
        _sync(device)
        row = dict(batch=batch_size, context=ctx)
        row.update(check(f"decode b{batch_size} c{ctx}", batch, seq_lens, query_lens, out))
        ms = bench(lambda: _run_kernel(batch, out))
        nbytes = kv_bytes(seq_lens, Hkv, D, elem) + 2 * out.numel() * elem
        row["num_splits"] = _plan(triton_kernels, batch, H, Hkv, device)["num_splits"]
        row.update(us=ms * 1e3, GBps=nbytes / (ms * 1e-3) / 1e9,
                   frac_copy_bw=nbytes / (ms * 1e-3) / copy_bw)
        # Dense SDPA on the same work: contiguous [B, Hkv, L, D] K/V, one query per sequence.
        kd = torch.randn(batch_size, Hkv, ctx, D, device=device, dtype=dtype, generator=gen)
        vd = torch.randn_like(kd)
        qd = torch.randn(batch_size, H, 1, D, device=device, dtype=dtype, generator=gen)
        sdpa_ms, sdpa_backend = _sdpa_best(bench, qd, kd, vd)
        if sdpa_backend is not None:
            row.update(sdpa_us=sdpa_ms * 1e3, sdpa_backend=sdpa_backend,
                       speedup_vs_sdpa=sdpa_ms / ms)
        del kd, vd, batch
        _empty_cache(device)
        results["decode"].append(row)
        print(f"{'':>8} {batch_size:>5} {ctx:>6} {row['num_splits']:>6} {row['us']:>9.1f} "
              f"{row['GBps']:>7.0f} {100 * row['frac_copy_bw']:>5.1f}% "
              f"{row.get('sdpa_us', float('nan')):>9.1f} "
              f"{row.get('speedup_vs_sdpa', float('nan')):>6.2f}x {row.get('sdpa_backend')} "
              f"{row.get('max_err_vs_ref', row['max_err_vs_sdpa']):>8.1e} "
              f"{'y' if row['correct'] else 'N':>3}", flush=True)

    # ---- decode over fp8 caches ----
    if not args.no_fp8:
        print(f"\n{'fp8':>8} {'format':>8} {'batch':>5} {'ctx':>6} {'us':>9} {'GB/s':>7} {'%copy':>6} "
              f"{'bf16 us':>9} {'vs bf16':>7} {'err':>8} {'ok':>3}")
        bf16_us = {(r["batch"], r["context"]): r["us"] for r in results["decode"]}
        for fmt, fp8 in FP8_DTYPES.items():
            for batch_size, ctx in (QUICK_FP8_DECODE_CASES if args.quick else FP8_DECODE_CASES):
                seq_lens, query_lens = [ctx] * batch_size, [1] * batch_size
                batch = _quantized(_paged_batch(seq_lens, query_lens, H, Hkv, D, BS, dtype, device, gen), fp8)
                out = torch.full_like(batch["query"], float("nan"))
                _run_kernel(batch, out)
                _sync(device)
                row = dict(format=fmt, batch=batch_size, context=ctx)
                ref = paged_attention_ref(batch["query"], batch["key_cache"], batch["value_cache"],
                                          batch["block_tables"], batch["seq_lens"], batch["query_start_loc"],
                                          batch["scale"], k_scale=batch["k_scale"], v_scale=batch["v_scale"])
                row["max_err_vs_ref"] = _err(out, ref)
                row["correct"] = bool(not torch.isnan(out).any() and row["max_err_vs_ref"] <= tol)
                if not row["correct"]:
                    results["failures"].append({"case": f"decode {fmt} b{batch_size} c{ctx}", **row})
                ms = bench(lambda: _run_kernel(batch, out))
                nbytes = kv_bytes(seq_lens, Hkv, D, 1) + 2 * out.numel() * elem
                row.update(us=ms * 1e3, GBps=nbytes / (ms * 1e-3) / 1e9, frac_copy_bw=nbytes / (ms * 1e-3) / copy_bw)
                if (batch_size, ctx) not in bf16_us:  # the bf16 decode of this case, for the ratio
                    plain = _paged_batch(seq_lens, query_lens, H, Hkv, D, BS, dtype, device, gen)
                    _run_kernel(plain)
                    bf16_us[(batch_size, ctx)] = 1e3 * bench(lambda: _run_kernel(plain))
                    del plain
                row.update(bf16_us=bf16_us[(batch_size, ctx)], speedup_vs_bf16=bf16_us[(batch_size, ctx)] / row["us"])
                results["decode_fp8"].append(row)
                print(f"{'':>8} {fmt:>8} {batch_size:>5} {ctx:>6} {row['us']:>9.1f} {row['GBps']:>7.0f} "
                      f"{100 * row['frac_copy_bw']:>5.1f}% {row['bf16_us']:>9.1f} {row['speedup_vs_bf16']:>6.2f}x "
                      f"{row['max_err_vs_ref']:>8.1e} {'y' if row['correct'] else 'N':>3}", flush=True)
                del batch, ref
                _empty_cache(device)

    # ---- prefill ----
    print(f"\n{'prefill':>8} {'batch':>5} {'len':>6} {'us':>9} {'TFLOP/s':>8} {'sdpa us':>9} "
          f"{'vs sdpa':>7} {'ok':>3}")
    for batch_size, length in (PREFILL_CASES[:2] if args.quick else PREFILL_CASES):
        seq_lens = query_lens = [length] * batch_size
        batch = _paged_batch(seq_lens, query_lens, H, Hkv, D, BS, dtype, device, gen)
        out = torch.full_like(batch["query"], float("nan"))
        _run_kernel(batch, out)
        _sync(device)
        row = dict(batch=batch_size, length=length)
        row.update(check(f"prefill b{batch_size} l{length}", batch, seq_lens, query_lens, out))
        ms = bench(lambda: _run_kernel(batch, out))
        flops = 4 * batch_size * H * D * length * length / 2  # causal: half the square
        qd = batch["query"].view(batch_size, length, H, D).transpose(1, 2)
        kd = torch.randn(batch_size, Hkv, length, D, device=device, dtype=dtype, generator=gen)
        vd = torch.randn_like(kd)
        sdpa_ms, sdpa_backend = _sdpa_best(bench, qd, kd, vd, is_causal=True)
        row.update(us=ms * 1e3, TFLOPs=flops / (ms * 1e-3) / 1e12, sdpa_us=sdpa_ms * 1e3,
                   sdpa_backend=sdpa_backend, speedup_vs_sdpa=sdpa_ms / ms)
        results["prefill"].append(row)
        print(f"{'':>8} {batch_size:>5} {length:>6} {row['us']:>9.1f} {row['TFLOPs']:>8.1f} "
              f"{row['sdpa_us']:>9.1f} {row['speedup_vs_sdpa']:>6.2f}x {row['sdpa_backend']} "
              f"{'y' if row['correct'] else 'N':>3}", flush=True)
        del batch, kd, vd
        _empty_cache(device)

    # ---- mixed ----
    print(f"\n{'mixed':>8} {'chunks':>14} {'decodes':>12} {'mixed us':>9} {'parts us':>9} "
          f"{'ratio':>6} {'ok':>3}")
    for n_chunks, chunk, chunk_ctx, n_dec, dec_ctx in (
            MIXED_CASES[:1] if args.quick else MIXED_CASES):
        p_lens, p_q = [chunk_ctx] * n_chunks, [chunk] * n_chunks
        d_lens, d_q = [dec_ctx] * n_dec, [1] * n_dec
        mixed = _paged_batch(p_lens + d_lens, p_q + d_q, H, Hkv, D, BS, dtype, device, gen)
        prefill = _paged_batch(p_lens, p_q, H, Hkv, D, BS, dtype, device, gen)
        decode = _paged_batch(d_lens, d_q, H, Hkv, D, BS, dtype, device, gen)
        out = torch.full_like(mixed["query"], float("nan"))
        _run_kernel(mixed, out)
        _run_kernel(prefill)
        _run_kernel(decode)
        _sync(device)
        row = dict(chunks=n_chunks, chunk=chunk, chunk_context=chunk_ctx, decodes=n_dec,
                   decode_context=dec_ctx)
        row.update(check(f"mixed {n_chunks}x{chunk}+{n_dec}", mixed, p_lens + d_lens,
                         p_q + d_q, out))
        mixed_ms = bench(lambda: _run_kernel(mixed, out))
        parts_ms = bench(lambda: _run_kernel(prefill)) + bench(lambda: _run_kernel(decode))
        row.update(mixed_us=mixed_ms * 1e3, parts_us=parts_ms * 1e3, ratio=mixed_ms / parts_ms)
        results["mixed"].append(row)
        print(f"{'':>8} {f'{n_chunks}x{chunk}@{chunk_ctx}':>14} {f'{n_dec}@{dec_ctx}':>12} "
              f"{row['mixed_us']:>9.1f} {row['parts_us']:>9.1f} {row['ratio']:>5.2f}x "
              f"{'y' if row['correct'] else 'N':>3}", flush=True)
        del mixed, prefill, decode
        _empty_cache(device)

    # ---- split-KV sweep (sets the heuristic's constants) ----
    from tokenlane.kernels.triton_kernels import paged_attention_triton

    results["split_sweep"] = []
    if not args.no_sweep:
        print(f"\n{'splits':>8} {'batch':>5} {'ctx':>6}  us per num_splits (* = heuristic)")
        for batch_size, ctx in SPLIT_SWEEP_CASES:
            seq_lens, query_lens = [ctx] * batch_size, [1] * batch_size
            batch = _paged_batch(seq_lens, query_lens, H, Hkv, D, BS, dtype, device, gen)
            chosen = _plan(triton_kernels, batch, H, Hkv, device)["num_splits"]
            timings = {}
            for splits in SPLIT_SWEEP_VALUES:
                if splits > 1 and ctx // splits < 128:
                    continue
                timings[splits] = 1e3 * bench(lambda: paged_attention_triton(
                    batch["query"], batch["key_cache"], batch["value_cache"],
                    batch["block_tables"], batch["seq_lens"], batch["query_start_loc"],
                    batch["scale"], max_query_len=1, max_seq_len=ctx, num_splits=splits))
            best = min(timings, key=timings.get)
            results["split_sweep"].append(dict(batch=batch_size, context=ctx, chosen=chosen,
                                               best=best, us=timings))
            print(f"{'':>8} {batch_size:>5} {ctx:>6}  " + " ".join(
                f"{k}{'*' if k == chosen else ''}:{v:.0f}" for k, v in timings.items())
                + f"  best {best}", flush=True)
            del batch
            _empty_cache(device)

    # ---- launch overhead (host side: what CUDA graphs would remove) ----
    small = _paged_batch([128], [1], H, Hkv, D, BS, dtype, device, gen)
    _run_kernel(small)
    _sync(device)
    n_calls = 200 if device.type == "cuda" else 2
    start = time.perf_counter()
    for _ in range(n_calls):
        _run_kernel(small)
    host_us = (time.perf_counter() - start) / n_calls * 1e6
    _sync(device)
    results["launch_overhead_us"] = host_us
    print(f"\nhost time per paged_attention call (1 x 128 decode, no sync): {host_us:.1f} us")
    if args.profile_host:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n_calls):
            _run_kernel(small)
        prof.disable()
        _sync(device)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        results["host_profile"] = text.getvalue()
        print(text.getvalue())

    tuned = getattr(triton_kernels._paged_attention_kernel_tuned, "cache", {})
    results["autotuned_configs"] = {str(k): str(v) for k, v in tuned.items()}
    if tuned:
        print("\nautotuned (HEAD_DIM_P, BLOCK_M, BLOCK_SIZE, GROUP, NUM_SPLITS, bucket, dtypes):")
        for k, v in tuned.items():
            print(f"  {k[:6]} -> {v}")

    # ---- targets ----
    big = [r for r in results["decode"] if r["batch"] >= 32 and r["context"] >= 4096]
    big_fp8 = [r for r in results["decode_fp8"] if r["batch"] >= 32 and r["context"] >= 4096]
    targets = dict(
        decode_bw_min_frac=min((r["frac_copy_bw"] for r in big), default=None),
        decode_bw_target=0.85,
        decode_fp8_bw_min_frac=min((r["frac_copy_bw"] for r in big_fp8), default=None),
        decode_fp8_min_speedup_vs_bf16=min((r["speedup_vs_bf16"] for r in big_fp8), default=None),
        decode_faster_than_sdpa=(all(r.get("speedup_vs_sdpa", 0) > 1 for r in big)
                                 if big else None),
        mixed_ratio_max=max((r["ratio"] for r in results["mixed"]), default=None),
        mixed_ratio_target=1.3,
        all_correct=not results["failures"],
    )
    results["targets"] = targets
    results["wall_s"] = time.time() - t0
    print("\ntargets:", json.dumps(targets))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if not results["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
