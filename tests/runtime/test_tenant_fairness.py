"""Weighted fair share among tenants inside one lane (lanes.py), through the real engine.

The property: with backlogged tenants of weights w_i in one lane, the tokens each tenant is
served (prompt tokens of its started requests + output tokens produced) divided by its weight
stay within a fixed bound of each other, so the shares converge to the weight ratio as the
totals grow, and no backlogged tenant goes unserved for long. The bound: a tenant is picked
only when it is furthest behind; from then on it can get ahead by at most one prompt plus the
outputs of the requests it has running, (maxPrompt + maxActive * maxOutput) / min weight.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenlane.runtime.config import TenantConfig
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.core.lanes import Lane
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.executor.fake import FakeExecutor, make_config
from tokenlane.runtime.executor.simulated import VirtualClock as Clock

MAX_PROMPT = 24
MAX_OUTPUT = 12


def _with_tenants(config, tenants):
    return dataclasses.replace(config, tenants=list(tenants))


def _engine(config, num_blocks=400):
    clock = Clock()
    ex = FakeExecutor(num_blocks, config.engine.block_size, vocab_size=1000, max_model_len=None, step_seconds=0.01)
    return LLMEngine(config, ex, clock=clock), clock


def _request(rid, tenant, prompt_len, max_tokens, now, priority=0, deadline=None):
    return Request(
        rid,
        [1 + (i % 50) for i in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens),
        tenant=tenant,
        priority=priority,
        deadline=deadline,
        arrival_time=now,
    )


@st.composite
def backlogs(draw):
    weights = draw(st.lists(st.sampled_from([1, 2, 3]), min_size=2, max_size=3))
    max_active = draw(st.integers(1, 4))
    mbt = draw(st.integers(8, 48))
    chunk = draw(st.integers(1, mbt))
    per_tenant = 30
    specs = []
    for t in range(len(weights)):
        for _ in range(per_tenant):
            specs.append((t, draw(st.integers(1, MAX_PROMPT)), draw(st.integers(1, MAX_OUTPUT))))
    order = draw(st.permutations(range(len(specs))))
    return weights, max_active, mbt, chunk, [specs[i] for i in order]


def _served(requests, tenant):
    return sum(r.num_prompt_tokens + r.num_output_tokens for r in requests
               if r.tenant == tenant and r.first_scheduled_time is not None)


def run_backlog(weights, max_active, mbt, chunk, specs):
    config = make_config(lanes=[{"name": "shared", "default": True}], max_batched_tokens=mbt,
                         prefill_chunk_size=chunk, max_active_sequences=max_active, max_waiting_requests=10_000,
                         prefix_caching=False)
    names = [f"t{i}" for i in range(len(weights))]
    config = _with_tenants(config, [TenantConfig(name=n, weight=float(w)) for n, w in zip(names, weights)])
    engine, clock = _engine(config)
    lane = engine.scheduler.lanes["shared"]
    requests = []
    for i, (t, prompt_len, max_tokens) in enumerate(specs):
        r = _request(f"r{i}", names[t], prompt_len, max_tokens, clock.now)
        requests.append(r)
        engine.add_request(r)
    bound = (MAX_PROMPT + max_active * MAX_OUTPUT) / min(weights)
    # A backlogged tenant unserved for this many steps would break the bound (each step
    # serves at least one token to some other tenant).
    starvation_window = int(2 * bound * (len(weights) - 1) * max(weights)) + 2
    last_served_step = {n: 0 for n in names}
    served_before = {n: 0 for n in names}
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        clock.now += 0.01
        step += 1
        backlogged = [n for n in names if any(r.tenant == n and r in lane for r in requests)]
        if len(backlogged) < len(names):
            break  # a tenant ran out of work: fair share among the backlogged ends here
        served = {n: _served(requests, n) for n in names}
        normalized = [served[n] / w for n, w in zip(names, weights)]
        assert max(normalized) - min(normalized) <= bound, (served, weights, bound)
        for n in names:
            if served[n] > served_before[n]:
                last_served_step[n] = step
            assert step - last_served_step[n] <= starvation_window, f"{n} starved"
        served_before = served
        assert step < 100_000
    return {n: _served(requests, n) for n in names}, bound


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(backlogs())
def test_backlogged_tenants_are_served_in_their_weight_ratio(scenario):
    weights, max_active, mbt, chunk, specs = scenario
    served, bound = run_backlog(weights, max_active, mbt, chunk, specs)
    normalized = [served[f"t{i}"] / w for i, w in enumerate(weights)]
    assert max(normalized) - min(normalized) <= bound


def test_shares_converge_to_the_weight_ratio():
    # Equal request sizes, weights 3:1, one at a time: the heavier tenant gets about 3x the tokens.
    specs = [(t, 8, 4) for _ in range(60) for t in (0, 1)]
    served, bound = run_backlog([3, 1], 1, 32, 16, specs)
    ratio = served["t0"] / served["t1"]
    assert 2.5 <= ratio <= 3.5, served


# ---- the lane's pick, directly


def _lane(weights=None):
    config = make_config(lanes=[{"name": "shared", "default": True}])
    lane = Lane(config.lanes[0], config.lane_budgets("shared"))
    lane.set_tenant_weights(weights or {})
    return lane


def _drain(lane):
    order = []
    while lane.num_waiting:
        order.append(lane.pop().request_id)
    return order


def test_one_tenant_keeps_deadline_priority_arrival_order():
    lane = _lane()
    lane.push(_request("late", "a", 4, 1, now=1.0))
    lane.push(_request("early", "a", 4, 1, now=2.0))
    lane.push(_request("urgent", "a", 4, 1, now=3.0, deadline=10.0))
    lane.push(_request("high", "a", 4, 1, now=4.0, priority=5))
    assert _drain(lane) == ["urgent", "high", "late", "early"]


def test_equal_weights_interleaved_stay_first_come_first_served():
    lane = _lane({"a": 1.0, "b": 1.0})
    for i in range(6):
        lane.push(_request(f"r{i}", "ab"[i % 2], 4, 1, now=float(i)))
    assert _drain(lane) == [f"r{i}" for i in range(6)]


def test_a_heavier_tenant_starts_more_often():
    lane = _lane({"a": 2.0, "b": 1.0})
    for i in range(6):
        lane.push(_request(f"a{i}", "a", 4, 1, now=float(i)))
        lane.push(_request(f"b{i}", "b", 4, 1, now=float(i) + 0.5))
    first_six = _drain(lane)[:6]
    assert sum(rid.startswith("a") for rid in first_six) == 4


def test_resumed_requests_still_go_first():
    lane = _lane()
    lane.push(_request("new", "a", 4, 1, now=0.0))
    resumed = _request("resumed", "b", 4, 1, now=5.0)
    resumed.first_scheduled_time = 5.0  # it ran before: preempted by recompute
    lane.push(resumed)
    assert _drain(lane) == ["resumed", "new"]


def test_a_returning_tenant_banks_no_idle_credit():
    lane = _lane()
    lane.charge_tenant("busy", 1000)
    lane.push(_request("b0", "busy", 4, 1, now=0.0))
    lane.push(_request("b1", "busy", 4, 1, now=0.1))
    lane.push(_request("idle0", "idle", 4, 1, now=0.2))
    lane.push(_request("idle1", "idle", 4, 1, now=0.3))
    # The idle tenant comes in level with the waiting one, not 1000 tokens ahead of it.
    assert lane.tenant_vtime["idle"] == lane.tenant_vtime["busy"]
    assert _drain(lane)[:2] in (["b0", "idle0"], ["idle0", "b0"])


def test_removed_and_expired_requests_leave_the_pick():
    lane = _lane()
    a = _request("a", "x", 4, 1, now=0.0)
    b = _request("b", "y", 4, 1, now=0.0)
    lane.push(a)
    lane.push(b)
    assert lane.remove(a)
    assert lane.peek() is b
    assert lane.pop_expired(now=1e9) == [b]
    assert lane.peek() is None and lane.num_waiting == 0


def test_reload_changes_the_weights_in_force():
    config = make_config(lanes=[{"name": "shared", "default": True}])
    engine, _ = _engine(_with_tenants(config, [TenantConfig(name="a", weight=1.0)]))
    lane = engine.scheduler.lanes["shared"]
    lane.charge_tenant("a", 10)
    assert lane.tenant_vtime["a"] == 10
    engine.reload_config(_with_tenants(config, [TenantConfig(name="a", weight=5.0)]))
    engine.step()
    lane.charge_tenant("a", 10)
    assert lane.tenant_vtime["a"] == 12  # counters kept, new tokens at the new weight
