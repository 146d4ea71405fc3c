"""Lane isolation does not change what the model says: greedy outputs through the real engine
with KV shares, the step-time budget and a preemption to free a raised reserve equal
transformers' `generate()` (the tiny random Llama checkpoint, float32, CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

# The transformers reference and request maker of test_model_vs_hf.py (tests are not a package).
_spec = importlib.util.spec_from_file_location("model_vs_hf", Path(__file__).with_name("test_model_vs_hf.py"))
_vs_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_vs_hf)
assert_matches_hf, make_requests = _vs_hf.assert_matches_hf, _vs_hf.make_requests

from tokenlane.runtime.config import RuntimeConfig  # noqa: E402


def isolated_config(path, *, reserve):
    lanes = [
        {"name": "inter", "priority": 100, "default": True, "slo": {"tpotP95Ms": 50},
         **({"kvCacheReserved": reserve} if reserve else {})},
        {"name": "bulk", "priority": 10, "maxKvCacheShare": 0.9, "slo": {"tpotP95Ms": 500}},
    ]
    return RuntimeConfig.from_dict({
        "model": {"path": str(path), "dtype": "float32"},
        "engine": {"kvCacheBlocks": 40, "blockSize": 4, "device": "cpu"},
        "scheduler": {"prefillChunkSize": 7, "maxBatchedTokens": 40, "maxActiveSequences": 16,
                      "kvCacheHighWatermark": 0.98, "kvCacheRejectWatermark": 0.99, "stepTimeBudget": "auto"},
        "lanes": lanes,
    })


def test_greedy_outputs_equal_transformers_with_shares_budget_and_a_reserve_preemption(tiny_model_dir):
    from tokenlane.runtime.engine.llm_engine import LLMEngine
    from tokenlane.runtime.executor.model_executor import ModelExecutor
    from tokenlane.runtime.engine.tokenizer import load_tokenizer

    config = isolated_config(tiny_model_dir, reserve=None)
    engine = LLMEngine(config, ModelExecutor(config), tokenizer=load_tokenizer(tiny_model_dir))
    bulk = make_requests(6, 1024, seed=21, min_len=12, max_len=30, max_new=(12, 20))
    inter = make_requests(4, 1024, seed=22, min_len=2, max_len=10, max_new=(4, 10))
    for i, r in enumerate(bulk):
        r.request_id, r.lane = f"bulk{i}", "bulk"
    for i, r in enumerate(inter):
        r.request_id, r.lane = f"inter{i}", "inter"
    for r in [*bulk, *inter]:
        r.sampling_params.ignore_eos = True  # HF side runs with EOS disabled too
    for r in bulk:
        engine.add_request(r)
    for _ in range(6):  # the bulk lane fills the pool
        engine.step()
    assert engine.scheduler.kv.num_free_blocks < 10
    # A reload reserves 25% (10 blocks) for the interactive lane: bulk requests are preempted.
    engine.reload_config(isolated_config(tiny_model_dir, reserve=0.25))
    for r in inter:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 5000
    assert sum(r.num_preemptions for r in bulk) > 0, "the raised reserve was meant to preempt"
    for r in [*bulk, *inter]:
        assert r.finish_reason is not None and r.finish_reason.value == "length", r.finish_detail
    assert engine.scheduler.kv.num_free_blocks == 40
    assert_matches_hf(tiny_model_dir, [*bulk, *inter])
