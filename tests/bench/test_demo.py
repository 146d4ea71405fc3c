"""`tokenlane demo` end to end with a tiny load (the full default run is marked slow)."""

from __future__ import annotations

import json

import pytest

from tokenlane.bench import demo


def _check(out, code, printed):
    assert code == 0
    doc = json.loads((out / "demo.json").read_text())
    phases = {p["name"]: p for p in doc["phases"]}
    assert set(phases) == {"continuous", "static"}
    for p in phases.values():
        assert set(p["lanes"]) <= {"interactive", "long-context", "batch"}
        assert "interactive" in p["lanes"]
        assert p["all"]["outcomes"]["error"] == 0
    assert (out / "demo.png").stat().st_size > 10_000
    assert "static" in doc["comparison"]["baseline"]
    assert "ratios vs 'static'" in printed and "chart:" in printed
    # Each phase's server was stopped with SIGTERM and exited cleanly: the exit status the
    # demo printed is the server process's own (0 only after a graceful drain).
    for name in ("continuous", "static"):
        (stopped,) = [line for line in printed.splitlines() if line.startswith(f"[{name}]") and "SIGTERM" in line]
        assert "server stopped with SIGTERM (exit 0," in stopped, stopped


def test_demo_smoke(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "demo"
    code = demo.main(["--out", str(out), "--duration", "3", "--model-dir", str(tiny_model_dir), "--no-progress"])
    _check(out, code, capsys.readouterr().out)


@pytest.mark.slow
def test_full_demo(tmp_path, capsys):
    out = tmp_path / "demo"
    code = demo.main(["--out", str(out), "--no-progress"])
    _check(out, code, capsys.readouterr().out)
