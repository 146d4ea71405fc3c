"""The prefix cache's host-memory tier (engine.kvOffload), pure parts and the engine with the
strict fake executor.

The fake executor keeps a pretend host tier (the plan's kv_offloads copy a block's slots out,
kv_restores copy them back, offloads first), and every chunk checks that its whole context
reads back as the request's own tokens: a restore of the wrong block, into the wrong block, or
one whose host copy was overwritten fails loudly. The scheduler and parallel-sampling property
tests run again here with the tier on (small tiers: drops and pins happen often).
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from property_examples import examples

from tokenlane.runtime.config import ConfigError, KVOffloadConfig, loads_config
from tokenlane.runtime.core.kv_cache import KVCacheManager
from tokenlane.runtime.core.kv_host_tier import HostKVTier
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.executor.fake import FakeExecutor, make_config

sys.path.insert(0, str(Path(__file__).parent))
import test_parallel_sampling as parallel_props  # noqa: E402
import test_scheduler_properties as sched_props  # noqa: E402


def req(rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


# ---------------------------------------------------------------- the index


def test_host_tier_is_lru_and_never_drops_a_pinned_slot():
    tier = HostKVTier(2)
    a, b = tier.store(b"a"), tier.store(b"b")
    assert (a, b) == (0, 1)
    assert tier.lookup(b"a") is None, "a slot being filled is not a hit in its own step"
    tier.end_step()
    assert tier.lookup(b"a") == 0 and tier.store(b"a") is None  # already there: refreshed, no copy
    tier.take_for_restore(b"b")  # b pinned (and most recent), a least recent
    c = tier.store(b"c")
    assert c == 0 and b"a" not in tier and tier.num_dropped == 1
    # A slot filled in this step may be refilled (the offloads run in order); the pinned one not.
    assert tier.store(b"d") == 0 and b"c" not in tier and b"b" in tier
    tier.check_invariants()
    tier.end_step()
    assert tier.store(b"e") == 1 and b"b" not in tier  # b unpinned: least recent now
    tier.discard([1, 1])
    assert b"e" not in tier and tier.num_used_slots == 1
    tier.check_invariants()
    only = HostKVTier(1)
    only.store(b"x")
    only.end_step()
    only.take_for_restore(b"x")
    assert only.store(b"y") is None, "the only slot is pinned: y is not kept"


def test_host_tier_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        HostKVTier(0)


# ---------------------------------------------------------------- the KV cache manager


def _run_prefill(kv: KVCacheManager, request: Request) -> None:
    """Allocate the whole prompt (with its prefix hits), mark it computed, cache its blocks."""
    cached = kv.find_cached_prefix(request)
    restore = kv.find_host_prefix(request, len(cached))
    todo = request.num_tokens - (len(cached) + len(restore)) * kv.block_size
    kv.allocate(request, todo, cached, restore)
    kv.record_prefix_query(request, cached, restore)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


def test_evicted_blocks_go_to_the_host_and_come_back_as_hits():
    kv = KVCacheManager(4, 4, num_host_blocks=8)
    a = req("a", list(range(1, 14)))  # 3 full blocks + 1 token: 4 blocks
    _run_prefill(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    kv.begin_step()
    b = req("b", list(range(100, 116)))  # takes the whole pool: A's 3 hashed blocks go to the host
    _run_prefill(kv, b)
    offloads, restores = kv.take_transfers()
    assert sorted(block for block, _ in offloads) == sorted(a_blocks[:3]) and restores == []
    assert kv.host.num_used_slots == 3
    kv.free(b)
    kv.check_invariants([])
    kv.begin_step()
    again = req("a2", list(range(1, 14)))
    assert kv.find_cached_prefix(again) == []
    slots = kv.find_host_prefix(again, 0)
    assert sorted(slots) == sorted(slot for _, slot in offloads)
    _run_prefill(kv, again)
    offloads2, restores2 = kv.take_transfers()
    assert [slot for slot, _ in restores2] == slots
    assert [block for _, block in restores2] == again.block_ids[:3]
    assert again.num_cached_tokens == 12 and kv.host_prefix_hits == 12 and kv.prefix_hits == 12
    # B's blocks evicted by the restores went to the host first (offloads before restores).
    assert {block for block, _ in offloads2} <= {block for _, block in restores2} | set(again.block_ids)
    kv.check_invariants([again])
    # The restored blocks are ordinary device prefix hits now.
    third = req("a3", list(range(1, 14)))
    assert kv.find_cached_prefix(third) == again.block_ids[:3]


def test_a_restore_pins_its_slots_against_the_evictions_it_causes():
    """A full host tier, and the restore itself evicts device blocks: their offloads must not
    overwrite the slots being restored in the same step."""
    kv = KVCacheManager(3, 2, num_host_blocks=2)
    a = req("a", [1, 2, 3, 4, 5])  # 2 full blocks + 1
    _run_prefill(kv, a)
    kv.free(a)
    kv.begin_step()
    b = req("b", [9, 8, 7, 6, 5])
    _run_prefill(kv, b)  # A's 2 blocks -> host (tier full)
    kv.free(b)
    kv.take_transfers()
    kv.begin_step()
    again = req("a2", [1, 2, 3, 4, 5])
    slots = kv.find_host_prefix(again, 0)
    assert len(slots) == 2
    _run_prefill(kv, again)  # evicts B's 2 hashed blocks; the tier has only A's pinned slots
    offloads, restores = kv.take_transfers()
    assert [slot for slot, _ in restores] == slots
    assert not {slot for _, slot in offloads} & set(slots)
    kv.check_invariants([again])


def test_a_failed_step_forgets_its_copies():
    kv = KVCacheManager(4, 4, num_host_blocks=8)
    a = req("a", list(range(1, 14)))
    _run_prefill(kv, a)
    kv.free(a)
    kv.begin_step()
    b = req("b", list(range(100, 116)))
    _run_prefill(kv, b)
    offloads, _ = kv.take_transfers()
    kv.forget_failed_transfers(offloads, ())
    assert kv.host.num_used_slots == 0
    kv.free(b)
    kv.check_invariants([])
    # A failed restore: the block stops serving as a prefix hit.
    kv2 = KVCacheManager(4, 4, num_host_blocks=8)
    _run_prefill(kv2, a := req("a", list(range(1, 14))))
    kv2.free(a)
    kv2.begin_step()
    _run_prefill(kv2, b := req("b", list(range(100, 116))))
    kv2.free(b)
    kv2.take_transfers()
    kv2.begin_step()
    _run_prefill(kv2, again := req("a2", list(range(1, 14))))
    _, restores = kv2.take_transfers()
    kv2.forget_failed_transfers((), restores)
    kv2.free(again)
    kv2.check_invariants([])
    assert kv2.find_cached_prefix(req("a3", list(range(1, 14)))) == []


def test_no_tier_without_prefix_caching():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False, num_host_blocks=8)
    assert kv.host is None and kv.find_host_prefix(req("a", list(range(9))), 0) == []


# ---------------------------------------------------------------- the engine (fake executor)


def _fake_engine(num_blocks: int, host_blocks: int, block_size: int = 4) -> LLMEngine:
    config = make_config(block_size=block_size, max_batched_tokens=64, prefill_chunk_size=64)
    config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, kv_offload=KVOffloadConfig(host_bytes=1 << 20))
    )
    executor = FakeExecutor(num_blocks, block_size, max_model_len=None, num_host_kv_blocks=host_blocks)
    return LLMEngine(config, executor)


def _finish(engine: LLMEngine, *requests: Request) -> None:
    for r in requests:
        engine.add_request(r)
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        engine.scheduler.check_invariants()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests), [r.finish_detail for r in requests]


def test_a_prompt_evicted_to_the_host_is_restored_not_recomputed():
    engine = _fake_engine(num_blocks=12, host_blocks=32)
    prompt = list(range(1, 34))  # 8 full blocks + 1 token
    _finish(engine, req("first", prompt, max_tokens=2))
    _finish(engine, req("flood", list(range(500, 544)), max_tokens=4))  # the whole pool: A's blocks evicted
    kv = engine.scheduler.kv
    assert kv.find_cached_prefix(req("probe", prompt)) == [], "the flood evicted the prompt from the device"
    hits_before = kv.host_prefix_hits
    again = req("again", prompt, max_tokens=2)
    _finish(engine, again)
    prompt_blocks = (len(prompt) - 1) // 4
    restored = (kv.host_prefix_hits - hits_before) // 4
    assert restored >= 0.9 * prompt_blocks and again.num_cached_tokens == restored * 4
    plans = engine.executor.plans
    assert sum(len(p.kv_restores) for p in plans) == restored
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants([])


def test_outputs_are_identical_with_and_without_the_tier():
    def run(host_blocks: int) -> dict[str, list[int]]:
        engine = _fake_engine(num_blocks=10, host_blocks=host_blocks)
        outs = {}
        system = list(range(1, 21))
        for turn in range(6):
            r = req(f"t{turn}", system + list(range(100 + turn, 104 + turn)), max_tokens=3)
            flood = req(f"f{turn}", list(range(600 + 40 * turn, 630 + 40 * turn)), max_tokens=2)
            _finish(engine, r, flood)
            outs[r.request_id] = list(r.output_token_ids)
        return outs

    assert run(0) == run(16)


# ---------------------------------------------------------------- property tests with the tier on


@settings(max_examples=examples(40, thorough_run=600), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sched_props.scenarios(), st.integers(1, 12))
def test_scheduler_properties_with_the_host_tier(scenario, host_blocks):
    """The scheduler property test (preemption, cancellation, deadlines, lanes with KV shares,
    prompt logprobs) with prefix caching and a host tier: no block leaked or double-freed,
    every output exactly the model's."""
    config, num_blocks, events = scenario
    engine = dataclasses.replace(config.engine, enable_prefix_caching=True,
                                 kv_offload=KVOffloadConfig(host_bytes=1 << 20))
    fake = partial(FakeExecutor, num_host_kv_blocks=host_blocks)
    with mock.patch.object(sched_props, "FakeExecutor", fake):
        sched_props.run_scenario(dataclasses.replace(config, engine=engine), num_blocks, events)


@st.composite
def reuse_scenarios(draw):
    """Multi-turn-like traffic for the scheduler property run: a few long shared prefixes
    over a device pool too small to keep them, so blocks go out to the host and come back."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(6, 16))
    mbt = draw(st.integers(8, 32))
    config = make_config(
        lanes=[{"name": "lane0", "default": True}],
        block_size=block_size,
        max_model_len=4096,
        max_batched_tokens=mbt,
        prefill_chunk_size=draw(st.integers(1, mbt)),
        max_active_sequences=draw(st.integers(1, 4)),
        max_waiting_requests=30,
        policy=draw(st.sampled_from(["decode-first", "mixed"])),
        kv_cache_high_watermark=draw(st.sampled_from([0.8, 0.95])),
        kv_cache_reject_watermark=1.0,
    )
    prefixes = [list(range(base, base + draw(st.integers(2, 5)) * block_size)) for base in (10, 200, 400)]
    events = []
    for _ in range(draw(st.integers(2, 25))):
        arrivals = []
        for _ in range(draw(st.integers(0, 2))):
            prompt_logprobs = draw(st.sampled_from([None, None, None, 0]))
            arrivals.append({
                "prompt": draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(600, 999), max_size=5)),
                "max_tokens": draw(st.integers(1, 6)),
                "logprobs": draw(st.sampled_from([None, 1])),
                "prompt_logprobs": prompt_logprobs,
                "lane": 0,
                "priority": draw(st.integers(0, 2)),
                "deadline": None,
                "stop_at": None,
            })
        events.append((arrivals, draw(st.lists(st.integers(0, 10_000), max_size=1))))
    return config, num_blocks, events


@settings(max_examples=examples(40, thorough_run=600), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reuse_scenarios(), st.integers(1, 16))
def test_prefix_reuse_properties_with_the_host_tier(scenario, host_blocks):
    """Heavy prefix reuse over a tiny pool: restores and offloads in most runs, with
    preemption, cancellation and prompt logprobs; the same checks as above."""
    config, num_blocks, events = scenario
    config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, kv_offload=KVOffloadConfig(host_bytes=1 << 20))
    )
    fake = partial(FakeExecutor, num_host_kv_blocks=host_blocks)
    with mock.patch.object(sched_props, "FakeExecutor", fake):
        sched_props.run_scenario(config, num_blocks, events)


@settings(max_examples=examples(30, thorough_run=300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parallel_props.group_scenarios(), st.integers(1, 12))
def test_parallel_sampling_properties_with_the_host_tier(scenario, host_blocks):
    """n > 1 forks and copy-on-write with the tier on."""
    block_size, num_blocks, _, max_active, modes, arrivals = scenario
    fake = partial(FakeExecutor, num_host_kv_blocks=host_blocks)
    with mock.patch.object(parallel_props, "FakeExecutor", fake):
        parallel_props.test_group_properties.hypothesis.inner_test(
            (block_size, num_blocks, True, max_active, modes, arrivals)
        )


def test_a_failing_step_keeps_the_other_requests_and_the_books():
    """The executor fails once in a step with restores: the isolating re-run repeats the
    restores (never the offloads), outputs stay exact and nothing leaks."""
    engine = _fake_engine(num_blocks=12, host_blocks=32)
    prompt = list(range(1, 34))
    _finish(engine, req("first", prompt, max_tokens=2))
    _finish(engine, req("flood", list(range(500, 544)), max_tokens=4))
    ex = engine.executor
    ex.fail_next = RuntimeError("boom")
    a, b = req("again", prompt, max_tokens=2), req("other", list(range(700, 709)), max_tokens=2)
    _finish(engine, a, b)
    assert sum(len(p.kv_restores) for p in ex.plans[-3:]) >= 8, "the re-run carried the restores"
    for r in (a, b):
        assert r.output_token_ids == [ex.token_fn(r.request_id, r.num_prompt_tokens + i) for i in range(2)]
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants([])


# ---------------------------------------------------------------- config


def test_config_keys_and_bad_input():
    base = "model: {path: /m}\n"
    config = loads_config(base + "engine: {kvOffload: {hostBytes: 8589934592}}")
    assert config.engine.kv_offload == KVOffloadConfig(host_bytes=8 << 30)
    assert "kvOffload" not in loads_config(base).to_dict()["engine"], "unset keeps older restart hashes"
    with pytest.raises(ConfigError, match=r"engine\.kvOffload\.hostBytes: must be > 0"):
        loads_config(base + "engine: {kvOffload: {hostBytes: 0}}")
    with pytest.raises(ConfigError, match=r"engine\.kvOffload: .*enablePrefixCaching"):
        loads_config(base + "engine: {enablePrefixCaching: false, kvOffload: {hostBytes: 1024}}")
    with pytest.raises(ConfigError, match=r"engine\.kvOffload: missing required key"):
        loads_config(base + "engine: {kvOffload: {}}")
