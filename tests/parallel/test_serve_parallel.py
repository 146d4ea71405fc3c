"""`tokenlane serve` with tensor and pipeline parallel ranks on the CPU (gloo), over real HTTP
with the official `openai` client, against transformers.

Each layout gets one real server process (its worker ranks are its children) shared by every
check: greedy tokens and logprobs (sampled and echoed prompt logprobs, float32, within 1e-4)
equal transformers' on a run with prefill chunks (prefillChunkSize 16), a prefix hit and
preemptions (a 14-block KV pool); n > 1 (forks and copy on write), structured output,
cancellation freeing the KV pool, a hot reload of a lane key, and a LoRA adapter added and
removed by hot reloads (loaded on every rank) against peft. The default run serves a
Llama with one KV head (replicated over the tensor ranks) at TP=2 with the engine in the server
process, and a Qwen2 (qkv bias, tied embeddings) at TP=2 x PP=2 with an engine core process;
the other layouts of both models are marked slow.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))
from serve_process import free_port, start_serve  # noqa: E402

TOL = 1e-4
IDS = {"return_token_ids": True, "ignore_eos": True}  # transformers runs without EOS too
KV_BLOCKS = 14
CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 256, dtype: float32{adapters}}}
engine: {{blockSize: 16, kvCacheBlocks: {blocks}, device: cpu, tensorParallelSize: {tp},
         pipelineParallelSize: {pp}, coreProcess: {core}, maxLoras: 2}}
scheduler: {{maxActiveSequences: 8, maxWaitingRequests: 64, maxBatchedTokens: 64, prefillChunkSize: 16}}
lanes:
  - {{name: interactive, default: true, priority: 100}}
  - {{name: batch, priority: 10, maxActiveSequences: {batch_seqs}}}
"""
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}

LAYOUTS = [
    pytest.param(("llama-mqa", 2, 1, False), id="llama-mqa-tp2"),
    pytest.param(("qwen2", 2, 2, True), id="qwen2-tp2xpp2-core"),
    pytest.param(("llama-mqa", 1, 2, True), id="llama-mqa-pp2-core", marks=pytest.mark.slow),
    pytest.param(("llama-mqa", 2, 2, False), id="llama-mqa-tp2xpp2", marks=pytest.mark.slow),
    pytest.param(("qwen2", 2, 1, False), id="qwen2-tp2", marks=pytest.mark.slow),
    pytest.param(("qwen2", 1, 2, False), id="qwen2-pp2", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_qwen2_dir):
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    mqa = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-mqa"), arch="llama", num_kv_heads=1, num_layers=3)
    return {"llama-mqa": mqa, "qwen2": tiny_qwen2_dir}


class Reference:
    """transformers on the same checkpoint, float32: greedy tokens and log_softmax rows."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None

    def run(self, ids: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=max_new, do_sample=False, pad_token_id=0)
            new = out[0, len(ids):].tolist()
            logits = self.model(torch.tensor([ids + new])).logits[0].float()
        return new, torch.log_softmax(logits, dim=-1)


class Served:
    def __init__(self, proc, url: str, config_path: Path, layout: tuple) -> None:
        self.proc, self.url, self.config_path, self.layout = proc, url, config_path, layout
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def wait_metric(self, name: str, predicate, **labels) -> float:
        for _ in range(600):  # bounded poll of the server's own counters, not a guessed sleep
            value = self.metric(name, **labels)
            if predicate(value):
                return value
            threading.Event().wait(0.05)
        raise AssertionError(f"{name}{labels} = {value}")


@pytest.fixture(scope="module", params=LAYOUTS)
def served(request, models, tmp_path_factory):
    arch, tp, pp, core = request.param
    folder = tmp_path_factory.mktemp(f"serve-{arch}-{tp}x{pp}")
    config_path = folder / "runtime.yaml"
    text = dict(model=models[arch], blocks=KV_BLOCKS, tp=tp, pp=pp, core=str(core).lower(), batch_seqs=4, adapters="")
    config_path.write_text(CONFIG.format(**text))
    proc, url = start_serve(config_path, "--master-port", str(free_port()), "--config-poll-seconds", "0.1")
    served = Served(proc, url, config_path, (arch, tp, pp, core))
    served.reference = Reference(models[arch])
    served.model_dir = models[arch]
    served.config_text = text
    yield served
    proc.terminate()
    try:
        log = proc.communicate(timeout=60)[0]
    except Exception:
        proc.kill()
        raise
    assert proc.returncode == 0, log[-3000:]
    assert "parallel group failed" not in log
    # A clean shutdown tells every worker rank to stop (with a core process too), none is killed.
    assert log.count("stopping (shutdown)") == tp * pp - 1, log[-3000:]


def prompt_ids(i: int, n: int = 40) -> list[int]:
    return [(7 + 31 * i + 13 * j) % 1000 + 3 for j in range(n)]


def check_logprobs(choice, want_ids: list[int], table: torch.Tensor) -> None:
    """An echoed choice's token logprobs (prompt, then generated) against log_softmax rows: the
    logprob of token p comes from row p - 1; the first token has none."""
    got = choice.logprobs.token_logprobs
    assert len(got) == len(want_ids) and got[0] is None
    for position in range(1, len(want_ids)):
        assert abs(got[position] - table[position - 1, want_ids[position]].item()) < TOL, position


def test_greedy_tokens_and_logprobs_equal_transformers_through_chunks_prefix_hits_and_preemption(served):
    """Four 40-token prompts (3 prefill chunks each) at once, 20 tokens each, on 14 KV blocks:
    the pool cannot hold them all, so some are preempted and recomputed. Echoed prompt
    logprobs and sampled logprobs within 1e-4 of transformers; then the first prompt again
    hits the prefix cache and gives the same tokens."""
    prompts = [prompt_ids(i) for i in range(4)]
    results: dict[int, object] = {}

    def one(i: int) -> None:
        results[i] = served.client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=20, temperature=0, logprobs=1, echo=True,
            extra_body=IDS)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        new, table = served.reference.run(prompt, 20)
        choice = results[i].choices[0]
        assert choice.prompt_token_ids == prompt and choice.token_ids == new, f"prompt {i}"
        check_logprobs(choice, prompt + new, table)
    assert served.metric("tokenlane_preemptions_total") > 0
    hits = served.metric("tokenlane_prefix_cache_hits_total")
    again = served.client.completions.create(model="tiny", prompt=prompts[0], max_tokens=20, temperature=0,
                                             extra_body=IDS)
    assert served.metric("tokenlane_prefix_cache_hits_total") > hits
    assert again.choices[0].token_ids == results[0].choices[0].token_ids


def test_parallel_sampling_forks_and_structured_output(served):
    prompt = prompt_ids(9, 21)  # the last prompt block is shared, then copied on write
    new, _ = served.reference.run(prompt, 12)
    out = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, n=3,
                                           extra_body=IDS)
    assert [c.token_ids for c in out.choices] == [new] * 3
    out = served.client.completions.create(model="tiny", prompt=["person:", "someone:"], max_tokens=60,
                                           temperature=1.0, seed=5, extra_body={"guided_json": PERSON})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_cancelled_stream_frees_the_pool_then_serving_goes_on(served):
    stream = served.client.completions.create(model="tiny", prompt=prompt_ids(11), max_tokens=150,
                                              temperature=0, stream=True)
    for k, _ in enumerate(stream):
        if k == 2:
            break
    stream.close()
    served.wait_metric("tokenlane_kv_blocks_free", lambda v: v == KV_BLOCKS)
    served.wait_metric("tokenlane_num_requests_running", lambda v: v == 0)
    prompt = prompt_ids(12)
    new, _ = served.reference.run(prompt, 6)
    out = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                           extra_body=IDS)
    assert out.choices[0].token_ids == new


def test_hot_reload_of_a_lane_key(served):
    labels = {"lane": "batch", "budget": "maxActiveSequences"}
    assert served.metric("tokenlane_lane_budget", **labels) == 4
    served.config_path.write_text(CONFIG.format(**{**served.config_text, "batch_seqs": 3}))
    served.wait_metric("tokenlane_lane_budget", lambda v: v == 3, **labels)
    assert served.metric("tokenlane_config_reloads_total", result="success") == 1
    prompt = prompt_ids(13)
    new, _ = served.reference.run(prompt, 4)
    out = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                           extra_headers={"X-Lane": "batch"}, extra_body=IDS)
    assert out.choices[0].token_ids == new


def test_lora_adapter_hot_loaded_on_every_rank_equals_peft(served, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from lora_helpers import make_peft_adapter, peft_reference, reference_greedy

    folder = make_peft_adapter(served.model_dir, tmp_path / "ad", r=4, seed=3)
    with_adapter = f', adapters: [{{name: ad, path: "{folder}"}}]'
    reloads = served.metric("tokenlane_config_reloads_total", result="success")
    served.config_path.write_text(CONFIG.format(**{**served.config_text, "batch_seqs": 3, "adapters": with_adapter}))
    served.wait_metric("tokenlane_config_reloads_total", lambda v: v == reloads + 1, result="success")
    prompt = prompt_ids(14, 24)
    want, _ = reference_greedy(peft_reference(served.model_dir, folder), prompt, 6)
    out = served.client.completions.create(model="ad", prompt=prompt, max_tokens=6, temperature=0, extra_body=IDS)
    assert out.choices[0].token_ids == want
    base = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body=IDS)
    assert base.choices[0].token_ids == served.reference.run(prompt, 6)[0] != want
    served.config_path.write_text(CONFIG.format(**{**served.config_text, "batch_seqs": 3}))
    served.wait_metric("tokenlane_config_reloads_total", lambda v: v == reloads + 2, result="success")
    assert "ad" not in {m.id for m in served.client.models.list().data}
