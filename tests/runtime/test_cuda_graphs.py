"""CUDA graphs for decode batches (runtime/executor/cuda_graphs.py): everything but the recording runs
on the CPU — bucket choice, padding, the eager fallback decisions, and the static-buffer
forward pass (`EagerDecodeRunner`) against the executor's unpadded path on the tiny model.
The recording itself is checked on a GPU (`gpu` marker here, and the benchmark
`python -m tokenlane.bench.cuda_graph_bench`, run by kernels/gpu_check.sh)."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenlane.runtime.config import ConfigError, EngineConfig, ModelConfig, RuntimeConfig, loads_config
from tokenlane.runtime.executor.cuda_graphs import (
    CudaGraphDecodeRunner,
    EagerDecodeRunner,
    graph_batch_sizes,
    pick_bucket,
)
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.executor.llama import AttentionMetadata
from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
from tokenlane.runtime.core.request import Request, SamplingParams


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):  # tests/conftest.py
    yield


BLOCK_SIZE = 4


def make_executor(path, **engine):
    engine.setdefault("kv_cache_blocks", 160)
    engine.setdefault("block_size", BLOCK_SIZE)
    engine.setdefault("device", "cpu")
    return ModelExecutor(RuntimeConfig(model=ModelConfig(path=str(path)), engine=EngineConfig(**engine)))


def eager_runner(ex: ModelExecutor, max_batch: int) -> EagerDecodeRunner:
    return EagerDecodeRunner(ex.model, ex.kv_caches, block_size=ex.block_size, max_model_len=ex.max_model_len,
                             max_batch=max_batch, backend=ex.backend, device=ex.device)


# ---------------------------------------------------------------- buckets and config


def test_batch_sizes_are_powers_then_multiples_of_eight_up_to_the_max():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]
    for bad in (0, 513):
        with pytest.raises(ValueError, match=r"\[1, 512\]"):
            graph_batch_sizes(bad)


@pytest.mark.parametrize("max_batch", [1, 5, 24, 64])
def test_pick_bucket_is_the_smallest_that_holds_the_batch(max_batch):
    sizes = graph_batch_sizes(max_batch)
    for batch in range(1, max_batch + 1):
        bucket = pick_bucket(sizes, batch)
        assert bucket >= batch and bucket in sizes
        assert all(s < batch for s in sizes if s < bucket)
    assert pick_bucket(sizes, max_batch + 1) is None


def test_config_keys_and_their_errors():
    config = loads_config("model: {path: /m}\nengine: {device: cuda, cudaGraphs: true, cudaGraphMaxBatch: 16}\n")
    assert config.engine.cuda_graphs is True and config.engine.cuda_graph_max_batch == 16
    assert EngineConfig().cuda_graphs is False and EngineConfig().cuda_graph_max_batch == 64
    with pytest.raises(ConfigError, match=r"cudaGraphMaxBatch: must be in \[1, 512\], got 0"):
        EngineConfig(cuda_graph_max_batch=0)
    with pytest.raises(ConfigError, match="cudaGraphs: needs a CUDA device, but engine.device is cpu"):
        EngineConfig(cuda_graphs=True, device="cpu")
    with pytest.raises(ConfigError, match="cudaGraphs: needs the triton attention backend"):
        EngineConfig(cuda_graphs=True, attention_backend="torch")


def test_graph_runner_refuses_cpu_and_the_torch_backend(tiny_model_dir):
    ex = make_executor(tiny_model_dir)
    kwargs = dict(block_size=ex.block_size, max_model_len=ex.max_model_len, max_batch=4)
    with pytest.raises(ValueError, match="need a CUDA device"):
        CudaGraphDecodeRunner(ex.model, ex.kv_caches, device=ex.device, backend="triton", **kwargs)
    with pytest.raises(ValueError, match="need the triton attention backend"):
        CudaGraphDecodeRunner(ex.model, ex.kv_caches, device=torch.device("cuda"), backend="torch", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a host without a GPU")
def test_cuda_graphs_with_device_auto_on_a_cpu_host_warn_and_run_eager(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="tokenlane.runtime.executor.cuda_graphs"):
        ex = make_executor(tiny_model_dir, device="auto", cuda_graphs=True)
    assert ex.decode_runner is None
    assert "engine.cudaGraphs is set but the engine runs on cpu" in caplog.text


# ---------------------------------------------------------------- eager fallback decisions


def _meta(query_lens: list[int], seq_lens: list[int], fresh: list[int] = ()) -> AttentionMetadata:
    paged_tokens = sum(query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    width = max((-(-s // BLOCK_SIZE) for s in seq_lens), default=1)
    return AttentionMetadata(
        slot_mapping=torch.zeros(paged_tokens + sum(fresh), dtype=torch.int64),
        block_tables=torch.zeros((len(seq_lens), width), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        num_paged_tokens=paged_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        fresh_query_lens=list(fresh),
        all_seq_lens=list(seq_lens) + list(fresh),
        all_query_lens=list(query_lens) + list(fresh),
        backend="torch",
    )


def test_only_decode_batches_within_the_graphs_take_the_static_path(tiny_model_dir):
    ex = make_executor(tiny_model_dir)
    runner = eager_runner(ex, max_batch=8)
    limit = ex.max_model_len
    assert runner.eager_reason(3, _meta([1, 1, 1], [5, 9, 1]), 3) is None
    assert runner.eager_reason(8, _meta([1] * 8, [limit] * 8), 8) is None
    # A 1-token chunk whose row scores a prompt token, not sampled: still one token per row.
    assert runner.eager_reason(2, _meta([1, 1], [5, 9]), 1) is None
    assert "prefill chunks" in runner.eager_reason(7, _meta([1], [9], fresh=[6]), 2)
    assert "more than one token" in runner.eager_reason(4, _meta([1, 3], [5, 12]), 2)
    assert "9 sequences exceed the largest graph (8)" in runner.eager_reason(9, _meta([1] * 9, [4] * 9), 9)
    assert "no row samples" in runner.eager_reason(2, _meta([1, 1], [5, 9]), 0)


def test_dynamic_rope_past_the_original_length_runs_eager(tmp_path):
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "m", num_layers=1, max_position_embeddings=32,
                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config = RuntimeConfig(model=ModelConfig(path=str(path), max_model_len=32),
                           engine=EngineConfig(device="cpu", kv_cache_blocks=16, block_size=BLOCK_SIZE))
    ex = ModelExecutor(config)
    runner = eager_runner(ex, max_batch=4)
    assert runner.max_context == 32
    assert runner.eager_reason(1, _meta([1], [32]), 1) is None
    assert "exceeds the graphs' 32" in runner.eager_reason(1, _meta([1], [33]), 1)


# ---------------------------------------------------------------- padded == unpadded


def _start(ex: ModelExecutor, n: int, first_block: int = 0, prompt_logprobs=None) -> list[Request]:
    """n requests with prompts of different lengths, prefilled in one step."""
    requests, chunks, block = [], [], first_block
    for i in range(n):
        prompt = [(7 * i + 3 * j) % 900 + 5 for j in range(3 + 5 * i % 11)]
        r = Request(f"r{i}", prompt, SamplingParams(temperature=0.0, prompt_logprobs=prompt_logprobs))
        blocks = -(-(len(prompt) + 12) // ex.block_size)
        r.block_ids = list(range(block, block + blocks))
        block += blocks
        requests.append(r)
        chunks.append(ScheduledChunk(r, 0, len(prompt), True))
    out = ex.execute(StepPlan(chunks=chunks))
    for r in requests:
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(out.sampled[r.request_id])
    return requests


def _decode(ex: ModelExecutor, requests: list[Request]) -> dict[str, int]:
    out = ex.execute(StepPlan(chunks=[ScheduledChunk(r, r.num_tokens - 1, 1, True) for r in requests]))
    for r in requests:
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(out.sampled[r.request_id])
    return out.sampled


@pytest.mark.parametrize("batch", [1, 3, 5, 8])
def test_padded_static_path_gives_the_unpadded_logits(tiny_model_dir, batch):
    """Every decode step runs both ways over the same cache: the model's own forward and the
    runner's static one (buckets 1, 4, 8, 8). Without padding (1, 8) the logits are bitwise
    equal. With padding rows the matmuls have more rows, and a BLAS picks its kernel by the
    row count (on this CPU, fp32 GEMMs of 1-3 rows round differently from 4+), so padded
    logits equal the unpadded ones to float32 rounding and the greedy tokens exactly."""
    ex = make_executor(tiny_model_dir)
    runner = eager_runner(ex, max_batch=8)
    pairs = []

    def both(input_ids, positions, meta, logits_indices, argmax_only=False):  # logits either way
        assert runner.can_run(input_ids.shape[0], meta, logits_indices.shape[0])
        padded = runner.run(input_ids, positions, meta, logits_indices).clone()
        eager = ex.model(input_ids, positions, ex.kv_caches, meta, logits_indices)
        pairs.append((eager, padded))
        return eager

    requests = _start(ex, batch)
    ex._forward = both
    for _ in range(3):
        _decode(ex, requests)
    assert len(pairs) == 3
    exact = batch in runner.batch_sizes
    for eager, padded in pairs:
        assert padded.shape == eager.shape == (batch, ex.vocab_size)
        tol = 0 if exact else 1e-5
        torch.testing.assert_close(padded, eager, rtol=tol, atol=tol)
        assert torch.equal(padded.argmax(-1), eager.argmax(-1))


def test_executor_with_the_runner_generates_the_same_tokens(tiny_model_dir):
    """Greedy decoding through the executor with the static path installed (batches shrinking
    through the buckets as requests finish) equals the plain executor's."""
    def generate(with_runner: bool) -> dict[str, list[int]]:
        ex = make_executor(tiny_model_dir)
        if with_runner:
            ex.decode_runner = eager_runner(ex, max_batch=8)
            static_steps = []
            run_static = ex.decode_runner.run
            ex.decode_runner.run = lambda ids, *a: static_steps.append(ids.shape[0]) or run_static(ids, *a)
        requests = _start(ex, 7)
        for running in (7, 7, 6, 5, 3, 2, 1):  # buckets 8, 8, 8, 8, 4, 2, 1
            _decode(ex, requests[:running])
        if with_runner:
            assert static_steps == [7, 7, 6, 5, 3, 2, 1]  # every decode step; the prefill ran eager
        return {r.request_id: r.output_token_ids for r in requests}

    assert generate(True) == generate(False)


def test_prompt_logprobs_of_a_one_token_chunk_through_the_static_path(tiny_model_dir):
    """A decode-shaped step whose rows are a decode and a 1-token prompt chunk scoring the
    next prompt token: logits rows come back in the step's order."""
    static_rows = []

    def run(with_runner: bool):
        ex = make_executor(tiny_model_dir)
        if with_runner:
            ex.decode_runner = runner = eager_runner(ex, max_batch=4)
            run_static = runner.run
            runner.run = lambda ids, pos, meta, rows: static_rows.append(rows.tolist()) or run_static(
                ids, pos, meta, rows)
        decoding = _start(ex, 1)[0]
        r = Request("p", [11, 12, 13, 14, 15, 16], SamplingParams(temperature=0.0, prompt_logprobs=2))
        r.block_ids = [100, 101, 102]
        ex.execute(StepPlan(chunks=[ScheduledChunk(r, 0, 3, False)]))  # 3 of 6 prompt tokens
        out = ex.execute(StepPlan(chunks=[ScheduledChunk(decoding, decoding.num_tokens - 1, 1, True),
                                          ScheduledChunk(r, 3, 1, False)]))
        return out.sampled, out.prompt_logprobs["p"]

    assert run(True) == run(False)
    assert static_rows == [[0, 1]]  # the sampled row, then the prompt row, in one static pass


# ---------------------------------------------------------------- the recording (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recorded_graphs_replay_the_static_pass_and_generate_the_eager_tokens(tiny_model_dir):
    """Each replay equals the same static pass run eagerly, bitwise; greedy tokens (float32,
    6 sequences in the 8-row graph) equal the executor's without graphs."""
    def generate(cuda_graphs: bool):
        config = RuntimeConfig(
            model=ModelConfig(path=str(tiny_model_dir), dtype="float32"),
            engine=EngineConfig(device="cuda", kv_cache_blocks=160, block_size=BLOCK_SIZE,
                                cuda_graphs=cuda_graphs, cuda_graph_max_batch=8),
        )
        ex = ModelExecutor(config)
        replays = []
        if cuda_graphs:
            graphs = ex.decode_runner
            assert sorted(graphs.graphs) == [1, 2, 4, 8]
            static = eager_runner(ex, max_batch=8)
            replay = graphs.run

            def both(input_ids, positions, meta, logits_indices):
                expected = static.run(input_ids, positions, meta, logits_indices).clone()
                got = replay(input_ids, positions, meta, logits_indices)
                replays.append(torch.equal(got, expected))
                return got

            graphs.run = both
        requests = _start(ex, 6)
        for _ in range(6):
            _decode(ex, requests)
        if cuda_graphs:
            assert replays == [True] * 6
        return {r.request_id: r.output_token_ids for r in requests}

    assert generate(True) == generate(False)


def test_benchmark_dry_run_checks_its_replay_on_the_cpu(tmp_path):
    """The GPU benchmark's code path on the CPU (no recording): batch 3 runs padded to 4."""
    import json

    from tokenlane.bench.cuda_graph_bench import main

    out = tmp_path / "bench.json"
    assert main(["--dry-run", "--batch-sizes", "1,3,4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["graph_batch_sizes"] == [1, 2, 4]
    assert [r["batch"] for r in report["results"]] == [1, 3, 4]
    for row in report["results"]:
        assert row["replay_tokens_exact"] and row["eager_token_agreement"] == 1.0
        assert row["eager_ms"] > 0 and row["graph_ms"] > 0


_TRITON_SCRIPT = """
import sys, torch
from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig
from tokenlane.runtime.executor.cuda_graphs import EagerDecodeRunner
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
from tokenlane.runtime.core.request import Request, SamplingParams
torch.set_num_threads(1)
result = {}
for name, backend, static in (("torch", "torch", False), ("triton", "triton", False),
                              ("triton-static", "triton", True)):
    config = RuntimeConfig(model=ModelConfig(path=sys.argv[1], max_model_len=64),
                           engine=EngineConfig(device="cpu", kv_cache_blocks=40, block_size=4,
                                               attention_backend=backend))
    ex = ModelExecutor(config)
    if static:
        ex.decode_runner = EagerDecodeRunner(ex.model, ex.kv_caches, block_size=4, max_model_len=64,
                                             max_batch=4, backend=backend, device=ex.device)
        ran = []
        run = ex.decode_runner.run
        ex.decode_runner.run = lambda ids, *a: ran.append(ids.shape[0]) or run(ids, *a)
    reqs = [Request(f"r{i}", [5 + i, 17, 99, 3, 240 - i, 7][: 3 + i], SamplingParams(temperature=0.0))
            for i in range(3)]
    for i, r in enumerate(reqs):
        r.block_ids = list(range(10 * i, 10 * i + 6))
    chunks = [ScheduledChunk(r, 0, r.num_tokens, True) for r in reqs]
    for _ in range(5):  # a prefill step, then decodes of 3 sequences (padded to 4)
        out = ex.execute(StepPlan(chunks=chunks))
        for r in reqs:
            r.num_computed_tokens = r.num_tokens
            r.output_token_ids.append(out.sampled[r.request_id])
        chunks = [ScheduledChunk(r, r.num_tokens - 1, 1, True) for r in reqs]
    if static:
        assert ran == [3, 3, 3, 3], ran
    result[name] = [r.output_token_ids for r in reqs]
print(result)
assert result["torch"] == result["triton"] == result["triton-static"], result
"""


@pytest.mark.slow
def test_static_path_through_the_triton_kernels_under_the_interpreter(tiny_model_dir):
    """The padded static pass with the Triton kernels (TRITON_INTERPRET=1 on the CPU): padding
    rows' slot -1 and the launch sized from the static maximum context give the eager tokens.
    A subprocess: the interpreter must be chosen before triton is imported."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, str(tiny_model_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
