"""The scheduler benchmark runs end to end (tiny sizes; speed is reported, never asserted)."""

from __future__ import annotations

import json

from tokenlane.runtime.bench import sched_bench


def test_sched_bench_writes_json(tmp_path, capsys):
    out = tmp_path / "sched.json"
    assert sched_bench.main(["--sizes", "16,32", "--steps", "30", "--waiting", "40", "--warmup", "20",
                             "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["running"] for r in rows] == [16, 32]
    for row in rows:
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert row["mean_running"] > 0.8 * row["running"]  # steady state really had them running
        assert row["mean_waiting"] >= 40
    assert "p50 ms" in capsys.readouterr().out
