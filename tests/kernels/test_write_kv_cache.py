"""Triton KV-cache write against the torch reference (interpreter on CPU, native on CUDA)."""

from __future__ import annotations

import pytest
import torch

from tokenlane.kernels.reference import write_kv_cache_ref
from tokenlane.kernels.triton_kernels import write_kv_cache_triton


def _caches(num_blocks, block_size, heads, head_dim, dtype, device):
    shape = (num_blocks, block_size, heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("heads,head_dim,block_size", [(2, 64, 16), (3, 96, 32), (8, 128, 16)])
def test_matches_reference(kcase, dtype, slot_dtype, heads, head_dim, block_size):
    device = kcase.DEVICE
    gen = torch.Generator().manual_seed(heads * head_dim)
    num_blocks, num_tokens = 6, 23
    # Slots anywhere in the cache, in any order; padding tokens (-1) are skipped.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 17]] = -1
    # K/V come out of a fused projection: strided views, not contiguous tensors.
    fused = torch.randn(num_tokens, 2 * heads + 1, head_dim, generator=gen).to(dtype).to(device)
    key, value = fused[:, :heads], fused[:, heads + 1 :]
    k_tri, v_tri = _caches(num_blocks, block_size, heads, head_dim, dtype, device)
    k_ref, v_ref = _caches(num_blocks, block_size, heads, head_dim, dtype, device)
    write_kv_cache_triton(key, value, k_tri, v_tri, slots.to(slot_dtype).to(device))
    write_kv_cache_ref(key, value, k_ref, v_ref, slots.to(slot_dtype).to(device))
    # Exact: a copy. NaN marks untouched slots in both (equal_nan).
    torch.testing.assert_close(k_tri, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_tri, v_ref, atol=0, rtol=0, equal_nan=True)
    written = (~torch.isnan(k_tri[..., 0, 0])).sum().item()
    assert written == num_tokens - 2


def test_casts_to_cache_dtype(kcase):
    device = kcase.DEVICE
    key = torch.randn(5, 2, 64, device=device)
    value = torch.randn(5, 2, 64, device=device)
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float16, device)
    slots = torch.tensor([0, 1, 2, 17, 31], device=device)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, 2, 64)
    torch.testing.assert_close(flat_k[slots], key.half(), atol=0, rtol=0)


def test_slots_beyond_int32_offsets(kcase):
    """Slot * (heads * head_dim) past 2**31 elements; only the touched pages become resident."""
    device = kcase.DEVICE
    block_size, head_dim = 16, 64
    num_blocks = (2**31) // (block_size * head_dim) + 64
    k_cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16, device=device)
    v_cache = torch.empty_like(k_cache)
    slots = torch.tensor([num_blocks * block_size - 1, (num_blocks - 40) * block_size + 3],
                         device=device)
    key = torch.randn(2, 1, head_dim, device=device).half()
    value = torch.randn(2, 1, head_dim, device=device).half()
    write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[-1, -1], key[0])
    assert torch.equal(v_cache[num_blocks - 40, 3], value[1])


def test_empty_batch_is_a_no_op(kcase):
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32, kcase.DEVICE)
    empty = torch.empty(0, 2, 64, device=kcase.DEVICE)
    write_kv_cache_triton(empty, empty, k_cache, v_cache,
                          torch.empty(0, dtype=torch.int64, device=kcase.DEVICE))
    assert torch.isnan(k_cache).all()


@pytest.mark.parametrize(
    "key_shape,slot_kw,match",
    [
        ((4, 3, 64), {}, r"key must be \[T, 2, 64\]"),
        ((4, 2, 64), {"dtype": torch.float32}, "slot_mapping must be int32 or int64"),
        ((4, 2, 64), {"n": 3}, r"slot_mapping must be \[T=4\]"),
    ],
)
def test_bad_inputs(kcase, key_shape, slot_kw, match):
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32, kcase.DEVICE)
    key = torch.randn(*key_shape, device=kcase.DEVICE)
    slots = torch.arange(slot_kw.get("n", key_shape[0]), device=kcase.DEVICE).to(
        slot_kw.get("dtype", torch.int64))
    with pytest.raises(ValueError, match=match):
        write_kv_cache_triton(key, key, k_cache, v_cache, slots)


def test_mismatched_caches(kcase):
    k_cache, _ = _caches(2, 16, 2, 64, torch.float32, kcase.DEVICE)
    v_cache = torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=kcase.DEVICE)
    key = torch.randn(1, 2, 64, device=kcase.DEVICE)
    with pytest.raises(ValueError, match="same for K and V"):
        write_kv_cache_triton(key, key, k_cache, v_cache, torch.zeros(1, dtype=torch.int64))
