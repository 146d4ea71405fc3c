"""The scheduler benchmark runs end to end (tiny sizes; speed is reported, never asserted)."""

from __future__ import annotations

import json

import pytest

from tokenlane.bench import sched_bench


def test_sched_bench_writes_json(tmp_path, capsys):
    out = tmp_path / "sched.json"
    assert sched_bench.main(["--sizes", "16,32", "--steps", "30", "--waiting", "40", "--warmup", "20",
                             "--recorder-running", "24", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["running"] for r in rows] == [16, 32]
    for row in rows:
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert row["mean_running"] > 0.8 * row["running"]  # steady state really had them running
        assert row["mean_waiting"] >= 40
    recorder = report["flight_recorder"]
    assert recorder["running"] == 24 and recorder["steps"] == 30
    assert recorder["recorded_steps"] >= 30  # warm-up steps are recorded too
    assert recorder["off_mean_ms"] > 0 and recorder["on_mean_ms"] > 0 and recorder["recorder_on_step_us"] > 0
    assert recorder["recorder_on_step_pct"] == pytest.approx(recorder["recorder_on_step_us"] / (recorder["off_mean_ms"] * 10))
    printed = capsys.readouterr().out
    assert "p50 ms" in printed and "flight recorder, 24 running" in printed


def test_sched_bench_side_by_side_with_a_peer_tree(tmp_path, capsys):
    """`--peer`: this tree's runs and the peer's alternate in subprocesses (here the peer is
    this same tree); each size gets both sides' p50 per run and the per-pair ratios."""
    import os

    import tokenlane

    peer = os.path.dirname(os.path.dirname(os.path.abspath(tokenlane.__file__)))  # holds tokenlane/
    out = tmp_path / "side.json"
    assert sched_bench.main(["--peer", peer, "--pairs", "2", "--sizes", "8,16", "--steps", "20", "--waiting", "30",
                             "--warmup", "10", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["pairs"] == 2 and report["peer"] == peer
    rows = report["results"]
    assert [r["running"] for r in rows] == [8, 16]
    for row in rows:
        assert len(row["this_p50_ms"]) == len(row["peer_p50_ms"]) == len(row["ratios"]) == 2
        assert all(v > 0 for v in row["this_p50_ms"] + row["peer_p50_ms"])
        assert row["ratios"] == pytest.approx([a / b for a, b in zip(row["this_p50_ms"], row["peer_p50_ms"])])
    printed = capsys.readouterr().out
    assert "this/peer" in printed and "2 alternated pairs" in printed
