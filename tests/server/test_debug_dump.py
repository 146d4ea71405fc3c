"""POST /debug/dump over real HTTP: the flight recorder's steps, a metrics snapshot and the
config in force written to a file whose path comes back (the operator asks for one at a
rollback), behind the API's auth."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tokenlane.runtime.config import hash_api_key

KEYED = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 64, device: cpu}}
tenants:
  - {{name: alpha, apiKeySha256: "{alpha}"}}
"""
ALPHA = {"Authorization": "Bearer alpha-secret"}


@pytest.fixture
def dump_dir(shared_server, tmp_path):
    state = shared_server.state
    old, state.options.dump_dir = state.options.dump_dir, tmp_path / "dumps"
    yield state.options.dump_dir
    state.options.dump_dir = old


def test_a_dump_holds_the_steps_metrics_and_config_and_its_path_comes_back(shared_server, dump_dir):
    url = shared_server.url
    r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/debug/dump", params={"reason": "rollback of revision abc123"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    path = Path(body["path"])
    assert body["reason"] == "rollback of revision abc123" and path.parent == dump_dir
    document = json.loads(path.read_text())
    assert document["reason"] == "rollback of revision abc123"
    assert sum(s["lanes"]["interactive"]["prefill_tokens"] for s in document["steps"]) >= 3
    assert "tokenlane_kv_blocks_cached_free" in document["metrics"]
    assert "servedName: tiny" in document["config"]
    assert list(dump_dir.iterdir()) == [path]  # no partial file left behind


def test_the_reason_defaults_and_is_bounded(shared_server, dump_dir):
    r = httpx.post(shared_server.url + "/debug/dump", timeout=30)
    assert r.status_code == 200 and r.json()["reason"] == "api"
    for bad in ("x" * 201, "two\nlines"):
        r = httpx.post(shared_server.url + "/debug/dump", params={"reason": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "reason"


def test_a_dump_that_cannot_be_written_is_a_500(shared_server, tmp_path):
    state = shared_server.state
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    old, state.options.dump_dir = state.options.dump_dir, blocker
    try:
        r = httpx.post(shared_server.url + "/debug/dump", timeout=30)
    finally:
        state.options.dump_dir = old
    assert r.status_code == 500 and r.json()["error"]["code"] == "dump_failed"


def test_a_dump_needs_the_api_key_when_keys_are_configured(serve, tmp_path):
    live = serve(KEYED.replace("{alpha}", hash_api_key("alpha-secret")))
    live.state.options.dump_dir = tmp_path
    assert httpx.post(live.url + "/debug/dump", timeout=30).status_code == 401
    r = httpx.post(live.url + "/debug/dump", headers=ALPHA, timeout=30)
    assert r.status_code == 200 and Path(r.json()["path"]).exists()
