"""ModelExecutor: flat batches from plans, bad input as per-request errors, seeds, pool size;
and the CPU attention path against the kernels' reference."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tokenlane.kernels.cpu_attention import paged_attention_cpu
from tokenlane.kernels.reference import paged_attention_ref
from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.executor.llama import kv_cache_bytes_per_block
from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
from tokenlane.runtime.core.request import Request, SamplingParams


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):  # tests/conftest.py
    yield


def make_executor(path, **engine):
    engine.setdefault("kv_cache_blocks", 64)
    engine.setdefault("block_size", 4)
    engine.setdefault("device", "cpu")
    config = RuntimeConfig(model=ModelConfig(path=str(path)), engine=EngineConfig(**engine))
    return ModelExecutor(config)


def prefill(ex, request, first_block=0):
    n = request.num_tokens
    request.block_ids = list(range(first_block, first_block + -(-(n + 8) // ex.block_size)))
    return ScheduledChunk(request, 0, n, True)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_matches_reference(dtype):
    rng = random.Random(0)
    bs, hkv, hq, d = 4, 2, 6, 16
    # (context length, query length): decodes, chunks with cached context, fresh prefills.
    shapes = [(9, 1), (1, 1), (23, 7), (7, 7), (16, 5), (30, 30), (13, 1)]
    num_blocks = sum(-(-c // bs) for c, _ in shapes) + 3
    kc = torch.randn(num_blocks, bs, hkv, d).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for c, _ in shapes:
        n = -(-c // bs)
        tables.append([free.pop() for _ in range(n)])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([c for c, _ in shapes], dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor([q for _, q in shapes]).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), hq, d).to(dtype)
    ref = paged_attention_ref(query, kc, vc, block_tables, seq_lens, qsl, 0.25)
    got = paged_attention_cpu(query, kc, vc, block_tables, seq_lens, qsl, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


# ---------------------------------------------------------------- executor


def test_bad_token_is_that_requests_error_only(tiny_model_dir):
    ex = make_executor(tiny_model_dir)
    good = Request("good", [5, 6, 7, 8], SamplingParams(temperature=0.0))
    bad = Request("bad", [5, ex.vocab_size + 3], SamplingParams(temperature=0.0))
    plan = StepPlan(chunks=[prefill(ex, good), prefill(ex, bad, first_block=10)])
    out = ex.execute(plan)
    assert "outside the vocabulary" in out.errors["bad"]
    assert set(out.sampled) == {"good"}
    assert out.step_seconds > 0


def test_context_over_model_length_is_an_error(tmp_path):
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "m", num_layers=1, max_position_embeddings=16)
    ex = make_executor(path)
    assert ex.max_model_len == 16
    r = Request("long", list(range(5, 25)), SamplingParams(temperature=0.0))
    out = ex.execute(StepPlan(chunks=[prefill(ex, r)]))
    assert "maximum length 16" in out.errors["long"]


def test_prefill_chunk_without_sampling_returns_nothing(tiny_model_dir):
    ex = make_executor(tiny_model_dir)
    r = Request("p", list(range(5, 25)), SamplingParams(temperature=0.0))
    r.block_ids = list(range(8))
    out = ex.execute(StepPlan(chunks=[ScheduledChunk(r, 0, 7, False)]))
    assert out.sampled == {} and out.errors == {}


def test_seeded_sampling_is_reproducible_and_generators_are_dropped(tiny_model_dir):
    ex = make_executor(tiny_model_dir)

    def generate(rid, partners):
        r = Request(rid, [5, 9, 33, 71, 100], SamplingParams(temperature=1.0, top_k=50, seed=1234))
        others = [Request(f"{rid}-o{i}", [7 + i, 8, 9], SamplingParams(temperature=1.0)) for i in range(partners)]
        chunks = [prefill(ex, r)] + [prefill(ex, o, first_block=20 + 5 * i) for i, o in enumerate(others)]
        tokens = []
        for _ in range(6):
            out = ex.execute(StepPlan(chunks=chunks))
            tok = out.sampled[rid]
            tokens.append(tok)
            r.num_computed_tokens = r.num_tokens
            r.output_token_ids.append(tok)
            for o in others:
                o.num_computed_tokens = o.num_tokens
                o.output_token_ids.append(out.sampled[o.request_id])
            chunks = [ScheduledChunk(x, x.num_tokens - 1, 1, True) for x in [r, *others]]
        ex.execute(StepPlan(finished=[r, *others]))
        assert rid not in ex.generators
        return tokens

    assert generate("a", 0) == generate("b", 3)


def test_pool_size_from_cpu_gib_and_explicit_blocks(tiny_model_dir):
    ex = make_executor(tiny_model_dir, kv_cache_blocks=None, cpu_kv_cache_gib=0.01, block_size=16)
    per_block = kv_cache_bytes_per_block(ex.args, 16, torch.float32)
    assert ex.num_kv_blocks == int(0.01 * 2**30 // per_block)
    assert ex.kv_caches[0][0].shape == (ex.num_kv_blocks, 16, 2, 16)
    assert make_executor(tiny_model_dir, kv_cache_blocks=7).num_kv_blocks == 7


def test_config_errors_are_clear(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="not a folder"):
        make_executor(tmp_path / "missing")
    config = RuntimeConfig(model=ModelConfig(path=str(tiny_model_dir), max_model_len=10**6),
                           engine=EngineConfig(device="cpu", kv_cache_blocks=8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelExecutor(config)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            make_executor(tiny_model_dir, device="cuda")


def test_unsupported_architecture_and_missing_weights(tmp_path):
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "m", num_layers=1)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        make_executor(path)
    (path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights"):
        make_executor(path)


_TRITON_SCRIPT = """
import sys, torch
from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
from tokenlane.runtime.core.request import Request, SamplingParams
torch.set_num_threads(1)
result = {}
for backend in ("torch", "triton"):
    config = RuntimeConfig(model=ModelConfig(path=sys.argv[1]),
                           engine=EngineConfig(device="cpu", kv_cache_blocks=16, block_size=4,
                                               attention_backend=backend))
    ex = ModelExecutor(config)
    r = Request("t", [5, 17, 99, 3, 240, 7, 8], SamplingParams(temperature=0.0))
    r.block_ids = list(range(6))
    ex.execute(StepPlan(chunks=[ScheduledChunk(r, 0, 4, False)]))  # fresh chunk, no sample
    r.num_computed_tokens = 4
    chunk = ScheduledChunk(r, 4, 3, True)  # chunk with cached context
    for _ in range(5):  # then decodes
        out = ex.execute(StepPlan(chunks=[chunk]))
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(out.sampled["t"])
        chunk = ScheduledChunk(r, r.num_tokens - 1, 1, True)
    result[backend] = r.output_token_ids
print(result)
assert result["torch"] == result["triton"], result
"""


@pytest.mark.slow
def test_triton_backend_under_interpreter_matches_torch(tiny_model_dir):
    """The whole model through the Triton kernels (TRITON_INTERPRET=1 on the CPU), in a
    subprocess because the interpreter must be chosen before triton is imported."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, str(tiny_model_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
