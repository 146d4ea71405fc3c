"""The model executor on a CUDA device: KV pool sized by gpuMemoryUtilization (profiling
run), Triton attention, greedy equality with transformers, and a bf16 smoke run.
Skipped without CUDA (`pytest -m gpu tests/runtime/test_gpu_model.py` on a GPU machine)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(path, dtype, n=12, seed=0):
    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
    from tokenlane.runtime.engine.llm_engine import LLMEngine
    from tokenlane.runtime.executor.model_executor import ModelExecutor
    from tokenlane.runtime.core.request import Request, SamplingParams

    config = RuntimeConfig(
        model=ModelConfig(path=str(path), dtype=dtype),
        engine=EngineConfig(device="cuda", gpu_memory_utilization=0.2, block_size=16),
        scheduler=SchedulerConfig(prefill_chunk_size=7, max_batched_tokens=64, max_active_sequences=16),
    )
    executor = ModelExecutor(config)
    assert executor.backend == "triton"
    assert executor.num_kv_blocks > 1000  # sized from device memory, not a default
    engine = LLMEngine(config, executor)
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(5, 1000) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0, ignore_eos=True)
        reqs.append(Request(f"g{i}", prompt, params))
        engine.add_request(reqs[-1])
    while engine.has_unfinished_requests():
        engine.step()
    return reqs


def test_cuda_greedy_matches_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    reqs = _run(tiny_model_dir, "float32")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    for r in reqs:
        ids = torch.tensor([r.prompt_token_ids], device="cuda")
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=r.sampling_params.max_tokens, pad_token_id=0)
        assert r.output_token_ids == out[0, ids.shape[1]:].tolist(), r.request_id


def test_cuda_bf16_smoke(tiny_qwen2_dir):
    reqs = _run(tiny_qwen2_dir, "auto")
    for r in reqs:
        assert len(r.output_token_ids) == r.sampling_params.max_tokens
        assert all(0 <= t < 1024 for t in r.output_token_ids)
