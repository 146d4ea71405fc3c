"""Multi-LoRA traffic for the simulator: adapters in the config, requests spread over them.

`tokenlane bench simulate --lora-adapters 4 [--lora-rank 16]` (any scenario or --config) and the
`lora` scenario use it. The simulated executor reads only an adapter's shape (rank and target
modules, from its PEFT `adapter_config.json`), so each adapter here is a real PEFT folder whose
`adapter_model.safetensors` holds no tensors: the cost model charges the LoRA products from the
shapes (runtime/executor/simulated.py, `lora_cost`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from tokenlane.bench.trace import Traffic
from tokenlane.runtime.config import LORA_TARGET_MODULES, RuntimeConfig

PEFT_MODULE_NAMES = {short: f"{short}_proj" for short in LORA_TARGET_MODULES}  # q -> q_proj, ...
DEFAULT_RANK = 16


def adapter_names(count: int) -> list[str]:
    return [f"lora-{i}" for i in range(count)]


def write_shape_only_adapter(folder: Path, rank: int, target_modules: Sequence[str] = LORA_TARGET_MODULES) -> Path:
    """A PEFT LoRA folder with the config of a rank-`rank` adapter over `target_modules` and an
    empty safetensors file (a header of no tensors): all the simulator reads."""
    unknown = [m for m in target_modules if m not in PEFT_MODULE_NAMES]
    if unknown:
        raise ValueError(f"target modules {unknown} are not among {list(PEFT_MODULE_NAMES)}")
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
              "target_modules": [PEFT_MODULE_NAMES[m] for m in target_modules], "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    header = b"{}"
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return folder


def with_adapters(config: RuntimeConfig, names: Sequence[str], rank: int, root: Optional[Path] = None) -> RuntimeConfig:
    """`config` serving `names` as rank-`rank` adapters over every target module (folders under
    `root`; default one folder per rank under the system temp dir, rewritten with the same
    content by every run), with `engine.maxLoraRank` raised to fit if needed."""
    root = Path(tempfile.gettempdir()) / "tokenlane-bench-lora" / f"r{rank}" if root is None else root
    data = config.to_dict()
    data["model"]["adapters"] = [
        {"name": name, "path": str(write_shape_only_adapter(root / name, rank))} for name in names]
    if rank > config.engine.lora_max_rank:
        data["engine"]["maxLoraRank"] = rank
    return RuntimeConfig.from_dict(data)


def spread_over_adapters(traffic: Traffic, names: Sequence[str], seed: int = 0,
                         base_share: float = 0.0) -> Traffic:
    """`traffic` with each request given one of `names` uniformly at random (a `base_share` of
    them stay on the base model), deterministically for `seed`."""
    if not names:
        return traffic
    if not 0.0 <= base_share < 1.0:
        raise ValueError(f"base_share must be in [0, 1), got {base_share}")
    rng = random.Random(seed)
    requests = []
    for planned in traffic.requests:
        adapter = None if rng.random() < base_share else rng.choice(list(names))
        requests.append(dataclasses.replace(planned, adapter=adapter))
    note = f"requests spread uniformly over {len(names)} LoRA adapters" + (
        f" ({base_share:.0%} on the base)" if base_share else "")
    return dataclasses.replace(traffic, requests=requests, description=f"{traffic.description}; {note}")


def step_table(profile_name: Optional[str] = None, batch: int = 64, context: int = 1000,
               adapter_counts: Sequence[int] = (1, 4, 8), ranks: Sequence[int] = (8, 16, 64)) -> list[dict]:
    """The cost model's decode step of `batch` sequences spread over N adapters of rank r (every
    target module), against the base-only step: one row per (N, r)."""
    from tokenlane.runtime.executor.simulated import ChunkShape, LoraShape, get_profile, step_cost

    profile = get_profile(profile_name)
    base = step_cost(profile, [ChunkShape(context, 1, True)] * batch)
    rows = []
    for rank in ranks:
        for count in adapter_counts:
            names = adapter_names(count)
            shapes = {n: LoraShape(rank, LORA_TARGET_MODULES) for n in names}
            chunks = [ChunkShape(context, 1, True, names[i % count]) for i in range(batch)]
            cost = step_cost(profile, chunks, shapes)
            rows.append({"profile": profile.name, "batch": batch, "context": context, "adapters": count,
                         "rank": rank, "base_ms": base.seconds * 1e3, "lora_ms": cost.seconds * 1e3,
                         "ratio": cost.seconds / base.seconds,
                         "extra_bytes_mb": (cost.bytes - base.bytes) / 1e6})
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tokenlane.bench.lora_cost",
                                     description="the simulator's LoRA cost of one decode step against the base")
    parser.add_argument("--profile", default=None, help="simulator profile (default h200-llama3-8b)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--out", default="out/bench/lora-step.json")
    args = parser.parse_args(argv)
    rows = step_table(args.profile, args.batch, args.context)
    print(f"{rows[0]['profile']}: decode step, {args.batch} sequences of {args.context} tokens")
    print(f"{'adapters':>8} {'rank':>5} {'base ms':>8} {'LoRA ms':>8} {'ratio':>6} {'extra MB':>9}")
    for r in rows:
        print(f"{r['adapters']:>8} {r['rank']:>5} {r['base_ms']:>8.3f} {r['lora_ms']:>8.3f} {r['ratio']:>6.3f} "
              f"{r['extra_bytes_mb']:>9.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python -m tokenlane.bench.lora_cost", "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
