"""engine.cpuBind: the pure plan (table-driven), the config key, and the pinning itself on a
real engine (the step thread's OpenMP team, read back from /proc)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tokenlane.runtime.config import ConfigError, RuntimeConfig
from tokenlane.runtime.executor.cpu_placement import (
    AUTO_MIN_CORES,
    Placement,
    Topology,
    format_cpu_list,
    parse_cpu_list,
    plan_core_process,
    plan_placement,
    read_cpu_quota,
)


def config_with(**engine) -> RuntimeConfig:
    return RuntimeConfig.from_dict({"model": {"path": "/models/x"}, "engine": engine})


def topology(cores: int, smt: int = 1) -> Topology:
    """`cores` physical cores of `smt` CPUs each, numbered as Linux does (siblings last)."""
    cpus = range(cores * smt)
    return Topology(tuple(cpus), {cpu: (0, cpu % cores) for cpu in cpus})


@pytest.mark.parametrize("text, cpus", [
    ("0", (0,)),
    ("0-3,8", (0, 1, 2, 3, 8)),
    ("7,2-3", (7, 2, 3)),  # the order written: compute thread i on the i-th CPU
    (" 4 , 5 ", (4, 5)),
])
def test_cpu_lists_parse_in_the_order_written(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text, message", [
    ("", "not a CPU list"),
    ("a-3", "not a CPU list"),
    ("1-", "not a CPU list"),
    ("3-1", "runs backwards"),
    ("1,0-2", "lists CPU 1 twice"),
    ("0-5000", "out of range"),
])
def test_bad_cpu_lists_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_list(text)


def test_cpu_lists_format_as_ranges():
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_cpu_list([]) == ""


@pytest.mark.parametrize("setting, threads, device, topo, engine, server", [
    # none: nothing pinned, whatever the host
    ("none", None, "cpu", topology(16), (), ()),
    # a list: those CPUs, in that order; the server keeps the rest (all of them if none is left)
    ("3,1", None, "cpu", topology(4), (3, 1), (0, 2)),
    ("0-3", 4, "cpu", topology(4), (0, 1, 2, 3), ()),
    ("1", None, "cuda", topology(2), (1,), (0,)),  # asked for explicitly: also with a GPU
    # auto from AUTO_MIN_CORES cores: the first core (both its CPUs) for the server, one
    # compute thread on each other core, SMT siblings idle
    ("auto", None, "cpu", topology(AUTO_MIN_CORES, smt=2),
     tuple(range(1, AUTO_MIN_CORES)), (0, AUTO_MIN_CORES)),
    (None, None, "cpu", topology(AUTO_MIN_CORES + 2), tuple(range(1, AUTO_MIN_CORES + 2)), (0,)),
    # auto leaves alone: fewer cores (SMT siblings are not cores), a GPU model, a thread count
    # the user set
    (None, None, "cpu", topology(2), (), ()),
    ("auto", None, "cpu", topology(AUTO_MIN_CORES - 1, smt=2), (), ()),
    ("auto", None, "cuda", topology(16), (), ()),
    ("auto", 3, "cpu", topology(16), (), ()),
    # auto leaves alone a container whose CPU limit is a quota over CPUs it shares with others
    ("auto", None, "cpu", Topology(tuple(range(16)), {c: (0, c) for c in range(16)}, quota_cpus=4.0), (), ()),
    ("auto", None, "cpu", Topology(tuple(range(16)), {c: (0, c) for c in range(16)}, quota_cpus=16.0),
     tuple(range(1, 16)), (0,)),
])
def test_the_plan(setting, threads, device, topo, engine, server):
    placement = plan_placement(setting, threads, device, topo)
    assert (placement.engine_cpus, placement.server_cpus) == (engine, server)
    assert placement.allowed == topo.allowed
    assert placement.reason.startswith("cpuBind")


def under_quota(cores: int, cpus: float) -> Topology:
    return Topology(tuple(range(cores)), {c: (0, c) for c in range(cores)}, quota_cpus=cpus)


@pytest.mark.parametrize("core_process, executor, device, cpu_bind, topo, own, why", [
    # set: as set, whatever the host
    (True, "model", "cpu", None, topology(2), True, "coreProcess true"),
    (False, "model", "cuda", None, topology(64), False, "coreProcess false"),
    (False, "model", "cpu", None, topology(AUTO_MIN_CORES), False, "coreProcess false"),
    # auto on the CPU: its own process where the placement leaves the server CPUs of its own
    (None, "model", "cpu", None, topology(AUTO_MIN_CORES), True, "server keeps CPU 0 to itself"),
    (None, "model", "cpu", None, topology(AUTO_MIN_CORES, smt=2), True, f"server keeps CPU 0,{AUTO_MIN_CORES}"),
    (None, "model", "cpu", "0", topology(2), True, "server keeps CPU 1 to itself"),
    (None, "model", "cpu", "2-5", topology(8), True, "server keeps CPU 0-1,6-7 to itself"),
    # ... and in process where the server would share the compute threads' cores
    (None, "model", "cpu", None, topology(2), False, "shares the compute threads' CPUs"),
    (None, "model", "cpu", None, topology(AUTO_MIN_CORES - 1, smt=2), False, "shares"),
    (None, "model", "cpu", "none", topology(16), False, "shares"),
    (None, "model", "cpu", "0-3", topology(4), False, "shares"),  # the list takes every CPU
    (None, "model", "cpu", None, under_quota(16, 4.0), False, "shares"),  # auto pins nothing under a quota
    # auto with a GPU: the step loop and the server each need a core
    (None, "model", "cuda", None, topology(2), True, "runs on the GPU"),
    (None, "model", "cuda", None, topology(1), False, "one core"),
    (None, "model", "cuda", None, topology(1, smt=2), False, "one core"),  # SMT siblings are one core
    (None, "model", "cuda", None, under_quota(16, 1.5), False, "quota of 1.5 CPUs"),
    (None, "model", "cuda", None, under_quota(16, 2.0), True, "runs on the GPU"),
    # auto without a model to run (the cost-model executor): in process
    (None, "simulated", "cpu", None, topology(16), False, "executor simulated"),
])
def test_the_engine_core_s_process(core_process, executor, device, cpu_bind, topo, own, why):
    placement = plan_placement(cpu_bind, None, device, topo)
    decided, reason = plan_core_process(core_process, executor, device, placement, topo)
    assert decided is own
    assert why in reason
    assert reason.startswith("coreProcess")


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "400000 100000\n"}, 4.0),  # cgroup v2, a 4-CPU limit
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_the_cgroup_cpu_quota_is_read_from_either_cgroup_version(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert read_cpu_quota(tmp_path) == quota


def test_a_list_of_cpus_this_process_may_not_use_is_refused():
    with pytest.raises(ValueError, match=r"engine.cpuBind '1,6-7': CPU 6-7 is not among the CPUs this process may use \(0-3\)"):
        plan_placement("1,6-7", None, "cpu", topology(4))


def test_the_key_is_unset_by_default_and_keeps_older_restart_hashes():
    assert config_with().engine.cpu_bind is None
    assert "cpuBind" not in config_with().restart_fields()["engine"]
    assert config_with(cpuBind="0-3").restart_fields()["engine"]["cpuBind"] == "0-3"
    assert config_with(cpuBind="0-3", cpuThreads=4).engine.cpu_bind == "0-3"


@pytest.mark.parametrize("engine, message", [
    ({"cpuBind": "all"}, "cpuBind: 'all' is not a CPU list"),
    ({"cpuBind": "0-3", "cpuThreads": 2}, "cpuBind: lists 4 CPUs but cpuThreads is 2"),
    ({"cpuBind": False}, "cpuBind: expected a string"),  # YAML's `off`: the key says none
])
def test_bad_values_name_the_key(engine, message):
    with pytest.raises(ConfigError, match=message):
        config_with(**engine)


def thread_masks() -> dict[int, set[int]]:
    """CPUs each thread of this process may run on, by thread id."""
    masks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        masks[int(task.name)] = {cpu for part in line.split()[1].split(",") for cpu in _expand(part)}
    return masks


def _expand(part: str) -> range:
    lo, _, hi = part.partition("-")
    return range(int(lo), int(hi or lo) + 1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin two threads apart")
def test_a_step_loop_thread_pins_its_compute_threads_one_per_cpu(tiny_model_dir):
    """The step thread and the OpenMP worker it runs the model with each end up on one CPU of
    the list, in order, and the engine still serves."""
    from tokenlane.kernels import cpu_native
    from tokenlane.runtime.engine.llm_engine import LLMEngine
    from tokenlane.runtime.core.request import Request, SamplingParams

    if not cpu_native.available():
        pytest.skip(f"the native library is not built here: {cpu_native.load_error()}")
    first, second = sorted(os.sched_getaffinity(0))[-2:]
    cpus = f"{second},{first}"  # reversed on purpose: thread 0 (the step thread) on `second`
    engine = LLMEngine.from_config(RuntimeConfig.from_dict({
        "model": {"path": str(tiny_model_dir)},
        "engine": {"device": "cpu", "cpuBind": cpus, "kvCacheBlocks": 64},
    }))
    assert engine.executor.placement == Placement((second, first), tuple(
        c for c in sorted(os.sched_getaffinity(0)) if c not in (first, second)),
        tuple(sorted(os.sched_getaffinity(0))), engine.executor.placement.reason)
    seen = {}

    def step_loop():
        engine.pin_step_thread()
        engine.add_request(Request("pinned", [3, 4, 5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0)))
        while engine.has_unfinished_requests():
            for output in engine.step():
                seen.setdefault("tokens", []).extend(output.new_token_ids)
        seen["me"] = threading.get_native_id()
        seen["masks"] = thread_masks()

    thread = threading.Thread(target=step_loop)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    masks = seen["masks"]
    assert masks[seen["me"]] == {second}
    assert any(mask == {first} for tid, mask in masks.items() if tid != seen["me"])
    assert masks[threading.get_native_id()] != {second}  # the caller's own thread is left alone
    assert len(seen["tokens"]) == 6


def test_without_the_native_library_the_step_thread_is_confined_not_pinned(monkeypatch):
    """No native library (no C compiler): the compute threads cannot be pinned one per CPU, so
    the step thread (and the pool threads it starts) keeps to the listed CPUs, with that many
    threads, and the log says why."""
    import torch

    from tokenlane.kernels import cpu_native
    from tokenlane.runtime.executor.cpu_placement import bind_compute_threads

    monkeypatch.setattr(cpu_native, "load", lambda: None)
    monkeypatch.setattr(cpu_native, "load_error", lambda: "no C compiler ('cc' not found; set CC)")
    cpu = sorted(os.sched_getaffinity(0))[-1]
    placement = Placement((cpu,), (), tuple(sorted(os.sched_getaffinity(0))), "test")
    threads = torch.get_num_threads()
    seen = {}

    def step_thread():
        seen["said"] = bind_compute_threads(placement)
        seen["mask"] = os.sched_getaffinity(0)
        seen["threads"] = torch.get_num_threads()

    try:
        thread = threading.Thread(target=step_thread)
        thread.start()
        thread.join(30)
    finally:
        torch.set_num_threads(threads)
    assert seen["mask"] == {cpu} and seen["threads"] == 1
    assert seen["said"] == f"compute threads confined to {cpu}, not one per CPU (no C compiler ('cc' not found; set CC))"
    assert os.sched_getaffinity(0) == set(placement.allowed)  # the caller's thread is untouched
