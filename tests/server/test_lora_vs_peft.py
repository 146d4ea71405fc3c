"""Multi-LoRA correctness through the HTTP API (issue 39's target): on a Llama and a Qwen2
checkpoint, two adapters of different ranks and target modules served next to the base by
real uvicorn on loopback and called with the official `openai` client, all in one concurrent
batch, give the greedy tokens and float32 logprobs (within 1e-4) of transformers + peft's
`PeftModel` for each adapter and the base, while the batch runs with chunked prefill, a
prefix-cache hit on the base (and none across adapters on the same prompt) and preemptions
(a KV pool too small for the whole batch). No KV block is left taken at the end."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tokenlane.runtime.executor.fake import StepGate

pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/lora_helpers.py
from lora_helpers import make_peft_adapter, peft_reference, reference_greedy  # noqa: E402

TOL = 1e-4
MAX_NEW = 8


def config_text(base_dir: Path, adapters: dict[str, Path]) -> str:
    entries = ", ".join(f"{{name: {name}, path: '{path}'}}" for name, path in adapters.items())
    # 24 blocks of 4 tokens hold three of the six 28-token sequences: the batch preempts.
    text = f"""
model: {{path: '{base_dir}', servedName: base, dtype: float32, maxModelLen: 128, adapters: [{entries}]}}
engine: {{blockSize: 4, kvCacheBlocks: 24, device: cpu, maxLoras: 2, maxLoraRank: 16}}
scheduler: {{maxActiveSequences: 8, maxBatchedTokens: 32, prefillChunkSize: 8, maxWaitingRequests: 64}}
"""
    return text.replace("{", "{{").replace("}", "}}")


class Finished:
    """Observer: what each finished request had (cached prefix tokens, preemptions)."""

    def __init__(self) -> None:
        self.requests = {}

    def on_step(self, stats) -> None:
        pass

    def on_config_applied(self, config, ok, message) -> None:
        pass

    def on_request_finished(self, request) -> None:
        self.requests[request.request_id] = request


def wait_idle(live, timeout: float = 30.0) -> None:
    engine = live.engine
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish"
        time.sleep(0.02)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adapters_and_base_in_one_batch_equal_peft(arch, serve, tiny_model_dir, tiny_qwen2_dir, tmp_path,
                                                  one_torch_thread):
    base_dir = tiny_model_dir if arch == "llama" else tiny_qwen2_dir
    adapters = {
        "low": make_peft_adapter(base_dir, tmp_path / "low", r=4, seed=1),
        "high": make_peft_adapter(base_dir, tmp_path / "high", r=12, seed=2,
                                  target_modules=("q_proj", "v_proj", "o_proj", "down_proj")),
    }
    live = serve(config_text(base_dir, adapters))
    finished = Finished()
    live.engine.add_observer(finished)
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    shared = [(7 * i + 3) % 1000 + 3 for i in range(20)]  # the same prompt for all three models
    prompts = {("base", 0): shared, ("low", 0): shared, ("high", 0): shared}
    for k, model in enumerate(("base", "low", "high")):
        prompts[(model, 1)] = [(13 * i + 101 * (k + 1)) % 1000 + 3 for i in range(20)]

    def complete(key):
        model, _ = key
        return key, client.completions.create(model=model, prompt=prompts[key], max_tokens=MAX_NEW, temperature=0,
                                              logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True})

    # The base's shared prompt first, alone: the batch below finds its blocks in the prefix cache.
    complete(("base", 0))
    wait_idle(live)
    preemptions = live.metric("tokenlane_preemptions_total")
    finished.requests.clear()
    engine = live.engine
    keys = list(prompts)
    # The base's repeat starts first (it takes its cached blocks before the others' allocations
    # could evict them), held at the gate until the other five are queued: one batch.
    with StepGate(engine.executor) as gate, ThreadPoolExecutor(len(keys)) as pool:
        gate.pause()
        first = pool.submit(complete, keys[0])
        gate.wait_paused()
        rest = [pool.submit(complete, key) for key in keys[1:]]
        deadline = time.monotonic() + 60
        while len(engine.scheduler.requests) + len(engine._staged) < len(keys):
            assert time.monotonic() < deadline, "requests were not admitted"
            time.sleep(0.01)
        gate.resume()
        results = dict(f.result() for f in [first, *rest])
    wait_idle(live)

    for (model, index), result in results.items():
        reference = peft_reference(base_dir, adapters.get(model))
        want_tokens, want_logprobs = reference_greedy(reference, prompts[(model, index)], MAX_NEW)
        choice = result.choices[0]
        assert result.model == model
        got_logprobs = choice.logprobs.token_logprobs
        assert choice.model_extra["token_ids"] == want_tokens, (arch, model, index)
        assert len(got_logprobs) == MAX_NEW
        assert max(abs(g - w) for g, w in zip(got_logprobs, want_logprobs)) < TOL, (arch, model, index)
    by_model = {}
    for request in finished.requests.values():
        by_model.setdefault((request.adapter, request.prompt_token_ids == shared), []).append(request)
    assert by_model[(None, True)][0].num_cached_tokens >= 16  # the base hit its own prefix
    for adapter in ("low", "high"):
        # Never the base's prefix or the other adapter's (after a preemption, its own blocks may
        # be found again); equal logprobs above also say no K/V of another model was read.
        request = by_model[(adapter, True)][0]
        assert request.num_cached_tokens == 0 or request.num_preemptions > 0, adapter
    assert live.metric("tokenlane_preemptions_total") > preemptions
    kv = live.engine.scheduler.kv
    assert kv.num_used_blocks == 0
    kv.check_invariants([])
