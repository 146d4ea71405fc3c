"""A faster torch path for paged attention on the CPU (same contract as the reference).

`paged_attention_ref` is the readable oracle: per sequence it repeats K/V for every query
head and runs two einsums and an explicit mask. On the CPU that costs far more than the
math: here each sequence gathers its blocks once (`index_select`, small enough to stay in
cache for the next op) and calls torch's fused `scaled_dot_product_attention` with
grouped-query heads (`enable_gqa`), a causal mask only when the chunk has cached context,
and no mask at all for single-token decodes. (Batching all decodes into one padded gather
was measured slower here: it streams several times the KV bytes through memory.) Results
equal the reference up to float32 summation order (tests/runtime/test_executor.py checks
it on random shapes). fp16/bf16 inputs are upcast like the reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_cpu(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32: context length including this step's queries
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query)
    # Most sequences' ops are tiny (a decode reads one context): run them on one thread, as
    # an OpenMP fork/join per op costs more than the op (and far more on a busy host). Big
    # chunks get all threads back.
    threads = torch.get_num_threads()
    try:
        _attend_each(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                     scale, out, threads)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    return out


# Work (query length x context length) from which a sequence uses every thread.
_PARALLEL_WORK = 1 << 15


def _attend_each(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                 out, threads):
    current = threads
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    gqa = num_heads != num_kv_heads
    upcast = query.dtype != torch.float32
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.long()
    for s, ctx_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        wanted = threads if q_len * ctx_len >= _PARALLEL_WORK else 1
        if wanted != current:
            torch.set_num_threads(wanted)
            current = wanted
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = tables[s, :n_blocks]
        k = key_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx_len]
        v = value_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx_len]
        q = query[q_start:q_end]
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        # [1, H, len, D] views for SDPA.
        q4 = q.transpose(0, 1).unsqueeze(0)
        k4 = k.transpose(0, 1).unsqueeze(0)
        v4 = v.transpose(0, 1).unsqueeze(0)
        if q_len == 1:
            mask, causal = None, False  # the last position sees the whole context
        elif q_len == ctx_len:
            mask, causal = None, True  # no cached context: plain causal
        else:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)[:, None]
            mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos
            causal = False
        o = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        out[q_start:q_end] = o[0].transpose(0, 1).to(out.dtype)
