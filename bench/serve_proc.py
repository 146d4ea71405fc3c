"""Start and stop `tokenlane serve` as a subprocess on loopback (demo and `bench compare`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import yaml


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_path(data: dict, dotted: str, value) -> None:
    """data["a"]["b"] = value for "a.b" (creating sections); lanes by name: lanes.NAME.key."""
    keys = dotted.split(".")
    node = data
    for i, key in enumerate(keys[:-1]):
        if isinstance(node, list):
            match = [item for item in node if isinstance(item, dict) and item.get("name") == key]
            if not match:
                raise ValueError(f"{dotted}: no list item named {key!r}")
            node = match[0]
        else:
            node = node.setdefault(key, {})
    if isinstance(node, list):
        raise ValueError(f"{dotted}: cannot set a whole list item")
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, object]:
    """'engine.continuousBatching=false' -> ('engine.continuousBatching', False) (YAML value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"override {text!r} must look like section.key=value")
    return key.strip(), yaml.safe_load(raw)


class ServerProcess:
    """`tokenlane serve --config FILE --host 127.0.0.1 --port P` until stop(): SIGTERM, then
    wait for the graceful drain (SIGKILL only if it overstays `stop_timeout_s`)."""

    def __init__(self, config: dict, workdir: Path, name: str, *, port: Optional[int] = None,
                 ready_timeout_s: float = 120.0, grace_s: float = 5.0, stop_timeout_s: float = 30.0,
                 env: Optional[dict[str, str]] = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / f"{name}.runtime.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = self.workdir / f"{name}.server.log"
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.stop_timeout_s = stop_timeout_s
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.exit_code: Optional[int] = None
        self.stop_seconds: Optional[float] = None

    # What a subclass may change to launch another OpenAI-compatible server (bench/vs_vllm.py).
    ready_path = "/ready"  # answers 200 once the server takes requests
    description = "tokenlane serve"
    cwd: Optional[Path] = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tokenlane.cli", "serve", "--config", str(self.config_path),
                "--host", "127.0.0.1", "--port", str(self.port), "--shutdown-grace-seconds", str(self.grace_s),
                "--log-level", "warning"]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.env or {})
        return env

    def start(self) -> "ServerProcess":
        import httpx

        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.environment(), cwd=self.cwd)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.description} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1.0, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.description} not ready after {self.ready_timeout_s:g} s:\n{self.log_tail()}")

    def stop(self) -> Optional[int]:
        if self.proc is None or self.exit_code is not None:
            return self.exit_code
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        self.stop_seconds = time.monotonic() - t0
        self._log.close()
        return self.exit_code

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
