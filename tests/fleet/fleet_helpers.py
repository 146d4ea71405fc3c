"""Fleet test helpers: real `tokenlane serve` processes on loopback, and the router in front
of them, either as a `tokenlane router` process or in this process under real uvicorn (so a
test can look at the router's view of the fleet).

Two kinds of replica: the tiny model (real tokenizer, real weights; lanes, streaming and the
openai client), and the simulated executor, whose steps sleep for an 8B model's step time on
an H200 (about 6 ms per decode step), so a request with thousands of tokens to generate is
slow by construction and a test can disconnect, saturate or kill while it runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tokenlane.bench.serve_proc import ServerProcess, free_port
from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.fleet.router import RouterOptions, create_router_app
from tokenlane.runtime.fleet.state import BackendSet

LANES = [
    {"name": "interactive", "default": True, "priority": 100, "weight": 4},
    {"name": "batch", "class": "batch", "priority": 10, "weight": 1, "match": {"minPromptTokens": 200}},
]


def tiny_config(model_dir: Path) -> dict:
    return {
        "model": {"path": str(model_dir), "servedName": "tiny", "maxModelLen": 512},
        "engine": {"blockSize": 16, "kvCacheBlocks": 256, "device": "cpu"},
        "scheduler": {"maxActiveSequences": 8, "maxBatchedTokens": 256, "prefillChunkSize": 128},
        "lanes": LANES,
    }


def simulated_config() -> dict:
    """Interactive lane: one running sequence and a queue of one, so two requests fill it."""
    return {
        "model": {"path": "simulated/llama3-8b", "servedName": "sim", "maxModelLen": 32768},
        "engine": {"executor": "simulated", "kvCacheBlocks": 8192, "blockSize": 16},
        "scheduler": {"maxActiveSequences": 4, "maxWaitingRequests": 16, "maxBatchedTokens": 1024,
                      "prefillChunkSize": 512, "queueTimeoutMs": 120000, "streamIdleTimeoutMs": 120000},
        "lanes": [{**LANES[0], "maxActiveSequences": 1, "maxWaitingRequests": 1}, LANES[1]],
    }


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` at `url`/metrics whose labels include `labels`."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    """Poll until `predicate()` holds (the timeout bounds a broken test; it is not a timing
    assumption: every wait is for a state the test brought about)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_replicas(config: dict, workdir: Path, count: int, grace_s: float = 2.0) -> list[ServerProcess]:
    """`count` `tokenlane serve` processes, started in parallel."""
    procs = [ServerProcess(config, workdir, f"replica{i}", ready_timeout_s=180, grace_s=grace_s)
             for i in range(count)]
    with ThreadPoolExecutor(count) as pool:
        errors = [f.exception() for f in [pool.submit(p.start) for p in procs]]
    if any(errors):
        for p in procs:
            p.stop()
        raise next(e for e in errors if e)
    return procs


@dataclass
class RouterProcess:
    """`tokenlane router` as a process (the command line as users run it)."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, backends: list[str], workdir: Path, *args: str) -> "RouterProcess":
        port = free_port()
        log_path = workdir / "router.log"
        cmd = [sys.executable, "-m", "tokenlane.cli", "router", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", *args]
        for backend in backends:
            cmd += ["--backend", backend]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        router = cls(f"http://127.0.0.1:{port}", proc, log_path)

        def ready() -> bool:
            assert proc.poll() is None, f"tokenlane router exited:\n{log_path.read_text()}"
            try:
                return httpx.get(router.url + "/ready", timeout=1, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, "the router to be ready", 60)
        return router

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@dataclass
class LiveRouter:
    """The router app under uvicorn in a thread of this process."""

    url: str
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def fleet(self):
        return self.app.state.fleet

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "router thread did not stop"


def start_router(backends: list[str], config: Optional[RuntimeConfig] = None,
                 options: Optional[RouterOptions] = None) -> LiveRouter:
    app = create_router_app(BackendSet(backends), config, options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", server_header=False,
                                          date_header=False, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="router")
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), "the router to start", 60)
    assert thread.is_alive(), "router failed to start"
    return LiveRouter(f"http://127.0.0.1:{port}", app, server, thread)
