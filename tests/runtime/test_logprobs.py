"""Logprobs against Hugging Face transformers on the same tiny random checkpoints.

The engine's output and prompt logprobs must equal `log_softmax` of transformers' float32
logits within 1e-4, whatever the batching: prefill chunks of 7 tokens (a prompt's logprobs
come chunk by chunk), a whole prompt in one chunk, a request that takes another's cached
prefix blocks (output logprobs), a prompt-logprob request whose prefix is cached (it must
compute it anyway), preemption by recompute, and `max_tokens=0` (prompt logprobs only).
Every run ends with the scheduler's and the KV pool's invariants checked and no block leaked.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.core.request import Request, SamplingParams, TokenLogprob
from tokenlane.runtime.engine.tokenizer import load_tokenizer

TOL = 1e-4
_HF: dict = {}
MAX_DIFF = {"seen": 0.0}  # largest |ours - HF| over the module (printed at the end)


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):  # tests/conftest.py
    yield


@pytest.fixture(scope="module", autouse=True)
def _report_max_diff():
    yield
    print(f"\nmax |logprob - HF log_softmax| over test_logprobs.py: {MAX_DIFF['seen']:.3g}")


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_model_dir, tiny_qwen2_dir):
    return tiny_model_dir if request.param == "llama" else tiny_qwen2_dir


def hf_logprobs(path, token_ids: list[int]) -> torch.Tensor:
    """[len, V] log_softmax of transformers' float32 logits over the whole sequence."""
    from transformers import AutoModelForCausalLM

    key = (str(path), tuple(token_ids))
    if key not in _HF:
        model_key = ("model", str(path))
        if model_key not in _HF:
            _HF[model_key] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = _HF[model_key](torch.tensor([token_ids])).logits[0].float()
        _HF[key] = torch.log_softmax(logits, dim=-1)
    return _HF[key]


def check_entry(entry: TokenLogprob, row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    diff = abs(entry.logprob - row[token].item())
    MAX_DIFF["seen"] = max(MAX_DIFF["seen"], diff)
    assert diff < TOL, (entry, row[token].item())
    assert len(entry.top) == k
    expected_top = row.topk(k).values.tolist() if k else []
    for (tid, value), kth in zip(entry.top, expected_top):
        d = max(abs(value - row[tid].item()), abs(value - kth))
        MAX_DIFF["seen"] = max(MAX_DIFF["seen"], d)
        assert d < TOL, (entry.top, expected_top)
    # rank: 1 + tokens strictly more likely (near-ties may swap by float noise: allow 1)
    true_rank = int((row > row[token]).sum().item()) + 1
    assert abs(entry.rank - true_rank) <= 1, (entry.rank, true_rank)


def check_against_hf(path, request: Request) -> None:
    params = request.sampling_params
    seq = request.prompt_token_ids + request.output_token_ids
    lp = hf_logprobs(path, seq)
    n_prompt = request.num_prompt_tokens
    if params.prompt_logprobs is not None:
        assert len(request.prompt_logprobs) == n_prompt, request.request_id
        assert request.prompt_logprobs[0] is None
        for i in range(1, n_prompt):
            check_entry(request.prompt_logprobs[i], lp[i - 1], request.prompt_token_ids[i], params.prompt_logprobs)
    if params.logprobs is not None:
        assert len(request.output_logprobs) == request.num_output_tokens
        for j, entry in enumerate(request.output_logprobs):
            check_entry(entry, lp[n_prompt - 1 + j], request.output_token_ids[j], params.logprobs)
            if params.temperature == 0:  # the greedy token is the most likely one of the same logits
                assert entry.rank == 1


def make_engine(path, *, blocks=256, block_size=4, chunk=7, max_batched_tokens=32, max_seqs=16):
    config = RuntimeConfig(
        model=ModelConfig(path=str(path), dtype="float32"),
        engine=EngineConfig(kv_cache_blocks=blocks, block_size=block_size, device="cpu"),
        scheduler=SchedulerConfig(prefill_chunk_size=chunk, max_batched_tokens=max_batched_tokens,
                                  max_active_sequences=max_seqs, kv_cache_high_watermark=0.98,
                                  kv_cache_reject_watermark=0.99),
    )
    return LLMEngine(config, ModelExecutor(config), tokenizer=load_tokenizer(path))


def run(engine: LLMEngine, requests, late=(), check=True) -> dict[str, list]:
    """Run to completion (late requests join once the first has computed its prompt);
    returns each request's outputs."""
    outputs: dict[str, list] = {}
    for r in requests:
        engine.add_request(r)
    pending = list(late)
    steps = 0
    while engine.has_unfinished_requests() or pending:
        if pending and requests[0].num_computed_tokens >= requests[0].num_prompt_tokens:
            for r in pending:
                engine.add_request(r)
            pending = []
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 5000
    if check:
        assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks, "KV blocks leaked"
    return outputs


def prompts(n, seed, min_len=2, max_len=40, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(5, 1000) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def req(rid, prompt, *, max_tokens=6, logprobs=None, prompt_logprobs=None, temperature=0.0, seed=None):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                     ignore_eos=True, logprobs=logprobs,
                                                     prompt_logprobs=prompt_logprobs))


@pytest.mark.parametrize("chunk", [7, 512], ids=["chunk7", "whole-prompt"])
def test_prompt_and_output_logprobs_match_hf(model_dir, chunk):
    engine = make_engine(model_dir, chunk=chunk, max_batched_tokens=max(40, chunk))
    ps = prompts(6, seed=1)
    reqs = [
        req("a", ps[0], logprobs=0, prompt_logprobs=0),
        req("b", ps[1], logprobs=5, prompt_logprobs=3),
        req("c", ps[2], logprobs=20),
        req("d", ps[3], prompt_logprobs=20, max_tokens=3),
        req("e", ps[4], logprobs=2, temperature=1.0, seed=7),  # sampled, not greedy
        req("f", ps[5]),  # no logprobs, batched with the others
    ]
    outputs = run(engine, reqs)
    for r in reqs:
        check_against_hf(model_dir, r)
    assert reqs[5].output_logprobs == [] and reqs[5].prompt_logprobs == []
    # The outputs carry them: each token's logprob with its token, prompt logprobs once.
    for r in reqs:
        outs = outputs[r.request_id]
        if r.sampling_params.logprobs is not None:
            streamed = [e for o in outs for e in (o.new_logprobs or [])]
            assert streamed == r.output_logprobs
            assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in outs)
        else:
            assert all(o.new_logprobs is None for o in outs)
        with_prompt = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        if r.sampling_params.prompt_logprobs is not None:
            assert with_prompt == [r.prompt_logprobs]
            assert outs[0].prompt_logprobs is not None  # on the first output
        else:
            assert with_prompt == []


def test_sampling_is_unchanged_by_logprobs(tiny_model_dir):
    """The same seed samples the same tokens with and without logprobs (same logits)."""
    ps = prompts(2, seed=2)
    plain = [req(f"p{i}", p, max_tokens=10, temperature=0.9, seed=11 + i) for i, p in enumerate(ps)]
    with_lp = [req(f"l{i}", p, max_tokens=10, temperature=0.9, seed=11 + i, logprobs=3, prompt_logprobs=1)
               for i, p in enumerate(ps)]
    run(make_engine(tiny_model_dir), plain)
    run(make_engine(tiny_model_dir), with_lp)
    assert [r.output_token_ids for r in plain] == [r.output_token_ids for r in with_lp]


def test_prefix_cache_hit_and_prompt_logprobs_bypass(model_dir):
    """A later request with output logprobs takes the cached prefix (and its logprobs still
    match); a later request with prompt logprobs takes none of it and computes every
    position, so its prompt logprobs match too."""
    prefix = prompts(1, seed=3, min_len=21, max_len=21)[0]
    first, hit, hit2, bypass = prompts(4, seed=4, min_len=3, max_len=9, prefix=prefix)
    engine = make_engine(model_dir, chunk=7, max_batched_tokens=40)
    a = req("first", first, logprobs=1)
    b = req("hit", hit, logprobs=4)
    c = req("bypass", bypass, prompt_logprobs=2, logprobs=2)
    d = req("hit2", hit2, prompt_logprobs=None)
    run(engine, [a], late=[b, c, d])
    assert b.num_cached_tokens >= 20 and d.num_cached_tokens >= 20, (b.num_cached_tokens, d.num_cached_tokens)
    assert c.num_cached_tokens == 0
    for r in (a, b, c):
        check_against_hf(model_dir, r)
    # Its blocks are registered like anyone's: a later plain request hits them.
    e = req("after", bypass[:-1] + [7], max_tokens=2)
    run(engine, [e])
    assert e.num_cached_tokens >= 20


def test_prompt_logprobs_survive_preemption(tiny_model_dir):
    """Recomputed after a preemption, a request keeps one logprob per prompt token (none
    twice, none missing), and after its prompt is recorded it may use the prefix cache."""
    ps = prompts(8, seed=5, min_len=10, max_len=30)
    reqs = [req(f"r{i}", p, max_tokens=14, logprobs=1, prompt_logprobs=2) for i, p in enumerate(ps)]
    engine = make_engine(tiny_model_dir, blocks=16, chunk=7, max_batched_tokens=40)
    run(engine, reqs)
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to force preemption"
    for r in reqs:
        check_against_hf(tiny_model_dir, r)


def test_max_tokens_zero_scores_the_prompt_only(tiny_model_dir):
    ps = prompts(3, seed=6, min_len=1, max_len=25)
    ps[0] = ps[0][:1]  # a one-token prompt: its only entry is None
    reqs = [req(f"z{i}", p, max_tokens=0, prompt_logprobs=1) for i, p in enumerate(ps)]
    engine = make_engine(tiny_model_dir, chunk=7)
    outputs = run(engine, reqs)
    for r in reqs:
        assert r.output_token_ids == [] and r.finish_reason.value == "length"
        check_against_hf(tiny_model_dir, r)
        (final,) = outputs[r.request_id]
        assert final.finished and final.new_token_ids == [] and final.prompt_logprobs == r.prompt_logprobs
    assert reqs[0].prompt_logprobs == [None]
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)  # without prompt logprobs there is nothing to compute
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


def test_executor_without_logprobs_fails_the_request_not_the_engine():
    """An executor that returns no logprobs (the simulated one) ends such a request as an
    error; the others are served."""
    from tokenlane.runtime.executor.simulated import SimulatedExecutor, VirtualClock

    config = RuntimeConfig(
        model=ModelConfig(path="unused"),
        engine=EngineConfig(executor="simulated", kv_cache_blocks=64, block_size=16),
    )
    clock = VirtualClock()
    engine = LLMEngine(config, SimulatedExecutor(config, clock), clock=clock)
    ok = Request("ok", [11, 12, 13], SamplingParams(max_tokens=3))
    bad = Request("bad", [11, 12, 13], SamplingParams(max_tokens=3, logprobs=1))
    bad_prompt = Request("bad-prompt", [11, 12, 13], SamplingParams(max_tokens=3, prompt_logprobs=1))
    run(engine, [ok, bad, bad_prompt])
    assert ok.finish_reason.value == "length"
    assert bad.finish_reason.value == "error" and "logprobs" in bad.finish_detail
    assert bad_prompt.finish_reason.value == "error" and "logprobs" in bad_prompt.finish_detail
