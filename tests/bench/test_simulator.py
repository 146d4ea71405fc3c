"""The cost model and the simulated executor (no engine)."""

from __future__ import annotations

import pytest

from tokenlane.runtime.executor.simulated import (
    ChunkShape,
    SimulatedExecutor,
    VirtualClock,
    get_profile,
    kv_blocks_for,
    step_cost,
)
from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
from tokenlane.runtime.core.request import Request, SamplingParams

H200 = get_profile("h200-llama3-8b")
H100 = get_profile("h100-llama3-8b")


def test_llama3_8b_shapes():
    m = H200.model
    assert m.kv_bytes_per_token == 128 * 1024  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    assert m.weight_bytes == pytest.approx(16.06e9)


def test_decode_is_memory_bound_and_prefill_compute_bound():
    decode = step_cost(H200, [ChunkShape(1000, 1, True)] * 8)
    assert decode.memory_s > decode.compute_s
    # One batch-1 decode reads every weight once: ~16 GB at 0.75 x 4.8 TB/s ~ 4.5 ms (+overhead).
    single = step_cost(H200, [ChunkShape(100, 1, True)])
    assert 0.004 < single.seconds < 0.008
    prefill = step_cost(H200, [ChunkShape(0, 4096, True)])
    assert prefill.compute_s > prefill.memory_s
    # 2 x ~7e9 FLOPs per token: 4096 tokens ~ 5.8e13 FLOP -> ~90 ms at 0.65 x 989 TFLOP/s.
    assert 0.06 < prefill.seconds < 0.15


def test_cost_grows_with_work_and_h200_beats_h100_on_decode():
    small = step_cost(H200, [ChunkShape(500, 1, True)] * 4).seconds
    big = step_cost(H200, [ChunkShape(500, 1, True)] * 64).seconds
    longer_ctx = step_cost(H200, [ChunkShape(8000, 1, True)] * 64).seconds
    assert small < big < longer_ctx
    batch = [ChunkShape(2000, 1, True)] * 32
    assert step_cost(H200, batch).seconds < step_cost(H100, batch).seconds
    # Batching pays: 64 decodes cost far less than 64 single decodes.
    assert big < 0.2 * 64 * step_cost(H200, [ChunkShape(500, 1, True)]).seconds
    assert step_cost(H200, []).seconds == 0.0


def test_kv_pool_size_from_memory():
    blocks_h200 = kv_blocks_for(H200, 16, 0.9)
    blocks_h100 = kv_blocks_for(H100, 16, 0.9)
    # (141 GB x 0.9 - 16 GB weights - 4 GiB reserve) / 2 MiB per 16-token block
    assert 45_000 < blocks_h200 < 55_000
    assert blocks_h100 < blocks_h200
    with pytest.raises(ValueError, match="no room"):
        kv_blocks_for(H100, 16, 0.2)


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(ValueError, match="known"):
        get_profile("a100-llama3-8b")


def _config(**engine):
    return RuntimeConfig.from_dict({"model": {"path": "sim"}, "engine": {"executor": "simulated", **engine}})


def test_executor_samples_synthetic_tokens_and_advances_the_clock():
    clock = VirtualClock()
    ex = SimulatedExecutor(_config(kvCacheBlocks=100), clock=clock)
    assert ex.num_kv_blocks == 100 and ex.eos_token_id is None
    req = Request("r1", [5] * 40, SamplingParams(max_tokens=4))
    other = Request("r2", [5] * 10, SamplingParams(max_tokens=4))
    plan = StepPlan(chunks=[ScheduledChunk(req, 0, 32, False), ScheduledChunk(other, 0, 10, True)],
                    num_batched_tokens=42)
    out = ex.execute(plan)
    assert set(out.sampled) == {"r2"}  # only chunks that reach the end sample
    assert out.step_seconds > 0 and clock() == pytest.approx(out.step_seconds)
    again = SimulatedExecutor(_config(kvCacheBlocks=100), clock=VirtualClock()).execute(plan)
    assert again.sampled == out.sampled  # deterministic
    assert all(1000 <= t < ex.vocab_size for t in out.sampled.values())
    empty = ex.execute(StepPlan())
    assert empty.step_seconds == 0 and not empty.sampled


def test_executor_without_clock_sleeps_in_real_time(monkeypatch):
    slept = []
    monkeypatch.setattr("tokenlane.runtime.executor.simulated.time.sleep", slept.append)
    ex = SimulatedExecutor(_config(kvCacheBlocks=10))
    req = Request("r", [1] * 4, SamplingParams(max_tokens=2))
    out = ex.execute(StepPlan(chunks=[ScheduledChunk(req, 0, 4, True)], num_batched_tokens=4))
    assert slept == [out.step_seconds]
