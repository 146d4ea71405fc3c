"""Real parts for the closed-loop test (test_closed_loop_on_api_server.py): Debian's Prometheus,
a `tokenlane serve` process, scripted traffic, and a timeline of what happened.

Nothing here fakes the loop: Prometheus scrapes the runtime's /metrics over HTTP, the operator
reads it back through PromQL, and the runtime hot-reloads the file the kubelet stand-in keeps
equal to the operator's ConfigMap. The runtime runs `engine.executor: simulated`: the real
scheduler, lanes and admission with a model step that sleeps for a cost model's step time, so
a flood starves the interactive lane by construction (all slots taken by long batch requests),
not by how busy the test machine's CPUs happen to be.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cluster_harness import SHARED_K8S, Cluster, free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll `url` until it answers 200 (a readiness wait with a generous cap)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{what} not ready at {url} after {timeout:.0f}s")


def stop_process(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


class Prometheus:
    """Debian's `prometheus` scraping one runtime every second, with the `namespace` target
    label a ServiceMonitor would add (the tuner selects the ModelService's series by it)."""

    def __init__(self, workdir: Path, target_port: int, namespace: str):
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: tokenlane\n    static_configs: [{{targets: ['127.0.0.1:{target_port}'], "
            f"labels: {{namespace: {namespace}}}}}]\n")
        self.proc: Optional[subprocess.Popen] = None
        self._log = open(workdir / "prometheus.log", "a")

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'prometheus-data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        wait_http(f"{self.url}/-/ready", self.proc, 60, "prometheus")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        stop_process(self.proc)

    def close(self) -> None:
        self.stop()
        self._log.close()


class Runtime:
    """`tokenlane serve --config FILE` on a fixed loopback port (the Prometheus target), FILE
    being what the kubelet stand-in projects from the ConfigMap."""

    def __init__(self, config_file: Path, log_path: Path, port: int):
        self.config_file, self.port = config_file, port
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "a")
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenlane.cli", "serve", "--config", str(self.config_file), "--host", "127.0.0.1",
             "--port", str(self.port), "--config-poll-seconds", "0.2", "--log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        wait_http(f"{self.url}/ready", self.proc, 120, "tokenlane serve")

    def budget(self, lane: str, knob: str) -> Optional[float]:
        """The runtime's own view of a lane budget in force (`tokenlane_lane_budget`)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "tokenlane_lane_budget" and s.labels.get("lane") == lane and s.labels.get("budget") == knob:
                    return s.value
        return None

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()


class Traffic:
    """A paced interactive stream (open loop: one request every `interactive_every_s`, whatever
    the latency, so a window's request count does not depend on how the server is doing) and a
    batch flood of `flood_clients` closed-loop clients sending long-output requests."""

    def __init__(self, url: str, *, interactive_every_s: float = 0.5, interactive_prompt_tokens: int = 100,
                 flood_clients: int = 10, flood_max_tokens: int = 300):
        self.url = url
        self.every = interactive_every_s
        # The simulated executor has no tokenizer: 4 bytes of text are one token. A unique
        # head keeps the prefix cache from shortening the prefill.
        self.interactive_prompt_bytes = 4 * interactive_prompt_tokens
        self.flood_clients, self.flood_max_tokens = flood_clients, flood_max_tokens
        self.client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))
        self._stop = threading.Event()
        self._flood = threading.Event()
        self._lock = threading.Lock()
        self.statuses: dict[str, dict[int, int]] = {"interactive": {}, "batch": {}}
        self._threads: list[threading.Thread] = []

    def _post(self, lane: str, prompt: str, max_tokens: int) -> None:
        try:
            code = self.client.post(f"{self.url}/v1/completions", headers={"X-Lane": lane},
                                    json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0}).status_code
        except httpx.HTTPError:
            code = 0
        with self._lock:
            self.statuses[lane][code] = self.statuses[lane].get(code, 0) + 1

    def _interactive(self) -> None:
        i = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            prompt = f"{i:08d}" + "q" * (self.interactive_prompt_bytes - 8)
            threading.Thread(target=self._post, args=("interactive", prompt, 4), daemon=True).start()
            i += 1
            next_at += self.every
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _batch(self, k: int) -> None:
        j = 0
        while not self._stop.is_set():
            if not self._flood.wait(0.2):
                continue
            self._post("batch", f"{k:03d}-{j:06d} " + "b" * 52, self.flood_max_tokens)
            j += 1

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._interactive, daemon=True)]
        self._threads += [threading.Thread(target=self._batch, args=(k,), daemon=True) for k in range(self.flood_clients)]
        for t in self._threads:
            t.start()

    def flood(self, on: bool) -> None:
        (self._flood.set if on else self._flood.clear)()

    def close(self) -> None:
        self._stop.set()
        self._flood.clear()
        for t in self._threads:
            t.join(timeout=150)
        self.client.close()


def lane_window(prometheus_url: str, model: str, namespace: str, window_s: float, lanes: list[str]) -> dict:
    """{lane: (TTFT p95 ms or None, refused share, requests in the window)} over the last
    `window_s`, read with the operator's own PromQL (tokenlane.operator.controllers.tuning.read_prometheus);
    {} when Prometheus cannot be read."""
    from tokenlane.operator.controllers.tuning import read_prometheus

    sample = asyncio.run(read_prometheus(prometheus_url, model, window_s, lanes, namespace=namespace))
    if not sample.available:
        return {}
    out = {}
    for lane in lanes:
        m = sample.lanes.get(lane)
        if m is None:
            out[lane] = (None, 0.0, 0)
            continue
        total = m.request_rate + m.rejection_rate
        out[lane] = (None if m.ttft_p95_s is None else m.ttft_p95_s * 1000.0,
                     m.rejection_rate / total if total > 0 else 0.0, int(round(total * window_s)))
    return out


class Timeline:
    """What happened, in order, for the run's note: phases, the operator's decisions
    (status.tuning.lastDecision) and Events, and the interactive lane's TTFT p95 and refused
    share per window as Prometheus has them. A background thread polls the cluster and
    Prometheus; `write()` prints it and saves it to $TOKENLANE_CLOSED_LOOP_TIMELINE."""

    def __init__(self, cluster: Cluster, namespace: str, name: str, window_s: float,
                 prometheus: Callable[[], Optional[str]], model: str, lanes: list[str]):
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.window_s, self.prometheus, self.model, self.lanes = window_s, prometheus, model, lanes
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        self._seen_events: set[tuple[str, int]] = set()
        self._last_decision: Optional[tuple] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def note(self, kind: str, text: str) -> None:
        with self._lock:
            self.lines.append(f"{time.monotonic() - self.t0:6.1f}s  {kind:<8} {text}")

    def start(self) -> None:
        self._thread.start()

    def _poll(self) -> None:
        next_window = 0.0
        while not self._stop.wait(2.0):
            try:
                self._poll_cluster()
                if time.monotonic() >= next_window:
                    next_window = time.monotonic() + self.window_s / 2
                    self._poll_window()
            except Exception as exc:  # a poll that fails is a gap in the note, not a test failure
                self.note("poll", f"failed: {exc!r}"[:200])

    def _poll_cluster(self) -> None:
        result = self.cluster.kubectl("-n", self.namespace, "get", "events", "-o", "json", check=False, timeout=30)
        if result.returncode == 0:
            items = sorted(json.loads(result.stdout)["items"],
                           key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
            for e in items:
                key = (e["metadata"]["uid"], int(e.get("count") or 1))
                # The operator's Events (the stand-in's pods have no node: the endpoints
                # controller's complaints about them are noise here).
                if key in self._seen_events or e["involvedObject"]["kind"] not in ("ModelService", "ServingLane"):
                    continue
                self._seen_events.add(key)
                self.note("event", f"{e['type']} {e['reason']} {e['involvedObject']['kind']}/"
                                   f"{e['involvedObject']['name']}: {e.get('message', '')}"[:400])
        msvc = self.cluster.get("msvc", self.name, self.namespace)
        decision = ((msvc or {}).get("status") or {}).get("tuning", {}).get("lastDecision")
        if decision:
            key = (decision.get("at"), decision.get("action"), decision.get("reason"))
            if key != self._last_decision:
                self._last_decision = key
                self.note("decision", f"{decision.get('action')}: {decision.get('reason')}"[:400])

    def _poll_window(self) -> None:
        url = self.prometheus()
        if url is None:
            return
        numbers = lane_window(url, self.model, self.namespace, self.window_s, self.lanes)
        if not numbers:
            self.note("window", "Prometheus unavailable")
            return
        parts = []
        for lane, (ttft, refused, n) in numbers.items():
            shown = "-" if ttft is None else f"{ttft:.0f}ms"
            parts.append(f"{lane}: TTFT p95 {shown}, refused {refused:.1%} ({n} req)")
        self.note("window", f"last {self.window_s:.0f}s: " + "; ".join(parts))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def write(self) -> str:
        text = "\n".join(["closed loop timeline (seconds since setup)"] + self.lines) + "\n"
        print(text)
        path = os.environ.get("TOKENLANE_CLOSED_LOOP_TIMELINE")
        if path:
            Path(path).write_text(text)
        return text


class KubeletStandin:
    """../shared/k8s/kubelet-standin.sh: keeps `out` equal to the ConfigMap's runtime.yaml and
    marks the pods matching `selector` Ready. The test runs one for the file from the start and
    one for readiness once the runtime answers /ready (the kubelet's readiness probe), so the
    operator verifies a revision only while the runtime really serves it."""

    def __init__(self, cluster: Cluster, namespace: str, selector: str, configmap: str, out: Path):
        self.proc = subprocess.Popen(
            ["bash", str(SHARED_K8S / "kubelet-standin.sh"), namespace, selector, configmap, "runtime.yaml", str(out),
             "0.5"], env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)
