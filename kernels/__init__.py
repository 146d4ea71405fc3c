"""Paged-attention kernels: Triton on CUDA, a pure-torch reference everywhere else.

Imports nothing of tokenlane's. The two entry points are what the runtime's model calls:

- `write_kv_cache(key, value, key_cache, value_cache, slot_mapping)`: scatter this step's
  K/V into the paged cache.
- `paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
  scale, out=None, backend="auto")`: attention of a flat batch of variable-length queries
  (prefill chunks and decodes together) over each sequence's paged context.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V, in float32,
bf16, fp16, or fp8 (`float8_e4m3fn` / `float8_e5m2`): an fp8 cache stores K / k_scale and
V / v_scale (per-layer scalars, keyword arguments of both entry points; kernels/reference.py).
"""

from tokenlane.kernels.api import paged_attention, write_kv_cache

__all__ = ["paged_attention", "write_kv_cache"]
