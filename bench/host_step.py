"""The host's share of an engine step: everything but the forward pass, on the CPU clock.

    python -m tokenlane.bench.host_step                          # 64 decodes, this tree
    python -m tokenlane.bench.host_step --peer /tmp/before       # against another tree
    python -m tokenlane.bench.host_step --running 16 64 256 --json out.json

An `LLMEngine` with the real `ModelExecutor` (the generated 19M Llama of `step_profile`, float32;
`--model DIR` for another checkpoint) runs N sequences to steady decoding; then the model's
forward pass is replaced by a stub that hands back a token per row, so a step is only the
host's work: the scheduler, the flat batch,
the executor's checks, the outputs, the step report, and the Prometheus metrics and flight
recorder the server attaches. Each step's thread CPU time is measured two ways:
  warm   steps back to back: the host's code and data stay in the caches;
  cold   between steps the stub sweeps `--sweep-mib` of memory (32 MiB: the 19M model's
         weights), as a forward pass does, and its own time is left out: closer to a served
         step, where the host's Python meets caches the forward pass emptied;
and, with the real forward pass back (on torch's threads as the engine sets them up):
  whole  the whole step's wall time, to see what the host's share is worth in a step.
`--cases` picks among them.

`--peer DIR` (a folder holding another tree's `tokenlane` package, e.g. a `pip install
--target` or a copy of site-packages/tokenlane) loads that tree too, in the same process under
another package name (a copy whose imports are renamed), and alternates blocks of steps of the
two engines, which goes first alternating: a busy host slows both alike, so the per-block ratio
(this tree / peer) is the figure to read. Its median and the two medians are printed per case.

Served, the same work also waits for the GIL while the event loop writes the streams; that
and the forward pass are `step_profile --http`'s. This one isolates the CPU time the step
thread's own code costs, with the spread of a busy host mostly cancelled.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from tokenlane.bench.host import host_info, host_line

PEER_PACKAGE = "tokenlane_peer"


def load_peer(folder: str, workdir: Path) -> str:
    """Copy `folder`/tokenlane to `workdir`/tokenlane_peer with its own imports renamed; the
    package name to import it by."""
    source = Path(folder) / "tokenlane"
    if not (source / "__init__.py").is_file():
        raise ValueError(f"--peer {folder!r} holds no tokenlane package (no tokenlane/__init__.py)")
    target = workdir / PEER_PACKAGE
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    pattern = re.compile(r"\btokenlane(?=\.|\s+import\b|$)", re.MULTILINE)
    for path in target.rglob("*.py"):
        text = path.read_text()
        # Module paths only ("tokenlane.x", "from tokenlane import", "import tokenlane"); the
        # metric prefix "tokenlane_" and names like "tokenlane-step" are not imports.
        renamed = pattern.sub(PEER_PACKAGE, text)
        if renamed != text:
            path.write_text(renamed)
    sys.path.insert(0, str(workdir))
    return PEER_PACKAGE


class HostOnlyEngine:
    """One tree's engine at steady decoding, its forward pass a stub (see the module doc)."""

    def __init__(self, package: str, model_dir: Optional[str], running: int, sweep_mib: int) -> None:
        import torch

        step_profile = importlib.import_module(f"{package}.bench.step_profile")
        config_module = importlib.import_module(f"{package}.runtime.config")
        request_module = importlib.import_module(f"{package}.runtime.core.request")
        LLMEngine = importlib.import_module(f"{package}.runtime.engine.llm_engine").LLMEngine
        ModelExecutor = importlib.import_module(f"{package}.runtime.executor.model_executor").ModelExecutor
        PrometheusMetrics = importlib.import_module(f"{package}.runtime.observability.metrics").PrometheusMetrics
        FlightRecorder = importlib.import_module(f"{package}.runtime.observability.flight_recorder").FlightRecorder
        c = config_module
        config = c.RuntimeConfig(
            model=c.ModelConfig(path=str(step_profile.ensure_model(model_dir)), dtype="float32"),
            engine=c.EngineConfig(block_size=16, device="cpu"),
            scheduler=c.SchedulerConfig(max_active_sequences=running + 1, max_waiting_requests=4096,
                                        max_batched_tokens=2048, prefill_chunk_size=512,
                                        queue_timeout_ms=3_600_000),
        )
        engine = LLMEngine(config, ModelExecutor(config), tokenizer=None, clock=time.perf_counter)
        # As long as the model allows past the longest prompt (512 tokens): the warm-up and
        # every measured step.
        max_tokens = engine.max_model_len - 512
        for i, prompt in enumerate(step_profile.make_prompts(running, engine.vocab_size)):
            engine.add_request(request_module.Request(
                f"r{i}", prompt, request_module.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
        for _ in range(400):  # prefill (with the real model) until every sequence decodes
            engine.step()
            if len(engine.scheduler.running) == running and all(r.num_output_tokens > 0 for r in engine.scheduler.running):
                break
        else:
            raise RuntimeError(f"{package}: {running} sequences did not all reach decoding")
        metrics = PrometheusMetrics(config.model.name)
        metrics.set_config(config)
        engine.add_observer(metrics)
        engine.add_observer(FlightRecorder(config=config))
        self.sweep = torch.ones(sweep_mib * 2**20 // 4)
        self.case = "warm"
        self.stub_seconds = 0.0
        model_forward = engine.executor._forward

        def forward(input_ids, positions, meta, logits_indices, argmax_only=False):
            if self.case == "whole":
                return model_forward(input_ids, positions, meta, logits_indices, argmax_only)
            if self.case == "cold":
                t0 = time.thread_time()
                self.sweep.add_(1.0)
                self.stub_seconds += time.thread_time() - t0
            return torch.full((logits_indices.shape[0],), 7, dtype=torch.int64)

        engine.executor._forward = forward
        self.engine = engine
        self.steps_left = max_tokens - max(r.num_output_tokens for r in engine.scheduler.running)
        self.block(30)  # the stub's first steps (allocations, caches)

    def block(self, steps: int) -> float:
        """µs per step over `steps` steps: thread CPU time with the stub (its own sweep left
        out), wall time with the real forward pass."""
        if steps > self.steps_left:
            raise RuntimeError("the sequences would finish: fewer --blocks or --block-steps")
        self.steps_left -= steps
        self.stub_seconds = 0.0
        clock = time.perf_counter if self.case == "whole" else time.thread_time
        t0 = clock()
        for _ in range(steps):
            self.engine.step()
        return 1e6 * (clock() - t0 - self.stub_seconds) / steps


CASES = ("warm", "cold", "whole")


def measure(packages: list[tuple[str, str]], model_dir: Optional[str], running: int, blocks: int, block_steps: int,
            sweep_mib: int, cases: tuple[str, ...] = CASES) -> dict[str, Any]:
    import torch

    threads = torch.get_num_threads()
    engines = {name: HostOnlyEngine(package, model_dir, running, sweep_mib) for name, package in packages}
    names = list(engines)
    samples: dict[str, dict[str, list[float]]] = {case: {name: [] for name in names} for case in cases}
    for b in range(blocks):
        order = names if b % 2 == 0 else names[::-1]
        for case in cases:
            # The host's work is one thread's, the sweep too; the forward pass takes torch's threads.
            torch.set_num_threads(threads if case == "whole" else 1)
            for name in order:
                engine = engines[name]
                engine.case = case
                samples[case][name].append(engine.block(block_steps))
    torch.set_num_threads(threads)
    result: dict[str, Any] = {"running": running, "blocks": blocks, "block_steps": block_steps, "sweep_mib": sweep_mib}
    for case, per_name in samples.items():
        row: dict[str, Any] = {name: {"median_us": statistics.median(v), "min_us": min(v), "blocks_us": v}
                               for name, v in per_name.items()}
        if len(names) == 2:
            ratios = [a / b for a, b in zip(per_name[names[0]], per_name[names[1]])]
            row["ratio_median"] = statistics.median(ratios)
            row["ratio_range"] = [min(ratios), max(ratios)]
        result[case] = row
    return result


def format_table(results: list[dict[str, Any]], names: list[str]) -> str:
    head = ["running", "case"] + [f"{n} median (min) µs/step" for n in names]
    if len(names) == 2:
        head += [f"{names[0]} / {names[1]}, median (range)"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in results:
        for case in CASES:
            if case not in r:
                continue
            row = r[case]
            cells = [str(r["running"]), case] + [f"{row[n]['median_us']:.1f} ({row[n]['min_us']:.1f})" for n in names]
            if len(names) == 2:
                lo, hi = row["ratio_range"]
                cells.append(f"{row['ratio_median']:.3f} ({lo:.2f}-{hi:.2f})")
            lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenlane.bench.host_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64], help="running sequences (default 64)")
    parser.add_argument("--peer", help="a folder holding another tree's tokenlane package, run alongside")
    parser.add_argument("--model", help="a checkpoint folder (default: the generated 19M Llama of step_profile)")
    parser.add_argument("--blocks", type=int, default=20, help="alternated blocks of steps per case (default 20)")
    parser.add_argument("--block-steps", type=int, default=40, help="steps per block (default 40)")
    parser.add_argument("--sweep-mib", type=int, default=32, help="memory the cold case sweeps between steps")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="default: all three")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if min(args.running) < 1 or args.blocks < 1 or args.block_steps < 1 or args.sweep_mib < 1:
        parser.error("--running, --blocks, --block-steps and --sweep-mib must be at least 1")
    packages = [("this", "tokenlane")]
    with tempfile.TemporaryDirectory(prefix="tokenlane-host-step-") as workdir:
        if args.peer:
            try:
                packages.append(("peer", load_peer(args.peer, Path(workdir))))
            except ValueError as exc:
                parser.error(str(exc))
        info = host_info()
        print(host_line(info))
        results = [measure(packages, args.model, n, args.blocks, args.block_steps, args.sweep_mib, tuple(args.cases))
                   for n in args.running]
    names = [name for name, _ in packages]
    print(format_table(results, names))
    if args.json:
        Path(args.json).write_text(json.dumps({"host": info, "peer": args.peer, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
