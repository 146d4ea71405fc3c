"""Cold start of `tokenlane serve`: process start to `/ready`, phase by phase.

    python -m tokenlane.bench.cold_start --runs 5 [--model DIR] [--set engine.coreProcess=true]

Starts `tokenlane serve` `--runs` times, one after the other, on a checkpoint already on disk
(a cache hit: `--model`, or a tiny random-weight model built once under `--out` before the
first run, not timed). Each run measures the wall time from just before the process is
spawned to the first 200 from `/ready` (polled every 20 ms over loopback), the CPU time the
server process used until then (user + system, from /proc: less sensitive to other load on
the host than the wall time), and reads the phases the server's start-up log states
(`startup: ready in ...`, runtime/core/startup.py). It also keeps the native CPU kernels'
log line, which says whether the library was prebuilt or compiled at start.

Prints a table (median and p90 per phase over the runs) and writes JSON. Target: `/ready`
within 5 s on a 2-core host, quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from tokenlane.runtime.core.startup import PHASES, parse_summary

READY_POLL_S = 0.02
_NATIVE = re.compile(r"native CPU kernels[^\n]*")


@dataclass
class ColdStart:
    """One start: what the poller saw and what the server's log says."""

    ready_s: float  # spawn to the first 200 from /ready (this process's clock)
    cpu_s: Optional[float]  # the server's user + system CPU seconds until then (None: not Linux)
    log_total_s: Optional[float]  # the server's own "ready in" (from its process start)
    phases: dict[str, float] = field(default_factory=dict)
    native: str = ""  # the native kernels' log line ("" when the log has none)


def parse_server_log(text: str) -> tuple[Optional[float], dict[str, float], str]:
    """(the summary's total, {phase: seconds}, the native kernels' line) of a server log."""
    summary = parse_summary(text)
    native = _NATIVE.search(text)
    total, phases = summary if summary else (None, {})
    return total, phases, native.group(0).strip() if native else ""


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(runs: list[ColdStart]) -> dict[str, dict[str, float]]:
    """{row: {median, p90, min, max}} for /ready, the CPU time, the log's total and each phase
    (in start-up order; a phase only some runs had is summarized over those)."""
    rows: dict[str, list[float]] = {"ready (HTTP poll)": [r.ready_s for r in runs]}
    cpu = [r.cpu_s for r in runs if r.cpu_s is not None]
    if cpu:
        rows["server CPU to ready"] = cpu
    totals = [r.log_total_s for r in runs if r.log_total_s is not None]
    if totals:
        rows["ready (server log)"] = totals
    names = [p for p in PHASES if any(p in r.phases for r in runs)]
    names += sorted({p for r in runs for p in r.phases} - set(names))
    for name in names:
        rows[name] = [r.phases[name] for r in runs if name in r.phases]
    return {name: {"median": percentile(v, 50), "p90": percentile(v, 90), "min": min(v), "max": max(v),
                   "runs": len(v)} for name, v in rows.items()}


def format_table(summary: dict[str, dict[str, float]]) -> str:
    lines = [f"{'phase':<22} {'median s':>9} {'p90 s':>8} {'min s':>8} {'max s':>8} {'runs':>5}"]
    for name, row in summary.items():
        lines.append(f"{name:<22} {row['median']:>9.2f} {row['p90']:>8.2f} {row['min']:>8.2f} "
                     f"{row['max']:>8.2f} {row['runs']:>5d}")
    return "\n".join(lines)


def _cpu_seconds(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def start_once(config_path: Path, log_path: Path, port: int, timeout_s: float = 120.0) -> ColdStart:
    """Spawn `tokenlane serve`, wait for /ready, stop it (SIGTERM, drained), parse its log."""
    import httpx

    url = f"http://127.0.0.1:{port}/ready"
    command = [sys.executable, "-m", "tokenlane.cli", "serve", "--config", str(config_path), "--host",
               "127.0.0.1", "--port", str(port), "--log-level", "info", "--shutdown-grace-seconds", "1"]
    with open(log_path, "wb") as log, httpx.Client(timeout=2.0, trust_env=False) as http:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = started + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"tokenlane serve exited with {proc.returncode}:\n"
                                       + log_path.read_text(errors="replace")[-3000:])
                try:
                    if http.get(url).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"tokenlane serve not ready after {timeout_s:g} s")
                time.sleep(READY_POLL_S)
            ready_s = time.perf_counter() - started
            cpu_s = _cpu_seconds(proc.pid)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    total, phases, native = parse_server_log(log_path.read_text(errors="replace"))
    return ColdStart(ready_s, cpu_s, total, phases, native)


def main(argv: Optional[list[str]] = None) -> int:
    from tokenlane.bench.serve_proc import free_port, parse_override, set_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="starts to measure (default 5)")
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (default: a tiny random-weight model built under --out once)")
    parser.add_argument("--set", action="append", default=[], metavar="section.key=value",
                        help="a runtime.yaml override, e.g. engine.coreProcess=true (repeatable)")
    parser.add_argument("--out", default="out/bench", help="output folder (default out/bench)")
    parser.add_argument("--stem", default="cold-start", help="JSON file name stem (default cold-start)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else out / "cold-start-tiny-model"
    if not args.model and not (model / "config.json").is_file():
        from tokenlane.runtime.executor.tiny_model import make_tiny_model

        make_tiny_model(model)  # the cache hit the runs measure: built before, not timed
    config: dict = {"model": {"path": str(model.resolve()), "servedName": "cold-start"},
                    "engine": {"kvCacheBlocks": 256}}
    try:
        for text in args.set:
            set_path(config, *parse_override(text))
    except ValueError as exc:
        print(f"cold_start: {exc}", file=sys.stderr)
        return 2
    config_path = out / f"{args.stem}.runtime.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    runs: list[ColdStart] = []
    for i in range(args.runs):
        run = start_once(config_path, out / f"{args.stem}.run{i}.log", free_port())
        runs.append(run)
        print(f"run {i + 1}/{args.runs}: ready in {run.ready_s:.2f} s"
              + (f", server CPU {run.cpu_s:.2f} s" if run.cpu_s is not None else ""), flush=True)
    summary = summarize(runs)
    print(f"\ncold start of tokenlane serve, {args.runs} runs, model {model} (already on disk), "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end")
    print(format_table(summary))
    natives = sorted({r.native for r in runs})
    print("native kernels: " + ("; ".join(n for n in natives if n) or "no log line (not a CPU model run)"))
    target = summary["ready (HTTP poll)"]["median"]
    print(f"target: /ready within 5 s; median {target:.2f} s: {'met' if target <= 5.0 else 'missed'}")
    report = {
        "command": "python -m tokenlane.bench.cold_start " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "config": config,
        "summary": summary,
        "native": natives,
        "runs": [asdict(r) for r in runs],
    }
    path = out / f"{args.stem}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
