"""The entry points the runtime calls; they pick the Triton kernels or the torch reference."""

from __future__ import annotations

import os

import torch

from tokenlane.kernels.reference import check_kv_scales, is_fp8, paged_attention_ref, write_kv_cache_ref

BACKENDS = ("auto", "torch", "triton", "native")
BACKEND_ENV = "TOKENLANE_ATTENTION_BACKEND"


def resolve_backend(backend: str, device: torch.device) -> str:
    """auto = Triton on CUDA; on the CPU the C decode kernel (`native`, kernels/cpu_native.py)
    when a native library loads here, else `torch` (kernels/cpu_attention.py).
    TOKENLANE_ATTENTION_BACKEND overrides auto (tests force `triton` on the CPU under TRITON_INTERPRET=1)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV, "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
    on_cpu = torch.device(device).type == "cpu"
    if backend == "auto":
        if not on_cpu:
            return "triton"
        from tokenlane.kernels import cpu_native

        return "native" if cpu_native.available() else "torch"
    if backend == "native":
        if not on_cpu:
            raise ValueError(f"the native attention backend runs on the CPU only, not on {device}")
        from tokenlane.kernels import cpu_native

        if not cpu_native.available():
            raise ValueError(f"the native attention backend is not available here: "
                             f"{cpu_native.load_error()} (use auto or torch)")
    return backend


def fresh_prefill_through_cache(backend: str, device: torch.device, head_dim: int, group: int) -> bool:
    """Whether `paged_attention` should get prefill chunks without cached context too (their
    keys read back from the cache, where the model writes them first): the Triton kernels and
    the native C prefill kernel (head sizes 32 and 64) take them. Otherwise the model sends
    such chunks straight to SDPA over their fresh keys (runtime/executor/llama.py)."""
    resolved = resolve_backend(backend, device)
    if resolved == "triton":
        return True
    if resolved == "native":
        from tokenlane.kernels import cpu_native

        return cpu_native.prefill_supported(head_dim, group)
    return False


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, backend: str = "auto", *,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter K/V `[T, Hkv, D]` into the paged caches at `slot_mapping` (< 0 = skip). An fp8
    cache stores key / k_scale and value / v_scale, saturated to the format's largest finite
    value and rounded to nearest even (kernels/reference.py `quantize_kv`)."""
    resolved = resolve_backend(backend, key.device)
    if resolved == "triton":
        from tokenlane.kernels.triton_kernels import write_kv_cache_triton

        write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    if resolved == "native" and not is_fp8(key_cache.dtype):
        from tokenlane.kernels import cpu_native

        # One C call instead of a mask, two gathers and two index_copy_ per layer.
        if cpu_native.can_write_kv(key, value, key_cache, value_cache, slot_mapping) and \
                cpu_native.write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
            return
    write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def rope_write_kv(qkv, num_heads, num_kv_heads, cos, sin_signed, key_cache, value_cache, slot_mapping,
                  backend: str = "auto") -> bool:
    """With the native backend, in one C call: RoPE on the query and key heads of `qkv`
    `[T, (Hq + 2 Hkv) * D]` in place (`cos`, and `sin_signed` with its first half negated, are
    `[T, D]`; bitwise runtime/executor/llama.py's `apply_rope_`), then `write_kv_cache` of its keys and
    values. False, with nothing done, where it does not apply (another backend, dtype or
    layout, an fp8 cache): the caller rotates with torch ops and calls `write_kv_cache`."""
    if backend != "native" and resolve_backend(backend, qkv.device) != "native":
        return False
    if is_fp8(key_cache.dtype):
        return False
    from tokenlane.kernels import cpu_native

    return cpu_native.try_rope_write_kv(qkv, num_heads, num_kv_heads, cos, sin_signed, key_cache,
                                        value_cache, slot_mapping)


def paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
    out=None, backend: str = "auto", *, max_query_len: int | None = None,
    max_seq_len: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
):
    """Attention of a flat batch of variable-length queries over their paged contexts.

    `max_query_len` / `max_seq_len` are optional host-side values of the batch metadata: with
    them the Triton launcher picks its tiling without a device-to-host sync. `k_scale` /
    `v_scale`: an fp8 cache's dequantization scales (K = stored value * k_scale)."""
    resolved = resolve_backend(backend, query.device)
    if resolved == "triton":
        from tokenlane.kernels.triton_kernels import paged_attention_triton

        return paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
            max_query_len=max_query_len, max_seq_len=max_seq_len, k_scale=k_scale, v_scale=v_scale,
        )
    if query.device.type == "cpu":
        # Same contract as the reference: every decode in one C kernel call (native) or in
        # length groups of SDPA (torch), one SDPA per prefill chunk (kernels/cpu_attention.py).
        from tokenlane.kernels.cpu_attention import paged_attention_cpu

        return paged_attention_cpu(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
            native=resolved == "native", k_scale=k_scale, v_scale=v_scale,
        )
    return paged_attention_ref(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
        k_scale, v_scale,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch") -> torch.Tensor:
    """runtime/executor/llama.py's RMSNorm of a [rows, cols] batch, a new tensor in x's dtype. float32:
    `(x * rsqrt(mean(x^2, -1) + eps)) * weight`; other dtypes as transformers' LlamaRMSNorm
    (statistics in float32, `weight * normed.to(dtype)`). With the `native` backend, float32 and
    bf16 batches take one C call (kernels/cpu_native.py; the sum of squares in another order
    than torch's, so equal up to the last bit) instead of six to nine torch ops."""
    if backend == "native":
        from tokenlane.kernels import cpu_native

        out = cpu_native.try_rms_norm(x, weight, eps)
        if out is not None:
            return out
    if x.dtype == torch.float32:
        # The same ops without the dtype round trips, and in place where the tensor is ours.
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        return h.mul_(weight)
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of a [rows, vocab] batch, the same indices (greedy sampling's
    tie-break: the first maximum). On the CPU a float32 batch goes through the C kernel when it
    is built (kernels/cpu_native.py), about 3x faster than torch's reduction at [64, 32000]."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(-1) == 1):
        from tokenlane.kernels import cpu_native

        if cpu_native.available():
            return cpu_native.argmax_rows(logits)
    return logits.argmax(dim=-1)
