"""Kernel-test fixtures.

On a machine without CUDA the Triton kernels run in Triton's interpreter. Triton decides that
when a kernel is decorated, i.e. when `tokenlane.kernels.triton_kernels` is first imported, so
TRITON_INTERPRET is set here, at collection time, before any test imports that module. It stays
set for the rest of the pytest process: nothing else in the project launches Triton kernels on
the CPU, and tokenlane code only imports the kernels module lazily (kernels/api.py).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    mod = sys.modules.get("tokenlane.kernels.triton_kernels")
    if mod is not None and not mod.INTERPRETED:  # imported earlier without the interpreter
        importlib.reload(mod)

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# Per-dtype tolerances of the kernels against float64 dense attention of the same inputs.
KERNEL_TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
# The reference computes in fp32 and rounds only the output.
REFERENCE_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def build_case(
    seq_lens,
    query_lens,
    *,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    dtype=torch.float32,
    shuffle=True,
    spare_blocks=3,
    table_padding=2,
    first_block=0,
    num_blocks=None,
    poison_cache=True,
    seed=0,
    device=DEVICE,
):
    """A paged batch: random dense K/V per sequence scattered into shuffled physical blocks.

    Blocks no sequence owns (and the padding of the block table, which points at one of them)
    hold NaN, so any read past a sequence's context shows up in the output. The block table is
    a column slice of a wider tensor (non-contiguous rows)."""
    assert len(seq_lens) == len(query_lens)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    total = sum(needed)
    if num_blocks is None:
        num_blocks = first_block + total + spare_blocks
    assert num_blocks >= first_block + total + 1
    candidates = torch.arange(first_block, first_block + total + 1)
    if shuffle:
        candidates = candidates[torch.randperm(len(candidates), generator=gen)]
    owned, poisoned_block = candidates[:total], int(candidates[total])

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if poison_cache:
        key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    else:  # a huge cache: touch only the blocks in use
        key_cache = torch.empty(shape, dtype=dtype, device=device)
        value_cache = torch.empty(shape, dtype=dtype, device=device)
        key_cache[poisoned_block] = float("nan")
        value_cache[poisoned_block] = float("nan")
    width = max(needed) + table_padding
    wide = torch.full((len(seq_lens), width + 3), poisoned_block, dtype=torch.int32)
    block_tables = wide[:, 1 : 1 + width]  # stride(0) != width

    keys, values, cursor = [], [], 0
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        blocks = owned[cursor : cursor + needed[s]]
        cursor += needed[s]
        block_tables[s, : needed[s]] = blocks.to(torch.int32)
        for i, b in enumerate(blocks.tolist()):
            rows = slice(i * block_size, min(n, (i + 1) * block_size))
            key_cache[b, : rows.stop - rows.start] = k[rows].to(device)
            value_cache[b, : rows.stop - rows.start] = v[rows].to(device)
        keys.append(k)
        values.append(v)

    num_tokens = sum(query_lens)
    query = (torch.randn(num_tokens, num_heads, head_dim, generator=gen)).to(dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return SimpleNamespace(
        query=query.to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        keys=keys,
        values=values,
        seq_lens_list=list(seq_lens),
        query_lens=list(query_lens),
        dtype=dtype,
    )


def dense_attention_f64(case) -> torch.Tensor:
    """Non-paged causal attention in float64: query i of a sequence with context L and query
    length q sits at position L - q + i."""
    query = case.query.cpu().double()
    out = torch.empty_like(query)
    num_heads = query.shape[1]
    start = 0
    for k, v, n, q_len in zip(case.keys, case.values, case.seq_lens_list, case.query_lens):
        if q_len == 0:
            continue
        group = num_heads // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        qq = query[start : start + q_len].transpose(0, 1)  # [H, q, D]
        scores = qq @ kk.transpose(1, 2) * case.scale
        q_pos = torch.arange(n - q_len, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[start : start + q_len] = (scores.softmax(-1) @ vv).transpose(0, 1)
        start += q_len
    return out


def poisoned_out(case) -> torch.Tensor:
    return torch.full_like(case.query, float("nan"))


def assert_close_all_written(actual, expected, tol, what=""):
    assert not torch.isnan(actual).any(), f"{what}: output has unwritten (NaN) elements"
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), **tol, msg=what)


@pytest.fixture
def kcase():
    return SimpleNamespace(
        build=build_case,
        dense=dense_attention_f64,
        poisoned_out=poisoned_out,
        check=assert_close_all_written,
        KERNEL_TOL=KERNEL_TOL,
        REFERENCE_TOL=REFERENCE_TOL,
        DEVICE=DEVICE,
        HAS_CUDA=HAS_CUDA,
    )
