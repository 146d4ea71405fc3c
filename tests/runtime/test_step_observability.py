"""What the engine reports per step beyond tokens: the free blocks still holding a cached
prefix, how long finished and cancelled requests kept their KV blocks, and out-of-memory
steps (their requests fail, the engine goes on). On a real LLMEngine with the fake executor
and a clock the test moves, through the flight recorder and the Prometheus metrics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.observability.flight_recorder import FlightRecorder
from tokenlane.runtime.core.kv_cache import KVCacheManager
from tokenlane.runtime.observability.metrics import PrometheusMetrics
from tokenlane.runtime.core.request import FinishReason, Request, SamplingParams
from tokenlane.runtime.executor.fake import FakeExecutor, make_config
from tokenlane.runtime.executor.simulated import VirtualClock as Clock

torch = pytest.importorskip("torch")

LANES = [
    {"name": "interactive", "default": True, "priority": 100, "weight": 4},
    {"name": "batch", "priority": 10, "weight": 1},
]


def make_engine(num_blocks=64):
    config = make_config(lanes=LANES, max_model_len=256)
    clock = Clock(100.0)
    engine = LLMEngine(config, FakeExecutor(num_blocks, 4, max_model_len=None), clock=clock)
    recorder = FlightRecorder(64, config)
    metrics = PrometheusMetrics("tiny")
    metrics.set_config(config)
    engine.add_observer(recorder)
    engine.add_observer(metrics)
    return engine, clock, recorder, metrics


def req(rid, prompt, max_tokens, lane="interactive", deadline=None):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), lane=lane,
                   deadline=deadline, arrival_time=100.0)


def sample(metrics, name, **labels):
    """The sum of the samples matching `labels` (None if there is none)."""
    values = [s.value for family in text_string_to_metric_families(metrics.render().decode())
              for s in family.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def run_until_idle(engine, limit=100):
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests")


# ---- cached-free blocks


def test_cached_free_count_follows_frees_hits_and_evictions():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", range(1, 10), 1)  # 9 tokens: 2 full blocks + 1 partial
    kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    assert kv.num_cached_free_blocks == 0  # held
    kv.free(a)
    assert kv.num_cached_free_blocks == 2  # the partial block carries no prefix
    b = req("b", range(1, 10), 1)
    hits = kv.find_cached_prefix(b)
    kv.allocate(b, 1, cached_blocks=hits)
    assert len(hits) == 2 and kv.num_cached_free_blocks == 0  # revived by the hit
    kv.free(b)
    c = req("c", range(50, 66), 1)  # 16 tokens: takes all 4 blocks, evicting both prefixes
    kv.allocate(c, 16)
    assert kv.num_cached_free_blocks == 0 and kv.num_free_blocks == 0
    kv.check_invariants([c])


def test_each_step_records_the_cached_free_blocks():
    engine, clock, recorder, metrics = make_engine()
    engine.add_request(req("a", range(1, 10), 2))  # 9 + 2 tokens: 2 full blocks computed
    run_until_idle(engine)
    steps = recorder.entries()
    assert [s["kv"]["blocks_cached_free"] for s in steps][-1] == 2
    assert steps[0]["kv"]["blocks_cached_free"] == 0
    assert sample(metrics, "tokenlane_kv_blocks_cached_free", model="tiny") == 2


def test_each_step_records_the_free_blocks_held_back_for_lane_reserves():
    lanes = [LANES[0], {**LANES[1], "kvCacheReserved": 0.25}]  # batch: 16 of the 64 blocks
    config = make_config(lanes=lanes, max_model_len=256)
    engine = LLMEngine(config, FakeExecutor(64, 4, max_model_len=None), clock=Clock(100.0))
    recorder = FlightRecorder(64, config)
    engine.add_observer(recorder)
    engine.add_request(req("i", range(1, 9), 1))  # interactive: 2 blocks, outside any reserve
    engine.step()
    assert recorder.entries()[-1]["kv"]["blocks_reserved"] == 16
    engine.add_request(req("b", range(20, 32), 5, lane="batch"))  # 12 tokens: 3 blocks of its reserve
    engine.step()
    assert recorder.entries()[-1]["kv"]["blocks_reserved"] == 13


# ---- tokens per lane


def test_prefill_and_decode_token_counters_per_lane_add_up_the_steps():
    engine, clock, recorder, metrics = make_engine()
    assert sample(metrics, "tokenlane_prefill_tokens_total", lane="batch") == 0  # present from the start
    engine.add_request(req("a", range(1, 21), 3))
    engine.add_request(req("b", range(30, 36), 2, lane="batch"))
    run_until_idle(engine)
    steps = recorder.entries()
    for lane, prompt, output in (("interactive", 20, 3), ("batch", 6, 2)):
        # The last token is sampled, not computed: decode steps compute output - 1 tokens.
        assert sample(metrics, "tokenlane_prefill_tokens_total", lane=lane) == prompt
        assert sample(metrics, "tokenlane_decode_tokens_total", lane=lane) == output - 1
        assert sum(s["lanes"][lane]["decode_tokens"] for s in steps) == output - 1


# ---- KV release latency


def test_a_cancel_waits_for_the_step_boundary_and_that_wait_is_its_release_latency():
    engine, clock, recorder, metrics = make_engine()
    engine.add_request(req("a", range(1, 9), 50))
    engine.step()
    engine.abort_request("a")  # staged while the engine is between steps ...
    clock.now += 0.3  # ... for 300 ms: the blocks stay taken until the next boundary
    engine.step()
    last = recorder.entries()[-1]
    assert last["kv"]["releases"] == 1 and last["kv"]["release_max_s"] == pytest.approx(0.3)
    assert last["kv"]["blocks_used"] == 0
    assert sample(metrics, "tokenlane_kv_release_seconds_count", lane="interactive") == 1
    assert sample(metrics, "tokenlane_kv_release_seconds_sum", lane="interactive") == pytest.approx(0.3)
    assert sample(metrics, "tokenlane_kv_release_seconds_bucket", lane="interactive", le="0.25") == 0
    assert sample(metrics, "tokenlane_kv_release_seconds_bucket", lane="interactive", le="0.5") == 1


def test_a_finish_frees_its_blocks_in_the_step_that_computed_its_last_token():
    engine, clock, recorder, metrics = make_engine()
    engine.add_request(req("a", range(1, 9), 2, lane="batch"))
    run_until_idle(engine)
    assert sample(metrics, "tokenlane_kv_release_seconds_count", lane="batch") == 1
    assert sample(metrics, "tokenlane_kv_release_seconds_sum", lane="batch") == 0.0  # the clock stood still


def test_a_passed_deadline_counts_from_the_deadline():
    engine, clock, recorder, metrics = make_engine()
    engine.add_request(req("a", range(1, 9), 50, deadline=100.5))
    engine.step()
    clock.now = 101.25  # the engine notices at its next step
    engine.step()
    (finished,) = [s["finished"] for s in recorder.entries() if s["finished"]]
    assert finished == {"interactive": {"deadline": 1}}
    assert sample(metrics, "tokenlane_kv_release_seconds_sum", lane="interactive") == pytest.approx(0.75)


def test_requests_that_held_no_blocks_are_not_timed():
    engine, clock, recorder, metrics = make_engine()
    engine.add_request(req("a", range(1, 9), 50))
    engine.abort_request("a")  # cancelled while still staged: never held a block
    engine.step()
    assert sample(metrics, "tokenlane_kv_release_seconds_count", lane="interactive") == 0


# ---- out of memory


class OutOfMemoryOnce:
    """An executor hook: the first step whose plan schedules `request_id` raises torch's
    out-of-memory error, as a CUDA allocation in the forward pass would."""

    def __init__(self, executor, request_id: str) -> None:
        self.execute = executor.execute
        self.request_id = request_id
        self.raised = 0
        executor.execute = self

    def __call__(self, plan):
        if not self.raised and any(c.request.request_id == self.request_id for c in plan.chunks):
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.execute(plan)


def test_an_out_of_memory_step_fails_its_requests_and_the_engine_goes_on():
    engine, clock, recorder, metrics = make_engine()
    engine.add_request(req("a", range(1, 9), 3))
    engine.step()  # a's prefill; a decodes in the next step, with b's prefill
    hook = OutOfMemoryOnce(engine.executor, "b")
    engine.add_request(req("b", range(20, 40), 3, lane="batch"))
    outputs = {o.request_id: o for o in engine.step()}  # a's decode and b's prefill: OOM
    assert hook.raised == 1
    assert outputs["a"].finish_reason == outputs["b"].finish_reason == FinishReason.ERROR
    assert outputs["a"].finish_detail == outputs["b"].finish_detail == "oom"
    assert engine.scheduler.kv.num_used_blocks == 0  # both requests' blocks are back
    engine.scheduler.kv.check_invariants()
    # The engine keeps serving.
    engine.add_request(req("c", range(50, 58), 2))
    run_until_idle(engine)
    assert recorder.entries()[-1]["finished"] == {"interactive": {"max_tokens": 1}}
    assert sum(s["oom_events"] for s in recorder.entries()) == 1
    assert sample(metrics, "tokenlane_oom_events_total", model="tiny") == 1
    assert sample(metrics, "tokenlane_requests_total", lane="batch", outcome="error", reason="oom") == 1
    assert sample(metrics, "tokenlane_requests_total", lane="interactive", outcome="finished",
                  reason="max_tokens") == 1


def test_other_executor_errors_are_not_out_of_memory():
    from tokenlane.runtime.engine.llm_engine import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert not is_out_of_memory(RuntimeError("CUDA out of memory"))  # only the type counts
    assert not is_out_of_memory(MemoryError())
