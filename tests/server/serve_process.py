"""A real `tokenlane serve` subprocess on a free loopback port, for the tests that need the
process itself (signals, exit codes, its log)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Optional

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(config_path, *flags: str, env: Optional[dict] = None,
                timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    """(the process, its base URL) once /ready answers 200; the log is on proc.stdout. `env`:
    variables added to this process's environment for the server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenlane.cli", "serve", "--config", str(config_path), "--host", "127.0.0.1",
         "--port", str(port), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=None if env is None else {**os.environ, **env},
    )
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() >= deadline:
            proc.kill()
            raise AssertionError("server did not become ready")
        time.sleep(0.2)
