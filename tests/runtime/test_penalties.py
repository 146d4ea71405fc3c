"""The logits processors: presence/frequency/repetition penalties, logit_bias, min_p and
min_tokens, batched in the sampler.

Each is checked against a reference: transformers' RepetitionPenaltyLogitsProcessor and
MinPLogitsWarper, and a small pure-torch loop for OpenAI's presence/frequency penalties.
Greedy generation with penalties through the engine must equal a step-by-step reference
over transformers' logits on the same tiny checkpoint, and the reported logprobs stay the
raw model distribution.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.executor.sampler import Sampler, apply_logits_processors, apply_min_p, make_generator
from tokenlane.runtime.engine.tokenizer import load_tokenizer


def make_engine(path, chunk=7):
    config = RuntimeConfig(
        model=ModelConfig(path=str(path), dtype="float32"),
        engine=EngineConfig(kv_cache_blocks=256, block_size=4, device="cpu"),
        scheduler=SchedulerConfig(prefill_chunk_size=chunk, max_batched_tokens=32, max_active_sequences=16),
    )
    return LLMEngine(config, ModelExecutor(config), tokenizer=load_tokenizer(path))


def run(engine, requests):
    for r in requests:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 2000
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks, "KV blocks leaked"


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):  # tests/conftest.py
    yield


def hist(prompt, output, eos=None):
    return SimpleNamespace(prompt_token_ids=list(prompt), output_token_ids=list(output), eos_token_id=eos)


def reference_openai_penalties(logits: torch.Tensor, output: list[int], presence: float, frequency: float):
    """OpenAI's formula, one token at a time: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for token in set(output):
        count = output.count(token)
        out[token] -= count * frequency + presence
    return out


def test_presence_and_frequency_match_the_reference_per_row():
    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(4, vocab)
    rows = [
        (SamplingParams(presence_penalty=0.7), [1, 2, 2, 5]),
        (SamplingParams(frequency_penalty=1.3), [3, 3, 3, 0, 39]),
        (SamplingParams(presence_penalty=-0.5, frequency_penalty=-2.0), [7, 8, 7]),
        (SamplingParams(), [1, 2, 3]),  # no penalty: unchanged, though batched with the others
    ]
    params = [p for p, _ in rows]
    out = apply_logits_processors(logits, params, [hist([9, 9, 9], o) for _, o in rows])
    for i, (p, o) in enumerate(rows):
        expected = reference_openai_penalties(logits[i], o, p.presence_penalty, p.frequency_penalty)
        assert torch.allclose(out[i], expected, atol=1e-6), i
    # The prompt does not count for these two (OpenAI: generated tokens only).
    assert torch.equal(out[0, 9], logits[0, 9])


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(1)
    vocab = 50
    logits = torch.randn(3, vocab) * 3
    seqs = [([1, 2, 3], [4, 4, 10]), ([49, 0], []), ([5], [6, 7])]
    penalties = [1.3, 0.7, 1.0]
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    out = apply_logits_processors(logits, params, [hist(p, o) for p, o in seqs])
    for i, ((prompt, output), r) in enumerate(zip(seqs, penalties)):
        ids = torch.tensor([prompt + output])
        expected = RepetitionPenaltyLogitsProcessor(r)(ids, logits[i : i + 1].clone())[0]
        assert torch.allclose(out[i], expected, atol=1e-6), i


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(3, 10)
    params = [
        SamplingParams(logit_bias={3: 5.0, 9: -100.0, 12: 1.0}),  # 12: past the vocabulary, skipped
        SamplingParams(min_tokens=2, stop_token_ids=[4], max_tokens=5),
        SamplingParams(min_tokens=2, stop_token_ids=[4], max_tokens=5),
    ]
    histories = [hist([1], []), hist([1], [0], eos=2), hist([1], [0, 0], eos=2)]
    out = apply_logits_processors(logits, params, histories)
    assert out[0, 3] == 5.0 and out[0, 9] == -100.0 and out[0].sum() == -95.0
    assert torch.isinf(out[1, [2, 4]]).all() and torch.isfinite(out[1, [0, 1, 3]]).all()
    assert torch.isfinite(out[2]).all()  # two tokens generated: EOS and stop ids allowed again
    assert torch.equal(logits, torch.zeros(3, 10))  # the input is never modified


def test_min_p_matches_transformers():
    from transformers.generation.logits_process import MinPLogitsWarper

    torch.manual_seed(2)
    logits = torch.randn(3, 30) * 2
    min_p = torch.tensor([0.0, 0.1, 0.5])
    out = apply_min_p(logits, min_p)
    assert torch.equal(out[0], logits[0])
    for i in (1, 2):
        expected = MinPLogitsWarper(min_p[i].item())(None, logits[i : i + 1].clone())[0]
        assert torch.equal(torch.isinf(out[i]), torch.isinf(expected)), i
    # Sampled draws stay in the min-p support.
    sampler = Sampler(seed=3)
    row = logits[2:3].expand(500, -1).clone()
    draws = sampler(row, [SamplingParams(temperature=1.0, min_p=0.5)] * 500, [None] * 500)
    allowed = set(torch.nonzero(torch.isfinite(out[2])).flatten().tolist())
    assert set(draws) <= allowed and len(allowed) < 30


def test_sampler_applies_processors_greedy_and_sampled_without_touching_logits():
    torch.manual_seed(4)
    logits = torch.randn(4, 20)
    before = logits.clone()
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0.0, logit_bias={top[0]: -100.0}),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.8, seed=5, logit_bias={17: 100.0}),
        SamplingParams(temperature=0.0),
    ]
    histories = [hist([], []), hist([], [top[1]] * 3), hist([], []), hist([], [])]
    tokens = Sampler()(logits, params, [None, None, make_generator(5), None], histories)
    assert tokens[0] != top[0]
    expected1 = reference_openai_penalties(logits[1], [top[1]] * 3, 2.0, 2.0).argmax().item()
    assert tokens[1] == expected1 != top[1]
    assert tokens[2] == 17
    assert tokens[3] == top[3]
    assert torch.equal(logits, before)
    with pytest.raises(ValueError):
        Sampler()(logits[:1], params[:1], [None])  # a processor without the histories


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 2.5}, {"frequency_penalty": -2.1}, {"repetition_penalty": 0.0}, {"repetition_penalty": float("inf")},
        {"min_p": 1.5}, {"min_tokens": 17}, {"min_tokens": -1}, {"logit_bias": {3: 101.0}},
        {"logit_bias": {-1: 1.0}},
    ],
)
def test_sampling_params_validate_ranges(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=16, **kwargs)


def reference_greedy(path, prompt, n, *, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Greedy decoding over transformers' float32 logits with the penalties applied by the
    reference implementations (HF's processor for repetition, OpenAI's formula for the rest)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    seq, out = list(prompt), []
    for _ in range(n):
        row = _hf_logits(path, seq)  # raw logits: the repetition penalty is not shift-invariant
        for token, value in (bias or {}).items():
            row[token] += value
        if repetition != 1.0:
            row = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([seq]), row[None].clone())[0]
        row = reference_openai_penalties(row, out, presence, frequency)
        token = int(row.argmax())
        out.append(token)
        seq.append(token)
    return out


_LOGITS: dict = {}


def _hf_logits(path, seq):
    from transformers import AutoModelForCausalLM

    key = ("model", str(path))
    if key not in _LOGITS:
        _LOGITS[key] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return _LOGITS[key](torch.tensor([seq])).logits[0, -1].float()


def test_engine_greedy_with_penalties_equals_the_reference(tiny_model_dir):
    rng = random.Random(7)
    prompt_a = [rng.randrange(5, 1000) for _ in range(11)]
    prompt_b = [rng.randrange(5, 1000) for _ in range(5)] * 3  # repeated: the penalty bites
    cases = {
        "rep": (prompt_b, dict(repetition_penalty=1.8)),
        "rep-low": (prompt_a, dict(repetition_penalty=0.6)),
        "presence": (prompt_a, dict(presence_penalty=-2.0)),  # negative: repeats encouraged
        "freq": (prompt_b, dict(frequency_penalty=1.9, presence_penalty=-0.3)),
        "bias": (prompt_a, dict(logit_bias={11: 8.0, 12: 6.0}, repetition_penalty=1.2)),
        "plain": (prompt_a, dict()),
    }
    reqs = {
        name: Request(name, list(prompt), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                         logprobs=1, **kw))
        for name, (prompt, kw) in cases.items()
    }
    run(make_engine(tiny_model_dir, chunk=7), list(reqs.values()))  # batched together, chunked prefill
    for name, (prompt, kw) in cases.items():
        expected = reference_greedy(
            tiny_model_dir, prompt, 8, presence=kw.get("presence_penalty", 0.0),
            frequency=kw.get("frequency_penalty", 0.0), repetition=kw.get("repetition_penalty", 1.0),
            bias=kw.get("logit_bias"),
        )
        r = reqs[name]
        assert r.output_token_ids == expected, name
        # Logprobs stay the raw model distribution (the penalties change the pick only).
        seq = r.prompt_token_ids + r.output_token_ids
        for j, entry in enumerate(r.output_logprobs):
            raw = torch.log_softmax(_hf_logits(tiny_model_dir, seq[: len(prompt) + j]), dim=-1)
            assert abs(entry.logprob - raw[entry.token_id].item()) < 1e-4, (name, j)
            assert entry.top[0][0] == int(raw.argmax())
    # The penalties changed what was generated (the test would prove nothing otherwise).
    for name in ("rep", "presence", "freq", "bias"):
        plain = reference_greedy(tiny_model_dir, cases[name][0], 8)
        assert reqs[name].output_token_ids != plain, name


def test_engine_min_tokens_holds_back_eos(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    eos = engine.executor.eos_token_id
    assert eos is not None
    # The bias makes EOS the greedy pick at every step: min_tokens alone keeps it back.
    held = Request("held", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4,
                                                     logit_bias={eos: 100.0}))
    free = Request("free", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}))
    run(engine, [held, free])
    assert len(held.output_token_ids) == 5 and held.output_token_ids[-1] == eos
    assert eos not in held.output_token_ids[:4]
    assert free.output_token_ids == [eos] and free.finish_reason.value == "stop"


def test_penalties_random_batches_match_the_references():
    """Rows of different lengths (padding), repeated ids and empty outputs, mixed in a batch."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = random.Random(11)
    vocab = 64
    for trial in range(20):
        n = rng.randint(1, 9)
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(trial)) * 3
        params, histories = [], []
        for _ in range(n):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            output = [rng.randrange(8) for _ in range(rng.randint(0, 15))]  # few ids: many repeats
            params.append(SamplingParams(max_tokens=32, presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
                                         frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
                                         repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)])))
            histories.append(hist(prompt, output))
        out = apply_logits_processors(logits, params, histories)
        for i, (p, h) in enumerate(zip(params, histories)):
            row = logits[i : i + 1].clone()
            if p.repetition_penalty != 1.0:
                seq = torch.tensor([h.prompt_token_ids + h.output_token_ids])
                row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seq, row)
            expected = reference_openai_penalties(row[0], h.output_token_ids, p.presence_penalty, p.frequency_penalty)
            assert torch.allclose(out[i], expected, atol=1e-5), (trial, i)
