"""LoRA adapters in the model (runtime/executor/lora.py, kernels/lora.py) against transformers + peft.

Two PEFT adapters of different ranks (8, and 16 with rsLoRA), every target module, on the tiny
Llama and Qwen2 (qkv bias, tied embeddings) checkpoints. Requests of the base and of both
adapters run in the same steps (prefill chunks of 7 tokens beside decodes): the greedy tokens
and their logprobs (float32, within 1e-4) must equal `PeftModel`'s for each adapter and the
base model's for base rows. Then: the slot table's LRU eviction with fewer slots than adapters,
and bad adapters refused with a ValueError naming the adapter, without disturbing serving.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import deque

import pytest
import torch

from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
from tokenlane.runtime.executor.model_executor import ModelExecutor

from lora_helpers import make_peft_adapter, peft_reference, reference_greedy

LOGPROB_TOL = 1e-4


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):  # tests/conftest.py
    yield


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_model_dir, tiny_qwen2_dir):
    return tiny_model_dir if request.param == "llama" else tiny_qwen2_dir


_ADAPTERS: dict = {}


def adapters_for(model_dir, tmp_path_factory) -> dict[str, str]:
    """Two adapters of the checkpoint: rank 8, and rank 16 with rsLoRA (made once per session)."""
    key = str(model_dir)
    if key not in _ADAPTERS:
        root = tmp_path_factory.mktemp("adapters")
        _ADAPTERS[key] = {
            "sql": str(make_peft_adapter(model_dir, root / "sql", r=8, seed=11)),
            "chat": str(make_peft_adapter(model_dir, root / "chat", r=16, seed=12, lora_alpha=8, use_rslora=True)),
        }
    return _ADAPTERS[key]


def make_executor(model_dir, max_loras=4, max_lora_rank=64, blocks=256) -> ModelExecutor:
    config = RuntimeConfig(
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        engine=EngineConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, kv_cache_blocks=blocks, block_size=4,
                            device="cpu"),
    )
    return ModelExecutor(config)


def make_request(rid, prompt, adapter, max_tokens):
    request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0))
    request.adapter = adapter
    return request


def run_mixed(executor, requests, chunk=7, budget=32):
    """Steps of decodes first, then prefill chunks of `chunk` tokens, within `budget` tokens:
    every request's blocks are reserved up front. Returns {id: (tokens, logprobs)}."""
    free = deque(range(executor.num_kv_blocks))
    waiting, running, results = deque(requests), [], {}
    for request in requests:
        need = -(-(len(request.prompt_token_ids) + request.sampling_params.max_tokens) // executor.block_size)
        request.block_ids = [free.popleft() for _ in range(need)]
        results[request.request_id] = ([], [])
    finished = []
    while waiting or running:
        plan, left = StepPlan(finished=finished), budget
        finished = []
        for request in running:
            if request.num_tokens - request.num_computed_tokens == 1:
                plan.chunks.append(ScheduledChunk(request, request.num_computed_tokens, 1, True))
                left -= 1
        for request in [r for r in running if r.num_tokens - r.num_computed_tokens > 1] + list(waiting):
            n = min(chunk, request.num_tokens - request.num_computed_tokens, left)
            if n <= 0:
                break
            if request in waiting:
                waiting.remove(request)
                running.append(request)
            plan.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n,
                                              request.num_computed_tokens + n == request.num_tokens))
            left -= n
        out = executor.execute(plan)
        assert not out.errors, out.errors
        for c in plan.chunks:
            request = c.request
            request.num_computed_tokens += c.num_tokens
            if c.sample:
                token = out.sampled[request.request_id]
                request.output_token_ids.append(token)
                results[request.request_id][0].append(token)
                results[request.request_id][1].append(out.logprobs[request.request_id].logprob)
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    running.remove(request)
                    finished.append(request)
    return results


def test_mixed_batch_matches_peft(model_dir, tmp_path_factory):
    adapters = adapters_for(model_dir, tmp_path_factory)
    executor = make_executor(model_dir)
    infos = {name: executor.add_adapter(name, folder) for name, folder in adapters.items()}
    assert (infos["sql"].rank, infos["chat"].rank) == (8, 16)
    assert infos["sql"].target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert sorted(executor.adapter_names()) == ["chat", "sql"]
    rng = random.Random(3)
    vocab = executor.vocab_size
    requests = []
    for i in range(9):
        adapter = [None, "sql", "chat"][i % 3]
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(3, 20))]
        requests.append(make_request(f"r{i}", prompt, adapter, max_tokens=rng.randint(4, 9)))
    results = run_mixed(executor, requests)
    for request in requests:
        reference = peft_reference(model_dir, adapters[request.adapter] if request.adapter else None)
        want_tokens, want_logprobs = reference_greedy(reference, request.prompt_token_ids,
                                                      request.sampling_params.max_tokens)
        tokens, logprobs = results[request.request_id]
        assert tokens == want_tokens, (request.request_id, request.adapter)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) <= LOGPROB_TOL, request.adapter
    # The adapters change the outputs (a test of a no-op delta would pass without LoRA).
    prompt = requests[0].prompt_token_ids
    outputs = {a: reference_greedy(peft_reference(model_dir, adapters[a] if a else None), prompt, 6)[0]
               for a in (None, "sql", "chat")}
    assert len({tuple(v) for v in outputs.values()}) == 3


def test_more_adapters_than_slots_evicts_the_least_recently_used(tiny_model_dir, tmp_path_factory):
    adapters = adapters_for(tiny_model_dir, tmp_path_factory)
    executor = make_executor(tiny_model_dir, max_loras=1)
    for name, folder in adapters.items():
        executor.add_adapter(name, folder)
    slots = executor.lora_slots
    rng = random.Random(5)
    for step, adapter in enumerate(["sql", "chat", "sql", "sql"]):
        prompt = [rng.randrange(5, executor.vocab_size) for _ in range(6)]
        request = make_request(f"s{step}", prompt, adapter, max_tokens=3)
        tokens, _ = run_mixed(executor, [request])[request.request_id]
        assert slots.resident == [adapter]
        assert tokens == reference_greedy(peft_reference(tiny_model_dir, adapters[adapter]), prompt, 3)[0]
    assert slots.loads == 3  # sql, chat, sql again; the last one was resident
    # Two adapters in one step with one slot: the later adapter's request fails, not the step.
    a = make_request("a", [7, 8, 9], "sql", 2)
    b = make_request("b", [7, 8, 9], "chat", 2)
    for request in (a, b):
        request.block_ids = [0, 1]
    out = executor.execute(StepPlan(chunks=[ScheduledChunk(a, 0, 3, True), ScheduledChunk(b, 0, 3, True)]))
    assert "maxLoras" in out.errors["b"] and "a" in out.sampled


def test_unknown_and_removed_adapters_fail_the_request(tiny_model_dir, tmp_path_factory):
    adapters = adapters_for(tiny_model_dir, tmp_path_factory)
    executor = make_executor(tiny_model_dir, max_loras=2)
    executor.add_adapter("sql", adapters["sql"])
    request = make_request("x", [5, 6, 7], "sql", 2)
    run_mixed(executor, [request])
    executor.remove_adapter("sql")
    assert executor.adapter_names() == [] and executor.lora_slots.resident == [None, None]
    gone = make_request("y", [5, 6, 7], "sql", 2)
    gone.block_ids = [0]
    base = make_request("z", [5, 6, 7], None, 2)
    base.block_ids = [1]
    out = executor.execute(StepPlan(chunks=[ScheduledChunk(gone, 0, 3, True), ScheduledChunk(base, 0, 3, True)]))
    assert out.errors == {"y": "adapter 'sql' is not loaded"} and "z" in out.sampled
    with pytest.raises(ValueError, match="'sql' is not loaded"):
        executor.remove_adapter("sql")


def test_adapters_off_without_max_loras(tiny_model_dir, tmp_path_factory):
    config = RuntimeConfig(model=ModelConfig(path=str(tiny_model_dir), dtype="float32"),
                           engine=EngineConfig(kv_cache_blocks=16, block_size=4, device="cpu"))
    executor = ModelExecutor(config)
    assert executor.lora_slots is None
    with pytest.raises(ValueError, match="'sql'.*engine.maxLoras"):
        executor.add_adapter("sql", adapters_for(tiny_model_dir, tmp_path_factory)["sql"])


def _copy(folder, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_bad_adapters_are_refused_naming_the_adapter(tiny_model_dir, tiny_qwen2_dir, tmp_path_factory, tmp_path):
    good = adapters_for(tiny_model_dir, tmp_path_factory)
    executor = make_executor(tiny_model_dir, max_lora_rank=8)
    executor.add_adapter("ok", good["sql"])  # rank 8: fits
    cases = {}
    cases["rank above maxLoraRank"] = (good["chat"], "rank 16 .* above engine.maxLoraRank 8")
    other_base = tmp_path_factory.mktemp("other-base")
    other = make_peft_adapter(_wider_checkpoint(tiny_model_dir, other_base), tmp_path / "wide", r=4, seed=3)
    cases["another base"] = (other, "do not fit the base")
    missing = _copy(good["sql"], tmp_path, "missing")
    (missing / "adapter_model.safetensors").unlink()
    cases["missing weights"] = (missing, "no adapter_model.safetensors")
    no_config = _copy(good["sql"], tmp_path, "no-config")
    (no_config / "adapter_config.json").unlink()
    cases["missing config"] = (no_config, "no adapter_config.json")
    corrupt = _copy(good["sql"], tmp_path, "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated safetensors"] = (corrupt, "cannot read adapter_model.safetensors")
    garbage = _copy(good["sql"], tmp_path, "garbage")
    (garbage / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    cases["garbage safetensors"] = (garbage, "cannot read adapter_model.safetensors")
    dora = _copy(good["sql"], tmp_path, "dora")
    _edit_config(dora, use_dora=True)
    cases["dora"] = (dora, "DoRA")
    bias = _copy(good["sql"], tmp_path, "bias")
    _edit_config(bias, bias="all")
    cases["bias"] = (bias, "biases")
    head = _copy(good["sql"], tmp_path, "head")
    _edit_config(head, target_modules=["q_proj", "lm_head"])
    cases["lm_head target"] = (head, r"target modules \['lm_head'\]")
    cases["not a folder"] = (tmp_path / "nowhere", "is not a folder")
    for label, (folder, message) in cases.items():
        with pytest.raises(ValueError, match=f"adapter 'bad'.*{message}"):
            executor.add_adapter("bad", str(folder))
        assert executor.adapter_names() == ["ok"], label
    with pytest.raises(ValueError, match="'ok' is already loaded"):
        executor.add_adapter("ok", good["sql"])
    # Serving goes on with what was loaded.
    request = make_request("after", [9, 10, 11], "ok", 3)
    tokens, _ = run_mixed(executor, [request])["after"]
    assert tokens == reference_greedy(peft_reference(tiny_model_dir, good["sql"]), [9, 10, 11], 3)[0]


def _wider_checkpoint(base_dir, out_dir):
    """The tiny Llama with a wider MLP: adapters of it do not fit the served base."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base_dir))
    config.intermediate_size *= 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out_dir))
    return out_dir


def test_slots_are_allocated_before_the_kv_pool_is_sized(tiny_model_dir, monkeypatch):
    seen = []
    size_pool = ModelExecutor._pool_size

    def spy(self):
        seen.append(self.lora_slots.nbytes if self.lora_slots is not None else None)
        return size_pool(self)

    monkeypatch.setattr(ModelExecutor, "_pool_size", spy)
    executor = make_executor(tiny_model_dir, max_loras=3, max_lora_rank=32, blocks=16)
    # Per layer, float32: A (3 slots x rank 32 x in) and B (3 x 32 x out) of the seven modules,
    # and a scaling per slot and module.
    a = executor.args
    q, kv, h, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, a.intermediate_size
    per_rank = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    assert seen == [a.num_layers * (3 * 32 * per_rank * 4 + 3 * 7 * 4)]


def test_batch_rows_of_one_adapter_are_side_by_side(tiny_model_dir, tmp_path_factory):
    adapters = adapters_for(tiny_model_dir, tmp_path_factory)
    executor = make_executor(tiny_model_dir, max_loras=2)
    for name, folder in adapters.items():
        executor.add_adapter(name, folder)
    requests = [make_request(f"d{i}", [5 + i, 6, 7], [None, "sql", "chat"][i % 3], 2) for i in range(6)]
    for i, request in enumerate(requests):
        request.block_ids = [i]
        request.num_computed_tokens = 2
    slots = {"sql": 0, "chat": 1}
    inputs = executor.inputs.build([ScheduledChunk(r, 2, 1, True) for r in requests], slots, [8, 16])
    assert [c.request.adapter for c in inputs.sampled_chunks] == [None, None, "sql", "sql", "chat", "chat"]
    segments = inputs.meta.lora
    assert segments.slots == [0, 1] and segments.ranks == [8, 16]
    assert segments.rows == [slice(2, 4), slice(4, 6)]
