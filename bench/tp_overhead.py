"""Tensor-parallel step overhead on the CPU (gloo): TP=2 against TP=1 over the same cores.

    python -m tokenlane.bench.tp_overhead [--model m19] [--steps 20] [--json out.json]

One ModelExecutor (TP=1) and one DistributedExecutor (TP=2: this process is rank 0, rank 1 a
child process; each rank gets half the cores, as `tokenlane serve` gives them) run the same
hand-built plans over the same random Llama: decode steps of 1, 16 and 64 sequences (one-token
chunks at the last position of a 128-token prompt, prefilled first; each repetition rewrites the
same KV slot, so every repetition is the same work) and one 256-token prefill chunk. For each,
the median step time of both, their ratio, and at TP=2 the median time rank 0 spends
broadcasting the plan, the bytes of one plan message, and the time it spends in the model's
collectives (the row-parallel all-reduces and the vocab-parallel gathers, including waiting
for the other rank to get there).

On a host whose cores are fewer than what the ranks' threads want, TP=2 cannot be faster: the
table shows what the group costs on top of the same compute. The numbers are in
docs/benchmarks.md (Tensor and pipeline parallel overhead).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

MODELS = {
    "m19": dict(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4),
    "m120": dict(hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=8),
}
PROMPT, BLOCK, PREFILL = 128, 16, 256
BATCHES = (1, 16, 64)


def ensure_model(name: str) -> Path:
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    path = Path(tempfile.gettempdir()) / f"tokenlane-tp-bench-{name}"
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, initializer_range=0.02, vocab_size=32000, max_position_embeddings=4096, **MODELS[name])
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_plans(vocab: int):
    """(name, prefill plan, measured plan) per case; requests own disjoint blocks."""
    from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
    from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan

    per_seq = PROMPT // BLOCK
    cases = []
    next_block = 0
    for batch in BATCHES:
        requests = []
        for i in range(batch):
            r = Request(f"d{batch}-{i}", [(7 + 31 * i + 13 * j) % (vocab - 1) + 1 for j in range(PROMPT)],
                        SamplingParams(max_tokens=64, temperature=0), status=RequestStatus.RUNNING)
            r.block_ids = list(range(next_block, next_block + per_seq))
            next_block += per_seq
            requests.append(r)
        fill = StepPlan(chunks=[ScheduledChunk(r, 0, PROMPT - 1, False) for r in requests],
                        num_batched_tokens=batch * (PROMPT - 1))
        step = StepPlan(chunks=[ScheduledChunk(r, PROMPT - 1, 1, True) for r in requests], num_batched_tokens=batch)
        cases.append((f"decode x{batch}", fill, step, requests))
    r = Request("prefill", [(5 + 17 * j) % (vocab - 1) + 1 for j in range(PREFILL)],
                SamplingParams(max_tokens=1, temperature=0), status=RequestStatus.RUNNING)
    r.block_ids = list(range(next_block, next_block + PREFILL // BLOCK))
    next_block += PREFILL // BLOCK
    cases.append((f"prefill {PREFILL}", None, StepPlan(chunks=[ScheduledChunk(r, 0, PREFILL, True)],
                                                         num_batched_tokens=PREFILL), [r]))
    return cases, next_block


def timed_collectives(state) -> dict:
    """Wrap rank 0's ParallelState collectives with a clock (the model calls them per layer)."""
    spent = {"seconds": 0.0}
    for name in ("all_reduce", "all_gather_last_dim"):
        inner = getattr(state, name)

        def wrapped(tensor, _inner=inner):
            t0 = time.perf_counter()
            try:
                return _inner(tensor)
            finally:
                spent["seconds"] += time.perf_counter() - t0

        setattr(state, name, wrapped)
    return spent


def run_case(executor, fill, step, requests, steps: int, spent: Optional[dict]) -> dict:
    if fill is not None:
        executor.execute(fill)
        for r in requests:
            r.num_computed_tokens = PROMPT - 1
    executor.execute(step)  # warm
    times, broadcasts, collectives = [], [], []
    for _ in range(steps):
        before = spent["seconds"] if spent is not None else 0.0
        t0 = time.perf_counter()
        executor.execute(step)
        times.append(time.perf_counter() - t0)
        broadcasts.append(getattr(executor, "last_broadcast_seconds", 0.0))
        if spent is not None:
            collectives.append(spent["seconds"] - before)
    return {"step_ms": statistics.median(times) * 1e3,
            "broadcast_ms": statistics.median(broadcasts) * 1e3,
            "collectives_ms": statistics.median(collectives) * 1e3 if collectives else 0.0}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="m19")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
    from tokenlane.runtime.distributed.channel import dumps
    from tokenlane.runtime.distributed.executor import DistributedExecutor
    from tokenlane.runtime.distributed.launch import Rendezvous
    from tokenlane.runtime.executor.model_executor import ModelExecutor

    path = ensure_model(args.model)
    cases, blocks = make_plans(32000)
    config = RuntimeConfig(
        model=ModelConfig(path=str(path), max_model_len=1024, dtype="float32"),
        engine=EngineConfig(device="cpu", block_size=BLOCK, kv_cache_blocks=blocks),
        scheduler=SchedulerConfig(max_batched_tokens=8192),
    )
    cpus = len(os.sched_getaffinity(0))
    results: dict[str, dict] = {}
    single = ModelExecutor(config)
    for name, fill, step, requests in cases:
        results.setdefault(name, {})["tp1"] = run_case(single, fill, step, requests, args.steps, None)
        for r in requests:
            r.num_computed_tokens = 0
    del single
    parallel_config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, tensor_parallel_size=2))
    group = DistributedExecutor.launch(parallel_config, Rendezvous(master_port=free_port(), timeout_s=120),
                                       exit_on_failure=False)
    try:
        spent = timed_collectives(group.member.state)
        for name, fill, step, requests in cases:
            results[name]["tp2"] = run_case(group, fill, step, requests, args.steps, spent)
            results[name]["plan_bytes"] = len(dumps(group.encoder.encode(step)))
    finally:
        group.shutdown()

    print(f"model {args.model}, {cpus} CPUs (TP=1: {cpus} threads; TP=2: {max(1, cpus // 2)} per rank), "
          f"median of {args.steps} steps")
    print(f"{'step':<14}{'TP=1 ms':>10}{'TP=2 ms':>10}{'ratio':>8}{'plan bcast ms':>15}{'plan bytes':>12}"
          f"{'collectives ms':>16}{'bcast share':>13}{'coll. share':>13}")
    for name, row in results.items():
        one, two = row["tp1"], row["tp2"]
        row["ratio"] = two["step_ms"] / one["step_ms"]
        row["broadcast_share"] = two["broadcast_ms"] / two["step_ms"]
        row["collectives_share"] = two["collectives_ms"] / two["step_ms"]
        print(f"{name:<14}{one['step_ms']:>10.2f}{two['step_ms']:>10.2f}{row['ratio']:>7.2f}x"
              f"{two['broadcast_ms']:>15.3f}{row['plan_bytes']:>12}{two['collectives_ms']:>16.2f}"
              f"{row['broadcast_share']:>12.1%}{row['collectives_share']:>13.1%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "cpus": cpus, "steps": args.steps,
                                         "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
