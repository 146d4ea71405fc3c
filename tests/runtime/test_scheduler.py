"""The token-budget scheduler, step by step, with a strict fake executor."""

from __future__ import annotations

import pytest

from tokenlane.runtime.core.request import FinishReason, Request, RequestStatus, SamplingParams
from tokenlane.runtime.core.scheduler import Scheduler
from tokenlane.runtime.executor.fake import FakeExecutor, make_config


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks=64, block_size=4, starvation_steps=32, **kw):
    clock = Clock()
    config = make_config(block_size=block_size, **kw)
    sched = Scheduler(config, num_blocks, block_size, max_model_len=4096, clock=clock,
                      starvation_steps=starvation_steps)
    ex = FakeExecutor(num_blocks, block_size)
    return sched, ex, clock


def req(rid, n_prompt=8, max_tokens=4, lane="default", *, first=0, priority=0, deadline=None,
        arrival=0.0):
    return Request(rid, list(range(first + 1, first + 1 + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   lane=lane, priority=priority, deadline=deadline, arrival_time=arrival)


def step(sched, ex, clock=None, dt=0.01):
    plan = sched.schedule()
    out = ex.execute(plan) if plan.chunks else None
    if out is not None:
        sched.update_from_output(plan, out)
    sched.check_invariants()
    if clock is not None:
        clock.now += dt
    return plan


def run_all(sched, ex, clock=None, limit=10_000):
    plans = []
    while sched.has_unfinished_requests():
        plans.append(step(sched, ex, clock))
        assert len(plans) < limit, "no progress"
    return plans


def test_chunked_prefill_splits_prompt_and_samples_at_the_end():
    sched, ex, _ = make(max_batched_tokens=64, prefill_chunk_size=7)
    r = req("a", n_prompt=20, max_tokens=3)
    sched.add_request(r)
    sizes = []
    for _ in range(3):
        plan = step(sched, ex)
        (chunk,) = plan.chunks
        sizes.append((chunk.start, chunk.num_tokens, chunk.sample))
    assert sizes == [(0, 7, False), (7, 7, False), (14, 6, True)]
    assert r.num_output_tokens == 1 and r.first_token_time is not None
    run_all(sched, ex)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3
    assert r.finish_detail == "max_tokens"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_decode_first_and_budgets():
    sched, ex, _ = make(max_batched_tokens=10, prefill_chunk_size=8, max_active_sequences=3)
    for i in range(5):
        sched.add_request(req(f"r{i}", n_prompt=6, max_tokens=5, first=100 * i))
    while sched.has_unfinished_requests():
        plan = step(sched, ex)
        assert plan.num_batched_tokens == sum(c.num_tokens for c in plan.chunks) <= 10
        assert len(plan.chunks) <= 3
        assert sched.num_running <= 3
        assert all(c.num_tokens <= 8 for c in plan.chunks)
        kinds = ["decode" if c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens else "prefill"
                 for c in plan.chunks]
        assert kinds == sorted(kinds), f"decodes must come first: {kinds}"


def test_mixed_policy_keeps_rank_order():
    sched, ex, _ = make(max_batched_tokens=20, prefill_chunk_size=4, policy="mixed")
    a = req("a", n_prompt=12, max_tokens=3)
    b = req("b", n_prompt=3, max_tokens=3, first=50)
    sched.add_request(a)
    step(sched, ex)
    sched.add_request(b)
    step(sched, ex)  # b starts; a continues its prefill
    plan = step(sched, ex)
    # a (older) is still prefilling and is served before b's decode under `mixed`.
    assert [c.request.request_id for c in plan.chunks] == ["a", "b"]
    assert plan.chunks[0].num_tokens == 4 and plan.chunks[1].num_tokens == 1


def test_lane_priority_starts_first():
    lanes = [{"name": "hi", "priority": 100, "default": True}, {"name": "lo", "priority": 10}]
    sched, ex, _ = make(lanes=lanes, max_batched_tokens=8, prefill_chunk_size=8)
    sched.add_request(req("lo1", lane="lo"))
    sched.add_request(req("hi1", lane="hi", first=50))
    plan = step(sched, ex)
    assert [c.request.request_id for c in plan.chunks] == ["hi1"]


def test_weighted_fair_share_between_equal_priority_lanes():
    lanes = [{"name": "a", "weight": 3, "default": True}, {"name": "b", "weight": 1}]
    sched, ex, _ = make(lanes=lanes, max_batched_tokens=8, prefill_chunk_size=8,
                        max_active_sequences=1, num_blocks=256, max_waiting_requests=1000)
    for i in range(40):
        sched.add_request(req(f"a{i}", n_prompt=7, max_tokens=1, lane="a", first=1000 + i * 10))
        sched.add_request(req(f"b{i}", n_prompt=7, max_tokens=1, lane="b", first=5000 + i * 10))
    served = {"a": 0, "b": 0}
    for _ in range(40):
        plan = step(sched, ex)
        for c in plan.chunks:
            served[c.request.lane] += c.num_tokens
    assert served["a"] / served["b"] == pytest.approx(3.0, rel=0.2)


def test_starvation_guard_serves_low_priority_lane():
    lanes = [{"name": "hi", "priority": 100, "default": True}, {"name": "lo", "priority": 10}]
    sched, ex, _ = make(lanes=lanes, max_batched_tokens=8, prefill_chunk_size=8,
                        max_active_sequences=1, starvation_steps=5, num_blocks=256)
    for i in range(60):
        sched.add_request(req(f"hi{i}", n_prompt=7, max_tokens=1, lane="hi", first=i * 10))
    sched.add_request(req("lo0", n_prompt=7, max_tokens=1, lane="lo", first=9000))
    started_at = None
    for n in range(30):
        plan = step(sched, ex)
        if any(c.request.request_id == "lo0" for c in plan.chunks):
            started_at = n
            break
    assert started_at is not None and started_at <= 6


def test_edf_inside_a_lane():
    sched, ex, _ = make(max_batched_tokens=8, prefill_chunk_size=8, max_active_sequences=1)
    sched.add_request(req("late", deadline=100.0, arrival=0.0))
    sched.add_request(req("none", arrival=0.0, first=20))
    sched.add_request(req("soon", deadline=50.0, arrival=1.0, first=40))
    sched.add_request(req("prio", arrival=2.0, priority=5, first=60))
    order = []
    while sched.has_unfinished_requests():
        plan = step(sched, ex)
        for c in plan.chunks:
            if c.start == 0:
                order.append(c.request.request_id)
    assert order == ["soon", "late", "prio", "none"]


def test_high_watermark_stops_new_prefills():
    sched, ex, _ = make(num_blocks=10, max_batched_tokens=64, prefill_chunk_size=64,
                        kv_cache_high_watermark=0.5, kv_cache_reject_watermark=0.9)
    sched.add_request(req("big", n_prompt=24, max_tokens=8))  # 6 blocks + growth
    step(sched, ex)
    assert sched.kv.usage >= 0.5
    sched.add_request(req("small", n_prompt=3, max_tokens=2, first=100))
    plan = step(sched, ex)
    assert [c.request.request_id for c in plan.chunks] == ["big"]
    run_all(sched, ex)
    assert sched.requests == {}


def test_preemption_lowest_priority_newest_first_and_recompute():
    lanes = [{"name": "hi", "priority": 100, "default": True}, {"name": "lo", "priority": 10}]
    sched, ex, _ = make(lanes=lanes, num_blocks=8, block_size=2, max_batched_tokens=64,
                        prefill_chunk_size=64, kv_cache_high_watermark=0.99,
                        kv_cache_reject_watermark=1.0)
    a = req("hi-old", n_prompt=4, max_tokens=6, lane="hi")
    b = req("lo", n_prompt=4, max_tokens=6, lane="lo", first=20)
    c = req("hi-new", n_prompt=4, max_tokens=6, lane="hi", first=40)
    for r in (a, b, c):
        sched.add_request(r)
    preempted = []
    plans = []
    while sched.has_unfinished_requests():
        plan = step(sched, ex)
        plans.append(plan)
        preempted += [r.request_id for r in plan.preempted]
        assert len(plans) < 200
    assert preempted and preempted[0] == "lo"
    for r in (a, b, c):
        assert r.status is RequestStatus.FINISHED_LENGTH
        # Output equals what an uninterrupted run would give (deterministic fake tokens).
        assert r.output_token_ids == [ex.token_fn(r.request_id, 4 + i) for i in range(6)]
    assert b.num_preemptions >= 1
    assert sched.kv.num_free_blocks == 8


def test_queue_timeout():
    lanes = [{"name": "fast", "queueTimeoutMs": 100, "default": True}]
    sched, ex, clock = make(lanes=lanes, max_active_sequences=1, max_batched_tokens=8,
                            prefill_chunk_size=8)
    a = req("a", max_tokens=50, lane="fast")
    b = req("b", first=50, lane="fast")
    sched.add_request(a)
    sched.add_request(b)
    step(sched, ex, clock, dt=0.06)
    step(sched, ex, clock, dt=0.06)
    step(sched, ex, clock)
    assert b.status is RequestStatus.FINISHED_TIMEOUT and b.finish_detail == "queue_timeout"
    assert b.finish_reason is FinishReason.TIMEOUT
    assert a.status is RequestStatus.RUNNING  # running requests are not queue-timed-out
    assert b in sched.drain_finished()


def test_deadline_expiry_finishes_waiting_and_running():
    sched, ex, clock = make(max_active_sequences=1, max_batched_tokens=8, prefill_chunk_size=8)
    a = req("a", max_tokens=50, deadline=0.05)
    b = req("b", first=50, deadline=0.03)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(6):
        step(sched, ex, clock)
    assert a.finish_detail == b.finish_detail == "deadline"
    assert a.finish_time <= 0.05 + 0.011 and b.finish_time <= 0.03 + 0.011
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_finished_requests_do_not_linger_in_the_deadline_heap():
    """A request with a far deadline (the API allows a day) that finishes early must not stay
    referenced until the deadline passes."""
    sched, ex, clock = make(max_batched_tokens=64, prefill_chunk_size=64)
    for i in range(500):
        sched.add_request(req(f"r{i}", n_prompt=2, max_tokens=1, first=i, deadline=86400.0))
        step(sched, ex, clock)
    assert not sched.has_unfinished_requests()
    assert len(sched._deadlines) <= 64 + 2


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding", "preempted"])
def test_cancel_in_any_state_frees_blocks_at_once(when):
    sched, ex, _ = make(max_batched_tokens=8, prefill_chunk_size=4)
    r = req("r", n_prompt=10, max_tokens=20)
    sched.add_request(r)
    if when != "waiting":
        step(sched, ex)
        assert r.block_ids
    if when == "decoding":
        for _ in range(3):
            step(sched, ex)
        assert not r.is_prefilling
    if when == "preempted":
        plan = sched.schedule()
        sched._preempt(r, plan)
        assert r.status is RequestStatus.PREEMPTED
    sched.finish_request(r, RequestStatus.FINISHED_CANCELLED, "cancelled")
    assert r.block_ids == [] and sched.kv.num_free_blocks == sched.kv.num_blocks
    assert r.finish_reason is FinishReason.CANCELLED
    sched.check_invariants()
    assert not sched.has_unfinished_requests()


def test_static_batching_runs_batch_to_completion():
    sched, ex, _ = make(continuous_batching=False, max_active_sequences=2, max_batched_tokens=16,
                        prefill_chunk_size=16)
    reqs = [req(f"r{i}", n_prompt=4, max_tokens=2 + 4 * (i % 2), first=i * 10) for i in range(4)]
    for r in reqs[:3]:
        sched.add_request(r)
    plans = []
    while sched.has_unfinished_requests():
        plans.append(step(sched, ex))
        if len(plans) == 1:
            sched.add_request(reqs[3])
    # r2 and r3 may start only once r0 and r1 have both finished.
    start_r2 = next(i for i, p in enumerate(plans) if any(c.request is reqs[2] for c in p.chunks))
    last_batch1 = max(i for i, p in enumerate(plans) if any(c.request in reqs[:2] for c in p.chunks))
    assert start_r2 > last_batch1
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)


def test_lane_caps():
    lanes = [
        {"name": "a", "maxActiveSequences": 1, "default": True},
        {"name": "b", "maxBatchedTokens": 3, "prefillChunkSize": 3},
    ]
    sched, ex, _ = make(lanes=lanes, max_batched_tokens=32, prefill_chunk_size=16)
    for i in range(3):
        sched.add_request(req(f"a{i}", lane="a", first=i * 10))
        sched.add_request(req(f"b{i}", lane="b", first=100 + i * 10))
    while sched.has_unfinished_requests():
        plan = step(sched, ex)
        assert sched.lanes["a"].num_running <= 1
        assert sum(c.num_tokens for c in plan.chunks if c.request.lane == "b") <= 3


def test_prefix_cache_hit_through_scheduler():
    sched, ex, _ = make(max_batched_tokens=64, prefill_chunk_size=64)
    a = req("a", n_prompt=13, max_tokens=2)
    sched.add_request(a)
    run_all(sched, ex)
    b = Request("b", list(range(1, 11)) + [77, 78], SamplingParams(max_tokens=2))
    sched.add_request(b)
    plan = step(sched, ex)
    assert b.num_cached_tokens == 8 and plan.chunks[0].start == 8  # FakeExecutor checked the KV
    run_all(sched, ex)
    assert sched.kv.prefix_hits == 8


def test_reload_moves_requests_of_removed_lane():
    lanes = [{"name": "a", "default": True}, {"name": "b"}]
    sched, ex, _ = make(lanes=lanes, max_active_sequences=1, max_batched_tokens=8, prefill_chunk_size=8)
    ra = req("ra", lane="a", max_tokens=3)
    rb = req("rb", lane="b", first=20)
    sched.add_request(ra)
    sched.add_request(rb)
    step(sched, ex)
    sched.apply_config(make_config(lanes=[{"name": "a", "default": True, "priority": 7}],
                                   max_active_sequences=1, max_batched_tokens=8, prefill_chunk_size=8))
    sched.check_invariants()
    assert rb.lane == "a"
    run_all(sched, ex)
    assert rb.status is RequestStatus.FINISHED_LENGTH


def test_executor_error_finishes_only_that_request():
    sched, ex, _ = make()
    a, b = req("a"), req("b", first=30)
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    out = ex.execute(plan)
    out.errors["a"] = "boom"
    sched.update_from_output(plan, out)
    assert a.status is RequestStatus.FINISHED_ERROR and a.finish_detail == "boom"
    assert b.status is RequestStatus.RUNNING
    sched.check_invariants()
    plan = sched.schedule()
    assert a in plan.finished  # the executor is told to drop a's state


def test_scheduler_stack_imports_without_torch():
    """The scheduler, pool, admission, engine core and fake executor are pure Python."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import tokenlane.runtime.core.scheduler, tokenlane.runtime.core.kv_cache, tokenlane.runtime.core.lanes\n"
        "import tokenlane.runtime.core.admission, tokenlane.runtime.engine.llm_engine, tokenlane.runtime.engine.async_engine\n"
        "import tokenlane.runtime.executor.fake, tokenlane.bench.sched_bench\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_static_batching_does_not_starve_low_priority_lane():
    lanes = [{"name": "hi", "priority": 100, "default": True}, {"name": "lo", "priority": 10}]
    sched, ex, _ = make(lanes=lanes, continuous_batching=False, max_active_sequences=1,
                        max_batched_tokens=8, prefill_chunk_size=8, starvation_steps=3,
                        num_blocks=256)
    sched.add_request(req("lo0", lane="lo", max_tokens=1, first=900))
    started = None
    for n in range(40):
        sched.add_request(req(f"hi{n}", lane="hi", max_tokens=1, first=n * 10))
        plan = step(sched, ex)
        if any(c.request.request_id == "lo0" for c in plan.chunks):
            started = n
            break
    assert started is not None and started <= 4
