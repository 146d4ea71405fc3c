"""Which ranks this process runs, the checks before any of them starts, spawning the local ones,
and joining the group.

engine.tensorParallelSize (tp) x engine.pipelineParallelSize (pp) ranks serve one model; global
rank r is tensor rank r % tp of stage r // tp (`ParallelLayout`). On one node (nnodes 1) every
rank runs there; across nodes (a LeaderWorkerSet group: pod k = stage k, nnodes == pp) node k
runs stage k's tp ranks. The first rank of a node runs in the `tokenlane serve` process (rank 0:
the engine; on node k > 0 a worker rank); the node's other ranks are child processes that die
with it.

The rendezvous: the leader (rank 0) hosts a TCPStore on `master_port`; every rank checks in
there, and rank 0 waits until all did (or the timeout passes: one message naming the address,
the ranks expected and joined). Then torch.distributed's process groups meet in the same
store under a prefix of their own (`init_parallel_state`), which then completes at once: the
group needs one port. The store stays: it carries the workers' heartbeats (watchdog.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, MutableMapping, Optional, Sequence

from tokenlane.runtime.config import ConfigError, RuntimeConfig

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
# How long a start-up waits for every rank to check in (pods of a group start at different
# times: image pulls, weights on a volume).
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0

# The environment `tokenlane serve` resolves its rendezvous from: its own variables (which the
# flags set, so that an engine core process reads the same), else LeaderWorkerSet's.
ENV_NNODES = "TOKENLANE_DIST_NNODES"
ENV_NODE_RANK = "TOKENLANE_DIST_NODE_RANK"
ENV_MASTER_ADDR = "TOKENLANE_DIST_MASTER_ADDR"
ENV_PORT = "TOKENLANE_DIST_PORT"
ENV_TIMEOUT = "TOKENLANE_DIST_TIMEOUT_S"
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"

_JOINED = "tokenlane/joined"


class GroupStartError(ValueError):
    """The group could not form (rendezvous timeout, a rank that died while starting)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where this process's group meets: nodes, this node's index, the leader's address."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be in [1, 65535], got {self.master_port}")
        if not self.timeout_s > 0:
            raise ValueError(f"--rendezvous-timeout must be > 0 seconds, got {self.timeout_s}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Rendezvous":
        """TOKENLANE_DIST_* first, then LeaderWorkerSet's LWS_* variables, then one node."""

        def pick(*names: str) -> tuple[Optional[str], Optional[str]]:
            for name in names:
                value = environ.get(name)
                if value not in (None, ""):
                    return name, value
            return None, None

        def number(kind, names: Sequence[str], default):
            name, value = pick(*names)
            if value is None:
                return default
            try:
                return kind(value)
            except ValueError:
                raise ValueError(f"environment variable {name}: expected a number, got {value!r}") from None

        return cls(
            nnodes=number(int, (ENV_NNODES, LWS_GROUP_SIZE), 1),
            node_rank=number(int, (ENV_NODE_RANK, LWS_WORKER_INDEX), 0),
            master_addr=pick(ENV_MASTER_ADDR, LWS_LEADER_ADDRESS)[1] or "127.0.0.1",
            master_port=number(int, (ENV_PORT,), DEFAULT_MASTER_PORT),
            timeout_s=number(float, (ENV_TIMEOUT,), DEFAULT_RENDEZVOUS_TIMEOUT_S),
        )

    def export(self, environ: MutableMapping[str, str]) -> None:
        """Write this rendezvous into `environ` (TOKENLANE_DIST_*): the processes this one
        starts (an engine core, worker ranks) resolve the same one."""
        environ[ENV_NNODES] = str(self.nnodes)
        environ[ENV_NODE_RANK] = str(self.node_rank)
        environ[ENV_MASTER_ADDR] = self.master_addr
        environ[ENV_PORT] = str(self.master_port)
        environ[ENV_TIMEOUT] = repr(self.timeout_s)

    def node_ranks(self, tp: int, pp: int) -> list[int]:
        """The global ranks this node runs, its own process's first."""
        if self.nnodes == 1:
            return list(range(tp * pp))
        return list(range(self.node_rank * tp, (self.node_rank + 1) * tp))

    @property
    def address(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def check_group(config: RuntimeConfig, rendezvous: Rendezvous, device_type: str,
                visible_gpus: int = 0) -> None:
    """ConfigError naming the key when the group cannot run: nnodes that is neither 1 nor
    the pipeline stages, sizes the model cannot be split by (sharding.check_parallel_fits),
    more ranks on this node than visible GPUs. Before any rank is spawned."""
    from tokenlane.runtime.executor.llama import load_hf_config, model_args_from_hf
    from tokenlane.runtime.executor.sharding import check_parallel_fits

    tp, pp = config.engine.tp_size, config.engine.pp_size
    if rendezvous.nnodes not in (1, pp):
        raise ConfigError(f"--nnodes (or LWS_GROUP_SIZE) {rendezvous.nnodes} must be 1 or "
                          f"engine.pipelineParallelSize ({pp}): each node runs one pipeline stage")
    try:
        args = model_args_from_hf(load_hf_config(config.model.path))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"model.path: {exc}") from None
    try:
        check_parallel_fits(args, tp, pp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    local = len(rendezvous.node_ranks(tp, pp))
    if device_type == "cuda" and local > visible_gpus:
        raise ConfigError(
            f"engine.tensorParallelSize {tp} x pipelineParallelSize {pp}: more ranks than GPUs: this node runs "
            f"{local} ranks (one GPU each) but {visible_gpus} GPU{'s are' if visible_gpus != 1 else ' is'} visible")


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs to start: pickled to its stdin."""

    config: RuntimeConfig
    tp: int
    pp: int
    rank: int
    local_index: int  # this rank's GPU on its node (cuda:local_index)
    local_world: int  # ranks on this node (they share its CPUs)
    device_type: str
    rendezvous: Rendezvous
    parent_pid: int
    log_level: int


def rank_config(config: RuntimeConfig, device_type: str, local_world: int) -> RuntimeConfig:
    """The config a rank's model executor gets. On the CPU the node's ranks share its cores:
    unless engine.cpuThreads / cpuBind say otherwise, each rank takes its share of them and
    none pins its threads (several ranks pinned to the same cores would take turns)."""
    engine = config.engine
    if device_type != "cpu" or local_world == 1:
        return config
    changes = {}
    if engine.cpu_threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        changes["cpu_threads"] = max(1, cpus // local_world)
    if engine.cpu_bind is None:
        changes["cpu_bind"] = "none"
    return dataclasses.replace(config, engine=dataclasses.replace(engine, **changes)) if changes else config


class LocalRanks:
    """The child processes of this node's other ranks. They die with this process (Linux:
    PR_SET_PDEATHSIG in the child, and a parent check in its heartbeat thread)."""

    def __init__(self, procs: dict[int, subprocess.Popen]) -> None:
        self.procs = procs  # global rank -> process

    @classmethod
    def spawn(cls, config: RuntimeConfig, rendezvous: Rendezvous, device_type: str,
              ranks: Sequence[int]) -> "LocalRanks":
        """Start ranks[1:] (ranks[0] is this process) as `python -m tokenlane.runtime.distributed.worker`."""
        tp, pp = config.engine.tp_size, config.engine.pp_size
        procs: dict[int, subprocess.Popen] = {}
        level = logging.getLogger().getEffectiveLevel()
        try:
            for index, rank in enumerate(ranks):
                if index == 0:
                    continue
                spec = RankSpec(config, tp, pp, rank, index, len(ranks), device_type, rendezvous, os.getpid(), level)
                proc = subprocess.Popen([sys.executable, "-m", "tokenlane.runtime.distributed.worker"],
                                        stdin=subprocess.PIPE)
                procs[rank] = proc
                proc.stdin.write(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
                proc.stdin.close()
        except BaseException:
            cls(procs).kill()
            raise
        if procs:
            log.info("parallel: started ranks %s as processes %s", list(procs),
                     [p.pid for p in procs.values()])
        return cls(procs)

    def exited(self) -> list[tuple[int, int, int]]:
        """(rank, pid, exit code) of every child that has exited."""
        return [(rank, p.pid, p.returncode) for rank, p in self.procs.items() if p.poll() is not None]

    def wait_exit(self, timeout_s: float) -> list[tuple[int, int, int]]:
        """`exited()`, after waiting up to timeout_s for a first child to exit."""
        deadline = time.monotonic() + timeout_s
        while True:
            gone = self.exited()
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.02)

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("rank process %d did not exit after SIGKILL", proc.pid)

    def join(self, timeout_s: float) -> bool:
        """Wait for every child to exit by itself; True when all did."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True


def describe_exit(rank: int, pid: int, code: int) -> str:
    how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} (pid {pid}) {how}"


def rendezvous_store(rendezvous: Rendezvous, rank: int, world: int, local: Optional[LocalRanks] = None):
    """Check in at the leader's store and wait until all `world` ranks did; the store, whose
    client stays this rank's line to the leader. GroupStartError with the address, the ranks
    expected and joined, and the timeout, if the group does not form in time (or a local
    rank dies meanwhile)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=rendezvous.timeout_s)
    deadline = time.monotonic() + rendezvous.timeout_s
    try:
        store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
    except Exception as exc:  # unreachable leader (its connect retries ran out), a port in use
        where = "could not listen on" if rank == 0 else "could not reach the leader at"
        raise GroupStartError(
            f"rank {rank}: rendezvous: {where} {rendezvous.address} within {rendezvous.timeout_s:g} s "
            f"({world} ranks expected): {exc}") from None
    store.set(f"{_JOINED}/{rank}", str(os.getpid()))
    store.add(_JOINED, 1)
    keys = [f"{_JOINED}/{r}" for r in range(world)]
    while True:
        joined = store.add(_JOINED, 0)
        if joined >= world:
            return store
        if local is not None:
            gone = local.exited()
            if gone:
                raise GroupStartError("rendezvous: " + "; ".join(describe_exit(*g) for g in gone)
                                      + " while the group was forming")
        if time.monotonic() >= deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise GroupStartError(
                f"rendezvous at {rendezvous.address} timed out after {rendezvous.timeout_s:g} s: {joined} of "
                f"{world} ranks joined (missing ranks {', '.join(map(str, missing))}; nnodes {rendezvous.nnodes}, "
                f"each node runs {world // rendezvous.nnodes} ranks)")
        time.sleep(0.05)
