"""Lane isolation on a real LLMEngine (fake executor, a clock the test moves): the per-lane
metrics (KV blocks held, steps capped by the time budget) through the Prometheus observer,
and every lane-isolation key taking effect by hot reload, without a restart
(docs/tuning.md, "Lane isolation")."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.engine.llm_engine import LLMEngine, restart_field_changes
from tokenlane.runtime.observability.metrics import PrometheusMetrics
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
from tokenlane.runtime.core.step_cost import MIN_OBSERVATIONS, chunk_terms
from tokenlane.runtime.executor.fake import FakeExecutor, make_config
from tokenlane.runtime.executor.simulated import VirtualClock as Clock

torch = pytest.importorskip("torch")


def make_engine(config, num_blocks=40, block_size=4, **executor):
    clock = Clock(100.0)
    engine = LLMEngine(config, FakeExecutor(num_blocks, block_size, vocab_size=100_000, max_model_len=None, **executor), clock=clock)
    metrics = PrometheusMetrics("tiny")
    metrics.set_config(config)
    engine.add_observer(metrics)
    return engine, clock, metrics


def req(rid, n_prompt, max_tokens, lane, first=0):
    return Request(rid, list(range(first + 1, first + 1 + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), lane=lane, arrival_time=100.0)


def step(engine, clock, n=1):
    for _ in range(n):
        engine.step()
        engine.scheduler.check_invariants()
        clock.now += 0.01


def run_until_idle(engine, clock, limit=2000):
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        step(engine, clock)
    raise AssertionError("the engine did not finish its requests")


def sample(metrics, name, **labels):
    values = [s.value for family in text_string_to_metric_families(metrics.render().decode())
              for s in family.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def running(engine, rid):
    request = engine.scheduler.requests.get(rid)
    return request is not None and request.status is RequestStatus.RUNNING


def reload(engine, config: RuntimeConfig, lanes=None, **scheduler) -> RuntimeConfig:
    """Stage `config` with the lanes' keys and scheduler keys replaced; it must need no restart."""
    new_lanes = [dataclasses.replace(lane, **(lanes or {}).get(lane.name, {})) for lane in config.lanes]
    new = dataclasses.replace(config, lanes=new_lanes,
                              scheduler=dataclasses.replace(config.scheduler, **scheduler))
    assert restart_field_changes(config, new) == []
    engine.reload_config(new)
    return new


TWO_LANES = [
    {"name": "inter", "priority": 100, "default": True},
    {"name": "long", "priority": 10},
]


# ---- per-lane metrics


@pytest.mark.parametrize("long_lane", [{}, {"maxKvCacheShare": 0.5, "kvCacheReserved": 0.1}])
def test_lane_kv_blocks_follow_the_blocks_each_lane_holds(long_lane):
    """With and without KV shares in force (the gauge reads the quota books or a recount)."""
    config = make_config(lanes=[TWO_LANES[0], {**TWO_LANES[1], **long_lane}])
    engine, clock, metrics = make_engine(config)
    for lane in ("inter", "long"):  # present from the start, at zero
        assert sample(metrics, "tokenlane_lane_kv_blocks", lane=lane) == 0
        assert sample(metrics, "tokenlane_time_capped_steps_total", lane=lane) == 0
    engine.add_request(req("i", 9, 6, "inter"))
    engine.add_request(req("l0", 20, 6, "long", first=100))
    engine.add_request(req("l1", 20, 6, "long", first=200))
    seen = {"inter": 0, "long": 0}
    while engine.has_unfinished_requests():
        step(engine, clock)
        for lane in ("inter", "long"):
            held = sum(len(r.block_ids) for r in engine.scheduler.running
                       if r.status is RequestStatus.RUNNING and r.lane == lane)
            assert sample(metrics, "tokenlane_lane_kv_blocks", lane=lane) == held
            seen[lane] = max(seen[lane], held)
    assert seen["inter"] >= 3 and seen["long"] >= 10  # the gauge moved with real holdings
    assert sample(metrics, "tokenlane_lane_kv_blocks", lane="long") == 0


def roofline_seconds(chunks):
    """A made-up hardware: 2 ms fixed, 10 us per token, 0.1 us per KV token read, 1 ns per pair."""
    tokens = kv = pairs = 0.0
    for start, n in chunks:
        t, k, p = chunk_terms(start, n)
        tokens, kv, pairs = tokens + t, kv + k, pairs + p
    return 0.002 + 1e-5 * tokens + 1e-7 * kv + 1e-9 * pairs


def timed(plan):
    return roofline_seconds([(c.start, c.num_tokens) for c in plan.chunks])


BUDGET_LANES = [
    {"name": "inter", "priority": 100, "default": True, "slo": {"tpotP95Ms": 10}},
    {"name": "bulk", "priority": 10, "slo": {"tpotP95Ms": 200}},
]


def budget_config(step_time_budget):
    return make_config(lanes=BUDGET_LANES, max_batched_tokens=4096, prefill_chunk_size=2048, max_active_sequences=64,
                       max_model_len=65536, step_time_budget=step_time_budget)


def calibrate(engine, clock):
    """Steps of varied shapes, both lanes, then idle: the cost model is fitted when on."""
    for i in range(2 * MIN_OBSERVATIONS):
        engine.add_request(req(f"warm{i}", 40 + 97 * i, 2, "inter" if i % 2 else "bulk", first=100 * i))
        step(engine, clock)
    run_until_idle(engine, clock)


def bulk_prompt_beside_a_decode(engine, clock):
    """An interactive decode runs; a long bulk prompt arrives. Returns its first chunk's size."""
    engine.add_request(req("d", 8, 64, "inter", first=9000))
    step(engine, clock)
    engine.add_request(req("bulk", 6000, 2, "bulk", first=20000))
    step(engine, clock)
    bulk = engine.scheduler.requests["bulk"]
    return bulk.num_computed_tokens


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_time_capped_steps_count_the_steps_the_budget_shortened_a_lane(mode):
    engine, clock, metrics = make_engine(budget_config(mode), num_blocks=4096, block_size=16, step_seconds=timed)
    calibrate(engine, clock)
    first_chunk = bulk_prompt_beside_a_decode(engine, clock)
    run_until_idle(engine, clock)
    capped = sample(metrics, "tokenlane_time_capped_steps_total", lane="bulk")
    assert capped == engine.scheduler.lanes["bulk"].time_capped_steps
    assert sample(metrics, "tokenlane_time_capped_steps_total", lane="inter") == 0  # its target sets the cap
    if mode == "off":
        assert first_chunk == 2048 and capped == 0
    else:
        assert first_chunk < 2048 and capped >= 1


# ---- hot reload of every lane-isolation key


def fill_long_lane(engine, clock, max_tokens):
    """Three long-lane requests of 8 blocks each: 24 of 40 blocks, above a 0.5 high watermark."""
    for i in range(3):
        engine.add_request(req(f"long{i}", 28, max_tokens, "long", first=100 * i))
    step(engine, clock, 4)


def test_max_kv_cache_share_applies_by_reload():
    config = make_config(lanes=TWO_LANES)
    engine, clock, _ = make_engine(config)
    fill_long_lane(engine, clock, max_tokens=4)
    assert engine.scheduler.quotas.held["long"] > 10
    reload(engine, config, lanes={"long": {"max_kv_cache_share": 0.25}})  # 10 of 40 blocks
    step(engine, clock)
    assert engine.scheduler.quotas.held["long"] <= 10  # the lane's newest requests were preempted
    run_until_idle(engine, clock)


def test_kv_cache_reserved_applies_by_reload():
    config = make_config(lanes=TWO_LANES, kv_cache_high_watermark=0.5, kv_cache_reject_watermark=0.95)
    engine, clock, _ = make_engine(config)
    fill_long_lane(engine, clock, max_tokens=20)
    assert engine.scheduler.kv.usage >= 0.5
    engine.add_request(req("i", 6, 2, "inter", first=900))
    step(engine, clock)
    assert not running(engine, "i")  # above the high watermark: no prefill starts
    reload(engine, config, lanes={"inter": {"kv_cache_reserved": 0.25}})
    step(engine, clock)
    assert running(engine, "i") or engine.scheduler.requests.get("i") is None  # started inside its reserve
    run_until_idle(engine, clock)


def test_continuous_batching_of_a_lane_applies_by_reload():
    config = make_config(lanes=TWO_LANES, max_batched_tokens=64)
    engine, clock, _ = make_engine(config, num_blocks=200)
    engine.add_request(req("first", 8, 40, "long"))
    step(engine, clock)
    engine.add_request(req("joins", 8, 40, "long", first=100))
    step(engine, clock)
    assert running(engine, "first") and running(engine, "joins")  # continuous: it joined at once
    reload(engine, config, lanes={"long": {"continuous_batching": False}})
    engine.add_request(req("waits", 8, 2, "long", first=200))
    engine.add_request(req("inter", 8, 2, "inter", first=300))
    step(engine, clock)
    assert running(engine, "inter")  # the other lane keeps continuous batching
    while engine.scheduler.requests.get("first") or engine.scheduler.requests.get("joins"):
        assert not running(engine, "waits")  # static now: it waits for the running batch to drain
        step(engine, clock)
    step(engine, clock)
    assert running(engine, "waits") or "waits" not in engine.scheduler.requests
    run_until_idle(engine, clock)


def test_step_time_budget_applies_by_reload():
    config = budget_config("off")
    engine, clock, _ = make_engine(config, num_blocks=4096, block_size=16, step_seconds=timed)
    calibrate(engine, clock)
    assert not engine.scheduler.step_cost.ready  # off: no measuring, no capping
    reload(engine, config, step_time_budget="auto")
    calibrate(engine, clock)
    assert bulk_prompt_beside_a_decode(engine, clock) < 2048
    assert engine.scheduler.lanes["bulk"].time_capped_steps >= 1
    run_until_idle(engine, clock)
