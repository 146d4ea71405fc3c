"""The tuner against real parts: Debian's `prometheus` scraping a real `tokenlane serve`.

A runtime on the tiny model serves two lanes; Prometheus scrapes its /metrics every second;
some traffic runs; the tuner reads the per-lane numbers back through real PromQL, decides a
budget change, the change is written to the runtime's config file (what the kubelet does when
the operator updates the ConfigMap), the runtime hot-reloads it and the new value appears in
its /metrics, with no restart.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tuner_helpers import apply_budgets, lane_targets

from tokenlane.operator.clients.prometheus import PrometheusClient, queries
from tokenlane.operator.controllers.tuning import read_prometheus
from tokenlane.operator.policy.tuner import decide
from tokenlane.operator.api.tuning_types import ADJUST, Bounds, EffectiveBudgets, TunerSettings
from tokenlane.runtime.config import dumps_config, load_config

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not os.path.exists(PROMETHEUS),
                       reason="Debian's prometheus is not installed (scripts/test.sh installs it with apt-get)"),
]

# The interactive lane's TTFT target (1 ms) cannot be met on a CPU: the tuner must act.
RUNTIME_YAML = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler: {{maxActiveSequences: 16, maxWaitingRequests: 64, maxBatchedTokens: 256, prefillChunkSize: 128,
            queueTimeoutMs: 30000}}
lanes:
  - {{name: interactive, default: true, priority: 100, weight: 4, slo: {{ttftP95Ms: 1, tpotP95Ms: 1000}}}}
  - {{name: batch, class: batch, priority: 10, weight: 1}}
"""
BOUNDS = {
    "interactive": {"maxBatchedTokens": Bounds(64, 256), "maxActiveSequences": Bounds(4, 16),
                    "prefillChunkSize": Bounds(32, 256)},
    "batch": {"maxBatchedTokens": Bounds(64, 256), "maxActiveSequences": Bounds(2, 16),
              "prefillChunkSize": Bounds(32, 256)},
}
WINDOW_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready at {url} after {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _budget(metrics_text: str, lane: str, budget: str) -> float | None:
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "tokenlane_lane_budget" and s.labels.get("lane") == lane and s.labels.get("budget") == budget:
                return s.value
    return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    """A `tokenlane serve` subprocess and a Prometheus scraping it every second."""
    tmp = tmp_path_factory.mktemp("prom-stack")
    config_path = tmp / "runtime.yaml"
    config_path.write_text(RUNTIME_YAML.format(model=tiny_model_dir))
    port, prom_port = _free_port(), _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENLANE_TEST_TORCH_THREADS": "1"}
    log = open(tmp / "serve.log", "w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "tokenlane.cli", "serve", "--config", str(config_path), "--host", "127.0.0.1",
         "--port", str(port), "--config-poll-seconds", "0.2", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        # The target label Kubernetes discovery / a ServiceMonitor adds; the tuner selects by it.
        f"  - job_name: tokenlane\n    static_configs: [{{targets: ['127.0.0.1:{port}'], labels: {{namespace: ml}}}}]\n"
    )
    prom_log = open(tmp / "prometheus.log", "w")
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=prom_log, stderr=subprocess.STDOUT,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/ready", serve, 120, "tokenlane serve")
        _wait_http(f"http://127.0.0.1:{prom_port}/-/ready", prom, 60, "prometheus")
        yield {"url": f"http://127.0.0.1:{port}", "prom": f"http://127.0.0.1:{prom_port}",
               "config_path": config_path}
    finally:
        _stop(prom)
        _stop(serve)
        log.close()
        prom_log.close()


def _traffic(url: str, n: int, lane: str, prompt: str, max_tokens: int) -> list[int]:
    def one(i: int) -> int:
        r = httpx.post(f"{url}/v1/completions", headers={"X-Lane": lane}, timeout=120,
                       json={"model": "tiny", "prompt": f"{prompt} {i}", "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True})
        return r.status_code

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(n)))


def _wait_until_scraped(prom_url: str, query: str, lanes: set[str], timeout_s: float = 60.0) -> None:
    """Until Prometheus has a sample of `query` for each lane with a value >= 1."""
    client = PrometheusClient(prom_url, timeout_s=10)
    deadline = time.monotonic() + timeout_s
    while True:
        series = asyncio.run(client.query(query))
        if lanes <= {s.labels.get("lane") for s in series if s.value is not None and s.value >= 1}:
            return
        assert time.monotonic() < deadline, f"Prometheus never scraped {query} for {lanes}: {series}"
        time.sleep(0.2)


def test_tuner_reads_prometheus_changes_a_budget_and_the_runtime_reloads_it(stack):
    url, prom_url, config_path = stack["url"], stack["prom"], stack["config_path"]
    # One request per lane first: a counter series that appears between two scrapes already
    # at its final value has no rate() in Prometheus, so let each series be scraped first.
    statuses = _traffic(url, 1, "interactive", "warm up", 2) + _traffic(url, 1, "batch", "warm up", 2)
    _wait_until_scraped(prom_url, 'sum by (lane) (tokenlane_time_to_first_token_seconds_count{model="tiny"})',
                        {"interactive", "batch"})
    statuses += _traffic(url, 24, "interactive", "hello there, how are you", 8)
    statuses += _traffic(url, 6, "batch", "summarise this document " * 8, 8)
    assert statuses.count(200) == len(statuses), statuses

    config = load_config(config_path)
    lanes = lane_targets(config, BOUNDS)
    settings = TunerSettings(cooldown_s=WINDOW_S, window_s=WINDOW_S, min_requests=5)

    # Wait until Prometheus has scraped the traffic (rate() needs two samples in the window).
    deadline = time.monotonic() + 60
    while True:
        # What the operator's timer calls (operator/controllers/tuning.py): model and namespace select the series.
        sample = asyncio.run(read_prometheus(prom_url, "tiny", WINDOW_S, ["interactive", "batch"], namespace="ml"))
        assert sample.available, sample.error
        inter = sample.lanes["interactive"]
        batch = sample.lanes["batch"]
        if (inter.request_rate * WINDOW_S >= settings.min_requests and inter.ttft_p95_s is not None
                and batch.request_rate * WINDOW_S >= 5):
            break
        assert time.monotonic() < deadline, f"no usable window from Prometheus: {sample}"
        time.sleep(1.0)
    assert sample.lanes["interactive"].tpot_p95_s is not None
    assert sample.kv_usage is not None

    decision = decide(lanes, settings, EffectiveBudgets.from_config(config), sample, [], time.time())
    assert decision.action == ADJUST, decision.reason
    assert decision.slo["interactive"].met is False and decision.slo["interactive"].reason == "TtftAboveTarget"
    change = decision.changes[0]

    # What the kubelet does with a changed ConfigMap: the mounted file is replaced in place.
    new_config = apply_budgets(config, decision.budgets)
    tmp = config_path.with_suffix(".tmp")
    tmp.write_text(dumps_config(new_config))
    os.replace(tmp, config_path)

    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        if _budget(text, change.scope, change.knob) == change.new:
            break
        assert time.monotonic() < deadline, f"{change} never showed in /metrics"
        time.sleep(0.3)
    # Every changed knob is in force, and the runtime did not restart (it kept its counters).
    for c in decision.changes:
        assert _budget(text, c.scope, c.knob) == c.new, c
    assert 'tokenlane_config_reloads_total{model="tiny",result="success"} 1.0' in text
    assert _traffic(url, 2, "interactive", "still serving", 4) == [200, 200]


def test_label_values_cannot_inject_promql():
    with pytest.raises(ValueError, match="quotes"):
        queries('tiny"} or vector(1) #', 30)


def test_unreachable_prometheus_gives_an_unavailable_sample():
    port = _free_port()  # nothing listens there
    sample = asyncio.run(PrometheusClient(f"http://127.0.0.1:{port}", timeout_s=2).read_sample("tiny", 30))
    assert not sample.available
    assert "cannot reach" in sample.error


def test_bad_promql_is_reported_not_raised(stack):
    client = PrometheusClient(stack["prom"], timeout_s=5)

    async def go():
        from tokenlane.operator.clients.prometheus import PrometheusError

        with pytest.raises(PrometheusError, match="bad_data"):
            await client.query("sum by (lane (")

    asyncio.run(go())
    assert set(queries("tiny", 30)) >= {"ttft_p95", "tpot_p95", "queue_delay_p95", "requests", "kv_usage"}


def test_a_batch_of_queries_shares_one_client(stack, monkeypatch):
    """read_sample's queries run at once over one connection pool, not one client each; a
    bad query in the batch fails the batch."""
    import httpx

    from tokenlane.operator.clients import prometheus
    from tokenlane.operator.clients.prometheus import PrometheusError

    opened = []

    class CountingClient(httpx.AsyncClient):
        def __init__(self, *args, **kwargs):
            opened.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(prometheus.httpx, "AsyncClient", CountingClient)
    client = PrometheusClient(stack["prom"], timeout_s=5)
    named = queries("tiny", 30)
    results = asyncio.run(client.query_all(named))
    assert list(results) == list(named) and opened == [1]
    assert asyncio.run(client.query_all({"one": "vector(1)"}))["one"][0].value == 1.0
    with pytest.raises(PrometheusError, match="bad_data"):
        asyncio.run(client.query_all({"one": "vector(1)", "bad": "sum by (lane ("}))
