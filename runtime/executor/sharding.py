"""How one rank's share of a Llama-family model is cut (tensor and pipeline parallel).

Megatron-style tensor parallelism over the `tp` ranks of a stage:
- qkv_proj and gate_up_proj are column-parallel: tensor rank t holds query heads
  [t * H / tp, (t + 1) * H / tp), its key/value heads, and intermediate columns
  [t * I / tp, (t + 1) * I / tp). Where tp exceeds the key/value heads (MQA, narrow GQA) each
  KV head is replicated: rank t holds KV head t * Hkv // tp, the one its query heads read.
- o_proj and down_proj are row-parallel: each rank multiplies its own input columns and one
  all-reduce sums the partial products (a bias is held by tensor rank 0 only, so it is added
  once).
- The embedding and the LM head are vocab-parallel over the vocabulary padded up to a
  multiple of tp: rank t holds rows [t * Vp / tp, (t + 1) * Vp / tp), padding rows zero.

Pipeline parallelism gives each stage the contiguous layers of `ParallelLayout.layer_range`;
the first stage holds the embedding, the last the final norm and LM head.

`check_parallel_fits` is the start-up check of a layout against a model's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from tokenlane.runtime.executor.parallel_state import ParallelLayout


def check_parallel_fits(args, tp: int, pp: int) -> None:
    """ValueError naming the config key when `tp` x `pp` ranks cannot split the model `args`
    (a ModelArgs): tp must divide the attention heads and the MLP width, and divide the
    key/value heads or be a multiple of them; pp must not exceed the layers."""
    if tp < 1:
        raise ValueError(f"engine.tensorParallelSize must be >= 1, got {tp}")
    if pp < 1:
        raise ValueError(f"engine.pipelineParallelSize must be >= 1, got {pp}")
    if args.num_heads % tp:
        raise ValueError(f"engine.tensorParallelSize {tp} must divide the model's {args.num_heads} attention heads")
    if args.num_kv_heads % tp and tp % args.num_kv_heads:
        raise ValueError(f"engine.tensorParallelSize {tp} must divide the model's {args.num_kv_heads} key/value "
                         f"heads or be a multiple of them")
    if args.intermediate_size % tp:
        raise ValueError(f"engine.tensorParallelSize {tp} must divide the model's intermediate_size "
                         f"{args.intermediate_size}")
    if pp > args.num_layers:
        raise ValueError(f"engine.pipelineParallelSize {pp} exceeds the model's {args.num_layers} layers")


@dataclass(frozen=True)
class ShardPlan:
    """One rank's slice of the model, in heads, columns, vocabulary rows and layers."""

    tp: int
    tp_rank: int
    num_heads: int  # this rank's query heads
    head_start: int  # its first query head
    num_kv_heads: int  # this rank's key/value heads (1 when replicated)
    kv_head_start: int
    intermediate_size: int  # this rank's MLP columns
    intermediate_start: int
    vocab_size: int  # the model's real vocabulary
    vocab_per_rank: int  # rows of this rank's embedding / LM head (padded vocabulary / tp)
    vocab_start: int  # first vocabulary id of this rank's rows
    layer_start: int  # this stage's decoder layers [layer_start, layer_end)
    layer_end: int
    first_stage: bool
    last_stage: bool

    @property
    def sharded(self) -> bool:
        return self.tp > 1

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def vocab_rows(self) -> int:
        """Real (not padding) vocabulary rows of this rank."""
        return max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))

    def local_layer(self, layer: int) -> Optional[int]:
        """This stage's index of global decoder layer `layer`, or None where another stage has it."""
        return layer - self.layer_start if self.layer_start <= layer < self.layer_end else None


def shard_plan(args, layout: Optional[ParallelLayout] = None) -> ShardPlan:
    layout = layout or ParallelLayout()
    tp, t = layout.tp, layout.tp_rank
    check_parallel_fits(args, tp, layout.pp)
    heads = args.num_heads // tp
    if args.num_kv_heads >= tp:
        kv_heads, kv_start = args.num_kv_heads // tp, t * (args.num_kv_heads // tp)
    else:  # replicated: the one KV head this rank's query heads belong to
        kv_heads, kv_start = 1, t * args.num_kv_heads // tp
    inter = args.intermediate_size // tp
    per_rank = -(-args.vocab_size // tp)
    start, end = layout.layer_range(args.num_layers)
    return ShardPlan(
        tp=tp, tp_rank=t, num_heads=heads, head_start=t * heads, num_kv_heads=kv_heads, kv_head_start=kv_start,
        intermediate_size=inter, intermediate_start=t * inter, vocab_size=args.vocab_size,
        vocab_per_rank=per_rank, vocab_start=t * per_rank, layer_start=start, layer_end=end,
        first_stage=layout.is_first_stage, last_stage=layout.is_last_stage,
    )


def local_args(args, plan: ShardPlan):
    """`args` as this rank's modules see them: its heads, MLP columns and layers (the
    vocabulary stays the model's: logits are gathered to full width)."""
    return replace(args, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
                   intermediate_size=plan.intermediate_size, num_layers=plan.num_layers)


def lora_shard(module: str, a, b, plan: ShardPlan, head_dim: int):
    """This rank's share of a LoRA module's A [r, in] and B [out, r] (PEFT's layout), cut like
    the base projection: a column-parallel one (q, k, v, gate, up) keeps its output rows of B,
    a row-parallel one (o, down) its input columns of A; the all-reduce after o_proj and
    down_proj then sums the adapter's partial deltas with the base's."""
    if not plan.sharded:
        return a, b
    q = slice(plan.head_start * head_dim, (plan.head_start + plan.num_heads) * head_dim)
    kv = slice(plan.kv_head_start * head_dim, (plan.kv_head_start + plan.num_kv_heads) * head_dim)
    mlp = slice(plan.intermediate_start, plan.intermediate_start + plan.intermediate_size)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    if module in rows:
        return a, b[rows[module]]
    return a[:, {"o_proj": q, "down_proj": mlp}[module]], b


__all__ = ["ShardPlan", "check_parallel_fits", "local_args", "lora_shard", "shard_plan"]
