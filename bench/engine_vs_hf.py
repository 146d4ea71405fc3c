"""Our engine against Hugging Face transformers on the CPU: same model, same workload, one run.

    python -m tokenlane.bench.engine_vs_hf --json out.json
    python -m tokenlane.bench.engine_vs_hf --systems tokenlane,hf-static-32 --rounds 3

Model: LlamaConfig(vocab 32000, hidden 512, intermediate 1376, 4 layers, 8 heads,
4 KV heads, untied embeddings), float32, random weights from torch.manual_seed(0).
Workload: 64 requests from random.Random(0): for each request, prompt length U[16, 512],
then max_new_tokens U[8, 128], then the prompt's token ids U[3, 32000); greedy; EOS
ignored; all submitted at t=0.

Systems, run one after the other with the same torch thread count (default 2); with
`--rounds N`, N times round-robin, each system's row then being its median run:
  tokenlane        LLMEngine + ModelExecutor (continuous batching, paged KV cache)
  tokenlane-kv-bf16  the same with `engine.kvCacheDtype: bfloat16` (not run by default: K/V
                   rounded to bf16, so its greedy tokens may differ)
  hf-continuous    transformers' ContinuousBatchingManager (behind `generate_batch`),
                   per-request max_new_tokens
  hf-static-8/32   `generate()` on left-padded batches of 8 / 32 requests in submission
                   order, each batch run to its longest max_new_tokens, then truncated

Reported per system: output tokens/s (sum of max_new_tokens over wall time from t=0 to the
last token), TTFT p50/p99 (from t=0), and whether its greedy tokens equal ours (float32
reductions in different orders can flip a near-tie; mismatches are counted, not hidden).
The matmul-bound limit is the FLOPs the workload needs (every linear layer for every
computed token, the LM head for every sampled token, causal attention scores) divided by
the machine's measured float32 GEMM rate at the same thread count. On a shared host, the
"GEMM GF/s" column (a 1024^3 GEMM probe right before each system) shows how much of the
machine each system had.

The matmul-bound limit leaves out what is bound by memory rather than FLOPs: each decode
reads its whole cached context (K and V, every layer), and these bytes are read again every
step. The "serial bound" adds the time to read them at the machine's measured single-process
read bandwidth (a large `sum`) to the matmul-bound time: an engine that does not overlap
attention with matmuls (ours does not on the CPU) cannot beat it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

MODEL_KW = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)


@dataclass
class SystemResult:
    name: str
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    tokens: list[list[int]]
    notes: str = ""
    mismatched_requests: int = 0
    first_mismatch: Optional[dict] = None
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def ttft_pct(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        if not xs:
            return float("nan")
        idx = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
        return xs[idx]


def make_workload(num_requests: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt_len = rng.randint(16, 512)
        max_new = rng.randint(8, 128)
        prompt = [rng.randrange(3, MODEL_KW["vocab_size"]) for _ in range(prompt_len)]
        work.append((prompt, max_new))
    return work


def build_model(out_dir: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL_KW)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS ignored everywhere
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(out_dir))
    return model


# --------------------------------------------------------------------------- systems


def run_tokenlane(model_dir: Path, work, *, max_batched_tokens: int, chunk: int, block_size: int,
                  kv_cache_dtype: str = "auto", name: str = "tokenlane") -> SystemResult:
    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
    from tokenlane.runtime.engine.llm_engine import LLMEngine
    from tokenlane.runtime.executor.model_executor import ModelExecutor
    from tokenlane.runtime.core.request import Request, SamplingParams

    config = RuntimeConfig(
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        engine=EngineConfig(block_size=block_size, device="cpu", kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(
            max_active_sequences=len(work),
            max_waiting_requests=max(512, len(work)),
            max_batched_tokens=max_batched_tokens,
            prefill_chunk_size=chunk,
            queue_timeout_ms=3_600_000,
        ),
    )
    engine = LLMEngine(config, ModelExecutor(config), tokenizer=None, clock=time.perf_counter)
    _warmup_engine(engine, work)
    requests = []
    t0 = time.perf_counter()
    for i, (prompt, max_new) in enumerate(work):
        params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        request = Request(f"r{i}", list(prompt), params, arrival_time=t0)
        engine.add_request(request)
        requests.append(request)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = max(r.finish_time for r in requests) - t0
    return SystemResult(
        name=name,
        wall_s=wall,
        output_tokens=sum(r.num_output_tokens for r in requests),
        ttft_s=[r.first_token_time - t0 for r in requests],
        tokens=[list(r.output_token_ids) for r in requests],
        notes=f"maxBatchedTokens={max_batched_tokens} prefillChunk={chunk} blockSize={block_size} "
              f"kvCacheDtype={kv_cache_dtype}",
        extra={"steps": steps, "preemptions": sum(r.num_preemptions for r in requests)},
    )


def _warmup_engine(engine, work) -> None:
    """One short request through the engine so first-call allocations are not timed."""
    from tokenlane.runtime.core.request import Request, SamplingParams

    engine.add_request(Request("warmup", list(work[0][0][:32]), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
    while engine.has_unfinished_requests():
        engine.step()


def run_hf_continuous(model, work) -> SystemResult:
    import torch
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(n for _, n in work),
        eos_token_id=None,
        pad_token_id=0,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p, _ in work),
        max_generated_length=max(n for _, n in work),
        num_requests=len(work),
    )
    results = {}
    with torch.inference_mode():
        with model.continuous_batching_context_manager(
            generation_config=gen_config, block=True, timeout=30, workload_hints=hints
        ) as manager:
            t0 = time.perf_counter()
            for i, (prompt, max_new) in enumerate(work):
                manager.add_request(
                    list(prompt), request_id=f"r{i}", max_new_tokens=max_new,
                    record_timestamps=True, eos_token_id=-1,
                )
            while len(results) < len(work):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = (result, time.perf_counter())
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread died")
    ordered = [results[f"r{i}"] for i in range(len(work))]
    errors = [r.error for r, _ in ordered if r.error]
    if errors:
        raise RuntimeError(f"transformers continuous batching failed: {errors[0]}")
    ttft = []
    for r, done in ordered:
        first = r.timestamps[0] if r.timestamps else (r.lifespan[0] if r.lifespan[0] > 0 else done)
        ttft.append(first - t0)
    wall = max(done for _, done in ordered) - t0
    return SystemResult(
        name="hf-continuous",
        wall_s=wall,
        output_tokens=sum(len(r.generated_tokens) for r, _ in ordered),
        ttft_s=ttft,
        tokens=[list(r.generated_tokens) for r, _ in ordered],
        notes="ContinuousBatchingManager, per-request max_new_tokens",
    )


class _FirstTokenTimer:
    """A generate() streamer that only records when the first new tokens come out."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_time: Optional[float] = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_time is None:  # call 1 is the prompt
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf_static(model, work, batch_size: int) -> SystemResult:
    import torch

    tokens: list[list[int]] = []
    ttft: list[float] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(work), batch_size):
            batch = work[start : start + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):  # left padding
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            timer = _FirstTokenTimer()
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max(n for _, n in batch),
                do_sample=False, eos_token_id=None, pad_token_id=0, streamer=timer,
            )
            for row, (_, max_new) in enumerate(batch):
                tokens.append(out[row, width : width + max_new].tolist())
                ttft.append(timer.first_token_time - t0)
    wall = time.perf_counter() - t0
    return SystemResult(
        name=f"hf-static-{batch_size}",
        wall_s=wall,
        output_tokens=sum(n for _, n in work),
        ttft_s=ttft,
        tokens=tokens,
        notes=f"generate() on left-padded batches of {batch_size}",
    )


# --------------------------------------------------------------------------- limits


def measure_matmul_flops(threads: int, seconds: float = 3.0, shapes=None) -> dict:
    """Best sustained float32 GEMM rate over shapes this model runs (tokens x hidden x out)."""
    import torch

    torch.set_num_threads(threads)
    shapes = shapes or [(2048, 512, 1376 * 2), (2048, 1376, 512), (64, 512, 32000), (1024, 1024, 1024)]
    best = {}
    per_shape = seconds / len(shapes)
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < per_shape:
            torch.mm(a, b)
            reps += 1
        rate = 2.0 * m * k * n * reps / (time.perf_counter() - t0)
        best[f"{m}x{k}x{n}"] = rate
    return best


def measure_read_bandwidth(threads: int, seconds: float = 1.0, mib: int = 512) -> float:
    """Bytes/s one process reads from memory (a `sum` over a buffer far larger than the caches)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best


def workload_kv_read_bytes(work, bytes_per_element: int = 4) -> float:
    """Bytes of cached K and V the decodes read: the decode that samples token j + 1 of a
    request (j >= 1 tokens already out) attends to prompt + j cached tokens in every layer."""
    layers, kv_heads = MODEL_KW["num_hidden_layers"], MODEL_KW["num_key_value_heads"]
    head_dim = MODEL_KW["hidden_size"] // MODEL_KW["num_attention_heads"]
    per_token = layers * 2 * kv_heads * head_dim * bytes_per_element
    return float(sum(per_token * (len(prompt) + j) for prompt, max_new in work for j in range(1, max_new)))


def workload_flops(work) -> dict:
    h, inter, layers = MODEL_KW["hidden_size"], MODEL_KW["intermediate_size"], MODEL_KW["num_hidden_layers"]
    heads, kv_heads = MODEL_KW["num_attention_heads"], MODEL_KW["num_key_value_heads"]
    head_dim = h // heads
    vocab = MODEL_KW["vocab_size"]
    per_token_linear = 2.0 * layers * (h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * inter)
    linear = head = attention = 0.0
    for prompt, max_new in work:
        computed = len(prompt) + max_new - 1  # the last sampled token is never fed back
        linear += computed * per_token_linear
        head += max_new * 2.0 * h * vocab  # one logits row per sampled token
        # Causal attention: the token at position p reads p + 1 keys (QK^T and PV).
        attention += layers * 4.0 * heads * head_dim * sum(p + 1 for p in range(computed))
    return {"linear": linear, "lm_head": head, "attention": attention, "total": linear + head + attention}


# --------------------------------------------------------------------------- main


def compare(reference: SystemResult, other: SystemResult) -> None:
    mismatched = 0
    for i, (a, b) in enumerate(zip(reference.tokens, other.tokens)):
        if a != b:
            mismatched += 1
            if other.first_mismatch is None:
                pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                other.first_mismatch = {"request": i, "position": pos, "of": len(a)}
    other.mismatched_requests = mismatched


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenlane.bench.engine_vs_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--systems", default="tokenlane,hf-continuous,hf-static-8,hf-static-32")
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--matmul-seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the systems this many times, round-robin; each system's row is its "
                             "median run, and each round's ratio to the best HF mode is printed (on a "
                             "shared host the machine's speed drifts between runs)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = make_workload(args.num_requests)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    known = {"tokenlane", "tokenlane-kv-bf16", "hf-continuous", "hf-static-8", "hf-static-32"}
    unknown = set(systems) - known
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; known: {sorted(known)}")

    runs: dict[str, list[SystemResult]] = {name: [] for name in systems}
    with tempfile.TemporaryDirectory(prefix="tokenlane-bench-") as tmp:
        model_dir = Path(tmp) / "llama-512"
        hf_model = build_model(model_dir)
        for round_no in range(args.rounds):
            for name in systems:
                # The host may be shared: a short GEMM probe before each system shows how much
                # of the machine it had (reported next to its numbers).
                probe = max(measure_matmul_flops(args.threads, 0.6, shapes=[(1024, 1024, 1024)]).values())
                label = f" (round {round_no + 1}/{args.rounds})" if args.rounds > 1 else ""
                print(f"running {name}{label} (GEMM probe {probe / 1e9:.0f} GFLOP/s) ...", file=sys.stderr, flush=True)
                if name.startswith("tokenlane"):
                    res = run_tokenlane(model_dir, work, max_batched_tokens=args.max_batched_tokens,
                                        chunk=args.prefill_chunk, block_size=args.block_size, name=name,
                                        kv_cache_dtype="bfloat16" if name.endswith("kv-bf16") else "auto")
                elif name == "hf-continuous":
                    res = run_hf_continuous(hf_model, work)
                else:
                    res = run_hf_static(hf_model, work, int(name.rsplit("-", 1)[1]))
                res.extra["gemm_probe_gflops"] = probe / 1e9
                runs[name].append(res)
                print(f"  {res.tokens_per_s:8.1f} tok/s  wall {res.wall_s:6.2f}s", file=sys.stderr, flush=True)

    # Each system's row: its median run (the lower one of an even count).
    results = [sorted(runs[name], key=lambda r: r.tokens_per_s)[(args.rounds - 1) // 2] for name in systems]
    reference = results[0]
    for name in systems[1:]:
        for res in runs[name]:
            compare(reference, res)
    hf_names = [name for name in systems if name.startswith("hf-")]
    per_round = [runs[reference.name][i].tokens_per_s / max(runs[name][i].tokens_per_s for name in hf_names)
                 for i in range(args.rounds)] if hf_names else []
    gemm = measure_matmul_flops(args.threads, args.matmul_seconds)
    peak = max(gemm.values())
    flops = workload_flops(work)
    total_out = sum(n for _, n in work)
    limit_s = flops["total"] / peak
    limit_tps = total_out / limit_s
    read_bw = measure_read_bandwidth(args.threads, min(1.0, args.matmul_seconds))
    kv_bytes = workload_kv_read_bytes(work)
    serial_s = limit_s + kv_bytes / read_bw
    serial_tps = total_out / serial_s
    best_hf = max((r for r in results if r.name.startswith("hf-")), key=lambda r: r.tokens_per_s, default=None)

    print()
    print(f"workload: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
          f"{total_out} output tokens; torch threads={args.threads}")
    print(f"{'system':<15} {'tok/s':>8} {'wall s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'vs best HF':>10} "
          f"{'of limit':>9} {'of serial':>9} {'GEMM GF/s':>9}  tokens vs {reference.name}")
    for r in results:
        ratio = r.tokens_per_s / best_hf.tokens_per_s if best_hf else float("nan")
        same = "reference" if r is reference else (
            "identical" if r.mismatched_requests == 0 else
            f"{r.mismatched_requests}/{len(work)} differ (first: req {r.first_mismatch['request']} "
            f"at token {r.first_mismatch['position']})")
        print(f"{r.name:<15} {r.tokens_per_s:8.1f} {r.wall_s:8.2f} {r.ttft_pct(50):9.2f} {r.ttft_pct(99):9.2f} "
              f"{ratio:9.2f}x {r.tokens_per_s / limit_tps:8.1%} {r.tokens_per_s / serial_tps:8.1%} "
              f"{r.extra['gemm_probe_gflops']:9.0f}  {same}")
    print(f"matmul-bound limit: {flops['total'] / 1e9:.0f} GFLOP needed "
          f"(linear {flops['linear'] / 1e9:.0f}, lm_head {flops['lm_head'] / 1e9:.0f}, "
          f"attention {flops['attention'] / 1e9:.0f}) / {peak / 1e9:.1f} GFLOP/s measured "
          f"= {limit_s:.2f} s -> {limit_tps:.0f} output tok/s")
    print(f"serial bound: + {kv_bytes / 1e9:.1f} GB of float32 K/V read by the decodes / "
          f"{read_bw / 1e9:.1f} GB/s measured = {serial_s:.2f} s -> {serial_tps:.0f} output tok/s")
    if args.rounds > 1:
        print(f"{args.rounds} rounds (rows: each system's median run); {reference.name} / the round's best HF "
              f"mode, per round: {', '.join(f'{x:.2f}x' for x in per_round) or 'no HF system run'}")

    if args.json:
        doc = {
            "model": MODEL_KW,
            "workload": {"num_requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
                         "output_tokens": total_out, "seed": 0},
            "threads": args.threads,
            "systems": [
                {
                    "name": r.name, "output_tokens_per_s": r.tokens_per_s, "wall_s": r.wall_s,
                    "output_tokens": r.output_tokens, "ttft_p50_s": r.ttft_pct(50), "ttft_p99_s": r.ttft_pct(99),
                    "speedup_vs_best_hf": (r.tokens_per_s / best_hf.tokens_per_s) if best_hf else None,
                    "fraction_of_matmul_limit": r.tokens_per_s / limit_tps,
                    "fraction_of_serial_bound": r.tokens_per_s / serial_tps,
                    "mismatched_requests_vs_reference": None if r is reference else r.mismatched_requests,
                    "first_mismatch": r.first_mismatch, "notes": r.notes, **r.extra,
                }
                for r in results
            ],
            "reference_system": reference.name,
            "rounds": [{name: runs[name][i].tokens_per_s for name in systems} for i in range(args.rounds)],
            "per_round_speedup_vs_best_hf": per_round,
            "matmul_gflops_measured": {k: v / 1e9 for k, v in gemm.items()},
            "workload_gflop": {k: v / 1e9 for k, v in flops.items()},
            "matmul_bound_seconds": limit_s,
            "matmul_bound_output_tokens_per_s": limit_tps,
            "decode_kv_read_gb": kv_bytes / 1e9,
            "read_bandwidth_gb_per_s": read_bw / 1e9,
            "serial_bound_seconds": serial_s,
            "serial_bound_output_tokens_per_s": serial_tps,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
