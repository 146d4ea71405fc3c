"""engine.kvCacheDtype: the paged cache in another dtype than the model's.

A float32 model over a bf16 cache: the pool holds twice the blocks for the same memory, the
cache holds exactly the bf16 rounding of the keys and values a float32 cache holds, and the
engine generates through both CPU attention paths."""

from __future__ import annotations

import pytest
import torch

from tokenlane.runtime.config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.core.request import Request, SamplingParams


def _engine(model_dir, kv_cache_dtype, backend="auto", **engine_kw):
    config = RuntimeConfig(
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        engine=EngineConfig(block_size=4, device="cpu", kv_cache_dtype=kv_cache_dtype,
                            attention_backend=backend, **engine_kw),
        scheduler=SchedulerConfig(prefill_chunk_size=16, max_batched_tokens=64,
                                  max_active_sequences=8),
    )
    return LLMEngine(config, ModelExecutor(config))


def _requests(max_tokens):
    # At most one 16-token chunk each: a prompt's prefill attends to its own fresh keys only.
    prompts = [[5 + (7 * i + j) % 900 for j in range(3 + 2 * i)] for i in range(6)]
    return [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True))
            for i, p in enumerate(prompts)]


def test_unknown_dtype_is_refused_with_the_key():
    with pytest.raises(ConfigError, match="kvCacheDtype"):
        EngineConfig(kv_cache_dtype="fp8")


def test_a_two_byte_cache_holds_twice_the_blocks(tiny_model_dir):
    sizes = {}
    for dtype in ("auto", "bfloat16", "float16"):
        config = RuntimeConfig(
            model=ModelConfig(path=str(tiny_model_dir), dtype="float32"),
            engine=EngineConfig(block_size=4, device="cpu", cpu_kv_cache_gib=0.01,
                                kv_cache_dtype=dtype))
        ex = ModelExecutor(config)
        assert ex.kv_caches[0][0].dtype == ex.kv_caches[0][1].dtype == (
            torch.float32 if dtype == "auto" else getattr(torch, dtype))
        assert ex.compute_dtype == torch.float32  # the model still computes in float32
        sizes[dtype] = ex.num_kv_blocks
    assert sizes["bfloat16"] == sizes["float16"] in (2 * sizes["auto"], 2 * sizes["auto"] + 1)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_the_cache_holds_the_rounded_keys_and_the_engine_generates(tiny_model_dir, backend):
    from tokenlane.kernels import cpu_native

    if backend == "native" and not cpu_native.available():
        pytest.skip(f"no C compiler here: {cpu_native.load_error()}")
    # Prompts only (one token each, fresh single-chunk prefills): both caches are written
    # from the same float32 keys and values.
    engines = {d: _engine(tiny_model_dir, d, backend, kv_cache_blocks=64)
               for d in ("float32", "bfloat16")}
    for engine in engines.values():
        for request in _requests(max_tokens=1):
            engine.add_request(request)
        while engine.has_unfinished_requests():
            engine.step()
    full, narrow = (engines[d].executor.kv_caches for d in ("float32", "bfloat16"))
    for (k32, v32), (k16, v16) in zip(full, narrow):
        assert torch.equal(k16, k32.to(torch.bfloat16)) and torch.equal(v16, v32.to(torch.bfloat16))

    # Then generation, decodes reading the bf16 cache: every request completes, no block leaks.
    engine = _engine(tiny_model_dir, "bfloat16", backend, kv_cache_blocks=64)
    requests = _requests(max_tokens=12)
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    assert all(len(r.output_token_ids) == 12 for r in requests)
    assert engine.scheduler.kv.num_free_blocks == engine.executor.num_kv_blocks
