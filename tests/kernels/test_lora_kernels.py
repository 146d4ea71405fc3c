"""The segmented LoRA product (kernels/lora.py): torch and Triton paths against `lora_ref`.

Batches mix rows of several slots (ranks 8/16/64 in slots of rank 64), rows of no adapter,
slots no row uses, runs of one slot split by other rows, and a fused q/k/v-like projection
(three sub-projections writing column slices of one output). Triton runs under its
interpreter on a machine without CUDA (tests/kernels/conftest.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenlane.kernels.lora import add_lora, lora_segments
from tokenlane.kernels.reference import lora_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton interprets on the CPU (conftest)

SLOT_RANK = 64
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def make_slots(num_slots, ranks, K, widths, dtype, seed=0):
    """Stacked slot weights with ranks[s] live rows per sub-projection, zero past them."""
    gen = torch.Generator().manual_seed(seed)
    groups = len(widths)
    lora_a = torch.zeros(num_slots, groups * SLOT_RANK, K)
    lora_b = [torch.zeros(num_slots, SLOT_RANK, n) for n in widths]
    for s, r in enumerate(ranks):
        lora_a[s, : groups * r] = torch.randn(groups * r, K, generator=gen) / K**0.5
        for g in range(groups):
            lora_b[g][s, :r] = torch.randn(r, widths[g], generator=gen) / r**0.5
    scaling = torch.rand(num_slots, groups, generator=gen) + 0.5
    return (lora_a.to(dtype).to(DEVICE), [b.to(dtype).to(DEVICE) for b in lora_b], scaling.to(DEVICE))


def runs_of(token_slots):
    runs, start = [], 0
    for i in range(1, len(token_slots) + 1):
        if i == len(token_slots) or token_slots[i] != token_slots[start]:
            runs.append((start, i - start, token_slots[start]))
            start = i
    return runs


CASES = {
    # name: (token slots, slot ranks)
    "decode-mixed": ([0, -1, 1, 2, 0, 1, -1, 2, 3, 0, 3, 3], [8, 16, 64, 16]),
    "prefill-runs": ([1] * 23 + [-1] * 5 + [0] * 17 + [1] * 3, [16, 8, 64, 8]),
    "empty-slots": ([2, 2, -1, 2], [8, 16, 64, 8]),
    "one-row": ([3], [8, 8, 8, 64]),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("widths", [(48,), (64, 16, 16)], ids=["one", "fused3"])
def test_add_lora_matches_reference(backend, dtype, case, widths):
    token_slots, ranks = CASES[case]
    K, T = 40, len(token_slots)
    lora_a, lora_b, scaling = make_slots(len(ranks), ranks, K, widths, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, K, generator=gen).to(dtype).to(DEVICE)
    fused = torch.randn(T, sum(widths), generator=gen).to(dtype).to(DEVICE)
    outs = list(fused.split(widths, dim=1))  # column views, as the model's fused projections
    expected = lora_ref(outs, x, token_slots, lora_a, lora_b, scaling, ranks)
    segments = lora_segments(runs_of(token_slots), T, ranks, DEVICE)
    add_lora(outs, x, lora_a, lora_b, scaling, segments, backend=backend)
    for out, exp in zip(outs, expected):
        torch.testing.assert_close(out.float(), exp.float(), **TOL[dtype])
    base_rows = [t for t, s in enumerate(token_slots) if s < 0]
    for out, exp in zip(outs, expected):  # rows without an adapter are bitwise unchanged
        assert torch.equal(out[base_rows], exp[base_rows])


def test_segments_group_rows_by_slot_and_keep_contiguous_runs():
    segments = lora_segments([(0, 3, 1), (3, 2, -1), (5, 1, 0), (6, 4, 1)], 10, [8, 16])
    assert segments.slots == [0, 1] and segments.ranks == [8, 16]
    assert segments.order.tolist() == [5, 0, 1, 2, 6, 7, 8, 9]
    assert segments.starts == [0, 1] and segments.lengths == [1, 7]
    assert segments.rows[0] == slice(5, 6)
    assert segments.rows[1].tolist() == [0, 1, 2, 6, 7, 8, 9]
    assert lora_segments([(0, 4, -1)], 4, [8]) is None
    adjacent = lora_segments([(0, 2, 0), (2, 3, 0)], 5, [8])  # merged into one slice
    assert adjacent.rows == [slice(0, 5)]


def test_no_segments_leaves_the_output_alone():
    lora_a, lora_b, scaling = make_slots(2, [8, 8], 16, (8,), torch.float32)
    out = torch.randn(3, 8, device=DEVICE)
    before = out.clone()
    add_lora([out], torch.randn(3, 16, device=DEVICE), lora_a, lora_b, scaling, None)
    assert torch.equal(out, before)


@pytest.mark.parametrize("bad", ["slot", "rank", "dtype", "rows", "out-width", "strided-x"])
def test_launcher_refuses_mismatched_arguments(bad):
    lora_a, lora_b, scaling = make_slots(2, [8, 16], 16, (8,), torch.float32)
    x, out = torch.randn(4, 16, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    ranks, runs, T = [8, 16], [(0, 4, 1)], 4
    if bad == "slot":
        ranks, runs = [8, 16, 8], [(0, 4, 2)]
    elif bad == "rank":
        ranks = [8, 128]
    elif bad == "dtype":
        x = x.to(torch.bfloat16)
    elif bad == "rows":
        T = 5
    elif bad == "out-width":
        out = torch.randn(4, 9, device=DEVICE)
    elif bad == "strided-x":
        x = torch.randn(16, 4, device=DEVICE).T
    segments = lora_segments(runs, T, ranks, DEVICE)
    with pytest.raises(ValueError, match="add_lora"):
        add_lora([out], x, lora_a, lora_b, scaling, segments, backend="torch")


def test_segments_refuse_rows_outside_the_batch():
    with pytest.raises(ValueError, match="outside"):
        lora_segments([(2, 4, 0)], 5, [8])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_random_batches_match_reference(backend):
    rng = random.Random(7)
    ranks = [8, 16, 64, 32, 8]
    lora_a, lora_b, scaling = make_slots(len(ranks), ranks, 32, (24, 8), torch.float32, seed=3)
    for trial in range(4):
        runs, token_slots = [], []
        for _ in range(rng.randint(1, 9)):
            slot, n = rng.randint(-1, len(ranks) - 1), rng.choice([1, 1, 1, 5, 19])
            runs.append((len(token_slots), n, slot))
            token_slots += [slot] * n
        T = len(token_slots)
        x = torch.randn(T, 32, device=DEVICE)
        fused = torch.randn(T, 32, device=DEVICE)
        outs = list(fused.split((24, 8), dim=1))
        expected = lora_ref(outs, x, token_slots, lora_a, lora_b, scaling, ranks)
        add_lora(outs, x, lora_a, lora_b, scaling, lora_segments(runs, T, ranks, DEVICE), backend=backend)
        for out, exp in zip(outs, expected):
            torch.testing.assert_close(out, exp, **TOL[torch.float32])


def test_model_with_triton_lora_equals_peft(tiny_model_dir, tmp_path):
    """The executor on the Triton path (attention and LoRA; the interpreter on a CPU host): a
    step of base and two adapters' prompts, then decodes, greedy as transformers + peft."""
    from lora_helpers import make_peft_adapter, peft_reference, reference_greedy

    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig
    from tokenlane.runtime.core.request import Request, SamplingParams
    from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
    from tokenlane.runtime.executor.model_executor import ModelExecutor

    folders = {"sql": make_peft_adapter(tiny_model_dir, tmp_path / "sql", r=8, seed=11),
               "chat": make_peft_adapter(tiny_model_dir, tmp_path / "chat", r=16, seed=12)}
    engine = EngineConfig(max_loras=2, max_lora_rank=16, kv_cache_blocks=8, block_size=16, device=str(DEVICE),
                                     attention_backend="triton")
    executor = ModelExecutor(RuntimeConfig(model=ModelConfig(path=str(tiny_model_dir), dtype="float32"),
                                           engine=engine))
    for name, folder in folders.items():
        executor.add_adapter(name, str(folder))
    new_tokens = 3
    requests = []
    for i, adapter in enumerate([None, "sql", "chat"]):
        request = Request(f"t{i}", [11 + i, 40, 300 + i, 7, 9], SamplingParams(max_tokens=new_tokens, temperature=0.0))
        request.adapter, request.block_ids = adapter, [i]
        requests.append(request)
    chunks = [ScheduledChunk(r, 0, 5, True) for r in requests]
    for _ in range(new_tokens):
        out = executor.execute(StepPlan(chunks=chunks))
        assert not out.errors
        for c in chunks:
            c.request.num_computed_tokens += c.num_tokens
            c.request.output_token_ids.append(out.sampled[c.request.request_id])
        chunks = [ScheduledChunk(r, r.num_computed_tokens, 1, True) for r in requests]
    for request in requests:
        reference = peft_reference(tiny_model_dir, folders[request.adapter] if request.adapter else None)
        assert request.output_token_ids == reference_greedy(reference, request.prompt_token_ids, new_tokens)[0]
