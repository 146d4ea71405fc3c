"""Thread placement (`engine.cpuBind`): which CPUs the engine's compute threads run on, one
thread pinned to each, and which CPUs the HTTP server's threads keep.

    auto (unset)  from AUTO_MIN_CORES physical cores up: the first core is kept for the
                  server (HTTP, tokenization, streams) and one compute thread is pinned to
                  each other core (SMT siblings left idle). Unpinned with a GPU, with
                  `cpuThreads` set, or on fewer cores.
    none          no pinning: torch's threads and the server float over every allowed CPU.
    "2-15", "0,2,4-7"   compute thread i on the i-th listed CPU; the server keeps the other
                  allowed CPUs (every one, if the list takes them all).

Whether the engine core gets a process of its own (`engine.coreProcess`) follows from the
same plan: unset, it does where the server has CPUs the step loop does not use
(`plan_core_process`).

The plans are pure (`plan_placement`, `plan_core_process`, tested table-driven);
`Topology.read()` reads what this process may use (its affinity mask, /sys's core ids), and the
binders act: `bind_compute_threads` in the thread that runs the model (the step thread; pins its
OpenMP team, i.e. torch's pool for that thread, through the native library),
`confine_server_threads` in the server's process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tokenlane.runtime.config import format_cpu_list, parse_cpu_list

log = logging.getLogger(__name__)

# A pinned compute thread cannot move away from the server's threads: on a 2-core host, pinned
# in place was 0.90-0.94x the unpinned output tokens/s at 64 streams (docs/benchmarks.md,
# "Thread placement"), so auto pins only when the server can have a core of its own. That core
# costs the engine 1/n of its compute: from this many cores up, at most an eighth.
AUTO_MIN_CORES = 8


def read_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """This process's cgroup CPU quota in CPUs (cgroup v2 `cpu.max` of its own cgroup, else
    v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`), or None when there is none or it cannot
    be read."""
    places = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):  # cgroup v2: the process's own cgroup under the mount
                places.append(root / line[3:].strip().lstrip("/") / "cpu.max")
    except OSError:
        pass
    places.append(root / "cpu.max")
    for place in places:
        try:
            quota, period = place.read_text().split()[:2]
            break
        except (OSError, ValueError):
            continue
    else:
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


@dataclass(frozen=True)
class Topology:
    """The CPUs this process may run on, and the physical core of each."""

    allowed: tuple[int, ...]  # sorted
    core_of: dict  # CPU -> an id shared by SMT siblings (package, core)
    # The cgroup's CPU quota in CPUs (a container's cpu limit), None if unlimited. Below the
    # affinity mask's size the CPUs are shared with others (no exclusive cpuset): not ours to pin.
    quota_cpus: Optional[float] = None

    @classmethod
    def read(cls) -> "Topology":
        allowed = tuple(sorted(os.sched_getaffinity(0)))
        core_of = {}
        for cpu in allowed:
            base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            try:
                core_of[cpu] = (int((base / "physical_package_id").read_text()),
                                int((base / "core_id").read_text()))
            except (OSError, ValueError):  # no sysfs (a sandbox): every CPU its own core
                core_of[cpu] = (-1, cpu)
        return cls(allowed, core_of, read_cpu_quota())

    def cores(self) -> list[tuple[int, ...]]:
        """Physical cores as tuples of their allowed CPUs, ordered by their first CPU."""
        groups: dict = {}
        for cpu in self.allowed:
            groups.setdefault(self.core_of.get(cpu, (-1, cpu)), []).append(cpu)
        return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


@dataclass(frozen=True)
class Placement:
    """Where the engine's compute threads and the server's threads run."""

    # Compute thread i is pinned to engine_cpus[i]; () = not pinned (torch's own count).
    engine_cpus: tuple[int, ...] = ()
    # CPUs of the server process's other threads (the event loop's and the rest; with
    # coreProcess, all of them); () = every allowed CPU.
    server_cpus: tuple[int, ...] = ()
    # The process's allowed CPUs when planned (what "every allowed CPU" means).
    allowed: tuple[int, ...] = ()
    # One line for the start-up log: what was decided and why.
    reason: str = ""

    @property
    def pinned(self) -> bool:
        return bool(self.engine_cpus)


def plan_placement(setting: Optional[str], cpu_threads: Optional[int], device_type: str,
                   topology: Topology) -> Placement:
    """The placement `engine.cpuBind` asks for on this topology. ValueError for a CPU list
    that names CPUs this process may not use."""
    allowed = topology.allowed
    setting = setting or "auto"
    if setting == "none":
        return Placement(allowed=allowed, reason="cpuBind none: threads not pinned")
    if setting != "auto":
        cpus = parse_cpu_list(setting)
        missing = [cpu for cpu in cpus if cpu not in allowed]
        if missing:
            raise ValueError(f"engine.cpuBind {setting!r}: CPU {format_cpu_list(missing)} is not among "
                             f"the CPUs this process may use ({format_cpu_list(allowed)})")
        server = tuple(cpu for cpu in allowed if cpu not in cpus)
        return Placement(cpus, server, allowed,
                         f"cpuBind {setting}: compute threads on {format_cpu_list(cpus)}, server on "
                         f"{format_cpu_list(server) if server else 'every allowed CPU'}")
    if device_type != "cpu":
        return Placement(allowed=allowed, reason="cpuBind auto: not pinned (the model runs on the GPU)")
    if cpu_threads is not None:
        return Placement(allowed=allowed, reason=f"cpuBind auto: not pinned (cpuThreads {cpu_threads} is set)")
    if topology.quota_cpus is not None and topology.quota_cpus < len(allowed):
        return Placement(allowed=allowed, reason=f"cpuBind auto: not pinned (a CPU quota of "
                                                 f"{topology.quota_cpus:g} CPUs over {len(allowed)} shared CPUs)")
    cores = topology.cores()
    if len(cores) < AUTO_MIN_CORES:
        return Placement(allowed=allowed, reason=f"cpuBind auto: not pinned ({len(cores)} cores, fewer "
                                                 f"than {AUTO_MIN_CORES}: the server shares them)")
    engine = tuple(core[0] for core in cores[1:])
    server = cores[0]
    return Placement(engine, server, allowed,
                     f"cpuBind auto: one compute thread per core on {format_cpu_list(engine)}, "
                     f"server on {format_cpu_list(server)}")


def placement_for(engine_config, device_type: str) -> Placement:
    """The plan for this process now (`engine_config` is the config's EngineConfig)."""
    return plan_placement(engine_config.cpu_bind, engine_config.cpu_threads, device_type, Topology.read())


def plan_core_process(setting: Optional[bool], executor: str, device_type: str, placement: Placement,
                      topology: Topology) -> tuple[bool, str]:
    """Whether the engine core runs in a process of its own (`engine.coreProcess`), and why.

    Unset (auto): yes where the server's threads have a CPU the step loop does not use: on a
    GPU from 2 cores up, and on the CPU when the placement leaves the server CPUs of its own
    (cpuBind auto from AUTO_MIN_CORES cores, or a list that does not take every CPU). In one
    process the step thread's Python would wait for the GIL while the event loop streams, and
    the server's core would idle meanwhile. Where the server shares the compute threads'
    cores, a second process only moves that wait into the forward pass (docs/benchmarks.md,
    "The engine core in its own process"), so the loop stays in process.
    """
    if setting is not None:
        return setting, f"coreProcess {str(setting).lower()}"
    if executor != "model":
        return False, f"coreProcess auto: in process (executor {executor})"
    if device_type != "cpu":
        cores = len(topology.cores())
        if topology.quota_cpus is not None and topology.quota_cpus < 2:
            return False, (f"coreProcess auto: in process (a CPU quota of {topology.quota_cpus:g} CPUs "
                           f"leaves no core for the server)")
        if cores < 2:
            return False, "coreProcess auto: in process (one core: nothing for the server to run on)"
        return True, (f"coreProcess auto: own process (the model runs on the GPU; the step loop and "
                      f"the server get cores of their own among {cores})")
    if placement.pinned and placement.server_cpus:  # the plan never gives the server a compute CPU
        return True, (f"coreProcess auto: own process (the server keeps CPU "
                      f"{format_cpu_list(placement.server_cpus)} to itself)")
    return False, "coreProcess auto: in process (the server shares the compute threads' CPUs)"


def core_process_for(engine_config, device_type: str) -> tuple[bool, str]:
    """`plan_core_process` for this process now (`engine_config` is the config's EngineConfig)."""
    topology = Topology.read()
    placement = plan_placement(engine_config.cpu_bind, engine_config.cpu_threads, device_type, topology)
    return plan_core_process(engine_config.core_process, engine_config.executor, device_type, placement,
                             topology)


def bind_compute_threads(placement: Placement) -> str:
    """In the thread that runs the model: pin its OpenMP team (torch's pool for this thread,
    which the native kernels share), thread i to engine_cpus[i]. Without the native library's
    OpenMP build the thread (and the pool threads it starts later) is confined to the engine's
    CPUs instead, unpinned. Returns what was done, for the log."""
    if not placement.pinned:
        return "not pinned"
    from tokenlane.kernels import cpu_native

    cpus = list(placement.engine_cpus)
    pinned = cpu_native.bind_threads(cpus)
    if pinned == len(cpus):
        return f"{pinned} compute threads pinned to {format_cpu_list(cpus)}"
    os.sched_setaffinity(0, cpus)
    if pinned is None:
        why = cpu_native.load_error() or "the native library has no OpenMP"
    else:
        why = f"{pinned} of {len(cpus)} pinned"
    return f"compute threads confined to {format_cpu_list(cpus)}, not one per CPU ({why})"


def confine_server_threads(placement: Placement) -> None:
    """In the server's process, once the engine is loaded and before the step thread starts:
    run every thread it has (the event loop's, torch's idle pool from loading) and so every
    thread started from now on on the server's CPUs, or on every allowed CPU. The step thread
    (in-process loop) inherits this and then pins itself."""
    if not placement.pinned:
        return
    cpus = placement.server_cpus or placement.allowed
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, ValueError):  # the thread ended meanwhile
            continue
