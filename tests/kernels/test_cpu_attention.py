"""kernels/cpu_attention.py (the CPU `backend="torch"` path) against the torch reference:
decodes batched in length groups, chunks with cached context, fresh chunks, mixed cache and
query dtypes, and the per-batch plan reused across layers."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tokenlane.kernels import cpu_attention, cpu_attention_bench
from tokenlane.kernels.cpu_attention import paged_attention_cpu
from tokenlane.kernels.reference import paged_attention_ref


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):  # tests/conftest.py
    yield


# (context length, query length): decodes of spread lengths, chunks with cached context,
# fresh chunks and an idle sequence, in a shuffled order.
MIXED = [(37, 1), (1, 1), (120, 1), (96, 1), (50, 9), (17, 17), (64, 1), (5, 0), (33, 1),
         (90, 32), (2, 1), (119, 1), (45, 1)]

DTYPES = {  # id: (query dtype, cache dtype)
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp32-query-bf16-cache": (torch.float32, torch.bfloat16),
}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def build(kcase, shapes, *, group=2, block_size=16, dtypes="fp32", **kw):
    query_dtype, cache_dtype = DTYPES[dtypes]
    case = kcase.build([c for c, _ in shapes], [q for _, q in shapes], num_heads=2 * group,
                       num_kv_heads=2, head_dim=32, block_size=block_size, dtype=cache_dtype, **kw)
    case.query = case.query.to(query_dtype)
    return case


def run_both(kcase, case, **kw):
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
            case.query_start_loc, case.scale)
    got = paged_attention_cpu(*args, kcase.poisoned_out(case), **kw)
    return got, paged_attention_ref(*args)


def assert_matches(got, ref):
    assert got.dtype == ref.dtype
    assert not torch.isnan(got).any(), "unwritten or NaN-polluted output rows"
    torch.testing.assert_close(got, ref, **TOL[ref.dtype])


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch_matches_reference(kcase, group, block_size, dtypes):
    shapes = MIXED[:]
    random.Random(group * block_size).shuffle(shapes)
    case = build(kcase, shapes, group=group, block_size=block_size, dtypes=dtypes)
    got, ref = run_both(kcase, case)
    assert_matches(got, ref)


@pytest.mark.parametrize("batch_decodes", [True, False], ids=["grouped", "per-sequence"])
def test_both_decode_paths_match_reference(kcase, batch_decodes):
    case = build(kcase, MIXED)
    got, ref = run_both(kcase, case, batch_decodes=batch_decodes)
    assert_matches(got, ref)


@pytest.mark.parametrize("dtypes", ["fp32", "fp32-query-bf16-cache"])
def test_large_pool_and_long_tables(kcase, dtypes):
    """Thousands of blocks in the pool and tables with hundreds of entries (block size 1)."""
    rng = random.Random(1)
    shapes = [(rng.randint(200, 700), 1) for _ in range(12)] + [(400, 24), (300, 300)]
    case = build(kcase, shapes, block_size=1, dtypes=dtypes, num_blocks=12000,
                 spare_blocks=0, poison_cache=False)
    assert case.block_tables.shape[1] > 600
    got, ref = run_both(kcase, case)
    assert_matches(got, ref)


def group_lengths(shapes, block_size, row_bytes):
    case_lens = torch.tensor([c for c, _ in shapes], dtype=torch.int32)
    qsl = torch.tensor([0] + [sum(q for _, q in shapes[: i + 1]) for i in range(len(shapes))],
                       dtype=torch.int32)
    tables = torch.zeros(len(shapes), -(-max(case_lens.tolist()) // block_size), dtype=torch.int32)
    plan = cpu_attention._build_plan(tables, case_lens, qsl, block_size, row_bytes, True)
    return [g.max_len for g in plan.decode_groups], plan


@pytest.mark.parametrize("block_size", [1, 16])
def test_lengths_straddling_group_boundaries(kcase, block_size):
    """Decodes that fall just inside and just outside a group's padding limit, and a group cut
    by its byte size, all match the reference."""
    longest = 128
    # A group of two wastes < 25% iff the second length >= 0.5 * longest (padded length).
    limit = int((1 - cpu_attention.DECODE_GROUP_MAX_WASTE) * 2 * longest) - longest
    shapes = [(longest, 1), (limit, 1), (limit - 1, 1), (limit - 2, 1), (20, 1), (19, 1),
              (3, 1), (64, 8)]
    row_bytes = 2 * 2 * 32 * 4
    max_lens, _ = group_lengths(shapes, block_size, row_bytes)
    assert max_lens[0] == longest and limit - 1 in max_lens  # the boundary is where we think
    case = build(kcase, shapes, block_size=block_size)
    got, ref = run_both(kcase, case)
    assert_matches(got, ref)

    # Equal lengths, cut only by the byte budget of a group.
    per_group = cpu_attention.DECODE_GROUP_BYTES // (longest * row_bytes)
    equal = [(longest, 1)] * (per_group + 1)
    max_lens, plan = group_lengths(equal, block_size, row_bytes)
    assert [g.work // g.max_len for g in plan.decode_groups] == [per_group, 1]
    case = build(kcase, equal, block_size=block_size)
    got, ref = run_both(kcase, case)
    assert_matches(got, ref)


def test_empty_batch():
    query = torch.empty(0, 4, 32)
    cache = torch.zeros(4, 16, 2, 32)
    out = paged_attention_cpu(query, cache, cache, torch.zeros((0, 1), dtype=torch.int32),
                              torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                              0.1)
    assert out.shape == (0, 4, 32)


def test_plan_is_reused_across_layers_and_rebuilt_when_metadata_changes(kcase, monkeypatch):
    case = build(kcase, MIXED)
    builds = []
    real = cpu_attention._build_plan
    monkeypatch.setattr(cpu_attention, "_build_plan", lambda *a: builds.append(1) or real(*a))
    layers = [(case.key_cache, case.value_cache),
              (case.key_cache * 0.5, -case.value_cache)]
    args = (case.block_tables, case.seq_lens, case.query_start_loc, case.scale)
    for key_cache, value_cache in layers:  # a second layer: same metadata, other caches
        got = paged_attention_cpu(case.query, key_cache, value_cache, *args)
        assert_matches(got, paged_attention_ref(case.query, key_cache, value_cache, *args))
    assert len(builds) == 1

    # The same table tensor edited in place (two sequences swap blocks): a new plan.
    case.block_tables[[0, 2]] = case.block_tables[[2, 0]].clone()
    case.seq_lens[[0, 2]] = case.seq_lens[[2, 0]].clone()
    got = paged_attention_cpu(case.query, *layers[0], *args)
    assert_matches(got, paged_attention_ref(case.query, *layers[0], *args))
    assert len(builds) == 2

    # Inference tensors (no version counter), edited in place between two calls.
    with torch.inference_mode():
        tables, lens, qsl = (t.clone() for t in args[:3])
        for swap in (False, True):
            if swap:
                tables[[1, 3]] = tables[[3, 1]].clone()
                lens[[1, 3]] = lens[[3, 1]].clone()
            meta = (tables, lens, qsl, case.scale)
            got = paged_attention_cpu(case.query, *layers[0], *meta)
            assert_matches(got, paged_attention_ref(case.query, *layers[0], *meta))
    assert len(builds) == 3  # same values as the last plan, then edited: one rebuild


@pytest.mark.parametrize("dtypes", ["fp32", "fp32-query-bf16-cache"])
def test_buffers_made_under_inference_mode_serve_later_calls_outside_it(kcase, dtypes):
    # The model runs under inference_mode; tests and benchmarks call the kernel outside it.
    # The thread's scratch buffers and plan outlive a call, so both orders must work.
    case = build(kcase, MIXED, dtypes=dtypes)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
            case.query_start_loc, case.scale)
    ref = paged_attention_ref(*args)
    cpu_attention._local.__dict__.clear()
    with torch.inference_mode():
        assert_matches(paged_attention_cpu(*args), ref)
    assert_matches(paged_attention_cpu(*args, kcase.poisoned_out(case)), ref)
    assert_matches(paged_attention_cpu(*args[:2], case.value_cache * 1.0, *args[3:]), ref)


def test_threads_are_restored_and_bad_head_counts_rejected(kcase):
    case = build(kcase, [(300, 200), (40, 1)])
    torch.set_num_threads(2)
    got, ref = run_both(kcase, case)  # the chunk is big enough to take every thread
    assert torch.get_num_threads() == 2
    assert_matches(got, ref)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention_cpu(case.query[:, :3], case.key_cache, case.value_cache,
                            case.block_tables, case.seq_lens, case.query_start_loc, case.scale)


def test_table_entries_past_a_sequence_are_never_read(kcase):
    """Entries past a sequence's own blocks (padding of the table) may hold any value."""
    shapes = [(70, 1), (60, 1), (33, 1), (5, 1), (40, 6)]  # 70 and 60 share a group
    case = build(kcase, shapes)
    for s, (ctx, _) in enumerate(shapes):
        case.block_tables[s, -(-ctx // 16):] = 10**6
    got, ref = run_both(kcase, case)
    assert_matches(got, ref)


def test_benchmark_script_runs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cpu_attention_bench.main(["--quick", "--rounds", "1", "--steps", "1",
                                     "--json", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["seqs"] == 4 and max(case["max_abs_error"].values()) < 1e-5
    assert "| 4 | U[16, 64] |" in capsys.readouterr().out
