"""Triton kernels of the segmented LoRA product (kernels/lora.py has the layout and `add_lora`).

Both kernels take the step's segment table (start in slot order, length, slot, rank per
segment). Grid axis 0 is the segment, axis 1 a tile of BLOCK_M of its rows (programs past a
short segment's end do nothing), axis 2 a tile of output columns.

- shrink: buffer[m, :] = x[order[m]] @ A[slot].T for the M adapter rows in slot order, float32
  [M, G*R] (columns past the slot's G * rank stay zero: A is zero there);
- expand (one launch per sub-projection g): out[order[m], n] += (buffer[m, g*r : (g+1)*r] @
  B_g[slot, :r, n]) * scaling[slot, g], read-modify-write of the output rows in place (each row
  belongs to one segment, so no two programs write the same element).

The inputs' dtype is kept for the products (tensor cores for bf16/fp16), with float32 sums;
float32 inputs multiply in IEEE float32 (no TF32), so a float32 model matches the reference.
Offsets into x and the outputs are int64 (large batches times wide projections).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
BLOCK_M = 16
SHRINK_BLOCK_N = 16
SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
EXPAND_BLOCK_R = 16


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, buf_ptr, order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    K, GR, stride_xm, stride_as, stride_ar, stride_bufm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    pos = (start + offs_m).to(tl.int64)
    rows = tl.load(order_ptr + pos, mask=mask_m, other=0)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < GR
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_ptr + slot * stride_as + offs_n[None, :].to(tl.int64) * stride_ar + offs_k[:, None],
                     mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N] = A.T
        if DOT_IN_FP32:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
    tl.store(buf_ptr + pos[:, None] * stride_bufm + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _lora_expand_kernel(
    buf_ptr, b_ptr, out_ptr, scaling_ptr, order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, seg_rank_ptr,
    N, R, group, groups, stride_bufm, stride_bs, stride_br, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    rank = tl.load(seg_rank_ptr + seg)
    scale = tl.load(scaling_ptr + slot * groups + group)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    pos = (start + offs_m).to(tl.int64)
    rows = tl.load(order_ptr + pos, mask=mask_m, other=0)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    col0 = group * rank
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        bt = tl.load(buf_ptr + pos[:, None] * stride_bufm + (col0 + offs_r)[None, :],
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # float32 [BLOCK_M, BLOCK_R]
        wt = tl.load(b_ptr + slot * stride_bs + offs_r[:, None].to(tl.int64) * stride_br + offs_n[None, :],
                     mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        if DOT_IN_FP32:
            acc += tl.dot(bt, wt.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(bt.to(wt.dtype), wt, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (y.to(tl.float32) + acc * scale).to(y.dtype), mask=mask)


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"the Triton LoRA kernels need CUDA tensors (got {x.device}); on the CPU use the "
                         "torch backend or set TRITON_INTERPRET=1 before tokenlane.kernels.lora_triton is imported")


def _dot_args(dtype: torch.dtype) -> dict:
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_IN_FP32=INTERPRETED and dtype != torch.float32)


def lora_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, segments) -> torch.Tensor:
    """float32 [M, G*R]: the adapter rows (slot order) times their slot's stacked A.T."""
    _check_device(x)
    GR, K = lora_a.shape[1], lora_a.shape[2]
    buffer = torch.empty((segments.num_adapter_rows, GR), dtype=torch.float32, device=x.device)
    grid = (len(segments.slots), triton.cdiv(segments.max_length, BLOCK_M), triton.cdiv(GR, SHRINK_BLOCK_N))
    _lora_shrink_kernel[grid](
        x, lora_a, buffer, segments.order, segments.seg_start, segments.seg_len, segments.seg_slot,
        K, GR, x.stride(0), lora_a.stride(0), lora_a.stride(1), buffer.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=SHRINK_BLOCK_N, BLOCK_K=SHRINK_BLOCK_K, **_dot_args(x.dtype),
    )
    return buffer


def lora_expand_triton(buffer: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, group: int,
                       groups: int, out: torch.Tensor, segments) -> None:
    """out[rows] += (buffer's sub-projection `group` columns @ B[slot]) * scaling[slot, group]."""
    _check_device(out)
    R, N = lora_b.shape[1], lora_b.shape[2]
    grid = (len(segments.slots), triton.cdiv(segments.max_length, BLOCK_M), triton.cdiv(N, EXPAND_BLOCK_N))
    _lora_expand_kernel[grid](
        buffer, lora_b, out, scaling, segments.order, segments.seg_start, segments.seg_len, segments.seg_slot,
        segments.seg_rank, N, R, group, groups, buffer.stride(0), lora_b.stride(0), lora_b.stride(1),
        out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=EXPAND_BLOCK_R, **_dot_args(out.dtype),
    )
