"""The engine end to end with the Triton attention path (interpreter on CPU, native on CUDA):
greedy output of the tiny checkpoint equals Hugging Face transformers' `generate()`, and the
same run through the torch reference backend."""

from __future__ import annotations

import random

import torch

from tokenlane.runtime.config import (
    EngineConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.core.request import Request, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_engine(model_dir, backend, prompts, max_tokens, chunk=8):
    config = RuntimeConfig(
        model=ModelConfig(path=str(model_dir), dtype="float32", max_model_len=256),
        # 16-token blocks, small chunks: prompts span blocks, prefills are chunked on top of
        # cached context, and decodes of one request run next to another's prefill chunk.
        engine=EngineConfig(kv_cache_blocks=32, block_size=16, device=DEVICE,
                            attention_backend=backend),
        scheduler=SchedulerConfig(max_batched_tokens=16, prefill_chunk_size=chunk,
                                  max_active_sequences=4),
    )
    engine = LLMEngine.from_config(config)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(prompt), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not engine.has_unfinished_requests()
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def hf_greedy(model_dir, prompt, max_new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # full lengths, like ignore_eos
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_triton_engine_greedy_equals_transformers_and_torch_backend(tiny_model_dir, monkeypatch):
    import tokenlane.kernels.triton_kernels as tk

    calls = {"attention": 0, "write": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(tk, "paged_attention_triton",
                        counted("attention", tk.paged_attention_triton))
    monkeypatch.setattr(tk, "write_kv_cache_triton", counted("write", tk.write_kv_cache_triton))
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (19, 3, 33)]
    max_tokens = 6
    triton_tokens = run_engine(tiny_model_dir, "triton", prompts, max_tokens)
    assert calls["attention"] > 0 and calls["write"] > 0, calls
    triton_calls = dict(calls)
    torch_tokens = run_engine(tiny_model_dir, "torch", prompts, max_tokens)
    assert calls == triton_calls, "the torch backend must not call the Triton kernels"
    expected = [hf_greedy(tiny_model_dir, p, max_tokens) for p in prompts]
    assert triton_tokens == expected
    assert torch_tokens == expected
