"""Pure-torch references for the paged KV write and paged attention (the CPU path)."""

from __future__ import annotations

import torch


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; < 0 = skip
) -> None:
    num_blocks, block_size = key_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    kc = key_cache.view(num_blocks * block_size, *key_cache.shape[2:])
    vc = value_cache.view(num_blocks * block_size, *value_cache.shape[2:])
    kc.index_copy_(0, slots, key[valid].to(kc.dtype))
    vc.index_copy_(0, slots, value[valid].to(vc.dtype))


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D], T = sum of query lengths
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [S] int32: context length including this step's queries
    query_start_loc: torch.Tensor,  # [S + 1] int32: cumulative query lengths
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
) -> torch.Tensor:
    """Query i of a sequence with context length L and query length q sits at position
    L - q + i and attends to keys 0..L - q + i (causal relative to the cached context)."""
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
        k = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)[:, None]
        k_pos = torch.arange(ctx_len, device=query.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
