"""The operator's rollback dump (operator/clients/dumps.py) against a real runtime with API keys on: it
authenticates with the key, among those mounted for it, of one of the ModelService's tenants;
without one it says so in the Event's sentence instead of collecting 401s. A loopback server
stands in for Prometheus (it names the runtime's address, as `tokenlane_config_info` does)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tokenlane.operator.clients import dumps
from tokenlane.runtime.config import hash_api_key

KEYED = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 64, device: cpu}}
tenants:
  - {{name: alpha, apiKeySha256: "{alpha}"}}
  - {{name: ops, apiKeySha256: "{ops}", tokensPerMinute: 1}}
"""
ALPHA, OPS = "alpha-secret", "ops-secret"
NS, REASON = "team-a", "rollback of revision r2"


class PrometheusStandIn:
    """Answers every instant query with one `tokenlane_config_info` series per pod."""

    def __init__(self, pods: dict[str, str]) -> None:
        pods_ = pods

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                assert urlsplit(self.path).path == "/api/v1/query"
                result = [{"metric": {"__name__": "tokenlane_config_info", "instance": address, "pod": pod},
                           "value": [0, "1"]} for pod, address in pods_.items()]
                data = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def keyed_runtime(serve, tmp_path_factory):
    live = serve(KEYED.replace("{alpha}", hash_api_key(ALPHA)).replace("{ops}", hash_api_key(OPS)))
    live.state.options.dump_dir = tmp_path_factory.mktemp("dumps")
    prometheus = PrometheusStandIn({"tiny-0": live.url.removeprefix("http://")})
    yield live, prometheus
    prometheus.close()


def secret_volume(root: Path, **files: str) -> Path:
    """A directory shaped like a mounted Secret: each key a symlink into `..data`."""
    data = root / "..2026_12_01"
    data.mkdir(parents=True)
    for name, text in files.items():
        (data / name).write_text(text)
        (root / name).symlink_to(data / name)
    (root / "..data").symlink_to(data, target_is_directory=True)
    return root


def dump(prometheus, keys_dir: Path, digests) -> str:
    return asyncio.run(dumps.dump_runtimes(prometheus.url, NS, "tiny", REASON, tenant_key_digests=digests,
                                           keys_dir=keys_dir, timeout_s=30))


def test_the_operator_dumps_with_a_tenants_key_it_holds(keyed_runtime, tmp_path):
    live, prometheus = keyed_runtime
    keys_dir = secret_volume(tmp_path / "api-keys", unrelated="not-a-tenant-key\n", ops=f"{OPS}\n")
    said = dump(prometheus, keys_dir, [hash_api_key(ALPHA), hash_api_key(OPS)])
    assert said.startswith("Flight recorder dumps: tiny-0:"), said
    path = Path(said.removeprefix("Flight recorder dumps: tiny-0:").removesuffix("."))
    assert json.loads(path.read_text())["reason"] == REASON


def test_a_key_the_pods_no_longer_take_is_named_and_the_next_one_is_tried(keyed_runtime, tmp_path):
    live, prometheus = keyed_runtime
    rotated = "rotated-away"  # still in the spec's digests, but not in the pods' config
    only_old = secret_volume(tmp_path / "old", old=f"{rotated}\n")
    said = dump(prometheus, only_old, [hash_api_key(rotated), hash_api_key(ALPHA)])
    assert said == "Flight recorder dumps: tiny-0 failed (HTTP 401 invalid_api_key)."
    both = secret_volume(tmp_path / "both", keys=f"{rotated}\n{ALPHA}\n")
    assert dump(prometheus, both, [hash_api_key(rotated), hash_api_key(ALPHA)]).startswith(
        "Flight recorder dumps: tiny-0:/")


def test_without_a_tenants_key_the_event_says_so(keyed_runtime, tmp_path):
    live, prometheus = keyed_runtime
    for keys_dir in (tmp_path / "absent", secret_volume(tmp_path / "other", x="not-a-tenant-key")):
        said = dump(prometheus, keys_dir, [hash_api_key(ALPHA)])
        assert said == ("No flight recorder dump: the runtime pods take API keys, and the operator holds the key of "
                        f"none of the tenants (keys are read from {keys_dir}, see docs/operations.md).")
