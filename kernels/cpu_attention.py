"""Paged attention on the CPU (same contract as the reference).

`paged_attention_cpu` computes what `reference.paged_attention_ref` computes, in float32.
With `native=True` (the `native` backend) every decode of the batch goes to the C decode
kernel in one call, and, for head sizes 32 and 64, every prefill chunk to the C prefill kernel
in another (kernels/cpu_native.py; 1.1-2.1x SDPA's speed on such heads); otherwise:

- Decodes (query length 1) are sorted by context length and cut into groups whose padding
  wastes < 25% of the group's rows and whose gathered K/V stay small
  (`DECODE_GROUP_BYTES`). Per group: one block gather of K and one of V into reused buffers,
  the padded rows zeroed (a stale or NaN cache row must not leak through a zero weight), and
  one `scaled_dot_product_attention` over `[n, Hkv, G, D]` queries (a KV head's G query heads
  are extra query rows: GQA without copies) with a length mask. One padded gather of every
  decode streams several times the real KV bytes, hence the groups.
- Prefill chunks with cached context keep one SDPA each (few and big), with a causal mask
  relative to the context, and all threads when the chunk is big enough.

The grouping depends only on the batch layout, so it is built once and reused by every layer
of a forward pass (while `block_tables` / `seq_lens` / `query_start_loc` hold the same values).
The cache may be stored in another dtype than the query (e.g. a bf16 cache with fp32
compute): only the gathered K/V are upcast. An fp8 cache (engine.kvCacheDtype fp8_e4m3 /
fp8_e5m2) is dequantized with its scales folded out of the products: q . (k * k_scale) is
the softmax scale times k_scale, and sum p (v * v_scale) one multiply of the output (the C
kernels need no scale arguments). Results equal the reference up to float32 summation order
(tests/kernels/test_cpu_attention.py).

Measured (`python -m tokenlane.kernels.cpu_attention_bench`, one thread, 19M-model shapes):
1.0-1.4x over one SDPA per decode, with an fp32 or a bf16 cache (fp32 queries). Decode
attention here is bound by the K/V bytes gathered and read (about 1 KiB per token per layer
at 19M), not by op count; a `torch.compile`d fused gather + attention was 1.4-1.7x faster
still, but took 45 s to compile cold plus 14 s per new batch shape.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenlane.kernels.reference import check_kv_scales, is_fp8

log = logging.getLogger("tokenlane.kernels")

# Gathered K + V bytes of one decode group. Of 0.5, 1 and 2 MiB, 2 was fastest on a 1 MiB-L2
# EPYC (fewer, bigger calls); unbounded (one gather of every decode) was slower.
DECODE_GROUP_BYTES = 2 << 20
# A group's rows (sequences x padded length) may be at most this share of padding.
DECODE_GROUP_MAX_WASTE = 0.25
# Work (query rows x context length) from which one attention call uses every thread.
_PARALLEL_WORK = 1 << 15
# (context token, KV head) rows of all decodes from which the C kernel uses every thread.
_NATIVE_PARALLEL_ROWS = 1 << 13
# Scratch buffers up to this size are kept for the next call; bigger gathers are one-off.
_MAX_KEPT_SCRATCH_BYTES = 16 << 20


def paged_attention_cpu(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32: context length including this step's queries
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    *,
    batch_decodes: bool = True,  # False: one SDPA per decode too (the previous path; benchmarks)
    native: bool = False,  # decodes through the C kernel (kernels/cpu_native.py), one call
    k_scale: float = 1.0,  # fp8 caches: K = stored value * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    # Inference mode throughout: the scratch buffers and the cached plan are reused across
    # calls, and a buffer first made under the model's inference_mode could not be written
    # in place by a later call outside it. The model's forward is in it already (entering it
    # again costs 7 us, every layer).
    if torch.is_inference_mode_enabled():
        return _paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                query_start_loc, scale, out, batch_decodes, native, k_scale, v_scale)
    with torch.inference_mode():
        return _paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                query_start_loc, scale, out, batch_decodes, native, k_scale, v_scale)


_fp8_fallback_logged = False


def _native_reads(cache_dtype: torch.dtype) -> bool:
    """Whether the loaded C library reads fp8 caches of this dtype (one built before fp8 does
    not): else they take the torch path (logged once)."""
    global _fp8_fallback_logged
    from tokenlane.kernels import cpu_native

    if cpu_native.reads_cache_dtype(cache_dtype):
        return True
    if not _fp8_fallback_logged:
        _fp8_fallback_logged = True
        log.info("the native attention kernels do not read %s caches here: that attention runs "
                 "on the torch path", cache_dtype)
    return False


def _paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                     scale, out, batch_decodes, native, k_scale=1.0, v_scale=1.0):
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    if native and is_fp8(key_cache.dtype) and not _native_reads(key_cache.dtype):
        native = False
    if out is None:
        out = torch.empty_like(query)
    # Scales folded out of the products: q . (k ks) = ks (q . k); sum p (v vs) = vs sum p v.
    scale = scale * k_scale
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    if query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of KV heads ({num_kv_heads})")
    # Bytes of one gathered token (K + V), with their float32 copies for a narrower cache.
    upcast_bytes = 0 if key_cache.dtype == torch.float32 else 4
    row_bytes = 2 * num_kv_heads * head_dim * (key_cache.element_size() + upcast_bytes)
    if native:
        from tokenlane.kernels import cpu_native

        native_prefill = cpu_native.prefill_supported(head_dim, query.shape[1] // num_kv_heads)
    else:
        native_prefill = False
    plan = _plan_for(block_tables, seq_lens, query_start_loc, block_size, row_bytes,
                     batch_decodes, native, native_prefill)
    # Most calls here are small: run them on one thread, as an OpenMP fork/join per op costs
    # more than the op (and far more on a busy host). Big ones get all threads back.
    threads = torch.get_num_threads()
    if plan.native_decodes is not None or plan.native_prefills is not None:
        from tokenlane.kernels import cpu_native

        # In a pool step (cpu_native.pool_step) the C kernels take the helper pool, else the OpenMP team.
        native_threads = cpu_native.pool_threads()
        pool = cpu_native.in_pool_step()
        if plan.native_decodes is not None:
            _attend_decodes_native(query, key_cache, value_cache, block_tables, plan.native_decodes,
                                   scale, out, native_threads, pool, v_scale)
        if plan.native_prefills is not None:
            _attend_prefills_native(query, key_cache, value_cache, block_tables, plan.native_prefills,
                                    scale, out, native_threads, pool, v_scale)
    try:
        current = threads
        for group in plan.decode_groups:
            current = _use_threads(threads if group.work >= _PARALLEL_WORK else 1, current)
            _attend_decode_group(query, key_cache, value_cache, group, scale, out, v_scale)
        for seq in plan.sequences:
            current = _use_threads(threads if seq.work >= _PARALLEL_WORK else 1, current)
            _attend_sequence(query, key_cache, value_cache, block_tables, seq, scale, out, v_scale)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    return out


def _use_threads(wanted: int, current: int) -> int:
    if wanted != current:
        torch.set_num_threads(wanted)
    return wanted


# --------------------------------------------------------------------------- the plan


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | slice  # the decodes' query (= output) rows; a slice when consecutive
    blocks: torch.Tensor  # [n * blocks_per_seq] int64: cache blocks to gather, row-major
    blocks_per_seq: int
    max_len: int  # longest context of the group (the gather is sliced to it)
    padding: torch.Tensor | None  # int64 gathered rows past their sequence's context
    mask: torch.Tensor | None  # [n, 1, 1, max_len] float32, 0 or -inf; None = no padding
    work: int


@dataclass
class _Sequence:
    q_start: int
    q_end: int
    ctx_len: int
    index: int  # row of block_tables
    work: int


@dataclass
class _NativeDecodes:
    """Every decode of the batch, for one call of the C kernel."""

    rows: torch.Tensor  # [n] int32: query (= output) row
    seqs: torch.Tensor  # [n] int32: block-table row
    lens: torch.Tensor  # [n] int32: context length
    max_len: int
    context_tokens: int  # summed over the decodes


@dataclass
class _NativePrefills:
    """Every prefill chunk of the batch, for one call of the C prefill kernel."""

    q_starts: torch.Tensor  # [n] int32: first query (= output) row
    q_lens: torch.Tensor  # [n] int32: query rows
    ctx_lens: torch.Tensor  # [n] int32: context length, the chunk's own tokens included
    seqs: torch.Tensor  # [n] int32: block-table row
    work: int  # query rows x context length, summed over the chunks


@dataclass
class _Plan:
    decode_groups: list[_DecodeGroup]
    sequences: list[_Sequence]
    native_decodes: _NativeDecodes | None = None
    native_prefills: _NativePrefills | None = None


_local = threading.local()


def _plan_for(block_tables, seq_lens, query_start_loc, block_size, row_bytes, batch_decodes,
              native, native_prefill=False):
    """The batch's plan, reused while the metadata holds the same values: every layer of a
    forward pass passes the same metadata. Compared by value (three small `torch.equal`s), so
    new tensors, in-place edits and inference tensors (no version counter) are all safe."""
    key = (block_size, row_bytes, batch_decodes, native, native_prefill)
    tensors = (block_tables, seq_lens, query_start_loc)
    cached = getattr(_local, "plan", None)
    if cached is not None:
        cached_key, copies, plan = cached
        if cached_key == key and all(
            c.shape == t.shape and c.dtype == t.dtype and torch.equal(c, t)
            for c, t in zip(copies, tensors)
        ):
            return plan
    plan = _build_plan(block_tables, seq_lens, query_start_loc, block_size, row_bytes,
                       batch_decodes, native, native_prefill)
    _local.plan = (key, tuple(t.clone() for t in tensors), plan)
    return plan


def _build_plan(block_tables, seq_lens, query_start_loc, block_size, row_bytes, batch_decodes,
                native=False, native_prefill=False):
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes, sequences = [], []
    for s, ctx_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len == 1 and batch_decodes:
            decodes.append((ctx_len, s))
        else:
            sequences.append(_Sequence(q_start, q_end, ctx_len, s, q_len * ctx_len))
    decodes.sort(reverse=True)  # longest first: a group's first member sets its length
    if native:
        # Longest first also balances the C kernel's threads (items are taken in order).
        native_decodes = None
        if decodes:
            # One [3, n] int32 array through numpy (a list to an array is one C loop; three
            # torch.tensor calls cost about three times as much), then its rows.
            columns = torch.from_numpy(np.array(
                [[starts[s] for _, s in decodes], [s for _, s in decodes], [c for c, _ in decodes]], dtype=np.int32))
            native_decodes = _NativeDecodes(
                rows=columns[0],
                seqs=columns[1],
                lens=columns[2],
                max_len=decodes[0][0],
                context_tokens=sum(c for c, _ in decodes),
            )
        native_prefills = None
        if native_prefill and sequences:
            native_prefills = _NativePrefills(
                q_starts=torch.tensor([q.q_start for q in sequences], dtype=torch.int32),
                q_lens=torch.tensor([q.q_end - q.q_start for q in sequences], dtype=torch.int32),
                ctx_lens=torch.tensor([q.ctx_len for q in sequences], dtype=torch.int32),
                seqs=torch.tensor([q.index for q in sequences], dtype=torch.int32),
                work=sum(q.work for q in sequences),
            )
            sequences = []
        return _Plan([], sequences, native_decodes, native_prefills)
    bounds, first, total = [], 0, 0  # groups as [first, end) ranges of `decodes`
    for i, (ctx_len, _) in enumerate(decodes):
        n = i - first + 1
        padded = n * _round_up(decodes[first][0], block_size)
        if n > 1 and (total + ctx_len < (1 - DECODE_GROUP_MAX_WASTE) * padded
                      or padded * row_bytes > DECODE_GROUP_BYTES):
            bounds.append((first, i))
            first, total = i, 0
        total += ctx_len
    if decodes:
        bounds.append((first, len(decodes)))
    return _Plan(_decode_groups(decodes, bounds, block_tables, starts, block_size), sequences)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _decode_groups(decodes, bounds, block_tables, starts, block_size) -> list[_DecodeGroup]:
    """Index tensors of every group, built for all decodes at once and sliced per group (a
    few ops per step, whatever the number of groups)."""
    if not decodes:
        return []
    ctx_list = [c for c, _ in decodes]
    row_list = [starts[s] for _, s in decodes]
    ctx = torch.tensor(ctx_list)
    rows = torch.tensor(row_list)
    width = -(-ctx_list[0] // block_size)
    tables = block_tables.index_select(0, torch.tensor([s for _, s in decodes]))[:, :width].long()
    # Table entries past a sequence's own blocks may be anything: read its first block there
    # instead (always a valid index); those rows are zeroed after the gather.
    own = torch.arange(width)[None, :] < (ctx[:, None] + block_size - 1) // block_size
    tables = torch.where(own, tables, tables[:, :1])
    positions = torch.arange(width * block_size)
    groups = []
    for first, end in bounds:
        n, max_len = end - first, ctx_list[first]
        per_seq = -(-max_len // block_size)
        padding = mask = None
        if ctx_list[end - 1] < max_len:  # sorted: shorter members leave padded rows
            past = positions[None, :max_len] >= ctx[first:end, None]  # [n, max_len]
            seq_idx, pos = past.nonzero().unbind(1)
            padding = seq_idx * (per_seq * block_size) + pos  # rows of the gathered buffer
            # Additive: SDPA would turn a bool mask into this on every call.
            mask = torch.zeros(past.shape).masked_fill_(past, float("-inf"))[:, None, None, :]
        r0 = row_list[first]
        consecutive = row_list[first:end] == list(range(r0, r0 + n))
        groups.append(_DecodeGroup(
            rows=slice(r0, r0 + n) if consecutive else rows[first:end],
            blocks=tables[first:end, :per_seq].reshape(-1),
            blocks_per_seq=per_seq,
            max_len=max_len,
            padding=padding,
            mask=mask,
            work=n * max_len,
        ))
    return groups


# --------------------------------------------------------------------------- attention


def _attend_decode_group(query, key_cache, value_cache, group, scale, out, v_scale=1.0):
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    n = group.blocks.numel() // group.blocks_per_seq
    padded_len = group.blocks_per_seq * block_size
    k = _gather(key_cache, group.blocks, "k")
    v = _gather(value_cache, group.blocks, "v")
    if group.padding is not None:  # (0 is also fp8's zero: fill the bytes)
        _bytes(k).view(-1, num_kv_heads * head_dim).index_fill_(0, group.padding, 0)
        _bytes(v).view(-1, num_kv_heads * head_dim).index_fill_(0, group.padding, 0)
    k, v = _as_float(k, "k32"), _as_float(v, "v32")  # contiguous: a plain conversion
    # [n, Hkv, len, D] strided views of the gathered blocks.
    k = k.view(n, padded_len, num_kv_heads, head_dim)[:, : group.max_len].transpose(1, 2)
    v = v.view(n, padded_len, num_kv_heads, head_dim)[:, : group.max_len].transpose(1, 2)
    # A KV head's query heads are consecutive: [n, Hkv, G, D] reads them as G query rows.
    rows = group.rows
    q = query[rows] if isinstance(rows, slice) else query.index_select(0, rows)
    q = q.view(n, num_kv_heads, -1, head_dim)
    if q.dtype != torch.float32:
        q = q.float()
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
    if v_scale != 1.0:
        o.mul_(v_scale)
    o = o.reshape(n, num_heads, head_dim).to(out.dtype)
    if isinstance(rows, slice):
        out[rows] = o
    else:
        out.index_copy_(0, rows, o)


def _attend_decodes_native(query, key_cache, value_cache, block_tables, decodes, scale, out,
                           threads, pool=False, v_scale=1.0):
    from tokenlane.kernels import cpu_native

    num_kv_heads = key_cache.shape[2]
    # Below this many (context token, KV head) rows one thread is faster than starting more
    # (a thread start costs about what 1-2k rows of attention do).
    if decodes.context_tokens * num_kv_heads < _NATIVE_PARALLEL_ROWS:
        threads = 1
    q = query if query.dtype == torch.float32 else query.float()
    o = out if out.dtype == torch.float32 else _scratch("o32", out.shape, torch.float32, out.device)
    cpu_native.paged_decode_attention(
        q, key_cache, value_cache, block_tables, decodes.rows, decodes.seqs, decodes.lens,
        decodes.max_len, scale, o, threads, pool)
    if o is not out or v_scale != 1.0:
        rows = decodes.rows.long()
        out.index_copy_(0, rows, o.index_select(0, rows).mul_(v_scale).to(out.dtype))


def _attend_prefills_native(query, key_cache, value_cache, block_tables, prefills, scale, out,
                            threads, pool=False, v_scale=1.0):
    from tokenlane.kernels import cpu_native

    if prefills.work < _PARALLEL_WORK:
        threads = 1
    q = query if query.dtype == torch.float32 else query.float()
    o = out if out.dtype == torch.float32 else _scratch("o32", out.shape, torch.float32, out.device)
    cpu_native.paged_prefill_attention(
        q, key_cache, value_cache, block_tables, prefills.q_starts, prefills.q_lens,
        prefills.ctx_lens, prefills.seqs, scale, o, threads, pool)
    if o is not out or v_scale != 1.0:
        for start, n in zip(prefills.q_starts.tolist(), prefills.q_lens.tolist()):
            out[start : start + n] = o[start : start + n].mul(v_scale).to(out.dtype)


def _attend_sequence(query, key_cache, value_cache, block_tables, seq, scale, out, v_scale=1.0):
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    q_len, ctx_len = seq.q_end - seq.q_start, seq.ctx_len
    blocks = block_tables[seq.index, : -(-ctx_len // block_size)].long()
    k = _bytes(key_cache).index_select(0, blocks).view(key_cache.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]
    v = _bytes(value_cache).index_select(0, blocks).view(value_cache.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]
    q = query[seq.q_start : seq.q_end]
    q, k, v = (t if t.dtype == torch.float32 else t.float() for t in (q, k, v))
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
        q4, k4, v4, attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    if v_scale != 1.0:
        o.mul_(v_scale)
    out[seq.q_start : seq.q_end] = o[0].transpose(0, 1).to(out.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """torch's CPU index ops lack float8: an fp8 tensor moves as its bytes."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def _gather(cache: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
    """cache[blocks] into a reused buffer (no allocation, no page faults per call)."""
    src = _bytes(cache)
    buf = _scratch(name, (blocks.numel(), *cache.shape[1:]), src.dtype, cache.device)
    return torch.index_select(src, 0, blocks, out=buf).view(cache.dtype)


def _as_float(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t
    return _scratch(name, t.shape, torch.float32, t.device).copy_(t)


def _scratch(name, shape, dtype, device) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
        buf = torch.empty(numel, dtype=dtype, device=device)
        if numel * buf.element_size() <= _MAX_KEPT_SCRATCH_BYTES:
            buffers[name] = buf
    return buf[:numel].view(shape)
