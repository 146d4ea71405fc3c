"""`tokenlane serve`: the command line, and a uvicorn server that shuts down gracefully.

The app itself is runtime/entrypoints/app.py. Shutdown on SIGTERM (or SIGINT) is graceful: /ready and
new requests answer 503 with Retry-After at once, in-flight requests finish or are aborted
when the grace period ends, then the process logs "shutdown complete" and exits 0. A second
signal exits at once. SIGUSR1 writes a flight recorder dump (recorded steps, metrics, config
in force) under --dump-dir and logs its path; serving goes on. Once served, the process ends
without CPython's teardown (see `end_process`). The start-up is logged phase by phase, from
process start to ready (`startup:` lines, `StartupTimer`, runtime/core/startup.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import uvicorn

from tokenlane.runtime.entrypoints.app import ServerOptions, ServerState, create_app
from tokenlane.runtime.config import (
    ConfigError,
    ModelConfig,
    RuntimeConfig,
    load_config,
)
from tokenlane.runtime.core.startup import StartupPhase, summary_line
from tokenlane.runtime.observability.flight_recorder import DEFAULT_CAPACITY, default_dump_dir
from tokenlane.runtime.observability.process_exit import exit_now

log = logging.getLogger("tokenlane.server")

_IMPORTED_AT = time.perf_counter()  # where the process's own start time cannot be read


def process_age_seconds() -> float:
    """Seconds since this process started (Linux: its start time in /proc, in clock ticks
    since boot); elsewhere since this module was imported."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED_AT


class StartupTimer:
    """The phases of `tokenlane serve`'s start (runtime/core/startup.py), from process start:
    each is logged when it ends, and `ready` logs the summary line and sets the
    tokenlane_startup_phase_seconds gauge."""

    def __init__(self) -> None:
        self.process_started = time.perf_counter() - process_age_seconds()
        self.phases: list[StartupPhase] = []

    def add(self, name: str, seconds: float, detail: str = "") -> None:
        phase = StartupPhase(name, seconds, detail)
        self.phases.append(phase)
        log.info("%s", phase.log_line())

    def add_engine(self, started: float, client, own_process: bool) -> None:
        """The engine's own phases (tokenizer, load, kv, warmup), and what else opening it took."""
        took = time.perf_counter() - started
        engine_phases = list(client.startup_phases)
        self.phases += engine_phases
        rest = took - sum(p.seconds for p in engine_phases)
        self.add("engine", max(0.0, rest), "the engine core process's spawn and imports (this process loads "
                 "the tokenizer meanwhile)" if own_process else "the scheduler and the detokenizer's tables")

    def ready(self, metrics) -> None:
        total = time.perf_counter() - self.process_started
        log.info("%s", summary_line(total, self.phases))
        metrics.set_startup(total, self.phases)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenlane serve",
        description="Serve a model over the OpenAI API with per-lane continuous batching.",
    )
    p.add_argument("--config", help="runtime.yaml (see docs/configuration.md); watched for hot reloads")
    p.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g = p.add_argument_group("config overrides (take precedence over the file)")
    g.add_argument("--model", help="model.path: checkpoint folder")
    g.add_argument("--served-model-name", help="model.servedName")
    g.add_argument("--dtype", help="model.dtype")
    g.add_argument("--max-model-len", type=int, help="model.maxModelLen")
    g.add_argument("--kv-cache-blocks", type=int, help="engine.kvCacheBlocks")
    g.add_argument("--block-size", type=int, help="engine.blockSize")
    g.add_argument("--device", help="engine.device (auto|cpu|cuda)")
    g.add_argument("--attention-backend", help="engine.attentionBackend (auto|torch|triton|native)")
    g.add_argument("--executor", help="engine.executor (model|simulated)")
    g.add_argument("--no-continuous-batching", action="store_true",
                   help="engine.continuousBatching=false (request-level static batching)")
    g.add_argument("--no-prefix-caching", action="store_true", help="engine.enablePrefixCaching=false")
    g.add_argument("--core-process", action=argparse.BooleanOptionalAction, default=None,
                   help="engine.coreProcess: the step loop in a process of its own, or not "
                        "(default: the config's; unset there, where the server has a core to itself)")
    g.add_argument("--cpu-bind", help="engine.cpuBind (auto|none|a CPU list such as 2-15): where the "
                                      "compute threads are pinned")
    g.add_argument("--tensor-parallel-size", type=int, help="engine.tensorParallelSize: ranks (GPUs) per "
                                                            "pipeline stage (docs/parallelism.md)")
    g.add_argument("--pipeline-parallel-size", type=int, help="engine.pipelineParallelSize: pipeline stages")
    d = p.add_argument_group("multi-node rendezvous (default: LeaderWorkerSet's LWS_* environment, else one node)")
    d.add_argument("--nnodes", type=int, help="nodes (pods) of the group: 1 or engine.pipelineParallelSize "
                                              "(env LWS_GROUP_SIZE)")
    d.add_argument("--node-rank", type=int, help="this node's index, 0 = the leader that serves the API "
                                                 "(env LWS_WORKER_INDEX)")
    d.add_argument("--master-addr", help="the leader's address (env LWS_LEADER_ADDRESS; default 127.0.0.1)")
    d.add_argument("--master-port", type=int, help="the leader's rendezvous port, the group's only one "
                                                   "(env TOKENLANE_DIST_PORT; default 29500)")
    d.add_argument("--rendezvous-timeout", type=float, help="seconds the start waits for every rank to join "
                                                            "(env TOKENLANE_DIST_TIMEOUT_S; default 600)")
    p.add_argument("--shutdown-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM, time in-flight requests get to finish (default 30)")
    p.add_argument("--config-poll-seconds", type=float, default=1.0,
                   help="how often the config file is checked for changes (default 1)")
    p.add_argument("--flight-recorder-steps", type=int, default=DEFAULT_CAPACITY,
                   help=f"engine steps the flight recorder keeps in memory, served at /debug/steps "
                        f"(default {DEFAULT_CAPACITY}; 0: off)")
    p.add_argument("--dump-dir", type=Path, default=None,
                   help=f"where SIGUSR1 writes flight recorder dumps (default {default_dump_dir()})")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def apply_overrides(config: RuntimeConfig, args: argparse.Namespace) -> RuntimeConfig:
    """The config with the command-line overrides applied (validated again)."""
    model_changes = {
        k: v for k, v in {
            "path": args.model,
            "served_name": args.served_model_name,
            "dtype": args.dtype,
            "max_model_len": args.max_model_len,
        }.items() if v is not None
    }
    engine_changes = {
        k: v for k, v in {
            "kv_cache_blocks": args.kv_cache_blocks,
            "block_size": args.block_size,
            "device": args.device,
            "attention_backend": args.attention_backend,
            "executor": args.executor,
            "cpu_bind": args.cpu_bind,
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size,
        }.items() if v is not None
    }
    if args.no_continuous_batching:
        engine_changes["continuous_batching"] = False
    if args.no_prefix_caching:
        engine_changes["enable_prefix_caching"] = False
    if args.core_process is not None:
        engine_changes["core_process"] = args.core_process
    try:
        model = dataclasses.replace(config.model, **model_changes)
    except ConfigError as exc:
        raise ConfigError(f"config.model.{exc}") from None
    try:
        engine = dataclasses.replace(config.engine, **engine_changes)
    except ConfigError as exc:
        raise ConfigError(f"config.engine.{exc}") from None
    return dataclasses.replace(config, model=model, engine=engine)


def resolve_rendezvous(args: argparse.Namespace):
    """Where a multi-rank group meets: the flags over the environment (TOKENLANE_DIST_*, then
    LeaderWorkerSet's LWS_*). ValueError naming the flag or variable."""
    from tokenlane.runtime.distributed.launch import Rendezvous

    found = Rendezvous.from_env(os.environ)
    flags = {k: v for k, v in {
        "nnodes": args.nnodes, "node_rank": args.node_rank, "master_addr": args.master_addr,
        "master_port": args.master_port, "timeout_s": args.rendezvous_timeout,
    }.items() if v is not None}
    return dataclasses.replace(found, **flags) if flags else found


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before exiting: uvicorn's
    own handling would close the listening socket at once (clients would see connection
    refused, not a 503) and re-raise the signal (exit status -15 instead of 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState,
                 startup: Optional[StartupTimer] = None, serve_started: float = 0.0) -> None:
        super().__init__(config)
        self.state = state
        self.startup_timer = startup
        self.serve_started = serve_started
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain_requested = False
        self._dumps: set[asyncio.Task] = set()  # running dump tasks (a reference keeps them alive)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self._loop.add_signal_handler(signal.SIGUSR1, self._dump_on_signal)
        except (NotImplementedError, RuntimeError, ValueError):  # no Unix signals, or not the main thread
            log.warning("SIGUSR1 dumps are not available here")
        await super().startup(sockets=sockets)
        if self.startup_timer is not None and self.started and not self.should_exit:
            # Sockets bound and the lifespan (engine start) done: /ready answers 200 from here.
            self.startup_timer.add("serve", time.perf_counter() - self.serve_started,
                                   "app, heap freeze, engine start, sockets bound")
            self.startup_timer.ready(self.state.metrics)

    def _dump_on_signal(self) -> None:
        """SIGUSR1, on the event loop: the dump itself runs in a worker thread."""
        task = self._loop.create_task(self.state.dump("SIGUSR1"), name="flight-recorder-dump")
        self._dumps.add(task)
        task.add_done_callback(self._dumps.discard)

    def handle_exit(self, sig, frame) -> None:
        if self._drain_requested or self._loop is None:
            return super().handle_exit(sig, frame)  # second signal, or not started: exit now
        self._drain_requested = True
        self._loop.call_soon_threadsafe(self._drain_then_exit)

    def _drain_then_exit(self) -> None:
        log.info("shutdown signal: draining")
        task = self.state.begin_drain()
        task.add_done_callback(lambda _task: setattr(self, "should_exit", True))


def end_process(code: int) -> None:
    """Exit with `code` now, skipping the interpreter's teardown (runtime/observability/
    process_exit.py). The server and the engine have stopped by then, and the asyncio default
    executor (dumps, tokenization) was joined when the event loop closed; the atexit handlers
    still run."""
    exit_now(code)


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive after start-up (torch, transformers, the
    model, FastAPI's routes: a few hundred thousand) into the collector's permanent generation.
    Python's cyclic collector holds the GIL while it runs, and a full collection walks every
    tracked object: 100-220 ms for this heap, during which the step thread waits for the GIL
    and every stream stalls (one such pause per 10-15 s of a 16-client run, measured with
    gc.callbacks; none after the freeze). Objects made while serving are collected as before.
    vLLM's engine core does the same."""
    gc.collect()
    gc.freeze()


def main(argv: Optional[list[str]] = None, *, exit_when_served: bool = True) -> int:
    """`tokenlane serve`; the exit status. A served run ends the process itself
    (`end_process`) unless `exit_when_served` is False; a refused start returns 1 or 2."""
    startup = StartupTimer()
    args = build_parser().parse_args(argv)
    if args.flight_recorder_steps < 0:
        print("tokenlane serve: --flight-recorder-steps must be 0 (off) or more", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    try:
        if args.config:
            file_config = load_config(args.config)
        elif args.model:
            file_config = RuntimeConfig(model=ModelConfig(path=args.model))
        else:
            print("tokenlane serve: give --config runtime.yaml or --model PATH", file=sys.stderr)
            return 2
        config = apply_overrides(file_config, args)
    except ConfigError as exc:
        print(f"tokenlane serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    config_s = time.perf_counter() - started
    if config.engine.tp_size * config.engine.pp_size > 1:
        try:
            rendezvous = resolve_rendezvous(args)
        except ValueError as exc:
            print(f"tokenlane serve: invalid configuration: {exc}", file=sys.stderr)
            return 2
        rendezvous.export(os.environ)  # the engine (here or in its core process) reads it there
        if rendezvous.node_rank > 0:
            from tokenlane.runtime.distributed.worker import run_worker_node

            code = run_worker_node(config, rendezvous, args.host, args.port)
            log.info("worker node done; exit %d", code)
            if exit_when_served:
                end_process(code)
            return code

    # Import: from process start (the interpreter, this module, FastAPI, uvicorn) to the engine's
    # modules loaded (torch, the kernels); transformers loads with the tokenizer.
    from tokenlane.runtime.engine.client import InProcessClient, open_client

    if config.engine.executor == "model":
        import tokenlane.runtime.executor.model_executor  # noqa: F401
    startup.add("import", time.perf_counter() - startup.process_started - config_s,
                "interpreter, server and engine modules" + (", torch" if config.engine.executor == "model" else ""))
    startup.add("config", config_s, args.config or "command line")

    started = time.perf_counter()
    try:
        client = open_client(config)
    except ConfigError as exc:  # e.g. a model.adapters entry that cannot be loaded
        print(f"tokenlane serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"tokenlane serve: cannot load {config.model.path}: {exc}", file=sys.stderr)
        return 1
    startup.add_engine(started, client, own_process=not isinstance(client, InProcessClient))
    serve_started = time.perf_counter()
    if config.engine.executor == "model":
        # engine.cpuBind: this process's threads and those it starts from now on, the step
        # thread included until it pins itself, keep to the server's CPUs.
        from tokenlane.runtime.executor.cpu_placement import confine_server_threads, placement_for
        from tokenlane.runtime.executor.model_executor import select_device

        confine_server_threads(placement_for(config.engine, select_device(config.engine.device).type))
    options = ServerOptions(
        shutdown_grace_s=args.shutdown_grace_seconds,
        config_poll_interval_s=args.config_poll_seconds,
        config_transform=lambda c: apply_overrides(c, args),
        flight_recorder_steps=args.flight_recorder_steps,
        dump_dir=args.dump_dir or default_dump_dir(),
    )
    app = create_app(client, args.config, options=options)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               timeout_graceful_shutdown=5, lifespan="on")
    server = GracefulServer(uv_config, app.state.tokenlane, startup, serve_started)
    freeze_startup_heap()
    server.run()
    code = 0 if client.healthy or app.state.tokenlane.draining else 1
    log.info("shutdown complete; exit %d", code)
    if exit_when_served:
        end_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
