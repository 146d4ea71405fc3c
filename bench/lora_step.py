"""Multi-LoRA decode cost: a decode step of 64 running sequences spread over 4 adapters against
the same step with every sequence on the base model, on the CPU, through the real executor.

    python -m tokenlane.bench.lora_step [--models m19,m120] [--rank 16] [--steps 30] [--threads N] [--json out.json]

Both steps run on one ModelExecutor with the 4 adapters loaded (engine.maxLoras 4, all seven
target modules, rank --rank), over the same KV contents (each sequence's prompt prefilled
first): 64 one-token chunks at the last prompt position, repeated (the step writes the same KV
slot each time, so every repetition is the same work). The two kinds of step alternate and each
one's median is reported, with the ratio (target: at most 1.3x). Adapters are written in PEFT's
format (adapter_config.json + adapter_model.safetensors) with random weights.

Models (random Llama weights, generated once under the temp dir):
- m19: hidden 256, 4 layers, intermediate 688, vocab 32000 (bench/step_profile.py's 19M model);
- m120: hidden 1024, 8 layers, intermediate 2816, vocab 32000.

Prints a table and, with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

MODELS = {
    "m19": dict(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4),
    "m120": dict(hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=8),
}
NUM_SEQS, NUM_ADAPTERS, PROMPT_LEN, BLOCK = 64, 4, 128, 16
TARGET_RATIO = 1.3
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ensure_model(name: str) -> Path:
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    path = Path(tempfile.gettempdir()) / f"tokenlane-lora-bench-{name}"
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, initializer_range=0.02, vocab_size=32000, max_position_embeddings=4096,
                        **MODELS[name])
    return path


def write_adapter(folder: Path, args, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA folder with random A and B for every layer and target module."""
    import torch
    from safetensors.torch import save_file

    from tokenlane.runtime.executor.lora import module_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(args)
    tensors = {}
    for layer in range(args.num_layers):
        for module in TARGETS:
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            in_features, out_features = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
    return folder


def run_model(name: str, rank: int, steps: int, threads=None) -> dict:
    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig
    from tokenlane.runtime.core.request import Request, SamplingParams
    from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
    from tokenlane.runtime.executor.model_executor import ModelExecutor

    path = ensure_model(name)
    blocks_per_seq = -(-PROMPT_LEN // BLOCK)
    # Slots of the default maxLoraRank (64).
    engine = EngineConfig(block_size=BLOCK, kv_cache_blocks=NUM_SEQS * blocks_per_seq + 1, device="cpu",
                          cpu_threads=threads, max_loras=NUM_ADAPTERS)
    executor = ModelExecutor(RuntimeConfig(model=ModelConfig(path=str(path), dtype="float32"), engine=engine))
    names = [f"adapter-{i}" for i in range(NUM_ADAPTERS)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, adapter in enumerate(names):
            executor.add_adapter(adapter, str(write_adapter(Path(tmp) / adapter, executor.args, rank, seed=i)))
    rng = random.Random(0)
    requests = []
    for i in range(NUM_SEQS):
        prompt = [rng.randrange(5, executor.vocab_size) for _ in range(PROMPT_LEN)]
        request = Request(f"s{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        request.block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        requests.append(request)

    def set_adapters(with_lora: bool) -> None:
        for i, request in enumerate(requests):
            request.adapter = names[i % NUM_ADAPTERS] if with_lora else None

    set_adapters(True)
    for start in range(0, NUM_SEQS, 8):  # prefill the prompts (all but the last token)
        prefill = [ScheduledChunk(r, 0, PROMPT_LEN - 1, False) for r in requests[start:start + 8]]
        executor.execute(StepPlan(chunks=prefill))
    decode = StepPlan(chunks=[ScheduledChunk(r, PROMPT_LEN - 1, 1, True) for r in requests])
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(steps + 3):
        for with_lora in (False, True):
            set_adapters(with_lora)
            started = time.perf_counter()
            out = executor.execute(decode)
            elapsed = time.perf_counter() - started
            assert not out.errors, out.errors
            if step >= 3:  # warm-up: first-time paths, slot loads
                times[with_lora].append(elapsed)
    base, lora = statistics.median(times[False]), statistics.median(times[True])
    return {"model": name, **{k: MODELS[name][k] for k in ("hidden_size", "num_layers")}, "rank": rank,
            "sequences": NUM_SEQS, "adapters": NUM_ADAPTERS, "context": PROMPT_LEN, "steps": steps,
            "threads": executor.cpu_threads, "base_ms": 1e3 * base, "lora_ms": 1e3 * lora, "ratio": lora / base,
            "target_ratio": TARGET_RATIO, "met": lora / base <= TARGET_RATIO}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="m19,m120")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, help="engine.cpuThreads (default: torch's own count)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = [run_model(name, args.rank, args.steps, args.threads) for name in args.models.split(",")]
    print(f"{'model':6} {'hidden':>6} {'layers':>6} {'threads':>7} {'rank':>4} {'base ms':>8} "
          f"{'4 adapters ms':>13} {'ratio':>6}  target")
    for r in rows:
        print(f"{r['model']:6} {r['hidden_size']:>6} {r['num_layers']:>6} {r['threads']:>7} {r['rank']:>4} "
              f"{r['base_ms']:>8.2f} "
              f"{r['lora_ms']:>13.2f} {r['ratio']:>5.2f}x  <= {TARGET_RATIO}x {'met' if r['met'] else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
