"""A served `tokenlane serve` ends its process without CPython's teardown (which took 2-4 s of
garbage collection and module unloading with torch loaded, on every stop), after the graceful
drain (tests/server/test_shutdown.py), the atexit handlers and a flushed log."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import httpx
from serve_process import free_port

CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 128, device: cpu, executor: simulated}}
"""

# `tokenlane serve` as the console script runs it, plus two witnesses: an atexit handler (must
# run) and a module global whose finalizer only the interpreter's teardown would run.
WRAPPER = textwrap.dedent("""
    import atexit, sys
    from tokenlane.runtime.entrypoints.server import main

    class TeardownWitness:
        def __del__(self):
            print("teardown ran", flush=True)

    witness = TeardownWitness()
    atexit.register(lambda: print("atexit ran", flush=True))
    sys.exit(main(sys.argv[1:]))
""")


def wait_ready(proc: subprocess.Popen, url: str) -> None:
    for _ in range(600):  # at most about 2 minutes (a cold import of torch on a busy host)
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become ready")


def test_a_served_process_skips_the_interpreter_teardown(tiny_model_dir, tmp_path):
    config = tmp_path / "runtime.yaml"
    config.write_text(CONFIG.format(model=tiny_model_dir))
    wrapper = tmp_path / "serve_wrapper.py"
    wrapper.write_text(WRAPPER)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(wrapper), "--config", str(config), "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "shutdown complete; exit 0" in output and output.splitlines()[-1] == "atexit ran", output[-2000:]
    assert "teardown ran" not in output
