"""Where one engine step's time goes, offline and behind the HTTP server.

    python -m tokenlane.bench.step_profile                       # offline, N=64, fp32
    python -m tokenlane.bench.step_profile --running 16 64 --dtype float32 bfloat16
    python -m tokenlane.bench.step_profile --http --cpu-threads 1 2   # alternated
    python -m tokenlane.bench.step_profile --http --step-loop thread process
    python -m tokenlane.bench.step_profile --http --step-loop thread process --cpu-bind 0
    python -m tokenlane.bench.step_profile --attention-backend torch native --rounds 2
    python -m tokenlane.bench.step_profile --http --isa-cap avx2          # the AVX2 code, CAPPED
    python -m tokenlane.bench.step_profile --json out.json

Offline, an `LLMEngine` with a `ModelExecutor` runs N sequences (prompts U[16, 512] tokens
from random.Random(0)) to steady state, then two cases are timed:
  decode   N running decodes, no prefill;
  mixed    N-1 running decodes plus one 128-token prefill chunk every step.
Each phase is timed by wrapping the engine's own methods on the instance (nothing in the
engine changes): schedule, prepare inputs (the executor's step less its forward pass and
sampling: block copies, input checks, building the flat batch, whose own part,
`BatchInputBuilder.build`, is shown below it as "of it: build batch"), forward split into
attention (each layer's `self_attn` less its projections), linear layers (every
`nn.Linear` but the LM head), LM head, other (embedding, norms, rotary, residuals); sample
(grammar masks, sampler), update (`Scheduler.update_from_output`), outputs (token ids and
final statuses: `LLMEngine._outputs`), engine other (the rest of `step()`: staged requests,
tenant charges, step report). The engine does not detokenize: offline, text is not made at all.

`--http` runs a real `tokenlane serve` (uvicorn) in a subprocess, instrumented the same
way, and N concurrent streaming clients (the official openai SDK, token-id prompts,
`ignore_eos`). It adds: loop gap (the step thread idle between two steps: a hand-off from the
event loop, or the GIL while the loop serves the streams), output dispatch (the loop's
`_dispatch` of the step's outputs: detokenization, stop strings, the request streams; on the
event loop, alongside the next step), the event loop's CPU seconds per
step (main-thread CPU clock: SSE framing and HTTP for every stream) and the step thread's
CPU share of its wall time (below 1: it waited for the GIL or a core), and the host CPU per
step: the step thread's CPU outside the forward pass plus the event loop's. Where the loop's
burst meets the step thread moves a wait for the GIL from one phase to another (and the host
overhead share with it); the host CPU stays. `--cpu-threads`
values run alternately (A B A B ...) with `engine.cpuThreads` set, for side-by-side ratios.
`--step-loop process` serves with `engine.coreProcess: true`: the recorder then sits in the
engine core process, loop gap is the core's time between steps, of which output dispatch is
its hand-off of a step's outputs (pickle, queue for its writer thread), and the event loop's
CPU is not measured (another process), nor the host CPU. `--cpu-bind` sets
`engine.cpuBind` for every server (e.g. `0`: one compute thread pinned to CPU 0, the server
on the other CPUs).
`--responses stream whole` alternates streamed responses with whole ones (`stream: false`):
the same decode steps without the event loop's per-token work, so the difference is what
streaming costs the step (no inter-token time then). Under "build batch", "its CPU time" is
the step thread's CPU clock: the rest of the phase it waited for the GIL or a core.

"Host overhead" is everything but the forward pass: schedule + prepare inputs + sample +
update + outputs + engine other + loop gap, as a share of the step cycle (start of one step
to the start of the next), per step, then the median over the case's steps.

The model is generated (the 19M-parameter random Llama: vocab 32000, hidden 256,
intermediate 688, 4 layers, 8 heads, 4 KV heads) with tokenlane's trained byte-level BPE
tokenizer (about 10k tokens: ids past it decode to no text, so detokenization costs a
little less than with a full vocabulary) unless `--model DIR` names one; `--http` needs a
tokenizer there. On a shared host compare columns of one run, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from tokenlane.bench.host import ISA_CAPS, host_info, isa_cap_refusal, host_line, load_1m

MODEL_KW = dict(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4,
                vocab_size=32000, max_position_embeddings=4096)
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "tokenlane-step-profile-m19"
MIXED_CHUNK = 128  # prefill chunk of the mixed case
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# Phases of one step, in table order. FORWARD_PHASES add up to the forward pass.
FORWARD_PHASES = ("attention", "linear", "lm_head", "forward_other")
# "build_batch" is a part of "prepare_inputs", shown under it, and "build_batch_cpu" the step
# thread's CPU time in it (the rest of it, served, is waiting for the GIL or a core).
ENGINE_PHASES = ("schedule", "prepare_inputs", "build_batch", "build_batch_cpu", *FORWARD_PHASES, "sample",
                 "update", "outputs", "engine_other")
# The event loop's dispatch of a step's outputs (text, streams) runs beside the step thread: not in the cycle.
HTTP_PHASES = ("loop_gap", "stream")
LABELS = {
    "schedule": "schedule",
    "prepare_inputs": "prepare inputs",
    "build_batch": "  of it: build batch",
    "build_batch_cpu": "    its CPU time",
    "attention": "forward: attention",
    "linear": "forward: linear layers",
    "lm_head": "forward: LM head",
    "forward_other": "forward: other",
    "sample": "sample",
    "update": "update_from_output",
    "outputs": "outputs",
    "engine_other": "engine other",
    "loop_gap": "loop gap (step thread idle)",
    "stream": "output dispatch",
}


# --------------------------------------------------------------------------- model


def ensure_model(model_dir: Optional[str]) -> Path:
    """The checkpoint to profile: `model_dir`, or the generated 19M model (made once)."""
    if model_dir:
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model_dir!r} has no config.json")
        return path
    path = DEFAULT_MODEL_DIR
    if not (path / "model.safetensors").is_file():
        from tokenlane.runtime.executor.tiny_model import make_tiny_model

        make_tiny_model(path, initializer_range=0.02, **MODEL_KW)
    return path


def make_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(rng.randint(16, 512))] for _ in range(count)]


# --------------------------------------------------------------------------- instrumentation


class StepRecorder:
    """Times the phases of every step of one engine (wrappers on the instances only).

    `records` gets one dict per step: the phase seconds, `cycle` (this step's start to the
    next one's; the last step's own duration until then), the batch composition, and CPU
    clocks of the step thread and, when `loop_thread_id` is given, the event loop thread."""

    def __init__(self, loop_thread_id: Optional[int] = None) -> None:
        self.records: list[dict[str, Any]] = []
        self.current: Optional[dict[str, Any]] = None
        self._loop_clock = time.pthread_getcpuclockid(loop_thread_id) if loop_thread_id else None
        self._last_start: Optional[float] = None
        self._last_end: Optional[float] = None
        self._last_loop_cpu: Optional[float] = None

    # -- wrapping helpers

    def _add(self, phase: str, seconds: float) -> None:
        if self.current is not None:
            self.current[phase] = self.current.get(phase, 0.0) + seconds

    def timed(self, phase: str, fn: Callable, cpu_phase: Optional[str] = None) -> Callable:
        """`fn` timed into `phase`; with `cpu_phase`, the calling thread's CPU time too."""
        add = self._add

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            c0 = time.thread_time() if cpu_phase else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                add(phase, time.perf_counter() - t0)
                if cpu_phase:
                    add(cpu_phase, time.thread_time() - c0)

        return wrapper

    def _hook_module(self, module, *phases: str) -> None:
        starts: list[float] = []

        def done(*_):
            seconds = time.perf_counter() - starts.pop()
            for phase in phases:
                self._add(phase, seconds)

        module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
        module.register_forward_hook(done)

    # -- attach

    def attach(self, engine) -> None:
        import torch.nn as nn

        from tokenlane.runtime.executor.cpu_dense import PrepackedLinear

        scheduler, executor = engine.scheduler, engine.executor
        schedule = scheduler.schedule

        def timed_schedule():  # also notes the step's batch composition
            t0 = time.perf_counter()
            plan = schedule()
            self._add("schedule", time.perf_counter() - t0)
            if self.current is not None:
                self.current["prefill_tokens"] = plan.num_prefill_tokens
                self.current["decode_tokens"] = plan.num_decode_tokens
            return plan

        scheduler.schedule = timed_schedule
        scheduler.update_from_output = self.timed("update", scheduler.update_from_output)
        engine._outputs = self.timed("outputs", engine._outputs)
        executor.execute = self.timed("execute", executor.execute)
        inputs = getattr(executor, "inputs", None)
        if inputs is not None:  # the flat batch (BatchInputBuilder.build): a part of prepare inputs
            inputs.build = self.timed("build_batch", inputs.build, cpu_phase="build_batch_cpu")
        model = getattr(executor, "model", None)
        if model is not None:
            model.forward = self.timed("forward", model.forward, cpu_phase="forward_cpu")
            for layer in model.layers:
                self._hook_module(layer.self_attn, "self_attn")
            for name, module in model.named_modules():
                if name == "lm_head":
                    self._hook_module(module, "lm_head")
                    if hasattr(module, "argmax"):  # a greedy step's head: token ids, no logits
                        module.argmax = self.timed("lm_head", module.argmax)
                elif isinstance(module, (nn.Linear, PrepackedLinear)):
                    # The attention modules' projections: linear time, not attention time.
                    extra = ("attn_linear",) if ".self_attn." in f".{name}." else ()
                    self._hook_module(module, "linear", *extra)
        if hasattr(executor, "sampler"):
            executor.sampler = _TimedCallable(executor.sampler, self.timed("sample", executor.sampler))
        grammars = getattr(executor, "grammars", None)
        if grammars is not None:
            grammars.masked = self.timed("sample", grammars.masked)
        original_step = engine.step

        def step():
            self._begin()
            try:
                return original_step()
            finally:
                self._end()

        engine.step = step

    def _begin(self) -> None:
        now = time.perf_counter()
        loop_cpu = time.clock_gettime(self._loop_clock) if self._loop_clock is not None else None
        if self.records and self._last_start is not None:
            previous = self.records[-1]
            previous["cycle"] = now - self._last_start
            previous["loop_gap"] = now - self._last_end
            if loop_cpu is not None and self._last_loop_cpu is not None:
                previous["loop_cpu"] = loop_cpu - self._last_loop_cpu
        self._last_loop_cpu = loop_cpu
        self._last_start = now
        self.current = {"start": now, "thread_cpu0": time.thread_time()}

    def _end(self) -> None:
        record, self.current = self.current, None
        now = time.perf_counter()
        record["step"] = now - record.pop("start")
        record["step_cpu"] = time.thread_time() - record.pop("thread_cpu0")
        record["cycle"] = record["step"]
        record.setdefault("prefill_tokens", 0)
        record.setdefault("decode_tokens", 0)
        self._last_end = now
        self.records.append(record)

    def attach_async(self, async_engine) -> None:
        """The event loop's per-step work: dispatching outputs to the request streams."""
        dispatch = async_engine._dispatch
        records = self.records

        def timed_dispatch(outputs):
            t0 = time.perf_counter()
            try:
                return dispatch(outputs)
            finally:
                if records:
                    records[-1]["stream"] = records[-1].get("stream", 0.0) + time.perf_counter() - t0

        async_engine._dispatch = timed_dispatch


class _TimedCallable:
    """A callable object (the sampler) timed, its other attributes passed through."""

    def __init__(self, inner, timed_call) -> None:
        self._inner, self._timed_call = inner, timed_call

    def __call__(self, *args, **kwargs):
        return self._timed_call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def instrument(engine, loop_thread_id: Optional[int] = None) -> StepRecorder:
    recorder = StepRecorder(loop_thread_id)
    recorder.attach(engine)
    return recorder


def phase_breakdown(record: dict[str, Any]) -> dict[str, float]:
    """Seconds per table phase of one step record (the derived phases computed). All but
    "stream" (a part of "loop_gap") and "build_batch" and its CPU time (parts of "prepare_inputs")
    add up to the record's cycle."""
    forward = record.get("forward", 0.0)
    linear, lm_head = record.get("linear", 0.0), record.get("lm_head", 0.0)
    self_attn = record.get("self_attn", 0.0)
    # The attention modules' own projections are linear layers; the rest is attention.
    attention = max(0.0, self_attn - record.get("attn_linear", 0.0))
    out = {
        "schedule": record.get("schedule", 0.0),
        "prepare_inputs": max(0.0, record.get("execute", 0.0) - forward - record.get("sample", 0.0)),
        "build_batch": record.get("build_batch", 0.0),
        "build_batch_cpu": record.get("build_batch_cpu", 0.0),
        "attention": attention,
        "linear": linear,
        "lm_head": lm_head,
        "forward_other": max(0.0, forward - attention - linear - lm_head),
        "sample": record.get("sample", 0.0),
        "update": record.get("update", 0.0),
        "outputs": record.get("outputs", 0.0),
    }
    out["engine_other"] = max(0.0, record["step"] - record.get("execute", 0.0) - out["schedule"]
                              - out["update"] - out["outputs"])
    out["stream"] = record.get("stream", 0.0)
    out["loop_gap"] = max(0.0, record.get("cycle", record["step"]) - record["step"])
    return out


def summarize(records: list[dict[str, Any]], host_cpu: bool = True) -> dict[str, Any]:
    """Median per phase over the records (ms), shares of the median cycle, host overhead;
    `host_cpu` False where the records cannot tell it (an engine core process: the API
    process's CPU is another process's)."""
    if not records:
        return {"steps": 0}
    phases = [phase_breakdown(r) for r in records]
    ms = {name: 1000 * statistics.median(p[name] for p in phases) for name in phases[0]}
    cycle = 1000 * statistics.median(r.get("cycle", r["step"]) for r in records)
    step = 1000 * statistics.median(r["step"] for r in records)
    summary = {
        "steps": len(records),
        "cycle_ms": cycle,
        "step_ms": step,
        "phase_ms": ms,
        "share": {name: value / cycle for name, value in ms.items()} if cycle else {},
        # Per step, then the median: medians of the parts need not add up to the cycle's.
        "host_overhead_share": statistics.median(
            max(0.0, 1 - sum(p[name] for name in FORWARD_PHASES) / r.get("cycle", r["step"]))
            for p, r in zip(phases, records) if r.get("cycle", r["step"])),
        "step_thread_cpu_share": statistics.median(r["step_cpu"] / r["step"] for r in records if r["step"]),
    }
    loop_cpu = [r["loop_cpu"] for r in records if "loop_cpu" in r]
    if loop_cpu:
        summary["loop_cpu_ms_per_step"] = 1000 * statistics.median(loop_cpu)
    # The host's CPU a step (the step thread's off the forward pass, plus the event loop's when
    # it shares the process): unlike the shares, the same wherever the loop's work meets the
    # step thread (a wait for the GIL moves between phases; the CPU does not).
    if host_cpu:
        summary["host_cpu_ms_per_step"] = 1000 * statistics.median(
            max(0.0, r["step_cpu"] - r.get("forward_cpu", 0.0)) + r.get("loop_cpu", 0.0) for r in records)
    return summary


def steady(records: list[dict[str, Any]], running: int, mixed: bool) -> list[dict[str, Any]]:
    """Steps of one case: exactly `running` decodes (decode), or decodes plus a prefill
    chunk (mixed). Steps whose cycle is unknown (the last) are left out."""
    out = []
    for i, r in enumerate(records[:-1]):
        if mixed and r["prefill_tokens"] > 0 and r["decode_tokens"] > 0:
            out.append(r)
        elif not mixed and r["prefill_tokens"] == 0 and r["decode_tokens"] == running:
            out.append(r)
    return out


# --------------------------------------------------------------------------- offline


def offline_profile(model_dir: Path, dtype: str, running: int, steps: int, threads: Optional[int],
                    attention_backend: str = "auto") -> dict[str, Any]:
    import torch

    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
    from tokenlane.runtime.engine.llm_engine import LLMEngine
    from tokenlane.runtime.executor.model_executor import ModelExecutor
    from tokenlane.runtime.core.request import Request, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    config = RuntimeConfig(
        model=ModelConfig(path=str(model_dir), dtype=dtype),
        engine=EngineConfig(block_size=16, device="cpu", attention_backend=attention_backend),
        scheduler=SchedulerConfig(max_active_sequences=running + 1, max_waiting_requests=4096,
                                  max_batched_tokens=2048, prefill_chunk_size=512, queue_timeout_ms=3_600_000),
    )
    tokenizer = _maybe_tokenizer(model_dir)
    engine = LLMEngine(config, ModelExecutor(config), tokenizer=tokenizer, clock=time.perf_counter)
    vocab = engine.vocab_size
    # Long enough to stay running through warm-up and both cases.
    max_tokens = 3 * steps + 64
    for i, prompt in enumerate(make_prompts(running, vocab)):
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True)))
    for _ in range(400):  # prefill until every sequence decodes
        engine.step()
        if len(engine.scheduler.running) == running and all(r.num_output_tokens > 0 for r in engine.scheduler.running):
            break
    for _ in range(3):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain_ms = 1000 * (time.perf_counter() - t0) / steps

    recorder = instrument(engine)
    for _ in range(steps + 1):
        engine.step()
    decode = steady(recorder.records, running, mixed=False)
    # Mixed: one sequence ends, and a stream of 2-chunk prompts (max_tokens=1) keeps one
    # prefill chunk in every step next to the running - 1 decodes.
    victim = engine.scheduler.running[-1]
    engine.abort_request(victim.request_id)
    engine.step()
    rng = random.Random(1)
    engine.reload_config(_with_chunk(engine.config, MIXED_CHUNK))
    engine.step()
    recorder.records.clear()
    for i in range(steps + 1):
        if not any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
            prompt = [rng.randrange(5, vocab) for _ in range(2 * MIXED_CHUNK)]
            engine.add_request(Request(f"m{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
        engine.step()
    mixed = steady(recorder.records, running, mixed=True)
    return {
        "mode": "offline", "dtype": dtype, "running": running, "threads": torch.get_num_threads(),
        "attention_backend": attention_backend,
        "unprofiled_step_ms": plain_ms,
        "decode": summarize(decode),
        "mixed": summarize(mixed),
    }


def _with_chunk(config, chunk: int):
    import dataclasses

    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, prefill_chunk_size=chunk))


def _maybe_tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return None
    from tokenlane.runtime.engine.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


# --------------------------------------------------------------------------- HTTP


def serve_instrumented(stats_path: str, serve_argv: list[str]) -> int:
    """`tokenlane serve` with a StepRecorder on its engine; the records go to `stats_path`
    when the server exits (after its graceful drain)."""
    from tokenlane.runtime.engine import async_engine as async_module
    from tokenlane.runtime.entrypoints import server

    recorders: list[StepRecorder] = []
    original = async_module.AsyncEngine.from_config.__func__

    def from_config(cls, config):
        front = original(cls, config)
        recorder = instrument(front.engine, loop_thread_id=threading.main_thread().ident)
        recorder.attach_async(front)
        recorders.append(recorder)
        return front

    async_module.AsyncEngine.from_config = classmethod(from_config)
    # engine.coreProcess: the recorder goes into the core, which writes the records itself.
    from tokenlane.runtime.engine.core_client import CoreProcessClient

    original_core = CoreProcessClient.from_config.__func__

    def core_from_config(cls, config, on_start=None, log_level=None):
        return original_core(cls, config, on_start=functools.partial(instrument_core, stats_path),
                             log_level=log_level)

    CoreProcessClient.from_config = classmethod(core_from_config)
    code = server.main(serve_argv, exit_when_served=False)
    if recorders:
        Path(stats_path).write_text(json.dumps(recorders[0].records))
    return code


def instrument_core(stats_path: str, core) -> Callable[[], None]:
    """The engine core's `on_start` hook: a StepRecorder on its engine, with the hand-off of
    each step's outputs to the API process (pickle, pipe) as the "output dispatch" part of
    the loop gap; the records are written when the core stops."""
    recorder = instrument(core.engine)
    send_step, records = core._send_step, recorder.records

    def timed_send_step(outputs):
        t0 = time.perf_counter()
        try:
            return send_step(outputs)
        finally:
            if records and outputs:
                records[-1]["stream"] = records[-1].get("stream", 0.0) + time.perf_counter() - t0

    core._send_step = timed_send_step
    return lambda: Path(stats_path).write_text(json.dumps(recorder.records))


async def _stream_clients(base_url: str, prompts: list[list[int]], max_tokens: int, streamed: bool = True) -> list[float]:
    """All prompts at once, one streaming completion each; returns every gap between two
    streamed tokens of a request (s). `streamed=False`: whole responses (no gaps)."""
    import httpx
    import openai

    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                  http_client=httpx.AsyncClient(trust_env=False, timeout=600,
                                                                limits=httpx.Limits(max_connections=len(prompts) + 4))) as client:
        model = (await client.models.list()).data[0].id

        async def one(prompt: list[int]) -> list[float]:
            if not streamed:
                await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                temperature=0.0, extra_body={"ignore_eos": True})
                return []
            times = []
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                times.append(time.perf_counter())
            return [b - a for a, b in zip(times, times[1:])]

        return [gap for gaps in await asyncio.gather(*(one(p) for p in prompts)) for gap in gaps]


def http_profile(model_dir: Path, dtype: str, running: int, max_tokens: int, cpu_threads: Optional[int],
                 workdir: Path, attention_backend: str = "auto", step_loop: str = "thread",
                 cpu_bind: Optional[str] = None, responses: str = "stream") -> dict[str, Any]:
    import yaml

    from tokenlane.bench.serve_proc import free_port
    import httpx

    port = free_port()
    engine_cfg: dict[str, Any] = {"device": "cpu", "blockSize": 16, "attentionBackend": attention_backend}
    if cpu_threads is not None:
        engine_cfg["cpuThreads"] = cpu_threads
    engine_cfg["coreProcess"] = step_loop == "process"  # explicit: unset would be the host's choice
    if cpu_bind is not None:
        engine_cfg["cpuBind"] = cpu_bind
    config = {
        "model": {"path": str(model_dir), "dtype": dtype},
        "engine": engine_cfg,
        "scheduler": {"maxActiveSequences": running, "maxWaitingRequests": 4096, "maxBatchedTokens": 2048,
                      "prefillChunkSize": 512, "queueTimeoutMs": 3_600_000, "streamIdleTimeoutMs": 600_000},
    }
    tag = f"{dtype}-{running}-{cpu_threads}-{attention_backend}-{step_loop}-{port}"
    config_path = workdir / f"{tag}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    stats_path = workdir / f"{tag}.steps.json"
    log_path = workdir / f"{tag}.log"
    cmd = [sys.executable, "-m", "tokenlane.bench.step_profile", "_serve", str(stats_path), "--",
           "--config", str(config_path), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
           "--shutdown-grace-seconds", "5", "--flight-recorder-steps", "0"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
                try:
                    if httpx.get(url + "/ready", timeout=1.0, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready: {log_path.read_text()[-2000:]}")
                time.sleep(0.2)
            # Warm-up request, then the measured run.
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            asyncio.run(_stream_clients(url, make_prompts(1, vocab, seed=7), 4))
            gaps = asyncio.run(_stream_clients(url, make_prompts(running, vocab), max_tokens, responses == "stream"))
        finally:
            proc.terminate()
            proc.wait(60)
    records = json.loads(stats_path.read_text())
    return {
        "mode": "http", "dtype": dtype, "running": running, "cpu_threads": cpu_threads,
        "attention_backend": attention_backend, "step_loop": step_loop, "cpu_bind": cpu_bind,
        "responses": responses,
        **({"itl_p50_ms": 1000 * statistics.median(gaps)} if gaps else {}),
        "decode": summarize(steady(records, running, mixed=False), host_cpu=step_loop == "thread"),
        "mixed": summarize(steady(records, running, mixed=True), host_cpu=step_loop == "thread"),
    }


# --------------------------------------------------------------------------- report


def format_table(results: list[dict[str, Any]]) -> str:
    columns = []
    for result in results:
        for case in ("decode", "mixed"):
            summary = result.get(case) or {}
            if summary.get("steps"):
                name = f"{result['mode']} {SHORT_DTYPES.get(result['dtype'], result['dtype'])} N={result['running']} {case}"
                if result.get("cpu_threads") is not None:
                    name += f" t={result['cpu_threads']}"
                if result.get("attention_backend", "auto") != "auto":
                    name += f" {result['attention_backend']}"
                if result.get("step_loop", "thread") != "thread":
                    name += f" {result['step_loop']}"
                if result.get("responses", "stream") != "stream":
                    name += f" {result['responses']}"
                columns.append((name, summary, result))
    if not columns:
        return "(no steady-state steps recorded)"
    phases = list(ENGINE_PHASES) + (list(HTTP_PHASES) if any(r["mode"] == "http" for _, _, r in columns) else [])
    width = max(len(LABELS[p]) for p in phases) + 2
    col = max(22, max(len(name) for name, _, _ in columns) + 2)
    lines = [" " * width + "".join(name.rjust(col) for name, _, _ in columns)]
    for phase in phases:
        cells = []
        for _, s, _ in columns:
            cells.append(f"{s['phase_ms'][phase]:7.2f} ms {100 * s['share'][phase]:5.1f}%".rjust(col))
        lines.append(LABELS[phase].ljust(width) + "".join(cells))
    rows = [
        ("step cycle", lambda s, r: f"{s['cycle_ms']:7.2f} ms"),
        ("host overhead share", lambda s, r: f"{100 * s['host_overhead_share']:5.1f}%"),
        ("step thread CPU/wall", lambda s, r: f"{s['step_thread_cpu_share']:.2f}"),
        ("event loop CPU/step", lambda s, r: f"{s['loop_cpu_ms_per_step']:.2f} ms" if "loop_cpu_ms_per_step" in s else "-"),
        ("host CPU/step", lambda s, r: f"{s['host_cpu_ms_per_step']:.2f} ms" if "host_cpu_ms_per_step" in s else "-"),
        ("unprofiled step", lambda s, r: f"{r['unprofiled_step_ms']:.2f} ms" if "unprofiled_step_ms" in r else "-"),
        ("client inter-token p50", lambda s, r: f"{r['itl_p50_ms']:.2f} ms" if "itl_p50_ms" in r else "-"),
        ("steps measured", lambda s, r: str(s["steps"])),
    ]
    for label, fn in rows:
        lines.append(label.ljust(width) + "".join(fn(s, r).rjust(col) for _, s, r in columns))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_serve"]:  # internal: the instrumented server of --http
        stats_path, rest = argv[1], argv[2:]
        return serve_instrumented(stats_path, rest[1:] if rest[:1] == ["--"] else rest)
    p = argparse.ArgumentParser(prog="python -m tokenlane.bench.step_profile",
                                description="Share of one engine step per phase (offline, or behind HTTP).")
    p.add_argument("--model", help="checkpoint folder (default: generate the 19M random Llama)")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--running", nargs="+", type=int, default=[64], help="running sequences N (default 64)")
    p.add_argument("--steps", type=int, default=30, help="steps timed per case (default 30)")
    p.add_argument("--threads", type=int, default=None, help="offline: torch threads (default: torch's)")
    p.add_argument("--http", action="store_true", help="profile a real `tokenlane serve` under N streaming clients")
    p.add_argument("--cpu-threads", nargs="+", type=int, default=None,
                   help="--http: engine.cpuThreads values run alternately (default: the config default)")
    p.add_argument("--attention-backend", nargs="+", default=["auto"],
                   choices=["auto", "torch", "native"],
                   help="engine.attentionBackend values run alternately (default auto)")
    p.add_argument("--step-loop", nargs="+", default=["thread"], choices=["thread", "process"],
                   help="--http: the step loop in the server's process (thread) or its own "
                        "(process: engine.coreProcess), run alternately (default thread)")
    p.add_argument("--cpu-bind", help="--http: engine.cpuBind of every server, e.g. 0 (the compute thread on "
                                      "CPU 0, the server on the others)")
    p.add_argument("--responses", nargs="+", choices=["stream", "whole"], default=["stream"],
                   help="--http: streamed responses, or whole ones (no per-token work on the event "
                        "loop: what streaming costs the step), run alternately (default stream)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the alternation (default 1)")
    p.add_argument("--max-tokens", type=int, default=96, help="--http: tokens per request (default 96)")
    p.add_argument("--isa-cap", choices=sorted(ISA_CAPS), default=None,
                   help="run the AVX2 code of tokenlane's native kernels, oneDNN, MKL and ATen on this wider "
                        "CPU (their environment variables; the host line says CAPPED)")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    if min(args.running) < 2:
        p.error("--running must be >= 2")
    if args.isa_cap:
        if refusal := isa_cap_refusal(args.isa_cap):
            p.error(refusal)
        cap_env = ISA_CAPS[args.isa_cap]
        if any(os.environ.get(k) != v for k, v in cap_env.items()):
            # Each library reads its cap once, when it loads: profile in a process started with them.
            return subprocess.call([sys.executable, "-m", "tokenlane.bench.step_profile", *argv],
                                   env={**os.environ, **cap_env})
    model_dir = ensure_model(args.model)
    host = host_info()
    print(host_line(host), flush=True)
    results = []
    if args.http:
        if _maybe_tokenizer(model_dir) is None:
            p.error(f"--http needs a tokenizer in {model_dir}")
        workdir = Path(tempfile.mkdtemp(prefix="tokenlane-step-profile-"))
        settings = args.cpu_threads or [None]
        for _ in range(args.rounds):
            for dtype in args.dtype:
                for running in args.running:
                    for setting in settings:
                        for backend in args.attention_backend:
                            for step_loop in args.step_loop:
                                for responses in args.responses:
                                    results.append(http_profile(model_dir, dtype, running, args.max_tokens,
                                                                setting, workdir, backend, step_loop,
                                                                args.cpu_bind, responses))
                                    print(format_table(results[-1:]), flush=True)
    else:
        for _ in range(args.rounds):
            for dtype in args.dtype:
                for running in args.running:
                    for backend in args.attention_backend:
                        results.append(offline_profile(model_dir, dtype, running, args.steps, args.threads,
                                                       backend))
                        print(format_table(results[-1:]), flush=True)
    print()
    print(format_table(results))
    if args.json:
        host["loadavg_1m_at_end"] = load_1m()
        Path(args.json).write_text(json.dumps([{**r, "host": host} for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
