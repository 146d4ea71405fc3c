"""The sampler: greedy, temperature, top-k, top-p and per-request seeds, batched."""

from __future__ import annotations

import pytest
import torch

from tokenlane.runtime.core.request import SamplingParams
from tokenlane.runtime.executor.sampler import Sampler, apply_top_k_top_p, make_generator


def sample_many(sampler, logits_row, params, n, seed=None):
    logits = logits_row.expand(n, -1).clone()
    gens = [make_generator(seed + i) if seed is not None else None for i in range(n)]
    return torch.tensor(sampler(logits, [params] * n, gens))


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    s = Sampler()
    expected = logits.argmax(-1).tolist()
    assert s(logits, [SamplingParams(temperature=0.0)] * 8, [None] * 8) == expected
    assert s(logits, [SamplingParams(temperature=1.0, top_k=1)] * 8, [None] * 8) == expected


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    s = Sampler(seed=1)
    for temp in (0.5, 1.0, 2.0):
        draws = sample_many(s, logits, SamplingParams(temperature=temp), 20000)
        freq = torch.bincount(draws, minlength=4).float() / len(draws)
        expected = torch.softmax(logits / temp, -1)
        assert torch.allclose(freq, expected, atol=0.015), (temp, freq, expected)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -2.0])
    s = Sampler(seed=2)
    draws = sample_many(s, logits, SamplingParams(temperature=1.0, top_k=2), 3000)
    assert set(draws.tolist()) == {0, 1}
    probs = torch.softmax(logits, -1)  # [0.48, 0.29, 0.18, ...]: top_p=0.7 keeps 0 and 1
    draws = sample_many(s, logits, SamplingParams(temperature=1.0, top_p=0.7), 3000)
    assert set(draws.tolist()) == {0, 1}
    assert probs[:2].sum() > 0.7 > probs[:1].sum()
    # Both: top-p applies to the top-k renormalized distribution ([0.51, 0.31, 0.19]),
    # so top_p=0.5 keeps only the first token.
    draws = sample_many(s, logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5), 2000)
    assert set(draws.tolist()) == {0}
    draws = sample_many(s, logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6), 2000)
    assert set(draws.tolist()) == {0, 1}


def test_apply_top_k_top_p_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isinf(out[0, :3]).all() and out[0, 3] == 4.0
    assert torch.equal(out[1], logits[1])  # top_k=0 is off


def test_seeded_rows_do_not_depend_on_batch_partners():
    torch.manual_seed(0)
    row = torch.randn(1, 100)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42)
    s = Sampler(seed=0)

    def run(extra_rows):
        gen = make_generator(42)
        out = []
        for _ in range(10):
            logits = torch.cat([torch.randn(extra_rows, 100), row]) if extra_rows else row
            ps = [SamplingParams(temperature=1.0)] * extra_rows + [params]
            out.append(s(logits, ps, [None] * extra_rows + [gen])[-1])
        return out

    assert run(0) == run(5) == run(2)
    other = make_generator(43)
    assert [s(row, [params], [other])[0] for _ in range(10)] != run(0)


def test_mixed_batch_greedy_rows_stay_greedy():
    torch.manual_seed(1)
    logits = torch.randn(6, 30)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 3
    out = Sampler(seed=3)(logits, params, [None] * 6)
    for i in (0, 2, 4):
        assert out[i] == logits[i].argmax().item()
    assert all(0 <= t < 30 for t in out)


@pytest.mark.parametrize("bad", [dict(top_p=0.0), dict(top_k=-1), dict(temperature=-1.0)])
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature):
    """logits / 1e-40 overflows to inf and softmax(inf) is NaN, whose argmax is token 0."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=temperature)] * 2 + [SamplingParams(temperature=1.0, seed=1)]
    tokens = Sampler()(logits, params, [None, None, make_generator(1)])
    assert tokens[:2] == logits.argmax(dim=-1).tolist()[:2]
