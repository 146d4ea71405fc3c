"""The host-memory KV tier (engine.kvOffload): TTFT of a repeated long prompt whose blocks the
device pool cannot keep, tier off vs on, with the real engine and a random-weight model on
the CPU.

    python -m tokenlane.bench.kv_offload [--prompt 1536] [--rounds 4] [--json out.json]

Each round sends the long prompt (a shared "system prompt" and a short question that changes
every round), then an unrelated prompt of the same length that takes the whole device pool,
evicting every block of the first. Without the tier the next round recomputes the whole
prompt; with it, the prefix comes back from host memory (kv_restores) and only the question is
computed. Round 1 is cold in both and left out of the TTFT figures. Greedy outputs are checked
to be identical between the two runs.

Prints a table and, with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

BLOCK = 16


def make_model(folder: Path, layers: int, hidden: int) -> Path:
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    return make_tiny_model(folder, hidden_size=hidden, intermediate_size=hidden * 3, num_layers=layers,
                           num_heads=hidden // 64, num_kv_heads=max(1, hidden // 128), vocab_size=4096,
                           max_position_embeddings=8192)


def run_config(model: Path, prompt_len: int, rounds: int, host_bytes: Optional[int]) -> dict:
    from tokenlane.runtime.config import EngineConfig, KVOffloadConfig, ModelConfig, RuntimeConfig, SchedulerConfig
    from tokenlane.runtime.core.request import Request, SamplingParams
    from tokenlane.runtime.engine.llm_engine import LLMEngine

    question_len, max_tokens = 16, 4
    # The pool holds one request (prompt + question + output), not two.
    pool_blocks = -(-(prompt_len + question_len + max_tokens) // BLOCK) + 1
    config = RuntimeConfig(
        model=ModelConfig(path=str(model), max_model_len=4 * prompt_len),
        engine=EngineConfig(block_size=BLOCK, kv_cache_blocks=pool_blocks, device="cpu",
                            kv_offload=KVOffloadConfig(host_bytes) if host_bytes else None),
        scheduler=SchedulerConfig(max_batched_tokens=prompt_len + question_len,
                                  prefill_chunk_size=prompt_len + question_len, max_active_sequences=4),
    )
    engine = LLMEngine.from_config(config)
    kv = engine.scheduler.kv
    system = [(31 * i + 7) % 4000 + 10 for i in range(prompt_len)]
    ttfts, restored, outputs = [], [], []

    def finish(request: Request) -> float:
        start = time.perf_counter()
        engine.add_request(request)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            if first is None and request.output_token_ids:
                first = time.perf_counter() - start
        return first

    for r in range(rounds):
        question = [(97 * r + 13 * i) % 4000 + 10 for i in range(question_len)]
        before = kv.host_prefix_hits
        ask = Request(f"ask{r}", system + question, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True))
        ttfts.append(finish(ask))
        restored.append((kv.host_prefix_hits - before) // BLOCK)
        outputs.append(list(ask.output_token_ids))
        flood = [(53 * i + 11 * r + 5) % 4000 + 10 for i in range(prompt_len + question_len)]
        finish(Request(f"flood{r}", flood, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    warm = ttfts[1:]
    return {
        "tier": "on" if host_bytes else "off",
        "host_bytes": host_bytes or 0,
        "device_blocks": pool_blocks,
        "prompt_blocks": (prompt_len + question_len - 1) // BLOCK,
        "ttft_s": ttfts,
        "warm_ttft_mean_s": statistics.mean(warm),
        "warm_ttft_median_s": statistics.median(warm),
        "restored_blocks": restored,
        "outputs": outputs,
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=1536, help="tokens of the shared prompt")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--host-bytes", type=int, default=256 << 20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (round 1 is cold)")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp), args.layers, args.hidden)
        off = run_config(model, args.prompt, args.rounds, None)
        on = run_config(model, args.prompt, args.rounds, args.host_bytes)
    if on["outputs"] != off["outputs"]:
        raise SystemExit("greedy outputs differ with the host tier: a bug")
    speedup = off["warm_ttft_mean_s"] / on["warm_ttft_mean_s"]
    print(f"prompt {args.prompt} tokens, {args.layers} layers x {args.hidden}, device pool "
          f"{off['device_blocks']} blocks of {BLOCK}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print(f"{'tier':<6}{'warm TTFT mean':>16}{'median':>10}{'restored blocks / prompt blocks':>34}")
    for row in (off, on):
        restored = f"{sum(row['restored_blocks'][1:])} / {row['prompt_blocks'] * (args.rounds - 1)}"
        print(f"{row['tier']:<6}{row['warm_ttft_mean_s'] * 1000:>14.1f}ms"
              f"{row['warm_ttft_median_s'] * 1000:>8.1f}ms{restored:>34}")
    print(f"TTFT off / on: {speedup:.2f}x; greedy outputs identical")
    if args.json:
        for row in (off, on):
            row.pop("outputs")
        args.json.write_text(json.dumps({"prompt_tokens": args.prompt, "layers": args.layers,
                                         "hidden": args.hidden, "threads": torch.get_num_threads(),
                                         "rounds": args.rounds, "off": off, "on": on,
                                         "ttft_ratio_off_over_on": speedup}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
