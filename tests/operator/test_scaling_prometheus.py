"""The autoscaler's per-replica running query against Debian's `prometheus`.

Three stand-in replicas serve fixed /metrics text (the runtime's own series and labels); a real
Prometheus scrapes them twice a second. One replica then stops answering, as a removed pod does:
its series goes stale at once, although its samples stay inside the averaging range. The
sample must list each replica scraped now with its own share, and leave the removed one out.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tokenlane.operator.controllers import scaling
from tokenlane.operator.clients.prometheus import PrometheusClient

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not os.path.exists(PROMETHEUS),
                       reason="Debian's prometheus is not installed (scripts/test.sh installs it with apt-get)"),
]

MODEL = "tiny"


def _metrics(running: float) -> str:
    lane = f'model="{MODEL}",lane="interactive"'
    return ("# TYPE tokenlane_requests_running gauge\n"
            f"tokenlane_requests_running{{{lane}}} {running}\n"
            "# TYPE tokenlane_requests_total counter\n"
            f'tokenlane_requests_total{{{lane},outcome="completed"}} 100\n'
            "# TYPE tokenlane_requests_waiting gauge\n"
            f"tokenlane_requests_waiting{{{lane}}} 0\n"
            "# TYPE tokenlane_lane_budget gauge\n"
            f'tokenlane_lane_budget{{{lane},budget="maxActiveSequences"}} 100\n'
            "# TYPE tokenlane_kv_cache_usage_ratio gauge\n"
            f'tokenlane_kv_cache_usage_ratio{{model="{MODEL}"}} 0.1\n')


class _Replica:
    """A /metrics endpoint with a fixed running count; `down()` makes its scrapes fail."""

    def __init__(self, running: float) -> None:
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if not replica.up:
                    self.send_error(503)
                    return
                body = _metrics(running).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.up = True
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self) -> None:
        self.up = False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _count(client: PrometheusClient, promql: str) -> int:
    return len(await client.query(promql))


async def _until(client: PrometheusClient, promql: str, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await _count(client, promql) != count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{promql!r} did not reach {count} series in {timeout_s:.0f} s")
        time.sleep(0.2)


@pytest.fixture
def prometheus(tmp_path):
    replicas = [_Replica(90.0), _Replica(10.0), _Replica(50.0)]
    port = _free_port()
    targets = ", ".join(f"'127.0.0.1:{r.port}'" for r in replicas)
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 500ms, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: tokenlane\n    static_configs: [{{targets: [{targets}], labels: {{namespace: ml}}}}]\n")
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("prometheus not ready after 60 s")
            time.sleep(0.2)
        yield url, replicas
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for r in replicas:
            r.close()


async def test_each_replica_scraped_now_reads_its_own_running_share(prometheus):
    url, replicas = prometheus
    client = PrometheusClient(url)
    running = f'tokenlane_requests_running{{model="{MODEL}",namespace="ml"}}'
    await _until(client, running, 3)
    # The lane is known from its request rate, which needs two scrapes of each counter: wait for
    # them, or the third replica may go down before the first two were scraped twice.
    total = f'tokenlane_requests_total{{model="{MODEL}",namespace="ml"}}'
    await _until(client, f"count_over_time({total}[60s]) >= 2", 3)
    replicas[2].down()
    await _until(client, running, 2)  # a failed scrape marks the replica's series stale at once
    # Its samples are still inside the range that the load now is averaged over.
    assert await _count(client, f"avg_over_time({running}[15s])") == 3

    sample = await scaling.read_prometheus(url, MODEL, 60.0, {}, namespace="ml", at=time.time())
    assert sample.available, sample.error
    lane = sample.lanes["interactive"]
    assert lane.replica_running_shares == (0.1, 0.9)
    assert lane.running_share == pytest.approx(0.5, abs=0.1)  # the mean still averages the removed one in
