"""Triton paged attention against the torch reference and a float64 dense attention.

Runs in Triton's interpreter on the CPU (tests/kernels/conftest.py), natively on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from tokenlane.kernels.reference import paged_attention_ref
from tokenlane.kernels.triton_kernels import paged_attention_triton

# (seq_lens, query_lens): context includes this step's queries.
SCENARIOS = {
    # decodes: length 1, block boundaries (15/16/17 with block 16), odd lengths
    "decode": ([1, 15, 16, 17, 33, 40], [1, 1, 1, 1, 1, 1]),
    # prefills from scratch, one across several blocks with an odd length
    "prefill": ([1, 16, 37], [1, 16, 37]),
    # chunked prefill on top of cached context, decodes, a fresh prefill, together
    "mixed": ([21, 1, 48, 9, 32], [5, 1, 1, 9, 16]),
}


def run_both(kcase, case, tol_kernel, **kwargs):
    out = kcase.poisoned_out(case)
    result = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, case.scale, out, **kwargs,
    )
    assert result is out
    dense = kcase.dense(case)
    kcase.check(out, dense, tol_kernel, "triton vs float64 dense")
    ref = paged_attention_ref(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, case.scale,
    )
    # Both round to the same dtype: allow the kernel tolerance between them.
    kcase.check(out, ref, tol_kernel, "triton vs torch reference")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenarios_by_dtype(kcase, scenario, dtype):
    seq_lens, query_lens = SCENARIOS[scenario]
    case = kcase.build(seq_lens, query_lens, dtype=dtype, seed=hash(scenario) % 1000)
    run_both(kcase, case, kcase.KERNEL_TOL[dtype])


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_ratios(kcase, group):
    seq_lens, query_lens = SCENARIOS["mixed"]
    case = kcase.build(seq_lens, query_lens, num_heads=2 * group, num_kv_heads=2, seed=group)
    run_both(kcase, case, kcase.KERNEL_TOL[torch.float32])


def test_mqa_and_non_power_of_two_group(kcase):
    case = kcase.build([19, 7], [3, 1], num_heads=3, num_kv_heads=1, seed=5)
    run_both(kcase, case, kcase.KERNEL_TOL[torch.float32])


@pytest.mark.parametrize(
    "head_dim,block_size", [(64, 32), (128, 16), (128, 32), (80, 16), (96, 32), (64, 4)]
)
def test_head_dims_and_block_sizes(kcase, head_dim, block_size):
    case = kcase.build([45, 1, 64], [6, 1, 1], head_dim=head_dim, block_size=block_size,
                       dtype=torch.float16, seed=head_dim + block_size)
    run_both(kcase, case, kcase.KERNEL_TOL[torch.float16])


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_split_kv(kcase, scenario, num_splits):
    """The flash-decoding path: KV ranges split across programs, then merged. Splits that
    get no KV tile (short sequences, 7 splits) must not disturb the merge."""
    seq_lens, query_lens = SCENARIOS[scenario]
    case = kcase.build(seq_lens, query_lens, dtype=torch.bfloat16, seed=num_splits)
    run_both(kcase, case, kcase.KERNEL_TOL[torch.bfloat16], num_splits=num_splits)


def test_split_kv_long_context(kcase):
    case = kcase.build([300, 257], [1, 2], block_size=32, dtype=torch.float16, seed=11)
    run_both(kcase, case, kcase.KERNEL_TOL[torch.float16], num_splits=4)


def test_sequence_without_queries_this_step(kcase):
    case = kcase.build([12, 20, 5], [3, 0, 5], seed=3)
    run_both(kcase, case, kcase.KERNEL_TOL[torch.float32])


def test_strided_query_and_output(kcase):
    """The model slices q out of a fused qkv projection; outputs may be views too."""
    case = kcase.build([30, 3], [4, 3], seed=7)
    num_tokens, num_heads, head_dim = case.query.shape
    fused = torch.randn(num_tokens, num_heads + 4, head_dim, device=case.query.device)
    fused[:, 2 : 2 + num_heads] = case.query
    case.query = fused[:, 2 : 2 + num_heads]
    assert not case.query.is_contiguous()
    out_wide = torch.full((num_tokens, num_heads + 1, head_dim), float("nan"),
                          device=case.query.device)
    out = out_wide[:, 1:]
    paged_attention_triton(case.query, case.key_cache, case.value_cache, case.block_tables,
                           case.seq_lens, case.query_start_loc, case.scale, out)
    kcase.check(out, kcase.dense(case), kcase.KERNEL_TOL[torch.float32], "strided")
    assert torch.isnan(out_wide[:, 0]).all(), "wrote outside the output view"


def test_host_hints_match_synced_path(kcase):
    seq_lens, query_lens = SCENARIOS["mixed"]
    case = kcase.build(seq_lens, query_lens, seed=9)
    hinted = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, case.scale, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    kcase.check(hinted, kcase.dense(case), kcase.KERNEL_TOL[torch.float32], "hinted")


def test_blocks_beyond_int32_offsets(kcase):
    """Blocks at element offsets past 2**31: int32 index arithmetic would wrap around.

    The fp16 cache is 2**31 + 2**17 elements per tensor (4 GiB of address space each), but
    only the blocks in use are ever touched, so the resident memory stays a few MiB."""
    head_dim, block_size = 64, 16
    per_block = block_size * head_dim
    num_blocks = (2**31) // per_block + 128
    case = kcase.build([40, 1, 17], [2, 1, 1], num_heads=2, num_kv_heads=1,
                       head_dim=head_dim, block_size=block_size, dtype=torch.float16,
                       first_block=num_blocks - 16, num_blocks=num_blocks,
                       poison_cache=False, seed=13)
    assert int(case.block_tables[:, 0].min()) * per_block >= 2**31
    run_both(kcase, case, kcase.KERNEL_TOL[torch.float16])
    run_both(kcase, case, kcase.KERNEL_TOL[torch.float16], num_splits=2)


# ---- input validation -------------------------------------------------------------------


def _valid_args(kcase):
    case = kcase.build([5], [1], seed=1)
    return case, [case.query, case.key_cache, case.value_cache, case.block_tables,
                  case.seq_lens, case.query_start_loc, case.scale]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.__setitem__(0, a[0].half()), "query dtype"),
        (lambda a: a.__setitem__(0, a[0][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.__setitem__(0, a[0][..., :32]), r"query must be \[T, num_heads, 64\]"),
        (lambda a: a.__setitem__(2, a[2][:, :8]), "value_cache shape"),
        (lambda a: a.__setitem__(1, a[1].transpose(2, 3).contiguous().transpose(2, 3)),
         "contiguous in head_dim"),
        (lambda a: a.__setitem__(3, a[3].long()), "block_tables must be int32"),
        (lambda a: a.__setitem__(4, a[4].long()), "seq_lens must be a 1-D int32"),
        (lambda a: a.__setitem__(5, a[5][:1]), "query_start_loc must be int32"),
        (lambda a: a.__setitem__(4, a[4] * 0), "seq_len must be >= its query length"),
        (lambda a: a.__setitem__(4, a[4] + 1000), "exceeds the block table"),
        (lambda a: a.__setitem__(5, a[5] + 1), "rise from 0"),
    ],
)
def test_bad_inputs_raise_clear_errors(kcase, mutate, match):
    _, args = _valid_args(kcase)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(*args)


def test_bad_out_buffer(kcase):
    case, args = _valid_args(kcase)
    with pytest.raises(ValueError, match="out must match query"):
        paged_attention_triton(*args, out=case.query.half())


def test_unsupported_block_size(kcase):
    case, args = _valid_args(kcase)
    args[1] = args[2] = torch.zeros(2, 512, 2, 64, device=case.key_cache.device)
    with pytest.raises(ValueError, match=r"block_size must be in \[1, 256\]"):
        paged_attention_triton(*args)


# ---- slow sweep -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_batches(kcase, seed):
    rng = random.Random(seed)
    block_size = rng.choice([16, 32])
    group = rng.choice([1, 2, 4, 8])
    num_kv_heads = rng.choice([1, 2])
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    seq_lens, query_lens = [], []
    for _ in range(rng.randint(1, 6)):
        n = rng.randint(1, 150)
        q = rng.choice([1, 1, n, rng.randint(1, n)])
        seq_lens.append(n)
        query_lens.append(q)
    case = kcase.build(seq_lens, query_lens, num_heads=group * num_kv_heads,
                       num_kv_heads=num_kv_heads, head_dim=rng.choice([64, 128, 96]),
                       block_size=block_size, dtype=dtype, seed=seed)
    run_both(kcase, case, kcase.KERNEL_TOL[dtype], num_splits=rng.choice([None, 1, 2, 5]))


# ---- launch planning (pure) -----------------------------------------------------------


def test_split_heuristic():
    from tokenlane.kernels.triton_kernels import MAX_SPLITS, choose_num_splits

    sms = 132
    assert choose_num_splits(32 * 8, 4096, sms) == 1  # enough (sequence, head) programs
    assert choose_num_splits(8 * 8, 32768, sms) == 9  # few long sequences: split
    assert choose_num_splits(1 * 8, 32768, sms) == MAX_SPLITS
    assert choose_num_splits(1 * 8, 4096, sms) == 8  # >= 512 keys per split
    assert choose_num_splits(1 * 8, 300, sms) == 1  # too short to split


def test_plan_counts_one_tile_per_decode(monkeypatch):
    import tokenlane.kernels.triton_kernels as tk

    monkeypatch.setattr(tk, "INTERPRETED", False)
    monkeypatch.setattr(tk, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    decode = tk.plan_launch(8, 8, 32, 8, 1, 32768, cuda)
    assert (decode["block_m"], decode["block_q"], decode["num_splits"]) == (16, 4, 9)
    prefill = tk.plan_launch(4096, 1, 32, 8, 4096, 4096, cuda)
    assert (prefill["block_m"], prefill["block_q"], prefill["num_splits"]) == (128, 32, 1)
    mixed = tk.plan_launch(1024 + 64, 66, 32, 8, 512, 4096, cuda)
    assert mixed["block_m"] == 64 and mixed["num_q_tiles"] == 1088 // 16 + 66
    assert tk.plan_launch(8, 8, 32, 8, 1, 32768, cuda, num_splits=3)["num_splits"] == 3
