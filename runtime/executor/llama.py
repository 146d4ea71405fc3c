"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Reads a local Hugging Face checkpoint: config.json through transformers' `AutoConfig`
(so old `rope_scaling` and new `rope_parameters` formats both work) and the weights with
the `safetensors` library. The math mirrors transformers' modeling code operation by
operation (RMSNorm in float32, rotate-half RoPE, SwiGLU, residual adds in the model dtype),
which is what lets the tests require token-for-token equality with `generate()`. On the
CPU, `runtime/executor/cpu_dense.py` picks the compute dtype (float32 for a bf16/fp16 model where the
CPU has no native low-precision matmul) and runs the large linears through oneDNN on
prepacked weights; with the native backend the RMSNorms are one C call each
(`kernels.api.rms_norm`).

Attention reads and writes the paged cache only through `tokenlane.kernels`
(`write_kv_cache`, `paged_attention`) on a flat batch: all sequences' tokens of a step in
one [T, ...] tensor. One CPU-side shortcut keeps exact semantics: a prefill chunk with no
cached context (context length == query length) attends only to its own fresh keys, so with
the torch backend it goes straight to `scaled_dot_product_attention` instead of gathering
the same keys back out of the cache.

Tensor and pipeline parallel (runtime/executor/sharding.py says how the model is cut): built
with a `ParallelState`, the model holds only this rank's heads, MLP columns, vocabulary rows
and stage layers, reads only those slices from the safetensors files, and does one all-reduce
after each row-parallel projection (o_proj, down_proj) and after the vocab-parallel embedding;
the LM head's logits are gathered over the tensor ranks. A stage after the first receives its
hidden states from the previous stage, a stage before the last sends them on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenlane.kernels import api as kernels
from tokenlane.kernels.lora import LoraSegments
from tokenlane.runtime.executor.cpu_dense import PrepackedLinear, detect_cpu_matmul_support, prepack_linear
from tokenlane.runtime.executor.parallel_state import ParallelState, single_process
from tokenlane.runtime.executor.sharding import ShardPlan, local_args, shard_plan

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 (and llama with attention_bias=True)
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    sliding_window: Optional[int]  # None = full attention everywhere
    bos_token_id: Optional[int]
    eos_token_id: Optional[int]


def load_hf_config(path: str | Path):
    """transformers' own parse of config.json (standardized rope parameters)."""
    from transformers import AutoConfig

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"no config.json in model folder {str(folder)!r}")
    raw = json.loads((folder / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {folder}/config.json; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def _first_id(value) -> Optional[int]:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def model_args_from_hf(hf_config) -> ModelArgs:
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    num_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    if c.num_attention_heads % num_kv_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {c.hidden_act!r} (only silu)")
    sliding_window = getattr(c, "sliding_window", None)
    if c.model_type == "qwen2" and not getattr(c, "use_sliding_window", False):
        sliding_window = None
    qkv_bias = c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False))
    return ModelArgs(
        model_type=c.model_type,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=c.model_type != "qwen2" and bool(getattr(c, "attention_bias", False)),
        mlp_bias=bool(getattr(c, "mlp_bias", False)),
        max_position_embeddings=c.max_position_embeddings,
        sliding_window=sliding_window,
        bos_token_id=_first_id(getattr(c, "bos_token_id", None)),
        eos_token_id=_first_id(getattr(c, "eos_token_id", None)),
    )


# --------------------------------------------------------------------------- RoPE


class RotaryEmbedding:
    """cos/sin per token position, as transformers computes them.

    default, linear, llama3 and yarn have position-independent frequencies (precomputed
    table). dynamic NTK rescales the base once a sequence grows past
    max_position_embeddings; transformers recomputes it from the longest sequence in the
    forward call, we do it per sequence from its context length this step (identical for
    one sequence; within the original length it is the default RoPE).
    """

    def __init__(self, hf_config, head_dim: int, max_positions: int, device: torch.device):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        if not params:  # transformers 4.x style config object
            params = dict(getattr(hf_config, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        self.rope_type = rope_type
        self.hf_config = hf_config
        self.head_dim = head_dim
        self.device = device
        self.original_max = hf_config.max_position_embeddings
        if rope_type == "default":
            base = params.get("rope_theta", 10000.0)
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        self.inv_freq = inv_freq.to(device)
        self._dynamic_cache: dict[int, torch.Tensor] = {}
        # Table for positions-only types (and dynamic within the original length).
        self._table_len = 0
        self._cos = self._sin = None
        self._grow_table(min(max_positions, 1 << 16))

    def _grow_table(self, length: int) -> None:
        if length <= self._table_len:
            return
        cos, sin = self._cos_sin(torch.arange(length, device=self.device), self.inv_freq)
        self._cos, self._sin, self._table_len = cos, sin, length

    def _cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor):
        freqs = positions[:, None].float() * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if seq_len not in self._dynamic_cache:
            inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](self.hf_config, torch.device("cpu"), seq_len=seq_len)
            self._dynamic_cache[seq_len] = inv_freq.to(self.device)
        return self._dynamic_cache[seq_len]

    def cos_sin(
        self, positions: torch.Tensor, seq_lens: list[int], query_lens: list[int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_dim] cos and sin in `dtype` for the flat batch's positions."""
        if self.rope_type == "dynamic" and max(seq_lens, default=0) > self.original_max:
            cos_parts, sin_parts, start = [], [], 0
            for ctx, q in zip(seq_lens, query_lens):
                pos = positions[start : start + q]
                inv = self.inv_freq if ctx <= self.original_max else self._dynamic_inv_freq(ctx)
                c, s = self._cos_sin(pos, inv)
                cos_parts.append(c)
                sin_parts.append(s)
                start += q
            return torch.cat(cos_parts).to(dtype), torch.cat(sin_parts).to(dtype)
        needed = max(seq_lens, default=0)  # host-side: no device sync for the max position
        if needed > self._table_len:
            self._grow_table(max(needed, 2 * self._table_len))
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (_rotate_half(x) * sin)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [T, D] with the first half negated: rotate_half's sign folded into the table."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """`apply_rope` in place, with `sin_signed = signed_sin(sin)`: the same products and
    sums (negating a factor is exact), two temporaries fewer."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    rotated.mul_(sin_signed[:, None, :])
    x.mul_(cos[:, None, :]).add_(rotated)


# --------------------------------------------------------------------------- batch metadata


@dataclass
class AttentionMetadata:
    """The flat batch's layout, shared by every layer of one forward pass.

    Sequences are ordered so that those whose attention needs the paged cache (decodes and
    prefill chunks with cached context) come first, covering tokens [0, num_paged_tokens);
    the remaining ones are fresh prefills (no cached context).
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each token (block * bs + offset)
    block_tables: torch.Tensor  # [S_paged, max_blocks] int32, paged sequences only
    seq_lens: torch.Tensor  # [S_paged] int32: context length incl. this step's tokens
    query_start_loc: torch.Tensor  # [S_paged + 1] int32
    num_paged_tokens: int  # tokens of the paged sequences (a prefix of the batch)
    max_query_len: int  # host-side maxima of the paged part (no device sync in kernels)
    max_seq_len: int
    fresh_query_lens: list[int]  # query lengths of the fresh-prefill sequences, in order
    all_seq_lens: list[int]  # context length of every sequence (paged then fresh)
    all_query_lens: list[int]  # query length of every sequence (paged then fresh)
    backend: str = "auto"  # attention backend for kernels.api
    sdpa_fresh_prefill: bool = True  # use SDPA for fresh prefills (torch backend only)
    lora: Optional[LoraSegments] = None  # the step's adapter rows by slot; None: no adapter rows


# --------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # `native`: float32 and bf16 norms in one C call (CausalLM.use_native_norms).
        self.backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: float32 statistics, `weight * normed.to(dtype)`.
        return kernels.rms_norm(x, self.weight, self.eps, backend=self.backend)


class Attention(nn.Module):
    """`args` are this rank's (sharding.local_args): its query and KV heads. With tensor
    parallel ranks `parallel` sums o_proj's partial products over them."""

    def __init__(self, args: ModelArgs, parallel: Optional[ParallelState] = None):
        super().__init__()
        self.parallel = parallel if parallel is not None and parallel.layout.tp > 1 else None
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        # q, k and v in one matmul (one GEMM instead of three small ones).
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.scale = args.head_dim**-0.5
        # An fp8 KV cache's per-layer scales (K = stored value * k_scale), fixed before serving
        # (runtime/executor/model_executor.py); 1 for other caches.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # LoRA slot tensors of qkv_proj and o_proj (runtime/executor/lora.py), when adapters are on.
        self.lora_qkv = None
        self.lora_o = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.lora_qkv is not None:  # each of q, k and v adds its delta into its own columns
            self.lora_qkv.apply(qkv, x, meta.lora, meta.backend)
        # q and k are adjacent columns of qkv: one in-place rotation covers both heads' sets.
        qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        if not kernels.rope_write_kv(qkv, self.num_heads, self.num_kv_heads, cos, sin, key_cache, value_cache,
                                     meta.slot_mapping, backend=meta.backend):  # one C call on the CPU
            apply_rope_(qk, cos, sin)
            kernels.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, backend=meta.backend,
                                   k_scale=self.k_scale, v_scale=self.v_scale)

        out = torch.empty((T, self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
        n_paged = meta.num_paged_tokens
        if n_paged:
            q_paged = q[:n_paged]
            if meta.backend == "triton" and q.dtype != key_cache.dtype and key_cache.element_size() > 1:
                # A float32-compute model over a lower-precision cache (runtime/executor/cpu_dense.py):
                # the Triton kernels take one dtype; the torch paths upcast the cache instead.
                # (An fp8 cache is widened to the query's dtype inside the kernel.)
                q_paged = q_paged.to(key_cache.dtype)
            kernels.paged_attention(
                q_paged,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                self.scale,
                out=out[:n_paged],
                backend=meta.backend,
                max_query_len=meta.max_query_len,
                max_seq_len=meta.max_seq_len,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
            )
        start = n_paged
        for q_len in meta.fresh_query_lens:
            end = start + q_len
            # [1, H, L, D]: the sequence attends causally to its own fresh keys only.
            qs = q[start:end].transpose(0, 1).unsqueeze(0)
            ks = k[start:end].transpose(0, 1).unsqueeze(0)
            vs = v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
            out[start:end] = o[0].transpose(0, 1)
            start = end
        attended = out.view(T, self.q_size)
        y = self.o_proj(attended)
        if self.lora_o is not None:
            self.lora_o.apply(y, attended, meta.lora, meta.backend)
        if self.parallel is not None:  # row-parallel: each rank's heads' share of the sum
            self.parallel.all_reduce(y)
        return y


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, parallel: Optional[ParallelState] = None):
        super().__init__()
        self.parallel = parallel if parallel is not None and parallel.layout.tp > 1 else None
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        # LoRA slot tensors of gate_up_proj and down_proj (runtime/executor/lora.py), when adapters are on.
        self.lora_gate_up = None
        self.lora_down = None

    def forward(self, x: torch.Tensor, lora: Optional[LoraSegments] = None, backend: str = "auto") -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora_gate_up is not None:
            self.lora_gate_up.apply(gate_up, x, lora, backend)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        hidden = F.silu(gate).mul_(up)
        y = self.down_proj(hidden)
        if self.lora_down is not None:
            self.lora_down.apply(y, hidden, lora, backend)
        if self.parallel is not None:  # row-parallel: each rank's columns' share of the sum
            self.parallel.all_reduce(y)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, parallel: Optional[ParallelState] = None):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, parallel)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, parallel)

    def forward(self, x, cos, sin_signed, kv_cache, meta):
        # Residual adds into the sublayers' fresh outputs (a + x == x + a exactly).
        h = self.self_attn(self.input_layernorm(x), cos, sin_signed, kv_cache, meta).add_(x)
        return self.mlp(self.post_attention_layernorm(h), meta.lora, meta.backend).add_(h)


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """nn.Embedding, initialized as its own reset_parameters does except on the meta device
    (from_pretrained builds there): there `normal_` runs a Python decomposition that imports
    torch._dynamo, most of a second of start-up for a tensor the checkpoint overwrites."""
    weight = torch.empty(num_embeddings, dim)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(num_embeddings, dim, _weight=weight)


class CausalLM(nn.Module):
    """The decoder stack plus LM head; `forward` returns logits of selected tokens only.

    `args` is the whole model's shape; with a `parallel` group of more than one rank the
    modules are this rank's share (`shard`, `local_args`): `layers` are the stage's layers
    (global layer `shard.layer_start + i` is `layers[i]`), `embed_tokens` exists on the first
    stage only, `norm` and `lm_head` on the last."""

    def __init__(self, args: ModelArgs, parallel: Optional[ParallelState] = None):
        super().__init__()
        self.args = args
        self.parallel = parallel if parallel is not None else single_process(torch.device("cpu"))
        self.shard: ShardPlan = shard_plan(args, self.parallel.layout)
        self.local_args = local_args(args, self.shard)
        shard, here = self.shard, self.local_args
        group = self.parallel if shard.sharded else None
        self.embed_tokens = _embedding(shard.vocab_per_rank, args.hidden_size) if shard.first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(here, group) for _ in range(shard.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if shard.last_stage else None
        self.lm_head = (nn.Linear(args.hidden_size, shard.vocab_per_rank, bias=False) if shard.last_stage
                        else None)
        self.hidden_dtype = torch.float32  # the compute dtype: what a later stage receives (from_pretrained)
        self.tie_weights()
        self.rotary: Optional[RotaryEmbedding] = None  # set by from_pretrained (needs a device)
        self.weights_loaded: Optional[WeightsLoaded] = None  # set by from_pretrained
        # KV-cache scale tensors of the checkpoint by weight name (load_weights; kv_cache_scales).
        self.checkpoint_kv_scales: dict[str, torch.Tensor] = {}

    def tie_weights(self) -> None:
        # A last stage without the embedding reads the embedding table into its own head.
        if self.args.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        shard = self.shard
        if not shard.sharded:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: ids of other ranks' rows give zero rows here; the sum has each row once.
        local = input_ids - shard.vocab_start
        outside = (local < 0) | (local >= shard.vocab_per_rank)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        x.masked_fill_(outside[:, None], 0)
        return self.parallel.all_reduce(x)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [N] int64: rows of the batch that get logits
        argmax_only: bool = False,
    ) -> Optional[torch.Tensor]:
        """Logits [N, vocab] float32 of `logits_indices`. With `argmax_only` (the caller needs
        only each row's argmax) it may return those token ids instead, int64 [N], when the LM
        head makes them without logits (a CPU panel head: PrepackedLinear.argmax).

        `kv_caches` are this stage's layers'. A stage before the last sends its hidden states
        to the next stage and returns None; every tensor rank of the last stage returns the
        same full-vocabulary logits."""
        if self.shard.first_stage:
            x = self._embed(input_ids)
        else:
            x = self.parallel.recv_from_previous_stage((input_ids.shape[0], self.args.hidden_size),
                                                       self.hidden_dtype)
        cos, sin = self.rotary.cos_sin(positions, meta.all_seq_lens, meta.all_query_lens, x.dtype)
        sin_signed = signed_sin(sin)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin_signed, kv_cache, meta)
        if not self.shard.last_stage:
            self.parallel.send_to_next_stage(x)
            return None
        # Norm and LM head only where a token is sampled: the head is the largest matmul.
        x = self.norm(x[logits_indices])
        if not self.shard.sharded:
            if argmax_only and hasattr(self.lm_head, "argmax"):
                tokens = self.lm_head.argmax(x)
                if tokens is not None:
                    return tokens
            return self.lm_head(x).float()
        if x.shape[0] == 0:  # the same on every rank: no rows, nothing to gather
            return torch.empty((0, self.args.vocab_size), dtype=torch.float32, device=x.device)
        logits = self.parallel.all_gather_last_dim(self.lm_head(x))
        return logits[:, : self.args.vocab_size].float()

    # ---- loading

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        weight_dtype: Optional[torch.dtype] = None,
        prepack: bool = True,
        parallel: Optional[ParallelState] = None,
    ) -> "CausalLM":
        """`dtype` is the compute dtype. `weight_dtype` (default: `dtype`) is the model's own
        dtype: weights are rounded to it first, so a bf16 model computed in float32 on the CPU
        (runtime/executor/cpu_dense.py) keeps bf16 weights. `prepack`: on the CPU, large linears run
        through oneDNN with prepacked weights (`prepack_linears`). `parallel`: this rank's share
        only (the class doc)."""
        device = torch.device(device)
        hf_config = load_hf_config(path)
        args = model_args_from_hf(hf_config)
        # Built on the meta device: no time spent on random init that the weights overwrite.
        with torch.device("meta"):
            model = cls(args, parallel)
        model = model.to_empty(device=device).to(dtype)
        model.hidden_dtype = dtype
        model.tie_weights()
        model.rotary = RotaryEmbedding(hf_config, args.head_dim, args.max_position_embeddings, device)
        model.weights_loaded = model.load_weights(path)
        if weight_dtype is not None and weight_dtype != dtype:
            model.round_weights(weight_dtype)
        if prepack and device.type == "cpu":
            model.prepack_linears()
        return model.eval()

    def attach_lora(self, slots) -> None:
        """Add the LoRA deltas of `slots` (runtime/executor/lora.py's LoraSlots) to q, k, v, o,
        gate, up and down of every layer, for the rows `meta.lora` gives a slot."""
        for layer, projections in zip(self.layers, slots.layers):
            layer.self_attn.lora_qkv, layer.self_attn.lora_o = projections["qkv_proj"], projections["o_proj"]
            layer.mlp.lora_gate_up, layer.mlp.lora_down = projections["gate_up_proj"], projections["down_proj"]

    def set_kv_cache_scales(self, scales: list[tuple[float, float]]) -> None:
        """Per-layer (k_scale, v_scale) of an fp8 KV cache: what its writes divide by and its
        reads multiply by. Fixed before serving (CUDA graphs record them as constants)."""
        if len(scales) != len(self.layers):
            raise ValueError(f"{len(scales)} KV-cache scale pairs for {len(self.layers)} layers")
        for layer, (k_scale, v_scale) in zip(self.layers, scales):
            layer.self_attn.k_scale, layer.self_attn.v_scale = float(k_scale), float(v_scale)

    def use_native_norms(self, enabled: bool = True) -> None:
        """Float32 and bf16 RMSNorms through the C kernel (kernels/cpu_native.py): one call
        instead of six to nine torch ops each, 2L + 1 norms per step. The executor turns it
        on with the native attention backend."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.backend = "native" if enabled else "torch"

    def prepack_linears(self) -> None:
        """Swap the large linears (float32, and bf16 where the CPU multiplies it natively) for
        oneDNN-prepacked ones (runtime/executor/cpu_dense.py). The per-layer ones drop their dense
        weight, but for small float32 ones (kept for the batch sizes MKL multiplies faster);
        the LM head keeps it (the tied embedding)."""
        support = detect_cpu_matmul_support()
        if self.lm_head is not None:
            self.lm_head = prepack_linear(self.lm_head, support=support)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = prepack_linear(attn.qkv_proj, keep_dense=False, support=support)
            attn.o_proj = prepack_linear(attn.o_proj, keep_dense=False, support=support)
            mlp.gate_up_proj = prepack_linear(mlp.gate_up_proj, keep_dense=False, support=support)
            mlp.down_proj = prepack_linear(mlp.down_proj, keep_dense=False, support=support)

    def panel_step_rows(self) -> Optional[range]:
        """The token counts of a forward pass whose every product is a panel product (each
        linear prepacked with panels for those rows), or None where some linear has none."""
        linears = [self.lm_head] if self.lm_head is not None else []
        for layer in self.layers:
            linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                        layer.mlp.down_proj]
        ranges = {linear.panel_rows if isinstance(linear, PrepackedLinear) else None for linear in linears}
        return ranges.pop() if len(ranges) == 1 else None

    @torch.no_grad()
    def round_weights(self, weight_dtype: torch.dtype) -> None:
        """Round every weight to `weight_dtype`, keeping the tensors' own dtype."""
        for param in self.parameters():
            param.copy_(param.to(weight_dtype))

    def load_weights(self, path: str | Path) -> "WeightsLoaded":
        """Read the checkpoint's safetensors files into the parameters. safetensors maps each
        file (copy-on-write); a weight the model keeps as stored (same dtype, not fused into
        qkv_proj/gate_up_proj, not sliced) on the CPU becomes a view of that map instead of a
        copy, so its pages come from the page cache when first touched. A tensor-parallel rank
        reads only its slices (`safe_open(...).get_slice`), a pipeline stage only its layers."""
        from safetensors import safe_open

        folder = Path(path)
        index = folder / "model.safetensors.index.json"
        if index.is_file():  # sharded checkpoint: the index names the shards
            shards = set(json.loads(index.read_text())["weight_map"].values())
            files = sorted(folder / name for name in shards)
        else:
            # Mistral repos may also ship `consolidated.safetensors` (other weight names).
            files = sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith("consolidated"))
        if not files:
            raise ValueError(f"no *.safetensors weights in {str(folder)!r}")
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        self.checkpoint_kv_scales = {}
        a, s = self.args, self.shard
        hd = a.head_dim
        q_rows = (s.head_start * hd, (s.head_start + s.num_heads) * hd)
        kv_rows = (s.kv_head_start * hd, (s.kv_head_start + s.num_kv_heads) * hd)
        mlp_rows = (s.intermediate_start, s.intermediate_start + s.intermediate_size)
        # Fused targets: (index, rows of the checkpoint's tensor this rank reads).
        fused = {"q_proj": (0, q_rows), "k_proj": (1, kv_rows), "v_proj": (2, kv_rows),
                 "gate_proj": (0, mlp_rows), "up_proj": (1, mlp_rows)}
        # Row-parallel inputs: the columns of the checkpoint's weight this rank reads.
        row_parallel = {"o_proj": q_rows, "down_proj": mlp_rows}
        local = self.local_args
        qkv_sizes = [local.num_heads * hd, local.num_kv_heads * hd, local.num_kv_heads * hd]
        mlp_sizes = [local.intermediate_size, local.intermediate_size]
        vocab_rows = (s.vocab_start, s.vocab_start + s.vocab_rows)
        if s.sharded:  # padding rows of the vocabulary (and a head's rows past it) stay zero
            for table in (self.embed_tokens, self.lm_head):
                if table is not None:
                    table.weight.data.zero_()
        read_bytes = mapped_bytes = 0
        for file in files:
            with safe_open(str(file), framework="pt") as f:

                def read(name: str, rows=None, cols=None) -> torch.Tensor:
                    if not s.sharded or (rows is None and cols is None):
                        return f.get_tensor(name)
                    part = f.get_slice(name)
                    return part[rows[0]: rows[1]] if cols is None else part[:, cols[0]: cols[1]]

                for name in f.keys():
                    key = name[len("model."):] if name.startswith("model.") else name
                    if "rotary_emb" in key:
                        continue
                    if kv_scale_kind(key) is not None:  # an fp8 KV cache's scale (kv_cache_scales)
                        tensor = f.get_tensor(name)
                        read_bytes += tensor.nbytes
                        self.checkpoint_kv_scales[name] = tensor
                        continue
                    parts = key.split(".")
                    if parts[0] == "layers" and len(parts) > 2 and parts[1].isdigit():
                        if int(parts[1]) >= a.num_layers:
                            raise ValueError(f"unexpected weight {name!r} in {file.name}")
                        at = s.local_layer(int(parts[1]))
                        if at is None:
                            continue  # another stage's layer: not read
                        key = ".".join(["layers", str(at)] + parts[2:])
                    elif key == "embed_tokens.weight":
                        if self.embed_tokens is None:
                            if self.lm_head is None or not a.tie_word_embeddings:
                                continue  # a middle stage, or a last stage with its own head
                            key = "lm_head.weight"  # a last stage's tied head
                    elif key.startswith(("norm.", "lm_head.")) and self.lm_head is None:
                        continue  # the last stage's
                    proj = parts[-2] if len(parts) >= 2 else ""
                    if proj in fused:
                        is_attn = proj in ("q_proj", "k_proj", "v_proj")
                        target = key.replace(proj, "qkv_proj" if is_attn else "gate_up_proj")
                        sizes = qkv_sizes if is_attn else mlp_sizes
                        idx, rows = fused[proj]
                        offset = sum(sizes[:idx])
                        param = params.get(target)
                        if param is None:
                            raise ValueError(f"unexpected weight {name!r} in {file.name}")
                        tensor = read(name, rows=rows)
                        read_bytes += tensor.nbytes
                        dest = param.data[offset: offset + sizes[idx]]
                        if dest.shape != tensor.shape:
                            raise ValueError(f"weight {name!r} does not match the model's shape: "
                                             f"{tuple(tensor.shape)} for {tuple(dest.shape)}")
                        dest.copy_(tensor)
                        loaded.add(f"{target}#{idx}")
                        continue
                    param = params.get(key)
                    if param is None:
                        raise ValueError(f"unexpected weight {name!r} in {file.name}")
                    rows = cols = None
                    dest = param.data
                    if proj in row_parallel and parts[-1] == "bias":
                        if s.tp_rank != 0:  # added once: by tensor rank 0 before the all-reduce
                            param.data.zero_()
                            loaded.add(key)
                            continue
                    elif proj in row_parallel:
                        cols = row_parallel[proj]
                    elif key in ("embed_tokens.weight", "lm_head.weight") and s.sharded:
                        rows, dest = vocab_rows, param.data[: s.vocab_rows]
                    tensor = read(name, rows=rows, cols=cols)
                    read_bytes += tensor.nbytes
                    if dest.shape != tensor.shape:
                        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(dest.shape)}")
                    if (rows is None and cols is None and param.device.type == "cpu" and tensor.dtype == param.dtype
                            and tensor.data_ptr() % tensor.element_size() == 0):
                        param.data = tensor  # the file's map itself (the map lives as long as the tensor)
                        mapped_bytes += tensor.nbytes
                    else:
                        dest.copy_(tensor)
                    loaded.add(key)
        missing = []
        for pname, param in self.named_parameters():
            if pname.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                missing += [f"{pname}#{i}" for i in range(3) if f"{pname}#{i}" not in loaded]
            elif pname.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
                missing += [f"{pname}#{i}" for i in range(2) if f"{pname}#{i}" not in loaded]
            elif pname not in loaded and not (pname == "lm_head.weight" and self.args.tie_word_embeddings):
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint {str(folder)!r} is missing weights: {missing[:8]}")
        return WeightsLoaded(files=len(files), bytes=read_bytes, mapped_bytes=mapped_bytes)


@dataclass(frozen=True)
class WeightsLoaded:
    """What `CausalLM.load_weights` read: safetensors files, bytes, and the bytes kept as views
    of the files' memory maps (no copy)."""

    files: int
    bytes: int
    mapped_bytes: int


# Per-layer KV-cache scale names a checkpoint may hold (after `layers.N.`), as vLLM reads them:
# `self_attn.k_scale` / `v_scale`, ModelOpt's `k_proj.k_scale` / `v_proj.v_scale`, and the
# older single `kv_scale` (for K and V both).
KV_SCALE_NAMES = {
    "self_attn.k_scale": "k",
    "self_attn.v_scale": "v",
    "self_attn.k_proj.k_scale": "k",
    "self_attn.v_proj.v_scale": "v",
    "self_attn.kv_scale": "kv",
}


def kv_scale_kind(key: str) -> Optional[tuple[int, str]]:
    """(layer, "k" | "v" | "kv") of a KV-scale weight name (without `model.`), else None."""
    parts = key.split(".")
    if len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit():
        return None
    kind = KV_SCALE_NAMES.get(".".join(parts[2:]))
    return None if kind is None else (int(parts[1]), kind)


def kv_cache_scales(checkpoint_scales: dict[str, torch.Tensor], num_layers: int) -> Optional[list[tuple[float, float]]]:
    """Per-layer (k_scale, v_scale) from a checkpoint's scale tensors (`CausalLM.load_weights`
    keeps them as `checkpoint_kv_scales`), or None where it has none. Scales that do not match
    the layers (a layer without its K or V scale, a layer the model lacks, a tensor of more
    than one element, a value that is not positive and finite) raise ValueError naming the
    weight."""
    if not checkpoint_scales:
        return None
    found: dict[tuple[int, str], float] = {}
    for name, tensor in sorted(checkpoint_scales.items()):
        key = name[len("model."):] if name.startswith("model.") else name
        layer, kind = kv_scale_kind(key)
        if layer >= num_layers:
            raise ValueError(f"KV-cache scale {name!r} names layer {layer}, but the model has {num_layers} layers")
        if tensor.numel() != 1:
            raise ValueError(f"KV-cache scale {name!r} must be one number (a per-layer scale), "
                             f"got shape {tuple(tensor.shape)}")
        value = float(tensor.float().reshape(()))
        if not (value > 0 and value != float("inf")):
            raise ValueError(f"KV-cache scale {name!r} must be positive and finite, got {value}")
        for part in ("k", "v") if kind == "kv" else (kind,):
            if kind == "kv":  # the older single scale; a layer's own k_scale / v_scale win
                found.setdefault((layer, part), value)
            else:
                found[(layer, part)] = value
    missing = [f"model.layers.{i}.self_attn.{part}_scale" for i in range(num_layers) for part in ("k", "v")
               if (i, part) not in found]
    if missing:
        raise ValueError(f"the checkpoint has KV-cache scales for some layers but not {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return [(found[(i, "k")], found[(i, "v")]) for i in range(num_layers)]


def kv_cache_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * elem


def math_flops_per_token(args: ModelArgs) -> float:
    """Matmul FLOPs of one token through the layers (excluding attention scores and head)."""
    h, i = args.hidden_size, args.intermediate_size
    qkv = h * (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    o = args.num_heads * args.head_dim * h
    return 2.0 * args.num_layers * (qkv + o + 3 * h * i)


__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "ModelArgs",
    "RotaryEmbedding",
    "WeightsLoaded",
    "kv_cache_bytes_per_block",
    "kv_cache_scales",
    "load_hf_config",
    "math_flops_per_token",
    "model_args_from_hf",
]
