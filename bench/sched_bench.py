"""Scheduler CPU time per step: planning plus applying a step's results.

    python -m tokenlane.bench.sched_bench --json out.json

Steady state with R running sequences and 1,000 waiting requests across three lanes
(interactive / long-context / batch, different priorities and weights): every step the
scheduler plans (decodes for the running set, prefill chunks for newly started requests),
a trivial executor "samples" token 1 for every sampling chunk, and the scheduler applies the
results (token append, stop checks, block hashing for the prefix cache, finished requests
freed). Finished requests are replaced by new arrivals outside the timed region so the
queue stays at 1,000. The timed region is exactly `schedule()` + `update_from_output()`.

Target: median < 0.5 ms at 256 running / 1,000 waiting. Prints a table of
p50/p90/p99 per running-set size and writes JSON.

`--peer DIR` compares against another tree side by side: this benchmark and the peer's run
alternately in subprocesses (`--pairs` pairs, which goes first alternating), the peer with
`PYTHONPATH=DIR` (a folder holding its `tokenlane` package) and `--peer-module` (the tree
before the reorganisation, 86e4e93, has it at `tokenlane.runtime.bench.sched_bench`); it
prints each side's median p50 and the median of the per-pair ratios (this / peer), the figure
to trust on a busy machine.

`--recorder-running R` (default 256; 0 skips it) adds the flight recorder's cost: two whole
`LLMEngine`s over the same workload with the same trivial executor, both observed by the
Prometheus metrics as in the server, one also by a `FlightRecorder`; their steps alternate
(which goes first alternates too) so a busy machine slows both alike. It reports the CPU time
per `engine.step()` of each, and the time spent inside the recorder's `on_step` itself, as a
share of the recorder-off step (target: at most 2 %). Without a model the step is all CPU, so
the share of a real step, which adds the model's time, is smaller still.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from tokenlane.runtime.config import (
    EngineConfig,
    LaneConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.observability.flight_recorder import FlightRecorder
from tokenlane.runtime.observability.metrics import PrometheusMetrics
from tokenlane.runtime.core.step_plan import ExecutorOutput, StepPlan
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.core.scheduler import Scheduler

# CPU time of this thread: what the scheduler itself costs, not time other processes on a
# shared machine took from it (wall-clock percentiles are reported next to it).
cpu = time.thread_time

LANES = [
    ("interactive", 100, 4.0),
    ("long-context", 50, 2.0),
    ("batch", 10, 1.0),
]


def make_config(num_running: int, max_waiting: int) -> RuntimeConfig:
    return RuntimeConfig(
        model=ModelConfig(path="/bench", max_model_len=8192),
        engine=EngineConfig(block_size=16),
        scheduler=SchedulerConfig(
            max_active_sequences=num_running,
            max_waiting_requests=max_waiting * 2,
            max_batched_tokens=max(8192, 2 * num_running),
            prefill_chunk_size=512,
            queue_timeout_ms=10**9,
        ),
        lanes=[
            LaneConfig(name=name, priority=prio, weight=weight, default=(name == "interactive"),
                       max_waiting_requests=max_waiting * 2)
            for name, prio, weight in LANES
        ],
    )


class Workload:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_id = 0

    def request(self, now: float) -> Request:
        rng = self.rng
        self.next_id += 1
        lane, _, _ = rng.choice(LANES)
        prompt_len = rng.randint(32, 256)
        return Request(
            request_id=f"req-{self.next_id}",
            prompt_token_ids=[rng.randrange(3, 32000) for _ in range(prompt_len)],
            sampling_params=SamplingParams(max_tokens=rng.randint(16, 256), ignore_eos=True),
            lane=lane,
            arrival_time=now,
        )


def bench_point(num_running: int, num_waiting: int, steps: int, seed: int = 0, warmup: int = 300) -> dict:
    clock_now = [0.0]
    config = make_config(num_running, num_waiting)
    # Enough blocks that memory never binds: this measures the scheduler's own cost.
    num_blocks = num_running * 40 + 4096
    sched = Scheduler(config, num_blocks, 16, max_model_len=8192, clock=lambda: clock_now[0])
    work = Workload(seed)
    for _ in range(num_waiting + num_running):
        sched.add_request(work.request(clock_now[0]))

    def one_step(timed: bool) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), cpu()
        plan = sched.schedule()
        t1, c1 = time.perf_counter(), cpu()
        sampled = {c.request.request_id: 1 for c in plan.chunks if c.sample}  # trivial executor
        output = ExecutorOutput(sampled=sampled, step_seconds=0.0)
        t2, c2 = time.perf_counter(), cpu()
        sched.update_from_output(plan, output)
        t3, c3 = time.perf_counter(), cpu()
        # Keep the queue full: replace what finished (not timed).
        finished = sched.drain_finished()
        for _ in finished:
            sched.add_request(work.request(clock_now[0]))
        clock_now[0] += 0.02
        return (c1 - c0) + (c3 - c2), (t1 - t0) + (t3 - t2)

    # Warm up until the running set is full and mostly decoding.
    warm = 0
    while (sched.num_running < num_running or warm < warmup) and warm < 5000:
        one_step(False)
        warm += 1
    gc.collect()
    cpu_times, wall_times = [], []
    running_seen = []
    waiting_seen = []
    for _ in range(steps):
        cpu_s, wall_s = one_step(True)
        cpu_times.append(cpu_s)
        wall_times.append(wall_s)
        running_seen.append(sched.num_running)
        waiting_seen.append(sched.num_waiting)
    cpu_times.sort()
    wall_times.sort()
    times = cpu_times

    def pct(p: float, series: list[float] = cpu_times) -> float:
        return series[min(len(series) - 1, int(p / 100 * len(series)))] * 1000

    return {
        "running": num_running,
        "waiting": num_waiting,
        "steps": steps,
        "mean_running": statistics.mean(running_seen),
        "mean_waiting": statistics.mean(waiting_seen),
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "max_ms": times[-1] * 1000,
        "mean_ms": statistics.mean(times) * 1000,
        "wall_p50_ms": pct(50, wall_times),
        "wall_p90_ms": pct(90, wall_times),
        "wall_p99_ms": pct(99, wall_times),
        "us_per_running_seq_p50": pct(50) * 1000 / num_running,
        "preemptions": sched.num_preemptions_total,
    }


class TrivialExecutor:
    """Samples token 1 for every sampling chunk, at once: the engine's own CPU cost only."""

    block_size = 16
    eos_token_id = None
    max_model_len = 8192

    def __init__(self, num_kv_blocks: int) -> None:
        self.num_kv_blocks = num_kv_blocks

    def execute(self, plan: StepPlan) -> ExecutorOutput:
        return ExecutorOutput(sampled={c.request.request_id: 1 for c in plan.chunks if c.sample})


class TimedRecorder(FlightRecorder):
    """A FlightRecorder that adds up the CPU time of its own `on_step` calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cpu_s = 0.0

    def on_step(self, stats) -> None:
        c0 = cpu()
        super().on_step(stats)
        self.cpu_s += cpu() - c0


def recorder_overhead(num_running: int, num_waiting: int, steps: int, seed: int = 0, warmup: int = 300,
                      capacity: int = 4096) -> dict:
    """CPU time per engine step with and without the flight recorder, side by side."""
    # Every request goes through admission here: the queues hold the whole initial load.
    config = make_config(num_running, num_waiting + num_running)
    num_blocks = num_running * 40 + 4096
    clock_now = [0.0]
    engines, works, recorder = [], [], None
    for with_recorder in (False, True):
        engine = LLMEngine(config, TrivialExecutor(num_blocks), clock=lambda: clock_now[0])
        metrics = PrometheusMetrics(config.model.name)
        metrics.set_config(config)
        engine.add_observer(metrics)
        if with_recorder:
            recorder = TimedRecorder(capacity, config)
            engine.add_observer(recorder)
        work = Workload(seed)
        for _ in range(num_waiting + num_running):
            engine.add_request(work.request(clock_now[0]))
        engines.append(engine)
        works.append(work)
    assert recorder is not None

    def one_step(which: int) -> float:
        engine, work = engines[which], works[which]
        c0 = cpu()
        outputs = engine.step()
        spent = cpu() - c0
        for output in outputs:  # keep the queue full (not timed)
            if output.finished:
                engine.add_request(work.request(clock_now[0]))
        return spent

    warm = 0
    while (min(e.scheduler.num_running for e in engines) < num_running or warm < warmup) and warm < 5000:
        one_step(0)
        one_step(1)
        clock_now[0] += 0.02
        warm += 1
    gc.collect()
    recorder.cpu_s = 0.0
    off, on = [], []
    for i in range(steps):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            (on if which else off).append(one_step(which))
        clock_now[0] += 0.02
    mean_off, mean_on = statistics.mean(off), statistics.mean(on)
    on_step_us = recorder.cpu_s / steps * 1e6
    return {
        "running": num_running,
        "waiting": num_waiting,
        "steps": steps,
        "recorder_capacity": capacity,
        "recorded_steps": len(recorder),
        "off_mean_ms": mean_off * 1000,
        "on_mean_ms": mean_on * 1000,
        "off_p50_ms": statistics.median(off) * 1000,
        "on_p50_ms": statistics.median(on) * 1000,
        "recorder_on_step_us": on_step_us,
        "recorder_on_step_pct": on_step_us / (mean_off * 1e6) * 100,
        "on_minus_off_pct": (mean_on - mean_off) / mean_off * 100,
    }


def side_by_side(peer_path: str, peer_module: str, pairs: int, sizes: list[int], waiting: int, steps: int,
                 warmup: int) -> dict:
    """This tree's benchmark and a peer tree's, alternating in subprocesses: p50 per run, and
    per size the median of the per-pair ratios (this / peer)."""
    common = ["--sizes", ",".join(map(str, sizes)), "--waiting", str(waiting), "--steps", str(steps),
              "--warmup", str(warmup), "--recorder-running", "0"]
    peer_env = dict(os.environ, PYTHONPATH=peer_path)
    runs: dict[str, list[dict[int, float]]] = {"this": [], "peer": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            for side in ("peer", "this") if i % 2 == 0 else ("this", "peer"):
                out = os.path.join(tmp, f"{side}-{i}.json")
                module, env = (peer_module, peer_env) if side == "peer" else (__spec__.name, None)
                subprocess.run([sys.executable, "-m", module, *common, "--json", out], env=env, check=True,
                               cwd=tmp, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    runs[side].append({r["running"]: r["p50_ms"] for r in json.load(f)["results"]})
    rows = []
    for size in sizes:
        this = [r[size] for r in runs["this"]]
        peer = [r[size] for r in runs["peer"]]
        ratios = [a / b for a, b in zip(this, peer)]
        rows.append({"running": size, "this_p50_ms": this, "peer_p50_ms": peer, "ratios": ratios,
                     "this_median_ms": statistics.median(this), "peer_median_ms": statistics.median(peer),
                     "ratio_median": statistics.median(ratios)})
    return {"peer": peer_path, "peer_module": peer_module, "pairs": pairs, "steps": steps, "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--waiting", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--sizes", default="16,64,256,1024", help="running-set sizes")
    parser.add_argument("--warmup", type=int, default=300, help="untimed steps first")
    parser.add_argument("--target-ms", type=float, default=0.5)
    parser.add_argument("--recorder-running", type=int, default=256,
                        help="running-set size of the flight recorder on/off comparison (0: skip it)")
    parser.add_argument("--recorder-target-pct", type=float, default=2.0)
    parser.add_argument("--peer", metavar="DIR",
                        help="compare against the tree whose tokenlane package is in DIR (runs alternate)")
    parser.add_argument("--peer-module", default="tokenlane.bench.sched_bench",
                        help="the peer's benchmark module (86e4e93: tokenlane.runtime.bench.sched_bench)")
    parser.add_argument("--pairs", type=int, default=5, help="alternated run pairs with --peer")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.peer:
        if args.pairs < 1:
            parser.error("--pairs must be at least 1")
        report = side_by_side(args.peer, args.peer_module, args.pairs, sizes, args.waiting, args.steps, args.warmup)
        print(f"scheduler CPU time per step, p50 (thread CPU time): this tree against {args.peer}, "
              f"{args.pairs} alternated pairs of runs")
        print(f"{'running':>8} {'peer ms':>8} {'this ms':>8} {'this/peer':>10}  per pair")
        for row in report["results"]:
            print(f"{row['running']:>8} {row['peer_median_ms']:>8.3f} {row['this_median_ms']:>8.3f} "
                  f"{row['ratio_median']:>10.2f}  {' '.join(f'{r:.2f}' for r in row['ratios'])}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "scheduler_step_cpu_time_side_by_side", **report}, f, indent=2)
            print(f"wrote {args.json}")
        return 0
    results = []
    print("scheduler CPU time per step (schedule + update_from_output), thread CPU time; "
          "wall-clock p50/p99 alongside")
    print(f"{'running':>8} {'waiting':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'us/seq':>7} {'wall p50':>9} {'wall p99':>9}")
    for size in sizes:
        row = bench_point(size, args.waiting, args.steps, warmup=args.warmup)
        results.append(row)
        print(f"{row['running']:>8} {row['mean_waiting']:>8.0f} {row['p50_ms']:>8.3f} "
              f"{row['p90_ms']:>8.3f} {row['p99_ms']:>8.3f} {row['max_ms']:>8.3f} "
              f"{row['us_per_running_seq_p50']:>7.2f} {row['wall_p50_ms']:>9.3f} "
              f"{row['wall_p99_ms']:>9.3f}")
    target = next((r for r in results if r["running"] == 256), None)
    verdict = None
    if target is not None:
        verdict = target["p50_ms"] < args.target_ms
        print(f"\n256 running / {args.waiting} waiting: median {target['p50_ms']:.3f} ms "
              f"(target < {args.target_ms} ms): {'MET' if verdict else 'NOT MET'}")
    recorder = None
    if args.recorder_running > 0:
        recorder = recorder_overhead(args.recorder_running, args.waiting, args.steps, warmup=args.warmup)
        recorder["target_pct"] = args.recorder_target_pct
        recorder["target_met"] = recorder["recorder_on_step_pct"] <= args.recorder_target_pct
        print(f"\nflight recorder, {recorder['running']} running / {args.waiting} waiting: CPU time per "
              f"engine.step() (trivial executor, Prometheus metrics observing both)")
        print(f"{'recorder':>9} {'mean ms':>8} {'p50 ms':>8}")
        print(f"{'off':>9} {recorder['off_mean_ms']:>8.3f} {recorder['off_p50_ms']:>8.3f}")
        print(f"{'on':>9} {recorder['on_mean_ms']:>8.3f} {recorder['on_p50_ms']:>8.3f}")
        print(f"recorder on_step: {recorder['recorder_on_step_us']:.2f} us per step = "
              f"{recorder['recorder_on_step_pct']:.2f} % of the recorder-off step "
              f"(target <= {args.recorder_target_pct} %): {'MET' if recorder['target_met'] else 'NOT MET'}; "
              f"on - off: {recorder['on_minus_off_pct']:+.2f} % (noise included)")
    report = {
        "benchmark": "scheduler_step_cpu_time",
        "timed": "Scheduler.schedule() + Scheduler.update_from_output(), trivial executor output",
        "clock": "time.thread_time (CPU); wall_* = time.perf_counter",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "target_p50_ms_at_256": args.target_ms,
        "target_met": verdict,
        "results": results,
        "flight_recorder": recorder,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
