"""Percentiles, goodput, rejection accounting and the JSON/PNG outputs on known samples."""

from __future__ import annotations

import json

import pytest

from tokenlane.bench import report
from tokenlane.bench.report import LaneSLO, RequestRecord, RunResult


def rec(i, lane="a", outcome=report.OK, ttft=0.1, tpot=0.01, e2e=1.0, out=10, reason="", stream=True):
    return RequestRecord(index=i, lane=lane, tenant="t", arrival_s=float(i), prompt_tokens=100, max_tokens=out,
                         output_tokens=out if outcome == report.OK else 0, outcome=outcome, reason=reason,
                         ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, queue_delay_s=None if ttft is None else ttft / 2, stream=stream)


def test_percentiles_match_numpy_linear_interpolation():
    values = [float(v) for v in range(1, 101)]
    assert report.percentile(values, 50) == pytest.approx(50.5)
    assert report.percentile(values, 95) == pytest.approx(95.05)
    assert report.percentile(values, 99) == pytest.approx(99.01)
    assert report.percentile([], 50) is None


def test_goodput_counts_only_requests_meeting_every_slo():
    records = [rec(i, ttft=0.1 * (i + 1)) for i in range(10)]  # TTFT 0.1 .. 1.0 s
    records[0].tpot_s = 0.5  # fast first token but slow decode: misses the TPOT target
    records.append(rec(10, outcome=report.REJECTED, reason="queue_full", ttft=None, tpot=None, e2e=None))
    records.append(rec(11, outcome=report.REJECTED, reason="kv_watermark", ttft=None, tpot=None, e2e=None))
    records.append(rec(12, outcome=report.CANCELLED, ttft=0.05))
    records.append(rec(13, outcome=report.TIMEOUT, reason="queue_timeout", ttft=None, tpot=None, e2e=None))
    records.append(rec(14, ttft=None, stream=False, e2e=0.5))  # non-streamed: only E2E is judged
    result = RunResult("p", records, duration_s=10.0, slos={"a": LaneSLO(ttft_ms=500, tpot_ms=100)})
    s = report.summarize(result)["lanes"]["a"]
    # TTFT <= 0.5 s: i = 0..4, minus i=0 (TPOT), plus the non-streamed one -> 5 met.
    assert s["slo_met"] == 5
    assert s["goodput_rps"] == pytest.approx(0.5)
    assert s["rejections"] == {"queue_full": 1, "kv_watermark": 1}
    assert s["timeouts"] == {"queue_timeout": 1}
    assert s["cancellations"] == 1
    assert s["outcomes"][report.OK] == 11
    assert s["slo_attainment"] == pytest.approx(5 / 14)  # the cancelled request is not judged
    assert s["ttft_s"]["n"] == 10  # OK streamed requests with a first token
    assert s["output_tokens"] == 11 * 10


def test_compare_gives_ratios_against_the_baseline():
    fast = RunResult("fast", [rec(i, ttft=0.1) for i in range(10)], 10.0, {"a": LaneSLO(ttft_ms=200)})
    slow = RunResult("slow", [rec(i, ttft=0.1 if i < 2 else 1.0) for i in range(10)], 10.0, {"a": LaneSLO(ttft_ms=200)})
    sums = [report.summarize(fast), report.summarize(slow)]
    cmp = report.compare(sums)
    assert cmp["baseline"] == "slow"
    assert cmp["phases"]["fast"]["a"]["goodput"] == pytest.approx(5.0)
    assert cmp["phases"]["fast"]["a"]["ttft_p95"] == pytest.approx(0.1)
    text = report.format_table(sums) + report.format_ratios(cmp)
    assert "goodput   5.00x" in text


def test_write_all_produces_json_and_png(tmp_path):
    res = RunResult("only", [rec(i, lane=("a" if i % 2 else "b")) for i in range(20)], 20.0,
                    {"a": LaneSLO(ttft_ms=500)}, token_bins={0: 5, 1: 7, 3: 2})
    text, json_path, png = report.write_all(tmp_path, "x", [res], {"k": "v"}, "title")
    doc = json.loads(json_path.read_text())
    assert doc["meta"] == {"k": "v"}
    assert set(doc["phases"][0]["lanes"]) == {"a", "b"}
    assert doc["tokens_over_time"]["only"] == {"0": 5, "1": 7, "3": 2}
    assert len(doc["records"]["only"]) == 20
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "only" in text and "all" in text
