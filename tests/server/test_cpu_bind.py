"""engine.cpuBind through `tokenlane serve`: the compute threads on the listed CPU, the
server's event loop on the others, with the step loop in the server's process and in the
engine core's (which `engine.coreProcess` unset picks when the server keeps CPUs of its
own). Read back from /proc after a served request."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from serve_process import start_serve

from tokenlane.kernels import cpu_native

ALLOWED = sorted(os.sched_getaffinity(0))

pytestmark = [
    pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to keep the server and the engine apart"),
    pytest.mark.skipif(not cpu_native.available(), reason=f"no native library to pin with: {cpu_native.load_error()}"),
]


def thread_masks(pid: int) -> dict[int, set[int]]:
    masks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        cpus = set()
        for part in line.split()[1].split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        masks[int(task.name)] = cpus
    return masks


def core_pid(server_pid: int) -> int:
    """The engine core: the server's child that multiprocessing spawned (not its resource
    tracker)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid and b"spawn_main" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no engine core under {server_pid}")


@pytest.mark.parametrize("core_process", [False, True, None], ids=["in-process", "core-process", "auto"])
def test_compute_threads_and_the_server_run_apart(tiny_model_dir, tmp_path, core_process):
    engine_cpu, server_cpus = ALLOWED[-1], set(ALLOWED[:-1])
    config = tmp_path / "runtime.yaml"
    config.write_text(f"model:\n  path: {tiny_model_dir}\n  servedName: tiny\n"
                      "engine:\n  device: cpu\n  kvCacheBlocks: 128\n")
    flags = ["--cpu-bind", str(engine_cpu)]
    if core_process is not None:
        flags.append("--core-process" if core_process else "--no-core-process")
    own_process = core_process is not False  # unset: the server keeps CPUs of its own, so a process
    proc, url = start_serve(config, *flags)
    try:
        response = httpx.post(url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        server = thread_masks(proc.pid)
        assert server[proc.pid] == server_cpus  # the event loop's thread
        engine_pid = core_pid(proc.pid) if own_process else proc.pid
        engine = thread_masks(engine_pid)
        pinned = [tid for tid, mask in engine.items() if mask == {engine_cpu}]
        assert pinned, engine
        if own_process:
            assert engine[engine_pid] == {engine_cpu}  # the core's step loop runs in its main thread
            assert all(mask == server_cpus for mask in server.values()), server
        else:  # every other thread of the server (torch's idle pool from loading too) kept apart
            assert all(mask in (server_cpus, {engine_cpu}) for mask in server.values()), server
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert f"thread placement: 1 compute threads pinned to {engine_cpu}" in out
    if core_process is None:
        assert "step loop: coreProcess auto: own process (the server keeps CPU " in out
