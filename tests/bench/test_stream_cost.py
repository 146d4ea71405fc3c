"""bench/stream_cost.py end to end: a real `tokenlane serve` (simulated executor) and raw-socket
streams; the event loop's CPU per token is measured, not asserted against a number."""

from __future__ import annotations

import json

from tokenlane.bench import stream_cost


def test_stream_cost_measures_the_loop_per_streamed_token(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert stream_cost.main(["--model", str(tiny_model_dir), "--streams", "4", "--rounds", "1", "--warmup", "0.5",
                             "--window", "1", "--json", str(out)]) == 0
    rounds = json.loads(out.read_text())["rounds"]
    assert len(rounds) == 1
    assert rounds[0]["tokens_per_s"] > 0 and rounds[0]["loop_cpu_us_per_token"] > 0
    assert 0 < rounds[0]["loop_cores"] <= 1.0 + 1e-6  # one thread's clock
    assert "loop CPU / token" in capsys.readouterr().out
