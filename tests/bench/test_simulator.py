"""The cost model and the simulated executor (no engine)."""

from __future__ import annotations

import pytest

from tokenlane.runtime.executor.simulated import (
    ChunkShape,
    SimulatedExecutor,
    VirtualClock,
    get_profile,
    kv_blocks_for,
    kv_transfer_seconds,
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


# --------------------------------------------------------------------------- KV cache dtype and host tier

H200_FP8 = get_profile("h200-llama3-8b", "fp8_e4m3")


@pytest.mark.parametrize("kv_dtype, element_bytes", [
    ("auto", 2), ("bfloat16", 2), ("float16", 2), ("float32", 4), ("fp8_e4m3", 1), ("fp8_e5m2", 1),
])
def test_kv_bytes_per_token_follow_the_cache_dtype(kv_dtype, element_bytes):
    profile = get_profile("h200-llama3-8b", kv_dtype)
    assert profile.kv_bytes_per_token == 2 * 32 * 8 * 128 * element_bytes
    assert profile.model.weight_bytes == H200.model.weight_bytes  # weights stay bf16


def test_fp8_doubles_the_pool_and_halves_the_kv_bytes_decode_reads():
    bf16_blocks, fp8_blocks = kv_blocks_for(H200, 16, 0.9), kv_blocks_for(H200_FP8, 16, 0.9)
    assert fp8_blocks in (2 * bf16_blocks, 2 * bf16_blocks + 1)  # same bytes, half per block
    assert kv_blocks_for(get_profile("h200-llama3-8b", "float32"), 16, 0.9) == bf16_blocks // 2
    batch = [ChunkShape(8000, 1, True)] * 64
    bf16, fp8 = step_cost(H200, batch), step_cost(H200_FP8, batch)
    kv_read_bf16 = bf16.bytes - H200.model.weight_bytes
    kv_read_fp8 = fp8.bytes - H200.model.weight_bytes
    assert kv_read_fp8 == pytest.approx(kv_read_bf16 / 2)
    assert fp8.flops == bf16.flops  # dequantized in the kernel: the same math
    assert fp8.seconds < bf16.seconds
    # A prefill chunk is compute-bound: the cache dtype does not change its time.
    prefill = [ChunkShape(0, 4096, True)]
    assert step_cost(H200_FP8, prefill).seconds == step_cost(H200, prefill).seconds


def test_unknown_kv_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kvCacheDtype"):
        get_profile("h200-llama3-8b", "int4")


@pytest.mark.parametrize("profile, blocks, expected_bytes", [
    (H200, 1, 16 * 128 * 1024),
    (H200, 10, 10 * 16 * 128 * 1024),
    (H200_FP8, 10, 10 * 16 * 64 * 1024),
    (H200, 0, 0),
])
def test_host_transfers_cost_block_bytes_over_the_host_link(profile, blocks, expected_bytes):
    assert kv_transfer_seconds(profile, 16, blocks) == pytest.approx(expected_bytes / profile.gpu.host_link_bytes_per_s)


def test_host_tier_copies_add_to_the_step_and_are_counted():
    config = _config(kvCacheBlocks=100, kvOffload={"hostBytes": 64 * 1024**2})
    ex = SimulatedExecutor(config, clock=VirtualClock())
    assert ex.num_host_kv_blocks == 64 * 1024**2 // (16 * 128 * 1024)  # 32 slots of 2 MiB
    assert SimulatedExecutor(_config(kvCacheBlocks=100)).num_host_kv_blocks == 0
    req = Request("r", [5] * 64, SamplingParams(max_tokens=2))
    chunks = [ScheduledChunk(req, 48, 16, True)]
    plain = ex.execute(StepPlan(chunks=chunks, num_batched_tokens=16))
    assert plain.kv_restore_seconds is None
    copied = ex.execute(StepPlan(chunks=chunks, num_batched_tokens=16, kv_offloads=[(7, 0)],
                                 kv_restores=[(1, 3), (2, 4), (3, 5)]))
    transfer = kv_transfer_seconds(ex.profile, 16, 4)
    assert copied.step_seconds == pytest.approx(plain.step_seconds + transfer)
    assert copied.kv_restore_seconds == pytest.approx(transfer)
    assert (ex.num_blocks_offloaded, ex.num_blocks_restored) == (1, 3)
    assert ex.host_link_seconds == pytest.approx(transfer)
