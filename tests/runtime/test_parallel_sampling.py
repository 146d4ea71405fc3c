"""Parallel sampling (n > 1, best_of): the sequences of one prompt share its KV blocks.

The engine runs with the strict fake executor (runtime/executor/fake.py): every chunk checks that
its whole context reads back as the sequence's own tokens, so a wrong fork, a missed copy on
write or a block written while shared fails loudly. Tokens are f(request id, position), so a
recomputation after a preemption must reproduce the same output. The real model executor
checks the block copy itself, greedy n > 1 against n = 1 and seeded reproducibility.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from property_examples import examples

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams, SequenceGroup, sequence_seed
from tokenlane.runtime.executor.fake import FakeExecutor, fake_token, make_config


def group_of(name: str, prompt: list[int], n: int, max_tokens: int, **params) -> list[Request]:
    members = [
        Request(f"{name}-{j}", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))
        for j in range(n)
    ]
    SequenceGroup.of(members)
    return members


def run(engine: LLMEngine, *, on_step=None) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.scheduler.check_invariants()
        if on_step is not None:
            on_step(engine)
    raise AssertionError("the engine did not finish")


def expected_tokens(request: Request, vocab_size: int = 1000) -> list[int]:
    p = request.num_prompt_tokens
    return [fake_token(request.request_id, p + k, vocab_size) for k in range(request.sampling_params.max_tokens)]


def test_sequence_seeds_are_derived_and_deterministic():
    assert sequence_seed(None, 3) is None
    assert sequence_seed(7, 0) == 7  # sequence 0 samples what an n=1 request would
    seeds = [sequence_seed(7, j) for j in range(1, 6)]
    assert seeds == [sequence_seed(7, j) for j in range(1, 6)]
    assert len(set(seeds)) == 5 and all(0 <= s < 2**63 for s in seeds)
    assert sequence_seed(8, 1) != sequence_seed(7, 1)


@pytest.mark.parametrize("prompt_len, copies", [(14, 3), (13, 0), (1, 0)])
def test_fork_shares_prompt_blocks_and_copies_the_partial_one(prompt_len, copies):
    """Block size 4. 14 prompt tokens: the 3 full blocks of the first 13 are shared and the
    4th (positions 12..15, partly the prompt's) is copied by 3 of the 4 sequences on their
    first write. 13 tokens: the first 12 fill 3 blocks exactly, nothing to copy. A one-token
    prompt has nothing to share: four independent sequences."""
    executor = FakeExecutor(num_kv_blocks=64, block_size=4)
    engine = LLMEngine(make_config(block_size=4), executor)
    members = group_of("g", list(range(1, prompt_len + 1)), 4, max_tokens=6)
    engine.add_group(members)
    peak = [0]

    def watch(engine):
        peak[0] = max(peak[0], engine.scheduler.kv.num_used_blocks)

    outputs = run(engine, on_step=watch)
    assert outputs == {m.request_id: expected_tokens(m) for m in members}
    assert all(m.status is RequestStatus.FINISHED_LENGTH for m in members)
    planned = [c for plan in executor.plans for c in plan.block_copies]
    assert len(planned) == copies
    prefill_tokens = sum(c.num_tokens for plan in executor.plans for c in plan.chunks if c.start == 0)
    if prompt_len > 1:
        assert prefill_tokens == prompt_len  # the prompt is computed once, by the leader
        shared = (prompt_len - 1) // 4
        own = -(-(prompt_len + 6) // 4) - shared
        assert peak[0] <= shared + 4 * own < 4 * -(-(prompt_len + 6) // 4)
    else:
        assert prefill_tokens == 4
    assert engine.scheduler.kv.num_free_blocks == 64
    engine.scheduler.kv.check_invariants([])


def test_group_counts_as_n_sequences_for_max_active():
    """maxActiveSequences 4: a group of 3 and a single run together; a second group of 3
    waits until there is room for all three of its sequences."""
    executor = FakeExecutor(num_kv_blocks=64, block_size=4)
    engine = LLMEngine(make_config(block_size=4, max_active_sequences=4), executor)
    engine.add_group(group_of("a", list(range(1, 10)), 3, max_tokens=8))
    engine.add_request(Request("single", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)))
    engine.add_group(group_of("b", list(range(1, 10)), 3, max_tokens=8))
    most = [0]

    def watch(engine):
        most[0] = max(most[0], engine.scheduler.num_running)

    run(engine, on_step=watch)
    assert most[0] == 4
    steps_of = {}
    for i, plan in enumerate(executor.plans):
        for c in plan.chunks:
            steps_of.setdefault(c.request.request_id[0], []).append(i)
    assert min(steps_of["b"]) > max(steps_of["a"])  # b started once all of a had finished


def test_group_admission_counts_every_sequence():
    engine = LLMEngine(make_config(block_size=4, max_active_sequences=4), FakeExecutor(num_kv_blocks=20, block_size=4))
    # 13 prompt tokens + 8: 3 shared blocks + 4 x 3 own = 15 blocks fit; 6 sequences (21) do not.
    engine.add_group(group_of("fits", list(range(1, 14)), 4, max_tokens=8))
    with pytest.raises(AdmissionError) as too_many:
        engine.add_group(group_of("wide", list(range(1, 14)), 5, max_tokens=8))
    assert too_many.value.status == 400 and "maxActiveSequences" in too_many.value.message
    big = LLMEngine(make_config(block_size=4, max_active_sequences=8), FakeExecutor(num_kv_blocks=20, block_size=4))
    with pytest.raises(AdmissionError) as too_long:
        big.add_group(group_of("long", list(range(1, 14)), 6, max_tokens=8))
    assert too_long.value.reason == "too_long" and "21 KV cache blocks" in too_long.value.message


@pytest.mark.parametrize("cancel", ["leader_waiting", "leader_prefilling", "all_decoding"])
def test_cancelling_frees_every_sequence(cancel):
    executor = FakeExecutor(num_kv_blocks=64, block_size=4)
    engine = LLMEngine(make_config(block_size=4, prefill_chunk_size=4), executor)
    members = group_of("g", list(range(1, 15)), 4, max_tokens=20)
    engine.add_group(members)
    if cancel == "leader_waiting":
        engine.abort_request("g-0")  # the followers cannot fork: they end the same way
    else:
        engine.step()
        if cancel == "all_decoding":
            while members[1].num_output_tokens < 2:
                engine.step()
        assert engine.scheduler.kv.num_used_blocks > 0
        for member in (members[:1] if cancel == "leader_prefilling" else members):
            engine.abort_request(member.request_id)
    run(engine)
    assert all(m.status is RequestStatus.FINISHED_CANCELLED for m in members)
    assert engine.scheduler.kv.num_free_blocks == 64
    engine.scheduler.kv.check_invariants([])


def test_preempted_sequence_recomputes_its_prompt_and_own_output():
    """The group (18 blocks at full length) and an older request (6) share a pool of 20:
    forked sequences get preempted, come back as recomputations of prompt + their own
    output, and end with the same tokens."""
    executor = FakeExecutor(num_kv_blocks=20, block_size=4)
    engine = LLMEngine(make_config(block_size=4, prefix_caching=False), executor)
    older = Request("older", list(range(20, 30)), SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request(older)
    members = group_of("g", list(range(1, 11)), 4, max_tokens=12)
    engine.add_group(members)
    outputs = run(engine)
    assert sum(m.num_preemptions for m in members[1:]) > 0
    assert outputs == {m.request_id: expected_tokens(m) for m in [older, *members]}
    assert engine.scheduler.kv.num_free_blocks == 20


@st.composite
def group_scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(8, 48))
    caching = draw(st.booleans())
    max_active = draw(st.integers(4, 8))
    modes = draw(st.sampled_from([("decode-first", True), ("mixed", True), ("decode-first", False)]))
    arrivals = []
    for step in range(draw(st.integers(1, 12))):
        n = draw(st.sampled_from([1, 1, 2, 3, 4]))
        n = min(n, max_active)
        prompt_len = draw(st.integers(1, 20))
        prompt = [draw(st.sampled_from([3, 5, 7])) for _ in range(prompt_len)]
        arrivals.append({
            "at": draw(st.integers(0, 10)),
            "n": n,
            "prompt": prompt,
            "max_tokens": draw(st.integers(1, 10)),
            "cancel_at": draw(st.one_of(st.none(), st.integers(0, 25))),
            "cancel_one": draw(st.booleans()),  # cancel one sequence, not the whole group
            "logprobs": draw(st.booleans()),
        })
    return block_size, num_blocks, caching, max_active, modes, arrivals


@settings(max_examples=examples(50, thorough_run=150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group_scenarios())
def test_group_properties(scenario):
    """Any policy, continuous or static batching: no leaked block, exact ref counts every
    step, cancel frees everything, and every sequence that ran to its length produced
    exactly its own tokens."""
    block_size, num_blocks, caching, max_active, (policy, continuous), arrivals = scenario
    executor = FakeExecutor(num_kv_blocks=num_blocks, block_size=block_size)
    config = make_config(block_size=block_size, prefix_caching=caching, max_active_sequences=max_active,
                         max_batched_tokens=16, prefill_chunk_size=8, policy=policy,
                         continuous_batching=continuous)
    engine = LLMEngine(config, executor)
    submitted: list[tuple[dict, list[Request]]] = []
    outputs: dict[str, list[int]] = {}
    for step in range(400):
        for i, a in enumerate(arrivals):
            if a["at"] == step:
                params = {"logprobs": 0} if a["logprobs"] else {}
                members = (group_of(f"r{i}", a["prompt"], a["n"], a["max_tokens"], **params) if a["n"] > 1 else
                           [Request(f"r{i}-0", a["prompt"], SamplingParams(max_tokens=a["max_tokens"],
                                                                           ignore_eos=True, **params))])
                try:
                    engine.add_group(members) if len(members) > 1 else engine.add_request(members[0])
                except AdmissionError as exc:
                    assert exc.status in (400, 429, 503), exc
                    assert all(m.status is RequestStatus.FINISHED_REJECTED for m in members)
                    continue
                submitted.append((a, members))
            if a["cancel_at"] == step:
                for b, members in submitted:
                    if b is a:
                        for m in members[-1:] if a["cancel_one"] else members:
                            engine.abort_request(m.request_id)
        if step > 12 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        scheduler = engine.scheduler
        scheduler.check_invariants()
        assert scheduler.num_running <= max_active
        for _, members in submitted:
            for m in members:
                if m.status is RequestStatus.RUNNING and not m.awaits_fork:
                    assert m.block_ids, m.request_id
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == num_blocks
    engine.scheduler.kv.check_invariants([])
    for _, members in submitted:
        for m in members:
            assert m.is_finished
            if m.status is RequestStatus.FINISHED_LENGTH:
                assert outputs[m.request_id] == expected_tokens(m)
                if m.sampling_params.logprobs is not None:
                    assert len(m.output_logprobs) == m.num_output_tokens
            else:
                assert m.status is RequestStatus.FINISHED_CANCELLED, (m.request_id, m.status, m.finish_detail)


def _check_lane_caps(scheduler) -> None:
    """No lane holds more block-table entries than its maxKvCacheShare allows (a recount over
    the running sequences; a forked sequence's shared prompt blocks count for each holder)."""
    quotas = scheduler.quotas
    held = {name: 0 for name in scheduler.lanes}
    for r in scheduler.requests.values():
        if r.status is RequestStatus.RUNNING:
            held[r.lane] += len(r.block_ids)
    for name, n in held.items():
        cap = quotas.cap[name]
        assert cap >= quotas.num_blocks or n <= cap, f"lane {name} holds {n} blocks, over its cap {cap}"


def test_a_fork_the_lane_cap_cannot_hold_gives_way():
    """A lane capped at 10 blocks: the leader holds 4, and each of 3 followers would take 3
    shared entries at the fork (13 > 10). The followers the cap cannot hold give way (back
    to the queue, recomputing later) instead of pushing the lane over its cap; every
    sequence still ends with exactly its own tokens."""
    executor = FakeExecutor(num_kv_blocks=20, block_size=4)
    config = make_config(block_size=4, prefix_caching=False,
                         lanes=[{"name": "capped", "default": True, "maxKvCacheShare": 0.5}])
    engine = LLMEngine(config, executor)
    members = group_of("g", list(range(1, 14)), 4, max_tokens=6)  # 13 tokens: forks at 12 (3 blocks)
    engine.add_group(members)
    outputs = run(engine, on_step=lambda e: _check_lane_caps(e.scheduler))
    assert sum(m.num_preemptions for m in members[1:]) > 0
    assert outputs == {m.request_id: expected_tokens(m) for m in members}
    assert engine.scheduler.kv.num_free_blocks == 20


@st.composite
def capped_group_scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(12, 40))
    lanes = []
    for i in range(draw(st.integers(1, 2))):
        lane = {"name": f"lane{i}", "default": i == 0, "priority": draw(st.sampled_from([10, 50]))}
        share = draw(st.sampled_from([None, 0.3, 0.5, 0.8]))
        if share is not None:
            lane["maxKvCacheShare"] = share
        if draw(st.booleans()):
            lane["kvCacheReserved"] = draw(st.sampled_from([0.1, 0.2]))
        lanes.append(lane)
    modes = draw(st.sampled_from([("decode-first", True), ("mixed", True), ("decode-first", False)]))
    arrivals = []
    for _ in range(draw(st.integers(1, 8))):
        prompt_len = draw(st.integers(1, 16))
        arrivals.append({
            "at": draw(st.integers(0, 8)),
            "n": draw(st.sampled_from([1, 2, 3, 4])),
            "prompt": [draw(st.sampled_from([3, 5, 7])) for _ in range(prompt_len)],
            "max_tokens": draw(st.integers(1, 8)),
            "lane": draw(st.integers(0, len(lanes) - 1)),
            "cancel_at": draw(st.one_of(st.none(), st.integers(0, 25))),
        })
    return block_size, num_blocks, lanes, modes, arrivals


@settings(max_examples=examples(40, thorough_run=150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capped_group_scenarios())
def test_group_forks_keep_lane_kv_caps(scenario):
    """Lanes with KV shares (maxKvCacheShare, kvCacheReserved) and sequence groups: after
    every step no lane holds more blocks than its cap, forks included, and the books balance
    (check_invariants: held == recount, unused reserves free); no block leaks and every
    sequence that ran to its length produced exactly its own tokens."""
    block_size, num_blocks, lanes, (policy, continuous), arrivals = scenario
    executor = FakeExecutor(num_kv_blocks=num_blocks, block_size=block_size)
    config = make_config(block_size=block_size, lanes=lanes, max_active_sequences=8, max_batched_tokens=16,
                         prefill_chunk_size=8, policy=policy, continuous_batching=continuous)
    engine = LLMEngine(config, executor)
    submitted: list[tuple[dict, list[Request]]] = []
    outputs: dict[str, list[int]] = {}
    for step in range(600):
        for i, a in enumerate(arrivals):
            if a["at"] == step:
                lane = f"lane{a['lane']}"
                if a["n"] > 1:
                    members = group_of(f"r{i}", a["prompt"], a["n"], a["max_tokens"])
                    for m in members:
                        m.lane = lane
                else:
                    members = [Request(f"r{i}-0", a["prompt"], SamplingParams(max_tokens=a["max_tokens"],
                                                                              ignore_eos=True), lane=lane)]
                try:
                    engine.add_group(members) if len(members) > 1 else engine.add_request(members[0])
                except AdmissionError as exc:
                    assert exc.status in (400, 429, 503), exc
                    continue
                submitted.append((a, members))
            if a["cancel_at"] == step:
                for b, members in submitted:
                    if b is a:
                        engine.abort_request(members[-1].request_id)
        if step > 8 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.scheduler.check_invariants()
        _check_lane_caps(engine.scheduler)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == num_blocks
    for _, members in submitted:
        for m in members:
            if m.status is RequestStatus.FINISHED_LENGTH:
                assert outputs[m.request_id] == expected_tokens(m)
            else:
                assert m.status is RequestStatus.FINISHED_CANCELLED, (m.request_id, m.status, m.finish_detail)


# ---------------------------------------------------------------- the real model executor


@pytest.fixture
def model_engine(tiny_model_dir, one_torch_thread):
    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig

    def build(**scheduler):
        config = RuntimeConfig(
            model=ModelConfig(path=str(tiny_model_dir), max_model_len=256),
            engine=EngineConfig(block_size=4, kv_cache_blocks=128, device="cpu"),
            scheduler=SchedulerConfig(max_batched_tokens=64, prefill_chunk_size=64, max_active_sequences=8,
                                      **scheduler),
        )
        return LLMEngine.from_config(config)

    return build


def _generate(engine: LLMEngine, prompt: list[int], n: int, **params) -> list[list[int]]:
    if n == 1:
        engine.add_request(Request("one", prompt, SamplingParams(max_tokens=12, ignore_eos=True, **params)))
        return [run(engine)["one"]]
    members = group_of("g", prompt, n, max_tokens=12, **params)
    for j, m in enumerate(members):
        m.sampling_params.seed = sequence_seed(params.get("seed"), j)
    engine.add_group(members)
    outputs = run(engine)
    return [outputs[m.request_id] for m in members]


PROMPT = [11, 45, 99, 300, 17, 8, 250, 61, 13, 77, 5, 402, 33, 29]  # 14 tokens: a partial last block


def test_model_copy_blocks_copies_every_layer(model_engine):
    executor = model_engine().executor
    for key_cache, value_cache in executor.kv_caches:
        key_cache[3].normal_()
        value_cache[3].normal_()
    executor._copy_blocks([(3, 9)])
    for key_cache, value_cache in executor.kv_caches:
        assert key_cache[9].equal(key_cache[3]) and value_cache[9].equal(value_cache[3])


def test_model_greedy_sequences_equal_the_single_output(model_engine):
    single = _generate(model_engine(), PROMPT, 1, temperature=0.0)[0]
    engine = model_engine()
    outs = _generate(engine, PROMPT, 3, temperature=0.0)
    assert outs == [single] * 3
    assert engine.scheduler.kv.num_free_blocks == 128


def test_model_seeded_sampling_is_reproducible(model_engine):
    first = _generate(model_engine(), PROMPT, 3, temperature=1.0, seed=1234)
    again = _generate(model_engine(), PROMPT, 3, temperature=1.0, seed=1234)
    assert first == again
    assert len({tuple(o) for o in first}) == 3  # each sequence draws its own tokens
    single = _generate(model_engine(), PROMPT, 1, temperature=1.0, seed=1234)[0]
    assert first[0] == single  # sequence 0 keeps the request's seed
