"""SIGTERM on a real `tokenlane serve` process: stop admitting (503 + Retry-After on /ready
and on new requests), let in-flight work finish, then exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from serve_process import start_serve

# The simulated executor sleeps each step's simulated GPU time (about 6 ms per decode step
# here): the short request needs about 0.1 s; the long one at least 60 s, so it is still in
# flight, keeping the drain open, until the test's client leaves. How a grace period that
# runs out aborts what is left is tested in-process (tests/runtime/test_async_engine.py).
CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 16384}}
engine: {{blockSize: 16, kvCacheBlocks: 1024, device: cpu, executor: simulated}}
scheduler: {{maxActiveSequences: 8, maxBatchedTokens: 256, prefillChunkSize: 128}}
"""

GRACE_S = 120.0
LONG_TOKENS = 10_000


class StreamReader(threading.Thread):
    def __init__(self, url, max_tokens):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first_token = threading.Event()
        self.leave = threading.Event()  # set: close the connection (the client goes away)
        self.events, self.error = [], None

    def run(self):
        try:
            payload = {"prompt": [7, 8, 9], "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}
            with httpx.stream("POST", self.url + "/v1/completions", json=payload, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if self.leave.is_set():
                        break
                    if line.startswith("data: "):
                        self.events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        self.first_token.set()
        except Exception as exc:  # reported by the test
            self.error = exc
            self.first_token.set()

    @property
    def finish_reason(self):
        reasons = [e["choices"][0]["finish_reason"] for e in self.events if isinstance(e, dict) and e["choices"]]
        return reasons[-1] if reasons else None

    @property
    def completion_tokens(self):
        return next(e["usage"]["completion_tokens"] for e in self.events if isinstance(e, dict) and e.get("usage"))


def test_sigterm_drains_and_exits_cleanly(tiny_model_dir, tmp_path):
    config = tmp_path / "runtime.yaml"
    config.write_text(CONFIG.format(model=tiny_model_dir))
    proc, url = start_serve(config, "--shutdown-grace-seconds", str(GRACE_S), "--log-level", "info")
    try:
        short = StreamReader(url, max_tokens=16)  # finishes while the server drains
        long = StreamReader(url, max_tokens=LONG_TOKENS)  # in flight until its client leaves
        for reader in (short, long):
            reader.start()
            assert reader.first_token.wait(30) and reader.error is None, reader.error

        proc.send_signal(signal.SIGTERM)
        while (ready := httpx.get(url + "/ready", timeout=5)).status_code == 200:
            time.sleep(0.02)
        assert ready.status_code == 503 and int(ready.headers["retry-after"]) >= 1
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # alive while draining
        refused = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "draining" and int(refused.headers["retry-after"]) >= 1

        short.join(30)
        assert short.error is None, short.error
        assert short.finish_reason == "length" and short.completion_tokens == 16
        assert short.events[-1] == "[DONE]"
        assert long.is_alive() and proc.poll() is None  # the drain waits for the long request

        # Its client leaves: the last in-flight request is aborted, the drain is done, and
        # the process exits 0 long before the grace period would have ended.
        long.leave.set()
        long.join(30)
        assert long.error is None, long.error
        assert proc.wait(timeout=60) == 0
        output = proc.stdout.read()
        assert "draining" in output and "shutdown complete; exit 0" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
