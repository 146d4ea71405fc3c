"""Property tests of the scheduler's policies (runtime/core/sched_policies.py), one rule each:
lane order (priority, weighted fair share, no starvation), the step-time budget, engine-wide
and per-lane static batching, and parallel sampling's start rule."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenlane.runtime.core.lanes import Lane
from tokenlane.runtime.core.request import Request, SamplingParams, SequenceGroup
from tokenlane.runtime.core.sched_policies import (
    CAPPED_PREFILL_FLOOR,
    STEP_BUDGET_SHARE,
    LaneBatches,
    LaneOrder,
    ParallelSampling,
    StaticBatch,
    StepTimePolicy,
)
from tokenlane.runtime.core.step_cost import MIN_OBSERVATIONS, StepCostModel
from tokenlane.runtime.executor.fake import make_config
from property_examples import examples

PROPERTY = settings(
    max_examples=examples(60, thorough_run=600), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def make_lanes(specs: list[dict]) -> list[Lane]:
    """Lanes from camelCase lane dicts (the first is the default lane)."""
    specs = [{"name": f"lane{i}", "default": i == 0, **spec} for i, spec in enumerate(specs)]
    config = make_config(lanes=specs, max_batched_tokens=64, prefill_chunk_size=64)
    return [Lane(lc, config.lane_budgets(lc.name)) for lc in config.lanes]


def request(rid: str, lane: str = "lane0", n_prompt: int = 4) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=2), lane=lane, arrival_time=0.0)


lane_specs = st.lists(
    st.fixed_dictionaries({"priority": st.sampled_from([10, 50, 100]), "weight": st.sampled_from([1, 2, 4])}),
    min_size=1,
    max_size=4,
)


# ---------------------------------------------------------------- LaneOrder


@PROPERTY
@given(lane_specs, st.data())
def test_lane_order_goes_starved_first_then_by_priority_then_by_fair_share(specs, data):
    lanes = make_lanes(specs)
    order = LaneOrder(starvation_steps=data.draw(st.integers(1, 8)))
    for lane in lanes:
        lane.vtime = data.draw(st.floats(0, 100))
        lane.starved_steps = data.draw(st.integers(0, 10))
    first = order.first(lanes)
    starved = [lane for lane in lanes if lane.starved_steps >= order.starvation_steps]
    pool = starved or lanes
    assert first in pool
    top = max(lane.config.priority for lane in pool)
    assert first.config.priority == top
    assert first.vtime == min(lane.vtime for lane in pool if lane.config.priority == top)


@PROPERTY
@given(lane_specs, st.integers(0, 4), st.lists(st.integers(1, 32), min_size=1, max_size=200))
def test_lane_order_serves_every_lane_with_work_within_the_starvation_bound(specs, extra_steps, chunks):
    """Every lane always has work; one lane starts per round, the others are passed over.
    The bound holds for starvation_steps >= lanes - 1 (the scheduler's default is 32): starved
    lanes go first among themselves by priority, so with fewer steps two high-priority lanes
    could take turns starving a third."""
    lanes = make_lanes(specs)
    starvation_steps = max(1, len(lanes) - 1) + extra_steps
    order = LaneOrder(starvation_steps)
    since_served = {lane.name: 0 for lane in lanes}
    for tokens in chunks:
        first = order.first(lanes)
        order.charge(first, tokens)
        order.started(first)
        for lane in lanes:
            if lane is first:
                since_served[lane.name] = 0
            else:
                order.passed_over(lane)
                since_served[lane.name] += 1
                assert since_served[lane.name] <= starvation_steps + len(lanes), lane.name


@PROPERTY
@given(st.lists(st.sampled_from([1, 2, 4]), min_size=2, max_size=4), st.lists(st.integers(1, 16), min_size=1, max_size=300))
def test_lanes_of_one_priority_share_tokens_by_weight(weights, chunks):
    """Weighted fair queueing: served tokens / weight of busy equal-priority lanes stay within
    one chunk of each other."""
    lanes = make_lanes([{"priority": 50, "weight": w} for w in weights])
    order = LaneOrder(starvation_steps=10**9)
    for tokens in chunks:
        lane = order.first(lanes)
        order.charge(lane, tokens)
        clocks = [lane.vtime for lane in lanes]
        assert max(clocks) - min(clocks) <= max(chunks) / min(weights) + 1e-9
    assert sum(lane.served_tokens for lane in lanes) == sum(chunks)


@PROPERTY
@given(lane_specs, st.data())
def test_an_idle_lane_banks_no_credit(specs, data):
    lanes = make_lanes(specs)
    for lane in lanes:
        lane.vtime = data.draw(st.floats(0, 100))
        lane.num_running = data.draw(st.integers(0, 1))
    before = {lane.name: lane.vtime for lane in lanes}
    LaneOrder.catch_up_idle(lanes)
    active = [before[lane.name] for lane in lanes if lane.num_running]
    for lane in lanes:
        if lane.num_running:
            assert lane.vtime == before[lane.name]
        else:
            assert lane.vtime >= before[lane.name]
            assert not active or lane.vtime >= min(active)


# ---------------------------------------------------------------- StepTimePolicy


def fitted_model(per_token_s: float, fixed_s: float) -> StepCostModel:
    model = StepCostModel()
    for i in range(MIN_OBSERVATIONS + 8):
        tokens = 1 + 37 * i % 300
        model.observe([(0, tokens)], fixed_s + per_token_s * tokens)
    assert model.ready
    return model


tpot_targets = st.sampled_from([None, 5, 20, 50, 200])


@PROPERTY
@given(
    st.lists(st.fixed_dictionaries({"priority": st.sampled_from([10, 50, 100]), "tpot": tpot_targets}), min_size=1, max_size=3),
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 2000), st.integers(0, 600), st.booleans(), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([2e-5, 1e-4]),  # seconds per token: with 1e-4, a 32-token chunk alone exceeds 5 ms
)
def test_the_step_time_budget_only_shortens_chunks_and_keeps_its_promises(specs, calls, per_token_s):
    lanes = make_lanes([
        {"priority": s["priority"], **({"slo": {"tpotP95Ms": s["tpot"]}} if s["tpot"] else {})} for s in specs
    ])
    for lane in lanes:
        lane.num_running = 1
    policy = StepTimePolicy(fitted_model(per_token_s=per_token_s, fixed_s=0.002))
    budget = policy.begin_step(True, lanes)
    targets = [lane.config.slo.tpot_p95_ms for lane in lanes if lane.config.slo.tpot_p95_ms]
    if not targets:
        assert not budget.active
        return
    assert budget.cap_s == min(targets) / 1000.0 * STEP_BUDGET_SHARE
    for lane_index, start, n, starting, starved in calls:
        lane = lanes[lane_index % len(lanes)]
        had_prefill = budget.has_prefill
        top_before = budget.prefill_priority
        got = policy.chunk(lane, start, n, starting=starting, starved=starved)
        assert 0 <= got <= n
        target = lane.config.slo.tpot_p95_ms
        if target and target / 1000.0 * STEP_BUDGET_SHARE <= budget.cap_s * (1 + 1e-9):
            assert got == n  # the lanes that set the cap keep their chunks whole
        elif lane.config.priority >= top_before and not had_prefill:
            assert got >= min(n, CAPPED_PREFILL_FLOOR)  # the step's first prefill progresses
        if got < n:
            assert lane.last_capped_step == policy.step_index and lane.time_capped_steps == 1
        if got:
            budget.add(start, got)


@PROPERTY
@given(tpot_targets, tpot_targets, st.floats(0, 2), st.floats(0, 2))
def test_a_decode_sits_out_a_step_only_within_its_own_target(cap_target, lane_target, since_last, now):
    capping, lane = make_lanes([
        {"priority": 100, **({"slo": {"tpotP95Ms": cap_target}} if cap_target else {})},
        {"priority": 10, **({"slo": {"tpotP95Ms": lane_target}} if lane_target else {})},
    ])
    capping.num_running = 1
    policy = StepTimePolicy(fitted_model(per_token_s=1e-3, fixed_s=0.01))  # every step exceeds 5 ms
    budget = policy.begin_step(True, [capping, lane])
    r = request("d", lane="lane1")
    r.num_computed_tokens = 4
    r.token_times.append(now - since_last)
    skipped = policy.may_skip_decode(r, lane, now)
    if not budget.active:
        assert not skipped
        return
    allowed = (lane_target / 1000.0 * STEP_BUDGET_SHARE) if lane_target else 1.0
    if skipped:
        assert allowed > budget.cap_s
        assert since_last + 2 * budget.cap_s <= allowed + 1e-9  # its next token still in time
    assert not policy.may_skip_decode(r, capping, now) or not cap_target


# ---------------------------------------------------------------- StaticBatch


@PROPERTY
@given(
    st.lists(
        st.fixed_dictionaries({
            "priority": st.sampled_from([10, 50]),
            "maxActiveSequences": st.integers(1, 4),
            "queued": st.lists(st.integers(1, 3), max_size=6),  # each a group size (1: single)
        }),
        min_size=1,
        max_size=3,
    ),
    st.integers(1, 8),
)
def test_a_static_batch_holds_at_most_max_active_sequences(specs, max_active):
    lanes = make_lanes([{"priority": s["priority"], "maxActiveSequences": s["maxActiveSequences"]} for s in specs])
    n = 0
    for lane, spec in zip(lanes, specs):
        for size in spec["queued"]:
            members = [request(f"r{n}.{i}", lane=lane.name) for i in range(size)]
            n += 1
            if size > 1:
                SequenceGroup.of(members)
            lane.push(members[0])  # followers wait for their leader, off the queue
    order = LaneOrder(starvation_steps=8)
    waiting_before = {lane.name: lane.num_waiting for lane in lanes}
    batch = StaticBatch()
    batch.form(lanes, order, max_active)
    groups = [r.group for r in batch.waiting if r.group is not None]
    size = len(batch.members)
    # Whole groups only; over the cap only when a single group alone is larger than it.
    assert size == len(batch.waiting) + sum(len(g.members) - 1 for g in groups)
    assert size <= max_active or len(batch.waiting) == 1
    for lane in lanes:
        taken = [r for r in batch.waiting if r.lane == lane.name]
        assert len(taken) <= lane.budgets.max_active_sequences
        assert batch.waiting_per_lane.get(lane.name, 0) == len(taken)
        assert lane.num_waiting == waiting_before[lane.name] - len(taken)
        if waiting_before[lane.name] and not taken and batch.members:
            assert lane.starved_steps == 1  # passed over
    batch.check_invariants([lane.name for lane in lanes])
    members = set(batch.members)
    batch.form(lanes, order, max_active)  # a batch with members takes nobody new
    assert batch.members == members


# ---------------------------------------------------------------- LaneBatches


@PROPERTY
@given(
    st.integers(1, 4),
    st.lists(st.sampled_from(["arrive", "start", "finish", "preempt"]), min_size=1, max_size=60),
)
def test_a_static_lane_admits_only_its_open_batch_until_it_drains(max_active, events):
    (lane,) = make_lanes([{"continuousBatching": False, "maxActiveSequences": max_active}])
    batches = LaneBatches()
    running: list[Request] = []
    arrived_at: dict[str, int] = {}
    drained_at = 0  # event index the lane's running set last became empty
    starts_since_drain = 0
    preempted_since_drain = 0
    n = 0
    for t, event in enumerate(events):
        if event == "arrive":
            r = request(f"r{n}", lane=lane.name)
            n += 1
            lane.push(r)
            batches.arrived(r)
            arrived_at[r.request_id] = t
        elif event == "start" and lane.num_waiting:
            head = lane.peek()
            if not running:
                drained_at, starts_since_drain, preempted_since_drain = t, 0, 0
            if batches.joins(lane, head):
                lane.pop()
                batches.started(lane, head)
                running.append(head)
                lane.num_running += 1
                starts_since_drain += 1
                # Joined the batch opened when the lane last drained: arrived before that.
                assert arrived_at.get(head.request_id, -1) <= drained_at
                assert starts_since_drain <= max_active + preempted_since_drain
        elif event == "finish" and running:
            r = running.pop(0)
            lane.num_running -= 1
            batches.forget(r)
        elif event == "preempt" and running:
            r = running.pop()
            lane.num_running -= 1
            r.first_scheduled_time = 0.0  # resumed: back at the head of the queue
            lane.push(r)
            batches.gave_back(lane)
            preempted_since_drain += 1
        if running:
            assert batches.closed(lane) == (batches._open[lane.name][1] <= 0)
        else:
            assert not batches.closed(lane)


# ---------------------------------------------------------------- ParallelSampling


@PROPERTY
@given(
    st.integers(2, 8),
    st.integers(0, 6),
    st.integers(0, 10),
    st.integers(1, 10),
    st.integers(0, 10),
    st.integers(1, 10),
    st.integers(0, 12),
)
def test_a_sequence_group_starts_only_with_room_for_all_its_sequences(
    size, leader_blocks, running, max_active, lane_running, lane_max, room
):
    asked: list[int] = []

    def fits(num_blocks: int) -> bool:
        asked.append(num_blocks)
        return num_blocks <= room

    ok = ParallelSampling().group_fits(
        size, leader_blocks, num_running=running, max_active=max_active,
        lane_running=lane_running, lane_max_active=lane_max, fits_blocks=fits,
    )
    if ok:
        assert running == 0 or running + size <= max_active
        assert lane_running == 0 or lane_running + size <= lane_max
        assert asked == [leader_blocks + size - 1]  # one spare block per follower's copy
    else:
        assert (
            (running and running + size > max_active)
            or (lane_running and lane_running + size > lane_max)
            or leader_blocks + size - 1 > room
        )


@PROPERTY
@given(st.integers(2, 8), st.integers(1, 6), st.integers(0, 12), st.integers(0, 12))
def test_a_sequence_group_larger_than_its_lane_starts_once_the_lane_has_room_for_all_it_holds(
    size, leader_blocks, capacity, room
):
    """With the lane's capacity (the most blocks it can ever hold), a leader asks for room for
    its group's blocks up to that capacity, never less than its own: a group its lane can
    never hold whole still starts (no livelock), and one it can hold asks for all of it."""
    capacity = max(capacity, leader_blocks)  # admission: each sequence alone fits its lane
    asked: list[int] = []

    def fits(num_blocks: int) -> bool:
        asked.append(num_blocks)
        return num_blocks <= room

    ok = ParallelSampling().group_fits(
        size, leader_blocks, num_running=0, max_active=8, lane_running=0, lane_max_active=8,
        fits_blocks=fits, capacity=capacity,
    )
    (need,) = asked
    assert leader_blocks <= need <= capacity
    assert need == min(leader_blocks + size - 1, capacity)
    assert ok == (need <= room)
    if room >= capacity:  # the lane has all it can ever hold free: the group starts
        assert ok
