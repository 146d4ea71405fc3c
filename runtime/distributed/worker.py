"""A worker rank: join the group, build this rank's ModelExecutor, then receive-plan, execute,
reply until rank 0 says stop.

Three ways to run one:
- `python -m tokenlane.runtime.distributed.worker`, the child process a node's first rank
  spawns for each of its other ranks (its RankSpec pickled on stdin); it dies with its parent;
- `tokenlane serve` on node k > 0 of a multi-node group (`run_worker_node`): the process runs
  its node's first rank itself, spawns the others, and answers `GET /health` (and `/ready`) on
  --port: 200 while the group is joined and serving, 503 otherwise;
- in tests and the benchmark, `run_rank` in a process of their own.

A worker whose step fails exits with status 1 (rank 0 fails the group on its exit); one whose
leader is gone exits by its heartbeat (watchdog.py).
"""

from __future__ import annotations

import ctypes
import http.server
import logging
import os
import pickle
import signal
import sys
import threading
from typing import Callable, Optional

from tokenlane.runtime.config import ConfigError, RuntimeConfig
from tokenlane.runtime.distributed.channel import set_grammar_loader
from tokenlane.runtime.distributed.executor import device_type_of, run_adapter_command
from tokenlane.runtime.distributed.group import GroupMember, build_rank_executor, join_group
from tokenlane.runtime.distributed.launch import (
    GroupStartError,
    LocalRanks,
    RankSpec,
    Rendezvous,
    check_group,
    describe_exit,
)
from tokenlane.runtime.distributed.messages import AdapterCommand, StepMessage, Stop
from tokenlane.runtime.distributed.mirror import RequestMirrors
from tokenlane.runtime.distributed.watchdog import Heartbeat, end_now

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel sends this process SIGKILL when its parent exits. (The parent spawns
    ranks from the thread that then runs the engine; the signal follows that thread's exit.)
    A parent gone before the call took effect is caught by the check after it."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError) as exc:
            log.warning("no PR_SET_PDEATHSIG (%s): the heartbeat's parent check remains", exc)
    if os.getppid() != parent_pid:
        os._exit(1)


def grammar_loader(config: RuntimeConfig, vocab_size: int) -> Callable[[str], object]:
    """Loads a serialized grammar against this rank's copy of the tokenizer (read on first use)."""
    compiler = []
    lock = threading.Lock()

    def load(serialized: str):
        from tokenlane.runtime.executor.structured_output import GrammarCompiler

        with lock:
            if not compiler:
                from transformers import AutoTokenizer, PreTrainedTokenizerFast

                folder = config.model.tokenizer or config.model.path
                try:
                    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
                except Exception:  # as the engine's load_tokenizer falls back
                    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(str(folder), "tokenizer.json"))
                compiler.append(GrammarCompiler(tokenizer, vocab_size))
        return compiler[0].load(serialized)

    return load


class WorkerLoop:
    def __init__(self, member: GroupMember, executor, on_stop: Optional[Callable[[], None]] = None) -> None:
        self.member = member
        self.executor = executor
        self.on_stop = on_stop
        self.mirrors = RequestMirrors()
        self.steps = 0

    def run(self) -> int:
        """Until Stop: 0. A failed step: 1 (logged)."""
        channel, layout = self.member.channel, self.member.layout
        reply = layout.is_output_rank and layout.rank != 0
        while True:
            try:
                message = channel.receive()
            except RuntimeError as exc:  # gloo: the leader's connection closed (it died or failed the group)
                log.error("rank %d: lost rank 0 (the leader): %s; exiting", layout.rank, exc)
                return 1
            if isinstance(message, StepMessage):
                plan = self.mirrors.apply(message)
                output = self.executor.execute(plan)
                self.steps += 1
                if reply:
                    channel.send_output(output)
            elif isinstance(message, AdapterCommand):
                try:
                    run_adapter_command(self.executor, message)
                    answer = None
                except (ValueError, OSError) as exc:
                    answer = str(exc)
                channel.gather(answer)
            elif isinstance(message, Stop):
                log.info("stopping (%s) after %d steps", message.reason, self.steps)
                if self.on_stop is not None:
                    self.on_stop()
                return 0
            else:
                raise TypeError(f"unexpected message {type(message).__name__}")


def run_rank(config: RuntimeConfig, rendezvous: Rendezvous, rank: int, local_index: int, local_world: int,
             device_type: str, parent_pid: Optional[int] = None, local: Optional[LocalRanks] = None,
             on_ready: Optional[Callable[[], None]] = None, on_stop: Optional[Callable[[], None]] = None) -> int:
    """Join, build, serve steps: the exit status."""
    try:
        member = join_group(config, rendezvous, rank, local_index, device_type, local)
    except GroupStartError as exc:
        log.error("%s", exc)
        return 1
    heartbeat = Heartbeat(member.store, rank, parent_pid).start()
    try:
        executor = build_rank_executor(config, member, device_type, local_world)
        set_grammar_loader(grammar_loader(config, executor.vocab_size))
        executor.pin_step_thread()
        if on_ready is not None:
            on_ready()
        code = WorkerLoop(member, executor, on_stop).run()
    except Exception:
        log.exception("rank %d failed", rank)
        return 1
    heartbeat.stop()
    return code


class HealthServer:
    """`GET /health` and `/ready` of a worker node: 200 while its ranks serve, 503 otherwise."""

    def __init__(self, host: str, port: int) -> None:
        self.healthy = False
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the stdlib's name)
                if self.path.split("?")[0] not in ("/health", "/ready"):
                    self.send_error(404)
                    return
                ok = owner.healthy
                body = b'{"status":"ok","role":"worker"}' if ok else b'{"status":"unavailable","role":"worker"}'
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # probes every few seconds: not worth a log line each
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="tokenlane-worker-health", daemon=True).start()


def run_worker_node(config: RuntimeConfig, rendezvous: Rendezvous, host: str, port: int) -> int:
    """`tokenlane serve` on node k > 0: this node's ranks, and the health endpoint. The exit
    status: 2 for sizes that cannot work, 1 for a failed group, 0 after rank 0's stop."""
    device_type, gpus = device_type_of(config)
    try:
        check_group(config, rendezvous, device_type, gpus)
    except ConfigError as exc:
        print(f"tokenlane serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    health = HealthServer(host, port)
    ranks = rendezvous.node_ranks(config.engine.tp_size, config.engine.pp_size)
    log.info("parallel: node %d of %d runs ranks %s; leader at %s; /health on %s:%d", rendezvous.node_rank,
             rendezvous.nnodes, ranks, rendezvous.address, host, port)
    local = LocalRanks.spawn(config, rendezvous, device_type, ranks)

    stopping = threading.Event()

    def watch_children() -> None:
        while True:
            gone = local.wait_exit(3600.0)
            if gone:
                if not stopping.is_set():  # rank 0's stop ends them as it ends this process's rank
                    log.error("parallel group failed: %s", "; ".join(describe_exit(*g) for g in gone))
                    health.healthy = False
                    local.kill()
                    end_now(1)
                return

    threading.Thread(target=watch_children, name="tokenlane-node-ranks", daemon=True).start()

    def ready() -> None:
        health.healthy = True

    code = run_rank(config, rendezvous, ranks[0], 0, len(ranks), device_type, local=local, on_ready=ready,
                    on_stop=stopping.set)
    health.healthy = False
    if code == 0 and local.join(10.0):
        return 0
    local.kill()
    return code


def main() -> None:
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to rank 0, which stops us
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {spec.rank}]: %(message)s")
    code = run_rank(spec.config, spec.rendezvous, spec.rank, spec.local_index, spec.local_world,
                    spec.device_type, parent_pid=spec.parent_pid)
    end_now(code)


if __name__ == "__main__":
    main()
