"""Lane isolation: per-lane KV shares (maxKvCacheShare, kvCacheReserved) and the step-time
budget (scheduler.stepTimeBudget), with the strict fake executor (docs/tuning.md, "Lane isolation")."""

from __future__ import annotations

import pytest

from tokenlane.runtime.config import ConfigError, RuntimeConfig
from tokenlane.runtime.core.step_plan import StepPlan
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
from tokenlane.runtime.core.scheduler import Scheduler
from tokenlane.runtime.core.step_cost import MIN_OBSERVATIONS, StepCostModel, StepTimeBudget, chunk_terms
from tokenlane.runtime.executor.fake import FakeExecutor, make_config
from tokenlane.runtime.executor.simulated import VirtualClock as Clock


def req(rid, n_prompt=8, max_tokens=4, lane="default", *, first=0):
    return Request(rid, list(range(first + 1, first + 1 + n_prompt)), SamplingParams(max_tokens=max_tokens), lane=lane)


def step(sched, ex, clock, dt=0.01):
    plan = sched.schedule()
    if plan.chunks:
        sched.update_from_output(plan, ex.execute(plan))
    sched.check_invariants()  # with KV shares: held == recount, caps kept, reserves free
    clock.now += dt
    return plan


def two_lanes(inter: dict, long: dict, **kw):
    lanes = [
        {"name": "inter", "priority": 100, "default": True, **inter},
        {"name": "long", "priority": 10, **long},
    ]
    return make_config(lanes=lanes, kv_cache_high_watermark=0.5, kv_cache_reject_watermark=0.6, **kw)


def make(config, num_blocks=40, block_size=4):
    clock = Clock()
    sched = Scheduler(config, num_blocks, block_size, max_model_len=4096, clock=clock)
    return sched, FakeExecutor(num_blocks, block_size), clock


def fill_long_lane(sched, ex, clock, n=3):
    """Long-lane requests that take the pool above the 0.5 high watermark (8 blocks each)."""
    for i in range(n):
        sched.add_request(req(f"long{i}", n_prompt=28, max_tokens=4, lane="long", first=100 * i))
    for _ in range(4):
        step(sched, ex, clock)


@pytest.mark.parametrize("reserved", [None, 0.25])
def test_a_reserve_lets_its_lane_start_while_another_lane_is_above_the_watermark(reserved):
    inter = {} if reserved is None else {"kvCacheReserved": reserved}
    sched, ex, clock = make(two_lanes(inter, {}))
    fill_long_lane(sched, ex, clock)
    assert sched.kv.usage >= 0.5  # the pool is above the high watermark
    sched.add_request(req("i", n_prompt=6, max_tokens=2, lane="inter"))
    plan = step(sched, ex, clock)
    started = any(c.request.request_id == "i" for c in plan.chunks)
    assert started == (reserved is not None)


def test_a_lane_never_holds_more_than_its_share_and_others_go_on():
    sched, ex, clock = make(two_lanes({}, {"maxKvCacheShare": 0.4}))  # 16 of 40 blocks
    for i in range(4):
        sched.add_request(req(f"long{i}", n_prompt=28, max_tokens=4, lane="long", first=100 * i))
    for _ in range(6):
        step(sched, ex, clock)
        assert sched.quotas.held["long"] <= 16
    # The long lane is at its share: an interactive request still starts at once.
    sched.add_request(req("i", n_prompt=6, max_tokens=2, lane="inter"))
    plan = step(sched, ex, clock)
    assert any(c.request.request_id == "i" for c in plan.chunks)
    while sched.has_unfinished_requests():
        step(sched, ex, clock)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_request_its_lane_can_never_hold_is_refused_not_left_waiting():
    sched, ex, clock = make(two_lanes({"kvCacheReserved": 0.5}, {}))  # the long lane gets <= 20 blocks
    big = req("big", n_prompt=90, max_tokens=4, lane="long")  # 24 blocks
    sched.add_request(big)
    step(sched, ex, clock)
    assert big.status is RequestStatus.FINISHED_REJECTED and big.finish_detail == "too_long"


def test_raising_a_reserve_by_reload_preempts_lower_priority_requests_to_free_it():
    config = two_lanes({}, {})
    sched, ex, clock = make(config)
    fill_long_lane(sched, ex, clock, n=4)
    held_before = sched.quotas.held["long"]
    assert held_before > 20
    sched.apply_config(two_lanes({"kvCacheReserved": 0.5}, {}))
    plan = step(sched, ex, clock)  # check_invariants: the reserve is free again
    assert plan.preempted and all(r.lane == "long" for r in plan.preempted)
    assert sched.kv.num_free_blocks >= 20 - sched.quotas.held["inter"]
    while sched.has_unfinished_requests():  # the preempted requests recompute and finish
        step(sched, ex, clock)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in plan.preempted)


@pytest.mark.parametrize(
    "lanes, message",
    [
        ([{"name": "a", "kvCacheReserved": 0.6}, {"name": "b", "kvCacheReserved": 0.4}], "add up to 1"),
        ([{"name": "a", "kvCacheReserved": 0.5, "maxKvCacheShare": 0.4}], "must be <= maxKvCacheShare"),
        ([{"name": "a", "maxKvCacheShare": 0}], "maxKvCacheShare"),
        ([{"name": "a", "kvCacheReserved": 1.0}], "must be in [0, 1)"),
    ],
)
def test_kv_shares_are_validated_with_a_clear_message(lanes, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        RuntimeConfig.from_dict({"model": {"path": "/m"}, "lanes": lanes})


def test_step_time_budget_key_is_off_by_default_and_validated():
    assert make_config().scheduler.step_time_budget == "off"
    with pytest.raises(ConfigError, match="stepTimeBudget"):
        RuntimeConfig.from_dict({"model": {"path": "/m"}, "scheduler": {"stepTimeBudget": "on"}})


# --------------------------------------------------------------------------- step-time budget


def roofline_seconds(chunks):
    """A made-up hardware: 2 ms fixed, 10 us per token, 0.1 us per KV token read, 1 ns per pair."""
    tokens = kv = pairs = 0.0
    for start, n in chunks:
        t, k, p = chunk_terms(start, n)
        tokens, kv, pairs = tokens + t, kv + k, pairs + p
    return 0.002 + 1e-5 * tokens + 1e-7 * kv + 1e-9 * pairs


def test_the_cost_model_learns_a_linear_step_time_from_measured_steps():
    model = StepCostModel()
    shapes = [[(100 + 7 * i, 1)] * (1 + i % 5) + ([(i * 13 % 900, 64 + i % 300)] if i % 3 else []) for i in range(64)]
    for chunks in shapes[:MIN_OBSERVATIONS - 1]:
        model.observe(chunks, roofline_seconds(chunks))
    assert not model.ready and not StepTimeBudget(model, 0.01).active
    for chunks in shapes[MIN_OBSERVATIONS - 1:]:
        model.observe(chunks, roofline_seconds(chunks))
    assert model.ready
    probe = [(5000, 1)] * 20 + [(2000, 512)]
    t, k, p = (sum(x) for x in zip(*(chunk_terms(s, n) for s, n in probe)))
    assert model.predict(t, k, p) == pytest.approx(roofline_seconds(probe), rel=0.02)


def timed_executor(num_blocks, block_size):
    """The fake executor, reporting the made-up hardware's step seconds."""
    return FakeExecutor(num_blocks, block_size,
                        step_seconds=lambda plan: roofline_seconds([(c.start, c.num_tokens) for c in plan.chunks]))


def budget_lanes(step_time_budget):
    lanes = [
        {"name": "inter", "priority": 100, "default": True, "slo": {"tpotP95Ms": 10}},
        {"name": "bulk", "priority": 10, "slo": {"tpotP95Ms": 200}},
    ]
    return make_config(lanes=lanes, max_batched_tokens=4096, prefill_chunk_size=2048, max_active_sequences=64,
                       step_time_budget=step_time_budget)


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_the_budget_caps_lower_priority_prefill_chunks_to_the_tightest_tpot_target(mode):
    clock = Clock()
    sched = Scheduler(budget_lanes(mode), 4096, 16, max_model_len=65536, clock=clock)
    ex = timed_executor(4096, 16)
    for i in range(2 * MIN_OBSERVATIONS):  # calibrate on steps of varied shapes, both lanes
        sched.add_request(req(f"warm{i}", n_prompt=40 + 97 * i, max_tokens=2, lane="inter" if i % 2 else "bulk",
                              first=100 * i))
        step(sched, ex, clock)
    while sched.has_unfinished_requests():
        step(sched, ex, clock)
    sched.add_request(req("d", n_prompt=8, max_tokens=64, lane="inter", first=9000))
    step(sched, ex, clock)  # now an interactive decode is running
    sched.add_request(req("bulk", n_prompt=6000, max_tokens=2, lane="bulk", first=20000))
    plan = step(sched, ex, clock)
    bulk = [c for c in plan.chunks if c.request.request_id == "bulk"]
    seconds = roofline_seconds([(c.start, c.num_tokens) for c in plan.chunks])
    if mode == "off":
        assert bulk[0].num_tokens == 2048 and seconds > 0.010
    else:
        assert 0 < bulk[0].num_tokens < 2048
        assert seconds <= 0.010 * 0.85 * 1.05  # the cap, give or take the model's error
        assert sched.num_time_capped_steps >= 1 and sched.lanes["bulk"].time_capped_steps >= 1
    while sched.has_unfinished_requests():
        step(sched, ex, clock)


# ---- per-lane static batching (lane key continuousBatching: false)


def running_ids(sched, lane):
    return {r.request_id for r in sched.running if r.status is RequestStatus.RUNNING and r.lane == lane}


@pytest.mark.parametrize("static", [False, True])
def test_a_static_lane_starts_new_requests_only_when_its_batch_has_drained(static):
    """Table: the same traffic with the batch lane static or continuous; the interactive lane
    keeps continuous batching either way."""
    lanes = [
        {"name": "inter", "priority": 100, "default": True},
        {"name": "batch", "priority": 10, "continuousBatching": not static},
    ]
    sched, ex, clock = make(make_config(lanes=lanes), num_blocks=200)
    sched.add_request(req("b0", max_tokens=6, lane="batch"))
    sched.add_request(req("b1", max_tokens=2, lane="batch", first=50))
    step(sched, ex, clock)
    assert running_ids(sched, "batch") == {"b0", "b1"}
    sched.add_request(req("late", max_tokens=2, lane="batch", first=90))
    sched.add_request(req("i0", max_tokens=2, lane="inter", first=130))
    step(sched, ex, clock)
    assert "i0" in running_ids(sched, "inter")  # other lanes join at any step
    assert ("late" in running_ids(sched, "batch")) == (not static)
    while "b0" in sched.requests:  # b1 finishes first: a static lane still waits for b0
        if static:
            assert "late" not in running_ids(sched, "batch")
        step(sched, ex, clock)
    step(sched, ex, clock)
    assert "late" in running_ids(sched, "batch") or "late" not in sched.requests


def test_a_static_lane_batch_is_capped_by_its_max_active_sequences_and_keeps_preempted_members():
    lanes = [{"name": "batch", "default": True, "continuousBatching": False, "maxActiveSequences": 2}]
    sched, ex, clock = make(make_config(lanes=lanes), num_blocks=200)
    for i in range(3):
        sched.add_request(req(f"b{i}", max_tokens=3, lane="batch", first=40 * i))
    step(sched, ex, clock)
    assert running_ids(sched, "batch") == {"b0", "b1"}
    # A preempted member gives its start back and restarts within the same batch.
    sched._preempt(sched.requests["b1"], StepPlan())  # as memory pressure would, between steps
    step(sched, ex, clock)
    assert running_ids(sched, "batch") == {"b0", "b1"}
    while "b0" in sched.requests or "b1" in sched.requests:
        assert "b2" not in running_ids(sched, "batch")
        step(sched, ex, clock)
    step(sched, ex, clock)
    assert "b2" in running_ids(sched, "batch") or "b2" not in sched.requests


def test_continuous_batching_on_a_lane_is_a_bool_that_defaults_to_true():
    config = make_config(lanes=[{"name": "a", "default": True}])
    assert config.lanes[0].continuous_batching is True
    with pytest.raises(ConfigError):
        make_config(lanes=[{"name": "a", "default": True, "continuousBatching": "sometimes"}])
