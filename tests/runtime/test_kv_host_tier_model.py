"""The host-memory tier (engine.kvOffload) with the real engine and the tiny model on the CPU:
greedy outputs identical with and without the tier, a prompt evicted to the host restored
rather than recomputed (read from the exported metrics), the flight recorder's per-step
copies, the host pool's copies themselves, and the start-up refusals."""

from __future__ import annotations

import pytest
import torch

from tokenlane.runtime.config import (ConfigError, EngineConfig, KVOffloadConfig, ModelConfig, RuntimeConfig,
                                      SchedulerConfig)
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.executor.kv_host_pool import HostKVPool, host_available_bytes, host_pool_slots
from tokenlane.runtime.observability.flight_recorder import FlightRecorder
from tokenlane.runtime.observability.metrics import PrometheusMetrics

BLOCK = 4
DEVICE_BLOCKS = 24  # holds one long prompt, not two
SYSTEM = [(7 * i + 3) % 1000 + 10 for i in range(60)]  # a 60-token shared "system prompt"


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def build(model_dir, host_bytes=None, device="cpu") -> LLMEngine:
    config = RuntimeConfig(
        model=ModelConfig(path=str(model_dir), max_model_len=256),
        engine=EngineConfig(block_size=BLOCK, kv_cache_blocks=DEVICE_BLOCKS, device=device,
                            kv_offload=KVOffloadConfig(host_bytes) if host_bytes else None),
        scheduler=SchedulerConfig(max_batched_tokens=128, prefill_chunk_size=128, max_active_sequences=4),
    )
    return LLMEngine.from_config(config)


def run(engine: LLMEngine, requests: list[Request]) -> None:
    for r in requests:
        engine.add_request(r)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        engine.scheduler.check_invariants()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests), [r.finish_detail for r in requests]


def turns(engine: LLMEngine) -> dict[str, list[int]]:
    """Three rounds: the system prompt with a question, then an unrelated long prompt that
    takes the whole device pool (evicting every block of the system prompt)."""
    outputs = {}
    for turn in range(3):
        question = Request(f"q{turn}", SYSTEM + [500 + turn, 600 + turn, 700 + turn],
                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        flood = Request(f"f{turn}", [(13 * i + turn) % 900 + 20 for i in range(92)],
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        run(engine, [question])
        run(engine, [flood])
        outputs[question.request_id] = list(question.output_token_ids)
        outputs[flood.request_id] = list(flood.output_token_ids)
    return outputs


def value(metrics: PrometheusMetrics, name: str, **labels) -> float:
    total = 0.0
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_outputs_identical_and_the_evicted_prefix_restored(tiny_model_dir, one_torch_thread, device):
    without = turns(build(tiny_model_dir, device=device))
    engine = build(tiny_model_dir, host_bytes=256 << 10, device=device)
    metrics = PrometheusMetrics("tiny")
    metrics.set_config(engine.config)
    recorder = FlightRecorder(4096, engine.config)
    engine.add_observer(metrics)
    engine.add_observer(recorder)
    assert engine.executor.num_host_kv_blocks == (256 << 10) // engine.executor.kv_bytes_per_block
    with_tier = turns(engine)
    assert with_tier == without

    # Turns 2 and 3 found the system prompt's blocks on the host: restored, not recomputed.
    prompt_blocks = len(SYSTEM) // BLOCK
    host_hit_tokens = value(metrics, "tokenlane_prefix_cache_hits_total", tier="host")
    restored = value(metrics, "tokenlane_kv_host_transfer_blocks_total", direction="restore")
    assert restored == host_hit_tokens / BLOCK
    assert restored >= 0.9 * 2 * prompt_blocks, (restored, prompt_blocks)
    assert value(metrics, "tokenlane_kv_host_transfer_bytes_total", direction="restore") == (
        restored * engine.executor.kv_bytes_per_block
    )
    assert value(metrics, "tokenlane_kv_host_transfer_blocks_total", direction="offload") >= 2 * prompt_blocks
    assert value(metrics, "tokenlane_kv_restore_seconds_count") >= 2
    assert value(metrics, "tokenlane_kv_host_blocks") == engine.executor.num_host_kv_blocks
    assert value(metrics, "tokenlane_kv_host_blocks_used") > 0
    assert b'tokenlane_prefix_cache_hits_total{model="tiny",tier="host"}' in metrics.render()
    # The flight recorder has each step's copies.
    steps = recorder.entries()
    assert sum(s["kv_host"]["restored_blocks"] for s in steps) == restored
    assert sum(s["kv_host"]["offloaded_blocks"] for s in steps) >= 2 * prompt_blocks
    assert any(s["kv_host"]["restore_s"] is not None for s in steps)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants([])


def test_host_pool_round_trip_of_every_layer_and_dtype():
    dtypes = [torch.float32, torch.bfloat16] + [getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n)]
    for dtype in dtypes:
        caches = [tuple(torch.randn(6, 4, 2, 8).to(dtype) for _ in range(2)) for _ in range(3)]
        before = [tuple(t.clone() for t in layer) for layer in caches]
        pool = HostKVPool(caches, 4, torch.device("cpu"))
        assert pool.transfer(caches, [(1, 2), (4, 0)], []) is None
        for layer in caches:  # the blocks are reused: their contents change
            for t in layer:
                t[1].zero_()
                t[4].zero_()
        seconds = pool.transfer(caches, [], [(2, 5), (0, 3)])
        assert seconds is not None and seconds >= 0
        for layer, old in zip(caches, before):
            for t, o in zip(layer, old):
                assert t[5].view(torch.uint8).equal(o[1].view(torch.uint8))
                assert t[3].view(torch.uint8).equal(o[4].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned pool, copy stream)")
def test_host_pool_round_trip_on_cuda():
    """The gather of offloaded blocks is ordered before the step's writes into them; the
    restores land before the compute stream reads them."""
    dev = torch.device("cuda")
    caches = [tuple(torch.randn(6, 4, 2, 8, device=dev) for _ in range(2)) for _ in range(3)]
    before = [tuple(t.clone() for t in layer) for layer in caches]
    pool = HostKVPool(caches, 4, dev)
    assert pool.transfer(caches, [(1, 2), (4, 0)], []) is None
    for layer in caches:
        for t in layer:
            t[1].zero_()
            t[4].zero_()
    torch.cuda.synchronize(dev)
    assert pool.finish() is None
    pool.transfer(caches, [], [(2, 5), (0, 3)])
    moved = [(t[5].clone(), t[3].clone()) for layer in caches for t in layer]  # read on the compute stream
    torch.cuda.synchronize(dev)
    seconds = pool.finish()
    assert seconds is not None and seconds >= 0
    old = [t for layer in before for t in layer]
    for (five, three), o in zip(moved, old):
        assert five.equal(o[1]) and three.equal(o[4])


def test_host_bytes_is_checked_against_the_host(tiny_model_dir):
    available = host_available_bytes()
    assert available is None or available > 0
    with pytest.raises(ConfigError, match=r"engine\.kvOffload\.hostBytes: .*more than the host's available memory"):
        host_pool_slots(10 << 30, 1024, available=1 << 30)
    with pytest.raises(ConfigError, match=r"engine\.kvOffload\.hostBytes: 512 bytes hold no KV block"):
        host_pool_slots(512, 1024, available=1 << 30)
    assert host_pool_slots(4096, 1024, available=None) == 4
    # At start: the executor refuses both, naming the key.
    with pytest.raises(ConfigError, match=r"engine\.kvOffload\.hostBytes: .*available memory"):
        build(tiny_model_dir, host_bytes=1 << 62)
    with pytest.raises(ConfigError, match=r"engine\.kvOffload\.hostBytes: 8 bytes hold no KV block"):
        build(tiny_model_dir, host_bytes=8)
