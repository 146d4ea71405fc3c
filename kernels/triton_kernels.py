"""Triton kernels for the paged KV cache: the KV write and one unified paged attention.

Layout: K and V caches are `[num_blocks, block_size, num_kv_heads, head_dim]`.
The last dimension of every tensor must be contiguous; the other strides are passed to the
kernels, so views (a slice of a bigger cache, a transposed batch) work without copies.

Paged attention is one kernel over a flat batch of variable-length queries, prefill chunks and
single-token decodes together (vLLM's "unified attention" shape):

- grid axis 0 walks query-token tiles of every sequence. A sequence with query tokens
  [q_start, q_end) owns the tile ids [q_start // BLOCK_Q + s, ...); the program finds its
  sequence by a binary search over `query_start_loc`, so the grid needs no host-side table
  (`T // BLOCK_Q + S` tiles is an upper bound; surplus programs exit at once).
- grid axis 1 is the KV head. All GROUP query heads that share it are packed into the rows of
  one tile (row r = query token r // GROUP, query head r % GROUP), so each K/V tile is read
  once for the whole group (GQA/MQA).
- grid axis 2 splits the KV range of a sequence (flash-decoding) when there are too few
  (sequence, head) programs to fill the GPU; a second kernel merges the partial softmaxes.

Inside, an online softmax in fp32 (exp2 domain) walks KV tiles of TILE_N keys; each key finds
its physical block through the block table, so TILE_N is independent of the page size. The
causal mask is relative to each sequence's context: query i of a sequence with context length
L and query length q sits at position L - q + i and sees keys 0..L - q + i. Tiles that every
row sees whole run without masks; only the diagonal and the ragged end are masked.

On a GPU, TILE_N / warps / stages are autotuned per shape and coarse size class; under
TRITON_INTERPRET=1 fixed small tiles keep the CPU tests cheap. Measured on an H200: see
kernels/README.md (bench.py).

Every offset into the caches, the query and the output is computed in int64: a cache of
num_blocks * block_size * num_kv_heads * head_dim elements passes 2**31 long before memory
runs out on a large GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tokenlane.kernels.reference import FP8_DTYPES, check_kv_scales, is_fp8

# Triton decides at decoration time (this module's import) whether kernels run in its
# interpreter; record that decision so launchers can explain a CPU tensor without it.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = QUERY_DTYPES + FP8_DTYPES  # of the KV cache
# fp8 formats: (mantissa bits, smallest normal, largest finite).
_FP8_FORMATS = {
    torch.float8_e4m3fn: (3, 2.0**-6, 448.0),
    torch.float8_e5m2: (2, 2.0**-14, 57344.0),
}
MAX_BLOCK_SIZE = 256
MAX_SPLITS = 64
# TOKENLANE_TRITON_AUTOTUNE=0 uses the fixed configs below instead of autotuning on a GPU (the
# GPU test run sets it: dozens of shapes, each tuned, would cost minutes of compiles).
AUTOTUNE = os.environ.get("TOKENLANE_TRITON_AUTOTUNE", "1") != "0"


# --------------------------------------------------------------------------------------------
# KV write
# --------------------------------------------------------------------------------------------


@triton.jit
def _round_to_fp8(x, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, FMAX: tl.constexpr):
    """float32 x saturated to +-FMAX and rounded to nearest even on the fp8 grid, still in
    float32: the cast that follows is then exact, whatever rounding the conversion does (the
    interpreter's fp8 cast truncates where rounding would carry into the exponent)."""
    x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    bits = x.to(tl.int32, bitcast=True)
    drop: tl.constexpr = 23 - MANT  # float32 mantissa bits the format lacks
    lsb = (bits >> drop) & 1
    bits = (bits + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    # Below the smallest normal the grid is uniform (step MIN_NORMAL * 2^-MANT): adding and
    # subtracting step * 2^23 rounds to it, to nearest even.
    magic: tl.constexpr = MIN_NORMAL * (2.0 ** (23 - MANT))
    ax = tl.abs(x)
    sub = (ax + magic) - magic
    return tl.where(ax < MIN_NORMAL, tl.where(x < 0, -sub, sub), normal)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int32/int64: block_id * block_size + offset; < 0 = skip
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    num_kv_heads,
    k_scale, v_scale,  # fp8 caches store key / k_scale, value / v_scale
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # KV heads per program
    FP8_MANT: tl.constexpr,  # 0: not an fp8 cache; else the format (see _FP8_FORMATS)
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    head_tile = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    heads64 = heads.to(tl.int64)
    tok64 = token.to(tl.int64)

    k = tl.load(key_ptr + tok64 * stride_k_t + heads64[:, None] * stride_k_h + dims[None, :],
                mask=mask)
    v = tl.load(value_ptr + tok64 * stride_v_t + heads64[:, None] * stride_v_h + dims[None, :],
                mask=mask)
    if FP8_MANT > 0:
        k = _round_to_fp8(tl.math.div_rn(k.to(tl.float32), k_scale), FP8_MANT, FP8_MIN_NORMAL, FP8_MAX)
        v = _round_to_fp8(tl.math.div_rn(v.to(tl.float32), v_scale), FP8_MANT, FP8_MIN_NORMAL, FP8_MAX)
    kc = key_cache_ptr + block * stride_kc_b + offset * stride_kc_s
    vc = value_cache_ptr + block * stride_vc_b + offset * stride_vc_s
    tl.store(kc + heads64[:, None] * stride_kc_h + dims[None, :],
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + heads64[:, None] * stride_vc_h + dims[None, :],
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
            f"{tuple(key_cache.shape)}"
        )
    if key_cache.dtype not in SUPPORTED_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"KV cache dtype must be one of {SUPPORTED_DTYPES} and the same for K and V, "
            f"got {key_cache.dtype} / {value_cache.dtype}"
        )
    block_size = key_cache.shape[1]
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), "
                             f"got strides {t.stride()}")


def _check_devices(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if first.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {first}); on the CPU use the torch backend "
            "or set TRITON_INTERPRET=1 before tokenlane.kernels.triton_kernels is imported"
        )
    return first


def write_kv_cache_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64; < 0 = skip this token
    k_scale: float = 1.0,  # fp8 caches: stored = key / k_scale (saturated, nearest even)
    v_scale: float = 1.0,
) -> None:
    """Scatter this step's keys and values into the paged cache (in place)."""
    _check_cache_pair(key_cache, value_cache)
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    _check_devices(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                   slot_mapping=slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key must be [T, {num_kv_heads}, {head_dim}] to match the cache, "
                         f"got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in head_dim (stride(-1) == 1)")
    if key.dtype not in QUERY_DTYPES or value.dtype != key.dtype:
        raise ValueError(f"key and value must share a dtype of {QUERY_DTYPES}, got {key.dtype} / {value.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    head_dim_p = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_dim_p))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_kv_heads, float(k_scale), float(v_scale),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size, BLOCK_H=block_h,
        **_fp8_meta(key_cache.dtype),
    )


def _fp8_meta(cache_dtype: torch.dtype) -> dict:
    mant, min_normal, fmax = _FP8_FORMATS.get(cache_dtype, (0, 1.0, 1.0))
    return dict(FP8_MANT=mant, FP8_MIN_NORMAL=min_normal, FP8_MAX=fmax)


# --------------------------------------------------------------------------------------------
# Paged attention
# --------------------------------------------------------------------------------------------


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with query_start_loc[s] // BLOCK_Q + s <= q_tile (a binary search)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(
    acc, m_i, l_i,  # [BLOCK_M, HEAD_DIM_P], [BLOCK_M], [BLOCK_M] fp32 running state
    q,  # [BLOCK_M, HEAD_DIM_P] query rows
    q_pos,  # [BLOCK_M] absolute position of each row's query
    tile_lo, tile_hi,  # KV tiles [tile_lo, tile_hi) to visit
    kv_len,  # keys the query tile may see
    bt_row,  # this sequence's block-table row (int32 pointer)
    k_base, v_base,  # caches offset to this KV head
    qk_scale,
    stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of these tiles is visible to every row
    KV_FP8: tl.constexpr,  # fp8 cache: widened (exactly) to the query's dtype after the load
):
    """Online-softmax over KV tiles (exp2 domain; qk_scale includes log2(e))."""
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        if MASKED:
            key_valid = keys < kv_len
            phys = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        else:
            phys = tl.load(bt_row + keys // BLOCK_SIZE).to(tl.int64)
        in_block = (keys % BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + (phys * stride_kc_b + in_block * stride_kc_s)[None, :] + dims[:, None]
        v_ptrs = v_base + (phys * stride_vc_b + in_block * stride_vc_s)[:, None] + dims[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=key_valid[None, :] & dim_valid[:, None], other=0.0)
        elif HEAD_DIM != HEAD_DIM_P:
            k = tl.load(k_ptrs, mask=dim_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)  # [HEAD_DIM_P, TILE_N]
        if KV_FP8:
            k = k.to(q.dtype)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        if MASKED:
            visible = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = m_new
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED:
            v = tl.load(v_ptrs, mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        elif HEAD_DIM != HEAD_DIM_P:
            v = tl.load(v_ptrs, mask=dim_valid[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)  # [TILE_N, HEAD_DIM_P]
        if KV_FP8:
            v = v.to(q.dtype)
        p = p.to(v.dtype)  # the probabilities enter the PV product in the cache dtype
        if DOT_IN_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["tune_bucket"])
def _paged_attention_kernel(
    query_ptr,  # [T, Hq, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, Hq, D]            (written when NUM_SPLITS == 1)
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_P] fp32 (written when NUM_SPLITS > 1)
    part_max_ptr,  # [T, Hq, NUM_SPLITS] fp32, running max in the log2 domain
    part_sum_ptr,  # [T, Hq, NUM_SPLITS] fp32, softmax denominator
    block_tables_ptr,  # [S, max_blocks_per_seq] int32
    seq_lens_ptr,  # [S] int32: context length including this step's queries
    query_start_loc_ptr,  # [S + 1] int32: cumulative query lengths
    qk_scale,  # softmax scale * log2(e) (* k_scale for an fp8 cache)
    v_scale,  # fp8 cache: V = stored value * v_scale, applied once to the accumulator
    num_seqs,
    tune_bucket,  # unused by the kernel: a coarse problem size, part of the autotune key
    stride_q_t, stride_q_h,
    stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt_s,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # KV cache page size
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * GROUP rounded up to a power of two
    TILE_N: tl.constexpr,  # keys per inner iteration
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), else the default
    DOT_IN_FP32: tl.constexpr,  # interpreter + bf16: its tl.dot multiplies raw bf16 bits
    KV_FP8: tl.constexpr,  # the caches are fp8 (the query float32/bf16/fp16)
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile_local = q_tile - (q_start // BLOCK_Q + seq)
    if q_tile_local * BLOCK_Q >= q_len:  # surplus program of the upper-bound grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_prefix = seq_len - q_len  # keys already cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_tile_local * BLOCK_Q + rows // GROUP  # query index within the sequence
    q_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    q_pos = context_prefix + q_tok  # absolute position of each row's query

    tok64 = (q_start + q_tok).to(tl.int64)
    head64 = q_head.to(tl.int64)
    q = tl.load(
        query_ptr + tok64[:, None] * stride_q_t + head64[:, None] * stride_q_h + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :], other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Keys this tile needs: up to the position of its last query (causal).
    last_q = tl.minimum(q_len, (q_tile_local + 1) * BLOCK_Q) - 1
    kv_len = context_prefix + last_q + 1
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(num_tiles, tile_lo + tiles_per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)

    # Tiles whose keys every row of this query tile sees (all <= its first query's position)
    # skip the causal and length masks; the rest (the diagonal, the ragged end) apply them.
    full_tiles = (context_prefix + q_tile_local * BLOCK_Q + 1) // TILE_N
    tile_mid = tl.minimum(tl.maximum(full_tiles, tile_lo), tile_hi)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    kv_head64 = kv_head.to(tl.int64)
    k_base = key_cache_ptr + kv_head64 * stride_kc_h
    v_base = value_cache_ptr + kv_head64 * stride_vc_h
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, tile_lo, tile_mid, kv_len, bt_row, k_base, v_base, qk_scale,
        stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
        HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, DOT_PRECISION, DOT_IN_FP32, False, KV_FP8,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, tile_mid, tile_hi, kv_len, bt_row, k_base, v_base, qk_scale,
        stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
        HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, DOT_PRECISION, DOT_IN_FP32, True, KV_FP8,
    )
    if KV_FP8:
        # Dequantization folded out of the loop: q . (k * ks) = ks (q . k) went into
        # qk_scale, and sum p (v * vs) = vs sum p v is one multiply here.
        acc = acc * v_scale

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok64[:, None] * stride_o_t + head64[:, None] * stride_o_h + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        # Partial results, contiguous [T, Hq, NUM_SPLITS(, HEAD_DIM_P)] buffers.
        num_heads = tl.num_programs(1) * GROUP
        part = (tok64 * num_heads + head64) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :], acc,
                 mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_P] fp32
    part_max_ptr,  # [T, Hq, NUM_SPLITS] fp32
    part_sum_ptr,  # [T, Hq, NUM_SPLITS] fp32
    num_heads,
    stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,  # next power of two >= NUM_SPLITS
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_P)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_P)
    base = (token * num_heads + head) * NUM_SPLITS
    m = tl.load(part_max_ptr + base + splits, mask=split_valid, other=float("-inf"))
    l = tl.load(part_sum_ptr + base + splits, mask=split_valid, other=0.0)
    m_all = tl.max(m, axis=0)  # finite: the first split always sees key 0
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_all))
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * HEAD_DIM_P + dims[None, :],
                  mask=split_valid[:, None], other=0.0)
    total = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + dims, 
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


# The best tile depends on the problem's size as well as its shape (a 128-token decode is
# launch-bound, a 32k one bandwidth-bound): `tune_bucket` puts the size in the key.
_CONFIG_KEY = ["HEAD_DIM_P", "BLOCK_M", "BLOCK_SIZE", "GROUP", "NUM_SPLITS", "tune_bucket"]
_TUNE_CONFIGS = (  # (TILE_N, num_warps, num_stages)
    (32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 3), (128, 8, 2), (128, 8, 3),
)


def _prune_configs(configs, named_args, **kwargs):
    """Decode tiles (16 rows) use four warps, 128-row prefill tiles eight (four would spill)."""
    block_m = kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 16))
    if block_m <= 32:
        keep = [c for c in configs if c.num_warps == 4]
    elif block_m >= 128:
        keep = [c for c in configs if c.num_warps == 8]
    else:
        keep = list(configs)
    return keep or configs


def _autotuned(kernel):
    """On a GPU, tune the KV tile and the warps/stages; the interpreter uses fixed configs."""
    configs = [
        triton.Config({"TILE_N": tile_n}, num_warps=warps, num_stages=stages)
        for tile_n, warps, stages in _TUNE_CONFIGS
    ]
    return triton.autotune(configs=configs, key=_CONFIG_KEY,
                           prune_configs_by={"early_config_prune": _prune_configs})(kernel)


def _log2_bucket(n: int) -> int:
    return max(0, int(n) - 1).bit_length()


def tune_bucket(num_tokens: int, num_seqs: int, max_seq_len: int) -> int:
    """Coarse size class of a batch: octaves of context, pairs of octaves of tokens/seqs."""
    return ((_log2_bucket(max_seq_len) * 16 + _log2_bucket(num_tokens) // 2) * 16
            + _log2_bucket(num_seqs) // 2)


_paged_attention_kernel_tuned = (
    _autotuned(_paged_attention_kernel) if AUTOTUNE and not INTERPRETED else None
)


def _fixed_config(dtype: torch.dtype, block_size: int, block_m: int) -> dict:
    if INTERPRETED:  # small tiles: the interpreter's cost grows with tile size
        return dict(TILE_N=16 if block_size <= 16 else 32)
    if dtype == torch.float32:  # twice the shared memory per tile
        return dict(TILE_N=32, num_warps=4, num_stages=2)
    if block_m >= 128:
        return dict(TILE_N=64, num_warps=8, num_stages=3)
    return dict(TILE_N=64, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Split-KV heuristic, from bench.py's split sweep on an H200 (132 SMs; 32/8 heads x 128, bf16
# decode): with >= ~256 (sequence, KV head) programs one split is fastest (32 x 4k: 141 us
# unsplit vs 188-195 us split); below, splitting until there are ~4 programs per SM wins
# (8 x 32k: 606 us unsplit, 268 us in 4-8 splits; 16 x 8k: 207 us vs 145 us in 2 splits).
SPLIT_BELOW_WAVES = 1.5  # split only when programs < this * SMs
SPLIT_TARGET_WAVES = 4  # ... into enough splits to reach this * SMs programs
SPLIT_MIN_KEYS = 512  # ... each split keeping at least this many keys


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split the KV range when (query tile, KV head) programs would leave SMs idle or end in a
    ragged last wave; long loops per program amortize the pipeline's start."""
    if num_programs >= SPLIT_BELOW_WAVES * num_sms:
        return 1
    want = triton.cdiv(SPLIT_TARGET_WAVES * num_sms, num_programs)
    most = max(1, max_seq_len // SPLIT_MIN_KEYS)
    return max(1, min(want, most, MAX_SPLITS))


def plan_launch(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                max_query_len: int, max_seq_len: int, device: torch.device,
                num_splits: int | None = None) -> dict:
    """The tiling of one paged-attention launch (pure; bench.py reports it)."""
    group = num_heads // num_kv_heads
    rows_for_group = triton.next_power_of_2(group)
    if max_query_len <= 1 or INTERPRETED:
        block_m = max(16, rows_for_group)  # decode: one token, the whole group
    elif num_tokens >= 256 * num_seqs:
        block_m = max(128, rows_for_group)  # long prefills dominate: big tiles
    else:
        # Mixed batches: decodes share the tile size of the prefill chunks, wasting rows.
        block_m = max(64, rows_for_group)
    block_q = max(1, block_m // group)
    if num_splits is None:
        if INTERPRETED or device.type != "cuda":
            num_splits = 1
        else:
            # Query tiles in use: one per decode, about tokens / BLOCK_Q for prefills.
            q_tiles = min(num_tokens, num_seqs + num_tokens // block_q)
            num_splits = choose_num_splits(
                q_tiles * num_kv_heads, max_seq_len,
                _num_sms(device.index if device.index is not None else 0),
            )
    return dict(block_m=block_m, block_q=block_q, num_splits=num_splits,
                num_q_tiles=num_tokens // block_q + num_seqs,
                tune_bucket=tune_bucket(num_tokens, num_seqs, max_seq_len))


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [S] int32: context length including this step's queries
    query_start_loc: torch.Tensor,  # [S + 1] int32: cumulative query lengths
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    *,
    max_query_len: int | None = None,  # host-side hints; computed (one sync) when None
    max_seq_len: int | None = None,
    num_splits: int | None = None,  # None = heuristic; tests force values
    k_scale: float = 1.0,  # fp8 caches: K = stored value * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Unified paged attention over a flat batch of prefill chunks and decodes."""
    _check_cache_pair(key_cache, value_cache)
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    device = _check_devices(query=query, key_cache=key_cache, value_cache=value_cache,
                            block_tables=block_tables, seq_lens=seq_lens,
                            query_start_loc=query_start_loc)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [T, num_heads, {head_dim}], got {tuple(query.shape)}")
    num_tokens, num_heads, _ = query.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    kv_fp8 = is_fp8(key_cache.dtype)
    if kv_fp8 and query.dtype not in QUERY_DTYPES:
        raise ValueError(f"query dtype must be one of {QUERY_DTYPES} over an fp8 cache, got {query.dtype}")
    if not kv_fp8 and query.dtype != key_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != KV cache dtype {key_cache.dtype}")
    if query.stride(-1) != 1:
        raise ValueError(f"query must be contiguous in head_dim, got strides {query.stride()}")
    if head_dim > 256 or head_dim < 16:
        raise ValueError(f"head_dim must be in [16, 256], got {head_dim}")
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be a 1-D int32 tensor, got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be int32 [S + 1 = {num_seqs + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 \
            or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be int32 [S = {num_seqs}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != device \
            or out.stride(-1) != 1:
        raise ValueError(f"out must match query ({tuple(query.shape)}, {query.dtype}, {device}, "
                         f"contiguous head_dim), got {tuple(out.shape)}, {out.dtype}, "
                         f"{out.device}, strides {out.stride()}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    seq_lens = seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()

    if max_query_len is None or max_seq_len is None:
        # One host sync; also the place to validate the metadata.
        qsl = query_start_loc.cpu()
        q_lens = qsl[1:] - qsl[:-1]
        lens = seq_lens.cpu()
        if int(qsl[0]) != 0 or int(qsl[-1]) != num_tokens or bool((q_lens < 0).any()):
            raise ValueError(f"query_start_loc must rise from 0 to T = {num_tokens}, got "
                             f"{qsl.tolist()}")
        if bool((lens < q_lens).any()):
            raise ValueError("every seq_len must be >= its query length (seq_lens counts the "
                             f"context including this step's queries): {lens.tolist()} vs "
                             f"{q_lens.tolist()}")
        if int(lens.max()) > block_tables.shape[1] * block_size:
            raise ValueError(f"a seq_len exceeds the block table's capacity "
                             f"({block_tables.shape[1]} blocks of {block_size})")
        max_query_len = int(q_lens.max())
        max_seq_len = int(lens.max())

    group = num_heads // num_kv_heads
    head_dim_p = triton.next_power_of_2(head_dim)
    plan = plan_launch(num_tokens, num_seqs, num_heads, num_kv_heads, max_query_len,
                       max_seq_len, device, num_splits)
    block_m, block_q, num_splits = plan["block_m"], plan["block_q"], plan["num_splits"]
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")

    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim_p),
                               dtype=torch.float32, device=device)
        part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32,
                               device=device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the kernel

    args = (
        query, key_cache, value_cache, out, part_acc, part_max, part_sum,
        block_tables, seq_lens, query_start_loc,
        scale * 1.4426950408889634 * float(k_scale), float(v_scale), num_seqs, plan["tune_bucket"],
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
    )
    meta = dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=INTERPRETED and query.dtype == torch.bfloat16, KV_FP8=kv_fp8,
    )
    grid = (plan["num_q_tiles"], num_kv_heads, num_splits)
    if _paged_attention_kernel_tuned is None:
        _paged_attention_kernel[grid](*args, **meta, **_fixed_config(query.dtype, block_size, block_m))
    else:
        _paged_attention_kernel_tuned[grid](*args, **meta)

    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS=num_splits,
            SPLITS_P=triton.next_power_of_2(num_splits),
        )
    return out


__all__ = [
    "INTERPRETED",
    "choose_num_splits",
    "plan_launch",
    "paged_attention_triton",
    "write_kv_cache_triton",
]
