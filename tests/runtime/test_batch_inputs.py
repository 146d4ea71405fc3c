"""The flat batch built with tensor ops (runtime/executor/batch_inputs.py) against a plain per-token
reference, on random mixed batches over several steps (block tables growing, copied on
write, freed and refilled, rows released and reused)."""

from __future__ import annotations

import random

import pytest
import torch

from tokenlane.runtime.executor.batch_inputs import BatchInputBuilder, PersistentBlockTables
from tokenlane.runtime.core.step_plan import ScheduledChunk
from tokenlane.runtime.core.request import Request, SamplingParams, TokenLogprob


def reference_inputs(chunks: list[ScheduledChunk], block_size: int, sdpa_fresh_prefill: bool) -> dict:
    """Every token's id, position and slot, and every sequence's block row, one at a time."""
    if sdpa_fresh_prefill:
        paged = [c for c in chunks if c.start > 0]
        ordered = paged + [c for c in chunks if c.start == 0]
    else:
        ordered = paged = chunks
    ids, positions, slots, seq_lens, query_lens, logits_rows = [], [], [], [], [], []
    prompt_rows, prompt_targets, prompt_ks, prompt_spans = [], [], [], []
    offset = 0
    for c in ordered:
        request = c.request
        everything = request.prompt_token_ids + request.output_token_ids
        for p in range(c.start, c.start + c.num_tokens):
            ids.append(everything[p])
            positions.append(p)
            slots.append(request.block_ids[p // block_size] * block_size + p % block_size)
        seq_lens.append(c.start + c.num_tokens)
        query_lens.append(c.num_tokens)
        k = request.sampling_params.prompt_logprobs
        if k is not None:
            for p in range(c.start, c.start + c.num_tokens):
                # Position p scores prompt token p + 1 unless that one was scored already.
                if p + 1 < request.num_prompt_tokens and p + 1 >= len(request.prompt_logprobs):
                    prompt_rows.append(offset + p - c.start)
                    prompt_targets.append(request.prompt_token_ids[p + 1])
                    prompt_ks.append(k)
            first = max(c.start, len(request.prompt_logprobs) - 1) + 1
            count = min(c.start + c.num_tokens, request.num_prompt_tokens - 1) - first + 1
            if count > 0:
                prompt_spans.append((request.request_id, first, count))
        offset += c.num_tokens
        if c.sample:
            logits_rows.append(offset - 1)
    n_paged = len(paged)
    max_blocks = max((-(-s // block_size) for s in seq_lens[:n_paged]), default=1)
    table = [c.request.block_ids[:max_blocks] + [0] * (max_blocks - len(c.request.block_ids[:max_blocks]))
             for c in paged]
    qsl = [0]
    for q in query_lens[:n_paged]:
        qsl.append(qsl[-1] + q)
    return dict(
        input_ids=ids, positions=positions, slot_mapping=slots, block_tables=table or [],
        seq_lens=seq_lens[:n_paged], query_start_loc=qsl, num_paged_tokens=sum(query_lens[:n_paged]),
        fresh_query_lens=query_lens[n_paged:], all_seq_lens=seq_lens, all_query_lens=query_lens,
        logits_rows=logits_rows + prompt_rows, prompt_targets=prompt_targets, prompt_ks=prompt_ks,
        prompt_spans=prompt_spans,
    )


BLOCK_SIZE = 4


class Pool:
    """Hands out distinct block ids (in random order) and takes them back."""

    def __init__(self, rng: random.Random, size: int = 4096) -> None:
        self.free = list(range(1, size))
        rng.shuffle(self.free)

    def cover(self, request: Request, tokens: int) -> None:
        while len(request.block_ids) * BLOCK_SIZE < tokens:
            request.block_ids.append(self.free.pop())

    def clear(self, request: Request) -> None:
        self.free += request.block_ids
        request.block_ids.clear()


def random_chunk(rng: random.Random, pool: Pool, request: Request) -> ScheduledChunk:
    """A decode, a fresh prefill chunk, a chunk with cached context, or a recomputation
    over prompt and generated tokens, for this request as it stands."""
    total = request.num_tokens
    kind = rng.choice(["decode", "decode", "fresh", "cached", "recompute"])
    if kind == "decode" and request.output_token_ids:
        start, n = total - 1, 1
    elif kind == "fresh":
        start, n = 0, rng.randint(1, min(total, 40))
    elif kind == "cached" and total > 2:
        start = rng.randint(1, total - 1)
        n = rng.randint(1, total - start)
    else:  # recompute from scratch or from the middle, possibly into the outputs
        start = rng.randint(0, total - 1)
        n = total - start
    pool.cover(request, start + n)
    return ScheduledChunk(request, start, n, sample=start + n == total)


def make_request(rng: random.Random, index: int) -> Request:
    k = rng.choice([None, None, 0, 2])
    params = SamplingParams(max_tokens=64, prompt_logprobs=k)
    request = Request(f"r{index}", [rng.randrange(5, 1000) for _ in range(rng.randint(1, 30))], params)
    request.output_token_ids = [rng.randrange(5, 1000) for _ in range(rng.randint(0, 12))]
    if k is not None:  # prompt tokens scored by earlier chunks (entry 0 is None)
        scored = rng.randint(0, request.num_prompt_tokens)
        request.prompt_logprobs = [None] + [TokenLogprob(0, 0.0, 1, ()) for _ in range(max(0, scored - 1))]
    return request


def check(built, expected: dict) -> None:
    meta = built.meta
    assert built.input_ids.tolist() == expected["input_ids"]
    assert built.positions.tolist() == expected["positions"]
    assert built.input_ids.dtype == built.positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == expected["slot_mapping"]
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.is_contiguous()
    if expected["block_tables"]:
        assert meta.block_tables.tolist() == expected["block_tables"]
    else:
        assert meta.block_tables.shape[0] == 0
    assert meta.seq_lens.tolist() == expected["seq_lens"]
    assert meta.query_start_loc.tolist() == expected["query_start_loc"]
    assert meta.num_paged_tokens == expected["num_paged_tokens"]
    assert meta.max_seq_len == max(expected["seq_lens"], default=0)
    assert meta.max_query_len == max(expected["query_start_loc"][i + 1] - expected["query_start_loc"][i]
                                     for i in range(len(expected["seq_lens"]))) if expected["seq_lens"] else True
    for name in ("fresh_query_lens", "all_seq_lens", "all_query_lens"):
        assert getattr(meta, name) == expected[name], name
    assert built.logits_rows == expected["logits_rows"]
    assert built.prompt_targets == expected["prompt_targets"]
    assert built.prompt_ks == expected["prompt_ks"]
    assert built.prompt_spans == expected["prompt_spans"]


@pytest.mark.parametrize("sdpa_fresh_prefill", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches_match_the_reference(seed, sdpa_fresh_prefill):
    rng = random.Random(seed)
    pool = Pool(rng)
    # Narrower than the longest request (60 tokens): rows widen as they grow.
    builder = BatchInputBuilder(BLOCK_SIZE, max_model_len=32, device=torch.device("cpu"), backend="torch",
                                sdpa_fresh_prefill=sdpa_fresh_prefill)
    requests = [make_request(rng, i) for i in range(12)]
    next_index = len(requests)
    for _ in range(25):
        batch = rng.sample(requests, rng.randint(1, len(requests)))
        chunks = [random_chunk(rng, pool, r) for r in batch]
        expected = reference_inputs(chunks, BLOCK_SIZE, sdpa_fresh_prefill)
        check(builder.build(chunks), expected)
        # Between steps: tokens generated, a block copied on write, a preemption, an end.
        for r in batch:
            if rng.random() < 0.7:
                r.output_token_ids.append(rng.randrange(5, 1000))
        victim = rng.choice(requests)
        if victim.block_ids and rng.random() < 0.5:
            index = rng.randrange(len(victim.block_ids))
            pool.free.insert(0, victim.block_ids[index])
            victim.block_ids[index] = pool.free.pop()
        if rng.random() < 0.3:
            preempted = rng.choice(requests)
            pool.clear(preempted)
            if rng.random() < 0.5:
                builder.release(preempted.request_id)
        if rng.random() < 0.3:
            done = requests.pop(rng.randrange(len(requests)))
            pool.clear(done)
            builder.release(done.request_id)
            requests.append(make_request(rng, next_index))
            next_index += 1
        for r in requests:  # at most 60 tokens
            if r.num_tokens > 60:
                r.output_token_ids = r.output_token_ids[:5]


def test_all_decode_batch_is_one_token_per_sequence_at_its_last_position():
    rng = random.Random(0)
    pool = Pool(rng)
    builder = BatchInputBuilder(BLOCK_SIZE, 64, torch.device("cpu"), "torch", sdpa_fresh_prefill=True)
    requests = [make_request(rng, i) for i in range(5)]
    for r in requests:
        r.output_token_ids.append(7)
        pool.cover(r, r.num_tokens)
    chunks = [ScheduledChunk(r, r.num_tokens - 1, 1, sample=True) for r in requests]
    built = builder.build(chunks)
    assert built.input_ids.tolist() == [7] * 5
    assert built.positions.tolist() == [r.num_tokens - 1 for r in requests]
    assert built.meta.query_start_loc.tolist() == list(range(6))
    assert built.logits_rows == list(range(5))
    check(built, reference_inputs(chunks, BLOCK_SIZE, True))


def test_block_table_rows_follow_every_change_of_the_list():
    tables = PersistentBlockTables(width=2, capacity=1)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    b = Request("b", [1], SamplingParams(max_tokens=4))
    a.block_ids = [5]
    row_a = tables.row_of(a)
    assert tables.table[row_a].tolist() == [5, 0]
    a.block_ids.append(9)  # appended
    assert tables.table[tables.row_of(a)].tolist() == [5, 9]
    a.block_ids[0] = 3  # copied on write
    assert tables.table[tables.row_of(a)].tolist() == [3, 9]
    a.block_ids += [4, 8, 6]  # past the width: the table widens
    row_a = tables.row_of(a)
    assert tables.width >= 5 and tables.table[row_a].tolist()[:5] == [3, 9, 4, 8, 6]
    a.block_ids[:] = [2]  # freed and refilled
    assert tables.table[tables.row_of(a)].tolist()[:5] == [2, 0, 0, 0, 0]
    b.block_ids = [7]
    row_b = tables.row_of(b)  # capacity 1: the table grows
    assert row_b != row_a and len(tables) == 2
    assert tables.table[row_b].tolist()[:2] == [7, 0]
    tables.release("a")
    c = Request("c", [1], SamplingParams(max_tokens=4))
    c.block_ids = [1]
    assert tables.row_of(c) == row_a  # a released row is reused, zeroed first
    assert tables.table[row_a].tolist()[:3] == [1, 0, 0]


@pytest.mark.parametrize("sdpa_fresh_prefill", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_decode_steps_built_column_by_column_match_the_reference(seed, sdpa_fresh_prefill):
    """Steps of decodes alone take `_build_decodes`, the others `build`'s loop; both against
    the reference, over steps whose block tables grow, are copied on write and are freed."""
    rng = random.Random(100 + seed)
    pool = Pool(rng)
    builder = BatchInputBuilder(BLOCK_SIZE, max_model_len=32, device=torch.device("cpu"), backend="torch",
                                sdpa_fresh_prefill=sdpa_fresh_prefill)
    requests = [make_request(rng, i) for i in range(10)]
    columns = 0
    for _ in range(40):
        for r in requests:
            if not r.output_token_ids and rng.random() < 0.5:
                r.output_token_ids.append(rng.randrange(5, 1000))
        batch = rng.sample(requests, rng.randint(1, len(requests)))
        # A sampled one-token chunk at the last known token; now and then the prompt's last
        # (no output yet) or, to leave the column path, a chunk of another kind.
        chunks = [ScheduledChunk(r, r.num_tokens - 1, 1, sample=True) for r in batch]
        if rng.random() < 0.2:
            chunks[rng.randrange(len(chunks))] = random_chunk(rng, pool, rng.choice(requests))
        for c in chunks:
            pool.cover(c.request, c.start + c.num_tokens)
        by_columns = builder._build_decodes(chunks) is not None
        columns += by_columns
        assert by_columns == all(c.num_tokens == 1 and c.sample and c.start > 0 for c in chunks)
        check(builder.build(chunks), reference_inputs(chunks, BLOCK_SIZE, sdpa_fresh_prefill))
        for r in batch:
            r.output_token_ids.append(rng.randrange(5, 1000))
        victim = rng.choice(requests)
        if victim.block_ids and rng.random() < 0.5:  # copied on write
            index = rng.randrange(len(victim.block_ids))
            pool.free.insert(0, victim.block_ids[index])
            victim.block_ids[index] = pool.free.pop()
        if rng.random() < 0.2:  # preempted: its row is handed back, its blocks freed
            preempted = rng.choice(requests)
            pool.clear(preempted)
            builder.release(preempted.request_id)
        for r in requests:  # at most 60 tokens
            if r.num_tokens > 60:
                pool.clear(r)
                builder.release(r.request_id)
                r.output_token_ids = r.output_token_ids[:2]
    assert columns >= 20


def test_the_batch_says_whether_every_row_takes_the_argmax():
    """`argmax_only`: every sampled row greedy with nothing reading its logits, on both paths."""
    pool = Pool(random.Random(0))
    builder = BatchInputBuilder(BLOCK_SIZE, 64, torch.device("cpu"), "torch", sdpa_fresh_prefill=True)

    def decode(rid, **params):
        request = Request(rid, [11, 12, 13], SamplingParams(max_tokens=8, **params))
        request.output_token_ids.append(7)
        pool.cover(request, request.num_tokens)
        return ScheduledChunk(request, request.num_tokens - 1, 1, sample=True)

    greedy = [decode(f"g{i}", temperature=0.0) for i in range(3)]
    assert builder.build(greedy).argmax_only
    for params in (dict(temperature=1.0), dict(temperature=0.0, logprobs=1),
                   dict(temperature=0.0, presence_penalty=0.5), dict(top_k=1, temperature=0.7, logit_bias={5: 1.0})):
        assert not builder.build(greedy + [decode(f"x{len(pool.free)}", **params)]).argmax_only, params
    assert builder.build([decode("t", top_k=1, temperature=0.7)] + greedy).argmax_only
    # A prefill chunk (the loop) with prompt logprobs: its rows read the logits.
    scored = Request("p", [11, 12, 13, 14], SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=1))
    pool.cover(scored, 4)
    assert not builder.build(greedy + [ScheduledChunk(scored, 0, 4, sample=True)]).argmax_only
    plain = Request("q", [11, 12, 13, 14], SamplingParams(max_tokens=8, temperature=0.0))
    pool.cover(plain, 4)
    assert builder.build(greedy + [ScheduledChunk(plain, 0, 4, sample=True)]).argmax_only
