"""Trace loading, scaling and the synthetic traffic builder."""

from __future__ import annotations

import numpy as np
from pathlib import Path

import pytest

from tokenlane.bench import trace
from tokenlane.bench.trace import Burst, LaneMix, TrafficSpec, build_requests, load_trace, merge


def test_packaged_trace_matches_the_shared_csv():
    packaged = load_trace(trace.PACKAGED_TRACE)
    assert len(packaged) == 19366  # data rows (the README rounds to 19,365)
    assert trace.PACKAGED_TRACE.stat().st_size < 1_000_000
    assert packaged[0].arrival_s == 0.0
    prompts = np.array([r.prompt_tokens for r in packaged])
    outputs = np.array([r.output_tokens for r in packaged])
    # README of the trace: prompt p50 1020, max 14050; generated p50 129, max 1000.
    assert np.median(prompts) == pytest.approx(1020, abs=2)
    assert prompts.max() == 14050 and outputs.max() == 1000
    assert np.median(outputs) == pytest.approx(129, abs=2)
    shared = trace._repo_root() / trace._SHARED_RELATIVE
    if shared.exists():
        original = load_trace(shared)
        assert len(original) == len(packaged)
        for a, b in zip(original[::997], packaged[::997]):
            assert (a.prompt_tokens, a.output_tokens) == (b.prompt_tokens, b.output_tokens)
            assert a.arrival_s == pytest.approx(b.arrival_s, abs=1e-3)


def test_missing_trace_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,abc,3\n")
    with pytest.raises(ValueError, match="row 2"):
        load_trace(bad)


def test_time_scaling_compresses_arrivals_and_is_described():
    slow = build_requests(TrafficSpec(source="trace", duration_s=60, time_scale=1.0))
    fast = build_requests(TrafficSpec(source="trace", duration_s=60, time_scale=2.0))
    # Twice the speed-up: the same 60 s hold the first 120 s of the trace (about twice as many).
    assert 1.6 < len(fast.requests) / len(slow.requests) < 2.4
    assert max(r.arrival_s for r in fast.requests) < 60
    assert "time x2" in fast.describe()
    # The first requests are the same trace rows, arriving twice as early.
    assert fast.requests[5].arrival_s == pytest.approx(slow.requests[5].arrival_s / 2)
    assert fast.requests[5].prompt_tokens == slow.requests[5].prompt_tokens


def test_target_rate_and_length_scaling_and_clipping():
    t = build_requests(TrafficSpec(source="trace", duration_s=30, target_rate_rps=10, length_scale=0.1,
                                   output_length_scale=0.5, max_prompt_tokens=300, max_output_tokens=100))
    assert len(t.requests) == 300
    assert max(r.prompt_tokens for r in t.requests) <= 300
    assert max(r.max_tokens for r in t.requests) <= 100
    assert "output lengths x0.5" in t.describe()


def test_synthetic_is_deterministic_and_honours_shares():
    spec = dict(source="synthetic", duration_s=100, rate_rps=5, seed=7,
                lanes=[LaneMix("interactive", 3, "short", "short"), LaneMix("long-context", 1, "long", "short")],
                tenants=["a", "b"], stream_share=0.5, cancel_share=0.2, deadline_share=0.3,
                bursts=[Burst(start_s=50, duration_s=10, rate_rps=20)])
    a = build_requests(TrafficSpec(**spec)).requests
    b = build_requests(TrafficSpec(**spec)).requests
    assert a == b
    assert a != build_requests(TrafficSpec(**{**spec, "seed": 8})).requests
    n = len(a)
    assert 600 < n < 1100  # 500 steady + 200 burst, Poisson
    burst = sum(1 for r in a if 50 <= r.arrival_s < 60)
    assert burst > 3 * 50  # the burst window is denser than steady traffic
    inter = [r for r in a if r.lane == "interactive"]
    longc = [r for r in a if r.lane == "long-context"]
    assert 0.65 < len(inter) / n < 0.85
    assert np.median([r.prompt_tokens for r in longc]) > 10 * np.median([r.prompt_tokens for r in inter])
    assert {r.tenant for r in a} == {"a", "b"}
    assert all(r.stream for r in a if r.cancel_after_tokens is not None)  # only streams get cut
    assert all(1 <= r.cancel_after_tokens < r.max_tokens or r.max_tokens == 1
               for r in a if r.cancel_after_tokens is not None)
    assert 0.2 < sum(r.deadline_ms is not None for r in a) / n < 0.4
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)


def test_spec_validation():
    with pytest.raises(ValueError, match="source"):
        TrafficSpec(source="replay")
    with pytest.raises(ValueError, match="cancel_share"):
        TrafficSpec(cancel_share=1.5)
    with pytest.raises(ValueError, match="prompt class"):
        TrafficSpec(lanes=[LaneMix("x", prompt="huge")])
    with pytest.raises(ValueError, match="unknown key"):
        TrafficSpec.from_dict({"rate": 3})
    with pytest.raises(ValueError, match="either"):
        build_requests(TrafficSpec(source="trace", time_scale=2, target_rate_rps=3))
    spec = TrafficSpec.from_dict({"lanes": [{"lane": "batch", "share": 1}], "bursts": [{"start_s": 1, "duration_s": 2, "rate_rps": 3}]})
    assert spec.lanes[0].lane == "batch" and spec.bursts[0].rate_rps == 3


def test_merge_renumbers_in_arrival_order():
    a = build_requests(TrafficSpec(duration_s=10, rate_rps=2, seed=1, lanes=[LaneMix("x")]))
    b = build_requests(TrafficSpec(duration_s=10, rate_rps=2, seed=2, lanes=[LaneMix("y")]))
    m = merge(a, b)
    assert len(m.requests) == len(a.requests) + len(b.requests)
    assert [r.index for r in m.requests] == list(range(len(m.requests)))
    assert [r.arrival_s for r in m.requests] == sorted(r.arrival_s for r in m.requests)
    assert len({r.request_id for r in m.requests}) == len(m.requests)


def test_packaged_trace_is_package_data():
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    # In a real (non-symlinked) install the file exists only if package-data shipped it.
    assert trace.PACKAGED_TRACE.exists()
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["tokenlane.bench"]
    assert any(fnmatch.fnmatch(trace.PACKAGED_TRACE.name, p) for p in patterns)
