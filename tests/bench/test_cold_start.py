"""The cold-start benchmark's reading of the server log and its statistics (no timing)."""

from __future__ import annotations

import pytest

from tokenlane.bench.cold_start import ColdStart, format_table, main, parse_server_log, percentile, summarize
from tokenlane.runtime.core.startup import StartupPhase, summary_line

NATIVE = ("native CPU kernels loaded: level x86-64-v3, prebuilt, "
          "/venv/lib/python3.11/site-packages/tokenlane/kernels/_native/libtokenlane_cpu_x86-64-v3.so")


def server_log(total: float, phases: dict[str, float]) -> str:
    """A start-up log as `tokenlane serve` writes it (the lines come from the same helpers)."""
    stamp = "2026-12-03 13:41:31,951 INFO"
    lines = [f"{stamp} tokenlane.runtime.executor.model_executor: {NATIVE}"]
    lines += [f"{stamp} tokenlane.server: {StartupPhase(n, s, 'detail').log_line()}" for n, s in phases.items()]
    lines += ["INFO:     Application startup complete.",
              f"{stamp} tokenlane.server: {summary_line(total, [StartupPhase(n, s) for n, s in phases.items()])}",
              'INFO:     127.0.0.1:37160 - "GET /ready HTTP/1.1" 200 OK']
    return "\n".join(lines) + "\n"


def test_parse_server_log_reads_the_summary_and_the_native_line():
    phases = {"import": 1.5, "config": 0.0, "tokenizer": 0.93, "load": 0.04, "kv": 0.01, "warmup": 0.0,
              "engine": 0.05, "serve": 0.31}
    total, parsed, native = parse_server_log(server_log(2.84, phases))
    assert total == 2.84
    assert parsed == phases and list(parsed) == list(phases)
    assert native == NATIVE


def test_parse_server_log_without_a_summary():
    """A server that died before ready, or a log from another server: nothing invented."""
    assert parse_server_log("INFO: something else\n") == (None, {}, "")


def test_percentile_interpolates_between_ranks():
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([5.0, 1.0, 4.0, 2.0, 3.0], 90) == pytest.approx(4.6)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_orders_phases_and_skips_what_a_run_lacks():
    runs = [
        ColdStart(3.0, 2.5, 2.9, {"serve": 0.3, "import": 1.0, "load": 0.2}),
        ColdStart(4.0, None, None, {"import": 2.0, "load": 0.4, "engine": 0.5}),
        ColdStart(5.0, 3.5, 4.9, {"import": 3.0, "load": 0.6, "serve": 0.5}),
    ]
    summary = summarize(runs)
    assert list(summary) == ["ready (HTTP poll)", "server CPU to ready", "ready (server log)", "import", "load",
                             "engine", "serve"]
    assert summary["ready (HTTP poll)"]["median"] == 4.0 and summary["ready (HTTP poll)"]["runs"] == 3
    assert summary["server CPU to ready"]["runs"] == 2 and summary["server CPU to ready"]["median"] == 3.0
    assert summary["engine"] == {"median": 0.5, "p90": 0.5, "min": 0.5, "max": 0.5, "runs": 1}
    table = format_table(summary).splitlines()
    assert table[0].split() == ["phase", "median", "s", "p90", "s", "min", "s", "max", "s", "runs"]
    assert table[1].split()[-5:] == ["4.00", "4.80", "3.00", "5.00", "3"]


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--runs", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert main(["--runs", "1", "--model", str(tmp_path), "--out", str(tmp_path), "--set", "nonsense"]) == 2
    assert "section.key=value" in capsys.readouterr().err
