"""Check the simulator's cost model against a real GPU: `python -m tokenlane.bench.calibrate`.

Runs a Llama-3-8B-shaped forward pass (random bf16 weights, 32 layers: fused QKV, GQA
attention through torch SDPA, output projection, SwiGLU MLP, LM head on sampled tokens) for
decode batches and prefill chunks, timed with CUDA events over CUDA-graph replays (as a
serving engine runs decode), and prints measured vs the cost model's estimate, plus the
achievable compute / bandwidth fractions and the per-step overhead that fit the measurement.
Writes JSON (--out). Needs torch with CUDA; `--small` runs a shrunken model on the CPU to
check the script itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tokenlane.runtime.executor.simulated import ChunkShape, get_profile, step_cost


def _build(torch, model, device, dtype, num_layers):
    h, q, kv, hd, inter = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim, None
    # Llama-3-8B MLP width; derived from the parameter count for other shapes.
    inter = 14336 if h == 4096 else 4 * h

    def w(*shape):
        return (torch.randn(*shape, device=device, dtype=dtype) * 0.02)

    layers = [
        dict(
            qkv=w((q + 2 * kv) * hd, h),
            o=w(h, q * hd),
            gate_up=w(2 * inter, h),
            down=w(h, inter),
        )
        for _ in range(num_layers)
    ]
    lm_head = w(model.vocab_size, h)
    return layers, lm_head, inter


def _forward(torch, F, model, layers, lm_head, x, kcache, vcache, batch, q_len, ctx, causal):
    q_heads, kv_heads, hd = model.num_heads, model.num_kv_heads, model.head_dim
    for li, layer in enumerate(layers):
        qkv = x @ layer["qkv"].t()
        q = qkv[:, : q_heads * hd].view(batch, q_len, q_heads, hd).transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            q, kcache[li][:, :, :ctx], vcache[li][:, :, :ctx], is_causal=causal, enable_gqa=True
        )
        x = x + attn.transpose(1, 2).reshape(batch * q_len, q_heads * hd) @ layer["o"].t()
        gu = x @ layer["gate_up"].t()
        g, u = gu.chunk(2, dim=-1)
        x = x + (F.silu(g) * u) @ layer["down"].t()
    # LM head on the last token of each sequence (the sampled ones).
    last = x.view(batch, q_len, -1)[:, -1]
    return last @ lm_head.t()


def measure(small: bool = False, iters: int = 10) -> dict:
    import torch
    import torch.nn.functional as F

    profile = get_profile("h200-llama3-8b")
    model = profile.model
    if small:
        from dataclasses import replace

        model = replace(model, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=1024)
        device, dtype = "cpu", torch.float32
        decode_cases = [(1, 128), (8, 128)]
        prefill_cases = [64, 128]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("calibrate: needs a CUDA device (use --small to check the script on a CPU)")
        device, dtype = "cuda", torch.bfloat16
        decode_cases = [(1, 1024), (16, 1024), (64, 1024), (128, 1024), (256, 1024), (64, 4096)]
        prefill_cases = [512, 2048, 8192]
    layers, lm_head, _ = _build(torch, model, device, dtype, model.num_layers)

    def timed(fn):
        if device == "cuda":
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000.0 / iters
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    rows = []
    with torch.inference_mode():
        for batch, ctx in decode_cases:
            kc = [torch.randn(batch, model.num_kv_heads, ctx, model.head_dim, device=device, dtype=dtype) for _ in layers]
            vc = [torch.randn_like(k) for k in kc]
            x = torch.randn(batch, model.hidden_size, device=device, dtype=dtype)
            secs = timed(lambda: _forward(torch, F, model, layers, lm_head, x, kc, vc, batch, 1, ctx, False))
            chunks = [ChunkShape(ctx - 1, 1, True)] * batch
            rows.append(dict(kind="decode", batch=batch, context=ctx, measured_s=secs, chunks=chunks))
            del kc, vc
        for n in prefill_cases:
            kc = [torch.randn(1, model.num_kv_heads, n, model.head_dim, device=device, dtype=dtype) for _ in layers]
            vc = [torch.randn_like(k) for k in kc]
            x = torch.randn(n, model.hidden_size, device=device, dtype=dtype)
            secs = timed(lambda: _forward(torch, F, model, layers, lm_head, x, kc, vc, 1, n, n, True))
            rows.append(dict(kind="prefill", batch=1, context=n, measured_s=secs, chunks=[ChunkShape(0, n, True)]))
            del kc, vc

    from tokenlane.runtime.executor.simulated import SimulatorProfile

    sim = SimulatorProfile(profile.gpu, model)
    g = sim.gpu
    out_rows = []
    for r in rows:
        cost = step_cost(sim, r.pop("chunks"))
        r.update(
            predicted_s=cost.seconds,
            flops=cost.flops,
            bytes=cost.bytes,
            achieved_tflops=cost.flops / r["measured_s"] / 1e12,
            achieved_tbps=cost.bytes / r["measured_s"] / 1e12,
            ratio_measured_over_predicted=r["measured_s"] / cost.seconds,
        )
        out_rows.append(r)
    # Fractions of the datasheet peaks the measurements reach (the best case of each kind).
    compute_frac = max(r["achieved_tflops"] * 1e12 for r in out_rows if r["kind"] == "prefill") / g.peak_bf16_flops
    memory_frac = max(r["achieved_tbps"] * 1e12 for r in out_rows if r["kind"] == "decode") / g.hbm_bytes_per_s
    result = dict(
        device=(torch.cuda.get_device_name() if device == "cuda" else "cpu"),
        torch=torch.__version__,
        model=model.name,
        assumed=dict(compute_efficiency=g.compute_efficiency, memory_efficiency=g.memory_efficiency,
                     step_overhead_s=g.step_overhead_s),
        fitted=dict(compute_efficiency=compute_frac, memory_efficiency=memory_frac),
        rows=out_rows,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenlane.bench.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU (checks the script)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    result = measure(small=args.small, iters=args.iters)
    print(f"device {result['device']}  torch {result['torch']}  model {result['model']}")
    print(f"{'kind':8} {'batch':>5} {'ctx':>6} {'measured ms':>12} {'model ms':>9} {'ratio':>6} {'TFLOP/s':>8} {'TB/s':>6}")
    for r in result["rows"]:
        print(
            f"{r['kind']:8} {r['batch']:>5} {r['context']:>6} {r['measured_s'] * 1e3:>12.2f} "
            f"{r['predicted_s'] * 1e3:>9.2f} {r['ratio_measured_over_predicted']:>6.2f} "
            f"{r['achieved_tflops']:>8.1f} {r['achieved_tbps']:>6.2f}"
        )
    print(f"assumed {result['assumed']}\nfitted  {result['fitted']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
