"""At a rollback the operator asks the runtime pods for a flight recorder dump and names the
files in the RolledBack Event: the running operator (kopf) against the kmock emulator, with a
local HTTP server standing in for Prometheus (the pods' addresses) and for the pods
(`POST /debug/dump`). The runtime's own endpoint is tested in tests/server/test_debug_dump.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from test_rollback_kmock import NS, advance, events, runtime_yaml, sample, start_stable, wait, _samples

from tokenlane.operator.clients import dumps

pytestmark = pytest.mark.timeout(240)


class PodsAndPrometheus:
    """One loopback server playing Prometheus (`/api/v1/query` answers the series of two
    runtime pods) and the first pod (`/debug/dump`); nothing listens at the second pod's
    address, as for a pod that is already gone."""

    def __init__(self) -> None:
        self.queries: list[str] = []
        self.dumps: list[str] = []  # the reasons asked for
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet test output
                pass

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                url = urlsplit(self.path)
                if url.path != "/api/v1/query":
                    return self._json(404, {})
                server.queries.append(parse_qs(url.query)["query"][0])
                pods = {"tiny-0": f"127.0.0.1:{server.port}", "tiny-1": "127.0.0.1:1"}
                result = [{"metric": {"__name__": "tokenlane_config_info", "instance": address, "pod": pod,
                                      "namespace": NS, "model": "tiny"}, "value": [0, "1"]}
                          for pod, address in pods.items()]
                self._json(200, {"status": "success", "data": {"resultType": "vector", "result": result}})

            def do_POST(self):
                url = urlsplit(self.path)
                if url.path != "/debug/dump":
                    return self._json(404, {})
                reason = parse_qs(url.query)["reason"][0]
                server.dumps.append(reason)
                self._json(200, {"path": "/tmp/tokenlane-dumps/tokenlane-dump-1.json", "reason": reason})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "PodsAndPrometheus":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def test_a_rollback_dumps_the_pods_and_names_the_files_in_its_event(guarded_cluster):
    cluster = guarded_cluster
    with PodsAndPrometheus() as stand_in:
        lkg = await start_stable(cluster, _samples(cluster, tuning={"prometheusUrl": stand_in.url}))
        assert stand_in.dumps == []  # verifying and promoting dump nothing

        await cluster.patch_spec("modelservices", "tiny", {"scheduler": {"prefillChunkSize": 512}})
        await wait(cluster, lambda: runtime_yaml(cluster).scheduler.prefill_chunk_size == 512, what="new chunk size")
        st = await advance(cluster)
        cluster.metrics.sample = sample(ttft_ms=900)
        await advance(cluster)
        st = await advance(cluster, 121)
        assert st["rollout"]["phase"] == "RolledBack" and st["rollout"]["lastKnownGood"] == lkg

        warn = await wait(cluster, lambda: events(cluster, "RolledBack"), what="RolledBack Event")
        message = warn[-1]["message"]
        assert "interactive TTFT p95 900ms vs 300ms" in message
        assert "Flight recorder dumps: tiny-0:/tmp/tokenlane-dumps/tokenlane-dump-1.json, tiny-1 failed (" in message
        rolled_back = st["rollout"]["rolledBackRevision"]
        assert stand_in.dumps == [f"rollback of revision {rolled_back}"]  # one pod answered, once
        assert stand_in.queries == [f'tokenlane_config_info{{namespace="{NS}",model="tiny"}}']


async def test_without_prometheus_the_event_says_why_there_is_no_dump():
    said = await dumps.dump_runtimes(None, NS, "tiny", "rollback of revision r1")
    assert said.startswith("No flight recorder dump: spec.tuning.prometheusUrl is not set")
    said = await dumps.dump_runtimes("http://127.0.0.1:1", NS, "tiny", "rollback of revision r1", timeout_s=2)
    assert said.startswith("No flight recorder dump: the runtime pods could not be listed (cannot reach")
