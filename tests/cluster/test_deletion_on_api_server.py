"""Deleting a ModelService while one of its timers is mid-run, on a real API server.

kopf keeps its finalizer on a ModelService being deleted until every timer of the object has
returned, and while one is still running it looks again only every
`settings.background.cancellation_polling` seconds (60 by default). A `kubectl delete` that
came during a timer's run that then wrote nothing (Prometheus down: a quiet hold) hung for a
minute; the operator sets the poll short (handlers.TIMER_EXIT_POLL_S).

The slow path is made certain, not left to chance: a stand-in Prometheus holds the queries of
the autoscaling timer's run until the test releases them, the ModelService is deleted while
the run waits, and the hold is released only after the operator's delete handler has run (kopf
found the timer still running in that cycle). The bound is about the hang, not speed: the
ModelService is normally gone about a second after the release. (The same in kmock:
tests/operator/test_scaling_kmock.py.)"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cluster_harness import Cluster, OperatorProcess, wait_for

NS = "deletion"
NAME = "doomed"
HANG_BOUND_S = 30.0  # kopf's default poll: 60 s


class HeldPrometheus:
    """Prometheus's /api/v1/query answering no series; once `armed`, each answer is held until
    `release()`. A held answer trickles whitespace (valid before JSON) every half second, so
    the client's read timeout never fires: the query, and the timer's run, wait for the release."""

    def __init__(self) -> None:
        self.armed = False
        self.in_flight = 0
        self.holding = threading.Event()
        self.released = threading.Event()
        lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with lock:
                    fake.in_flight += 1
                try:
                    self.send_response(200)  # HTTP/1.0: the body ends when the connection closes
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    if fake.armed:
                        fake.holding.set()
                        while not fake.released.wait(0.5):
                            self.wfile.write(b" ")
                            self.wfile.flush()
                    self.wfile.write(json.dumps({"status": "success",
                                                 "data": {"resultType": "vector", "result": []}}).encode())
                except OSError:
                    pass  # the client went away
                finally:
                    with lock:
                        fake.in_flight -= 1

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


def model_service(prometheus_url: str) -> dict:
    return {
        "apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "replicas": 1,
            "model": {"path": "/models/simulated", "servedName": "tiny", "maxModelLen": 2048},
            "engine": {"device": "cpu", "executor": "simulated"},
            "gpus": {"count": 0},
            "monitoring": {"serviceMonitor": False},
            "autoscaling": {"enabled": True, "prometheusUrl": prometheus_url, "minReplicas": 1, "maxReplicas": 2,
                            "interval": "1s"},
            # The tuning timer's rollout guard runs once at the start, then not within the test.
            "tuning": {"interval": "1h"},
        },
    }


@pytest.fixture
def prometheus():
    fake = HeldPrometheus()
    yield fake
    fake.close()


@pytest.fixture
def operator(crds: Cluster, tmp_path):
    crds.kubectl("create", "namespace", NS)
    # The test's own credentials: the operator's RBAC is not what this module tests.
    process = OperatorProcess(Path(crds.kubeconfig), ["--namespace", NS, "--standalone"], tmp_path / "operator.log")
    try:
        yield process
    finally:
        crds.kubectl("-n", NS, "delete", "msvc", "--all", "--wait=true", "--timeout=60s", check=False, timeout=90)
        process.stop()
        print(process.log()[-6000:])
        crds.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=90s", check=False, timeout=120)


def test_deleted_mid_timer_run_it_is_gone_once_the_run_returns(crds: Cluster, prometheus: HeldPrometheus,
                                                               operator: OperatorProcess):
    crds.apply([model_service(prometheus.url)])
    # The first run writes its decision (a hold: no series); the next ones, the same again, write nothing.
    wait_for(lambda: ((crds.get("msvc", NAME, NS) or {}).get("status") or {}).get("autoscaling"), timeout=120,
             what="the first autoscaling decision in status")
    prometheus.armed = True
    wait_for(prometheus.holding.is_set, timeout=60, what="an autoscaling run waiting on Prometheus")
    crds.kubectl("-n", NS, "delete", "msvc", NAME, "--wait=false")
    wait_for(lambda: f"ModelService {NS}/{NAME} deleted" in operator.log(), timeout=60,
             what="the operator's delete handler")
    assert prometheus.in_flight > 0  # the run still waits on its query: kopf keeps the finalizer
    assert crds.get("msvc", NAME, NS) is not None

    prometheus.release()
    started = time.monotonic()
    wait_for(lambda: crds.get("msvc", NAME, NS) is None, timeout=HANG_BOUND_S + 60, interval=0.2,
             what="the ModelService gone")
    took = time.monotonic() - started
    assert took < HANG_BOUND_S, f"the finalizer stayed {took:.0f}s after the timer's run returned"
