"""Server test harness: the real engine and tiny model behind real uvicorn on loopback.

`serve(yaml_text)` writes the config (with `{model}` replaced by the tiny checkpoint) to a
temporary runtime.yaml, opens its engine (`open_client`), and runs `create_app` under
uvicorn in a background thread on 127.0.0.1 with an OS-chosen port. Every server is shut
down at the end of the test (or module, for `shared_server`).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tokenlane.runtime.config import load_config
from tokenlane.runtime.entrypoints.app import ServerOptions, create_app

# --import-mode=importlib does not put test folders on sys.path: the helper module
# serve_process.py (a unique name) is imported by the tests that start `tokenlane serve`.
sys.path.insert(0, str(Path(__file__).parent))

BASIC_CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler:
  maxActiveSequences: 16
  maxWaitingRequests: 64
  maxBatchedTokens: 256
  prefillChunkSize: 128
  queueTimeoutMs: 30000
  streamIdleTimeoutMs: 10000
lanes:
  - {{name: interactive, default: true, priority: 100, weight: 4}}
  - {{name: batch, class: batch, priority: 10, weight: 1, match: {{minPromptTokens: 200}}}}
"""


@dataclass
class LiveServer:
    url: str
    config_path: Path
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self):
        return self.app.state.tokenlane

    @property
    def engine(self):
        """The LLMEngine of an in-process server (the tests reach into it)."""
        return self.state.client.llm_engine

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
        total = 0.0
        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def wait_metric(self, name: str, predicate, timeout: float = 20.0, **labels) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name, **labels)
            if predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{labels} = {value} did not reach the expected value")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "server thread did not stop"


def start_server(config_text: str, model_dir: Path, tmp_dir: Path, *, grace_s: float = 5.0,
                 wrap=None, on_core_start=None) -> LiveServer:
    """`wrap(app)` may return an ASGI middleware around the app (to inject faults). With
    `engine.coreProcess: true` in the config the engine runs in its own process, and
    `on_core_start` is its `on_start` hook (see core_hooks.py); unset, it runs in this
    process whatever the host (the tests reach into the in-process engine)."""
    from tokenlane.runtime.engine.client import open_client

    config_path = tmp_dir / "runtime.yaml"
    config_path.write_text(config_text.format(model=model_dir))
    config = load_config(config_path)
    client = open_client(config, on_core_start, own_process=bool(config.engine.core_process))
    app = create_app(client, config_path,
                     options=ServerOptions(shutdown_grace_s=grace_s, config_poll_interval_s=0.05))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(wrap(app) if wrap else app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", config_path, app, server, thread)


@pytest.fixture(scope="module")
def serve(tiny_model_dir, tmp_path_factory):
    """Start servers: `serve(yaml_text)` -> LiveServer; all are stopped when the module ends."""
    servers: list[LiveServer] = []

    def _serve(config_text: str = BASIC_CONFIG, **kwargs) -> LiveServer:
        live = start_server(config_text, tiny_model_dir, tmp_path_factory.mktemp("server"), **kwargs)
        servers.append(live)
        return live

    yield _serve
    for live in servers:
        live.stop()


@pytest.fixture(scope="module")
def shared_server(serve):
    """One server with BASIC_CONFIG for the tests of a module that do not change it."""
    return serve(BASIC_CONFIG)


@pytest.fixture
def sse():
    return sse_events


def sse_events(lines) -> list[Any]:
    """Parse `data: ...` SSE lines into JSON objects (and the literal "[DONE]")."""
    import json

    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


