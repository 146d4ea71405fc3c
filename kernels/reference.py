"""Pure-torch references for the paged KV write and paged attention (the CPU path)."""

from __future__ import annotations

import math

import torch

# fp8 cache formats (engine.kvCacheDtype fp8_e4m3 / fp8_e5m2). Such a cache stores K / k_scale
# and V / v_scale (per-layer float32 scalars): x / scale saturated to the format's largest
# finite value (torch's e5m2 cast would give inf) and rounded to nearest even; readers
# multiply back. Other caches store K and V as they are, with scales of 1.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def check_kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Scales are positive finite numbers, and 1 unless the cache is fp8."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if value != 1.0 and not is_fp8(cache_dtype):
            raise ValueError(f"{name} applies to fp8 caches only (got {value} for a {cache_dtype} cache)")


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` as the cache stores it: for fp8, x / scale saturated and rounded to nearest even."""
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-fmax, fmax).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cache contents in float32, multiplied back by the scale (fp8)."""
    return x.float() * scale if is_fp8(x.dtype) else x.float()


def _bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """The CPU lacks index_copy_ / index_select for float8: move fp8 elements as bytes."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; < 0 = skip
    k_scale: float = 1.0,  # fp8 caches: the stored value is key / k_scale
    v_scale: float = 1.0,
) -> None:
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    num_blocks, block_size = key_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    kc = _bytes_view(key_cache).view(num_blocks * block_size, *key_cache.shape[2:])
    vc = _bytes_view(value_cache).view(num_blocks * block_size, *value_cache.shape[2:])
    kc.index_copy_(0, slots, _bytes_view(quantize_kv(key[valid], key_cache.dtype, k_scale)))
    vc.index_copy_(0, slots, _bytes_view(quantize_kv(value[valid], value_cache.dtype, v_scale)))


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D], T = sum of query lengths
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [S] int32: context length including this step's queries
    query_start_loc: torch.Tensor,  # [S + 1] int32: cumulative query lengths
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    k_scale: float = 1.0,  # fp8 caches: K = stored value * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Query i of a sequence with context length L and query length q sits at position
    L - q + i and attends to keys 0..L - q + i (causal relative to the cached context)."""
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, ctx_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[s, :n_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        q = query[q_start:q_end].float()  # [q, Hq, D]
        k = dequantize_kv(k, k_scale).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = dequantize_kv(v, v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)[:, None]
        k_pos = torch.arange(ctx_len, device=query.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def lora_ref(
    outs: list[torch.Tensor],  # G x [T, N_g]: returned with the deltas added (inputs untouched)
    x: torch.Tensor,  # [T, K]
    token_slots: list[int],  # [T]: each row's adapter slot, -1 = none
    lora_a: torch.Tensor,  # [S, G*R, K]: slot s's G sub-projections stacked by its rank r_s
    lora_b: list[torch.Tensor],  # G x [S, R, N_g] (B transposed)
    scaling: torch.Tensor,  # [S, G] float32
    slot_ranks: list[int],  # [S]
) -> list[torch.Tensor]:
    """The segmented LoRA product (kernels/lora.py), one row at a time in float32."""
    groups = len(lora_b)
    results = [out.float().clone() for out in outs]
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        r = slot_ranks[slot]
        shrunk = x[t].float() @ lora_a[slot, : groups * r].float().T
        for g in range(groups):
            delta = shrunk[g * r : (g + 1) * r] @ lora_b[g][slot, :r].float()
            results[g][t] += delta * scaling[slot, g].item()
    return [res.to(out.dtype) for res, out in zip(results, outs)]
