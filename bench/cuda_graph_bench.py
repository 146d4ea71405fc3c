"""Decode steps/s with and without CUDA graphs (`engine.cudaGraphs`), and the fraction of HBM
bandwidth a step reaches.

    python -m tokenlane.bench.cuda_graph_bench --json out.json   # on a CUDA machine
    OUT=/tmp/out ONLY_GRAPHS=1 bash kernels/gpu_check.sh                 # the same, packaged
    python -m tokenlane.bench.cuda_graph_bench --dry-run         # CPU smoke test

The model is Llama-3-8B-shaped (hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV
heads, vocab 128256, bf16) with random weights made on the device: no checkpoint. Each batch
of B sequences starts at a context of `--context` tokens (random K/V in scattered 16-token
pages) and decodes `--steps` tokens greedily. A timed step is what the executor does for a
decode step: the batch metadata built on the host from Python lists, the forward pass (eager,
or the decode runner's replay), the argmax and its transfer to the host. Eager and graph runs
alternate (`--rounds` of each); the table gives medians.

HBM fraction = (weights read + K/V read per step) / step time / `--hbm-tbps` (4.8 TB/s: the
H200's peak). Weights read: every matrix once, plus B rows of the embedding table; K/V read:
every sequence's context, every layer, at the mean context of the timed steps.

Checks (exit code 1 when one fails): the replayed graphs give exactly the greedy tokens of the
same static-buffer forward pass run eagerly (`EagerDecodeRunner`: same shapes, same kernels).
Against the executor's plain eager path (real context length in the attention launch, hence
other KV splits and tiles) the table reports the share of equal tokens and the largest logit
difference of the first step; bf16 rounding can flip a near tie on a random model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from tokenlane.kernels.api import resolve_backend
from tokenlane.runtime.executor.cuda_graphs import CudaGraphDecodeRunner, DecodeRunner, EagerDecodeRunner
from tokenlane.runtime.executor.llama import AttentionMetadata, CausalLM, RotaryEmbedding, model_args_from_hf


@dataclass(frozen=True)
class Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int


LLAMA3_8B = Shape(128256, 4096, 14336, 32, 32, 8)
DRY_RUN = Shape(1024, 64, 128, 2, 4, 2)


def build_model(shape: Shape, dtype: torch.dtype, device: torch.device, max_len: int) -> CausalLM:
    """Random weights made on the device (Linear's default init keeps activations bounded)."""
    from transformers import LlamaConfig

    hf = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=max_len, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    args = model_args_from_hf(hf)
    default_dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)  # never materialize fp32 weights of an 8B model
        with torch.device(device):
            model = CausalLM(args)
    finally:
        torch.set_default_dtype(default_dtype)
    model.rotary = RotaryEmbedding(hf, args.head_dim, max_len, device)
    return model.eval()


class DecodeBatch:
    """B sequences at `context` tokens, each in its own scattered pages, decoding from there."""

    def __init__(self, batch: int, context: int, steps: int, block_size: int, num_blocks: int,
                 vocab_size: int, device: torch.device, seed: int):
        gen = torch.Generator().manual_seed(seed)
        per_seq = -(-(context + steps) // block_size)
        assert batch * per_seq <= num_blocks, "the KV pool is too small for this batch"
        blocks = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq)
        self.tables = blocks.tolist()
        self.batch, self.context, self.block_size, self.device = batch, context, block_size, device
        self.first_tokens = torch.randint(0, vocab_size, (batch,), generator=gen).tolist()

    def inputs(self, step: int, tokens: list[int], backend: str):
        """The executor's host-side preparation of a decode step (lists, then tensors)."""
        bs, pos = self.block_size, self.context + step
        positions = [pos] * self.batch
        slots = [row[pos // bs] * bs + pos % bs for row in self.tables]
        width = -(-(pos + 1) // bs)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([row[:width] for row in self.tables], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([pos + 1] * self.batch, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(self.batch + 1, dtype=torch.int32, device=dev),
            num_paged_tokens=self.batch,
            max_query_len=1,
            max_seq_len=pos + 1,
            fresh_query_lens=[],
            all_seq_lens=[pos + 1] * self.batch,
            all_query_lens=[1] * self.batch,
            backend=backend,
        )
        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        return ids, torch.tensor(positions, dtype=torch.int64, device=dev), meta


def decode(model, kv_caches, batch: DecodeBatch, steps: int, backend: str,
           runner: DecodeRunner | None, keep_logits: bool = False):
    """Greedy decode `steps` tokens from the batch's start; (tokens per step, first logits)."""
    tokens = list(batch.first_tokens)
    out, first = [], None
    rows = torch.arange(batch.batch, device=batch.device)
    for step in range(steps):
        ids, pos, meta = batch.inputs(step, tokens, backend)
        if runner is None:
            logits = model(ids, pos, kv_caches, meta, rows)
        else:
            logits = runner.run(ids, pos, meta, rows)
        if keep_logits and step == 0:
            first = logits.float().clone()
        tokens = logits.argmax(-1).tolist()  # the host waits for the step, as the sampler does
        out.append(tokens)
    return out, first


def bytes_per_step(model: CausalLM, batch: int, mean_context: float, kv_elem: int) -> float:
    a = model.args
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if not name.startswith("embed_tokens"))
    weights += batch * a.hidden_size * model.embed_tokens.weight.element_size()
    kv = batch * mean_context * a.num_layers * 2 * a.num_kv_heads * a.head_dim * kv_elem
    return float(weights + kv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--context", type=int, default=1024, help="context length at the first step")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    p.add_argument("--rounds", type=int, default=3, help="eager/graph pairs per batch size")
    p.add_argument("--check-steps", type=int, default=16, help="greedy steps compared")
    p.add_argument("--max-model-len", type=int, default=8192, help="the graphs' static context")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="peak HBM bandwidth (H200: 4.8)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny model, no recording (the static path runs eagerly): checks the script")
    args = p.parse_args(argv)

    if args.dry_run:
        device, dtype, shape = torch.device("cpu"), torch.float32, DRY_RUN
        args.context, args.steps, args.rounds = min(args.context, 24), min(args.steps, 3), 1
        args.check_steps, args.max_model_len = min(args.check_steps, 3), min(args.max_model_len, 128)
        args.block_size = min(args.block_size, 4)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
            return 2
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA3_8B
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.dry_run:
        batch_sizes = sorted({min(b, 4) for b in batch_sizes})
    if args.context + args.steps + args.check_steps > args.max_model_len:
        raise ValueError("--context + --steps + --check-steps must fit in --max-model-len")
    backend = resolve_backend("auto", device)

    t0 = time.perf_counter()
    model = build_model(shape, dtype, device, args.max_model_len)
    a = model.args
    per_seq = -(-(args.context + max(args.steps, args.check_steps)) // args.block_size)
    num_blocks = max(batch_sizes) * per_seq + 1
    kv_shape = (num_blocks, args.block_size, a.num_kv_heads, a.head_dim)
    kv_caches = [(torch.randn(kv_shape, dtype=dtype, device=device),
                  torch.randn(kv_shape, dtype=dtype, device=device)) for _ in range(a.num_layers)]
    build_s = time.perf_counter() - t0
    runner_args = dict(block_size=args.block_size, max_model_len=args.max_model_len,
                       max_batch=max(batch_sizes), backend=backend, device=device)
    static_eager = EagerDecodeRunner(model, kv_caches, **runner_args)
    t0 = time.perf_counter()
    graphs: DecodeRunner = (EagerDecodeRunner(model, kv_caches, **runner_args) if args.dry_run
                            else CudaGraphDecodeRunner(model, kv_caches, **runner_args))
    capture_s = time.perf_counter() - t0
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}, "
          f"model built in {build_s:.1f} s, {len(graphs.batch_sizes)} graphs {graphs.batch_sizes} "
          f"{'(dry run: not recorded)' if args.dry_run else 'recorded'} in {capture_s:.1f} s", flush=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    results = []
    failed = False
    for b in batch_sizes:
        batch = DecodeBatch(b, args.context, max(args.steps, args.check_steps), args.block_size,
                            num_blocks, a.vocab_size, device, seed=b)
        # Greedy tokens: replay vs the same static pass eagerly (exact), vs the plain eager path.
        eager_tokens, eager_logits = decode(model, kv_caches, batch, args.check_steps, backend, None, True)
        static_tokens, _ = decode(model, kv_caches, batch, args.check_steps, backend, static_eager)
        graph_tokens, graph_logits = decode(model, kv_caches, batch, args.check_steps, backend, graphs, True)
        replay_exact = graph_tokens == static_tokens
        failed |= not replay_exact
        flat_e = [t for step in eager_tokens for t in step]
        flat_g = [t for step in graph_tokens for t in step]
        agree = sum(x == y for x, y in zip(flat_e, flat_g)) / len(flat_e)
        logit_diff = float((eager_logits - graph_logits).abs().max())

        times = {"eager": [], "graph": []}
        for mode in ("eager", "graph"):  # warm-up (tune and compile outside the timing)
            decode(model, kv_caches, batch, 2, backend, None if mode == "eager" else graphs)
        for _ in range(args.rounds):
            for mode in ("eager", "graph"):
                sync()
                t = time.perf_counter()
                decode(model, kv_caches, batch, args.steps, backend, None if mode == "eager" else graphs)
                sync()
                times[mode].append((time.perf_counter() - t) / args.steps)
        eager_s, graph_s = statistics.median(times["eager"]), statistics.median(times["graph"])
        moved = bytes_per_step(model, b, args.context + args.steps / 2, kv_caches[0][0].element_size())
        peak = args.hbm_tbps * 1e12
        row = dict(batch=b, context=args.context, eager_ms=eager_s * 1e3, graph_ms=graph_s * 1e3,
                   eager_steps_per_s=1 / eager_s, graph_steps_per_s=1 / graph_s, speedup=eager_s / graph_s,
                   gb_per_step=moved / 1e9, eager_hbm_fraction=moved / eager_s / peak,
                   graph_hbm_fraction=moved / graph_s / peak, replay_tokens_exact=replay_exact,
                   eager_token_agreement=agree, first_step_max_logit_diff=logit_diff,
                   eager_runs_ms=[x * 1e3 for x in times["eager"]],
                   graph_runs_ms=[x * 1e3 for x in times["graph"]])
        results.append(row)
        print(f"batch {b:3d} @ {args.context}: eager {row['eager_ms']:7.2f} ms ({row['eager_steps_per_s']:6.1f} "
              f"steps/s, {row['eager_hbm_fraction']:5.1%} HBM) | graph {row['graph_ms']:7.2f} ms "
              f"({row['graph_steps_per_s']:6.1f} steps/s, {row['graph_hbm_fraction']:5.1%} HBM) | "
              f"x{row['speedup']:.2f} | {row['gb_per_step']:.2f} GB/step | replay tokens exact: "
              f"{replay_exact} | vs eager: {agree:.1%} tokens equal, first-step max |dlogit| "
              f"{logit_diff:.3g}", flush=True)

    report = dict(device=str(device), dtype=str(dtype), shape=asdict(shape), args=vars(args),
                  graph_batch_sizes=graphs.batch_sizes, capture_seconds=capture_s,
                  torch=torch.__version__, results=results, ok=not failed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if failed:
        print("FAIL: replayed graphs and the eager static pass gave different tokens", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
