"""GET /debug/steps over real HTTP (the flight recorder's JSONL, behind the API's auth), and
SIGUSR1 on a real `tokenlane serve` process: a dump file with steps, metrics and config."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
from serve_process import start_serve
from prometheus_client.parser import text_string_to_metric_families

from tokenlane.runtime.config import hash_api_key

KEYED = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 64, device: cpu}}
tenants:
  - {{name: alpha, apiKeySha256: "{alpha}"}}
"""
ALPHA = {"Authorization": "Bearer alpha-secret"}


def steps_of(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def last_step(url: str, headers=None) -> int:
    steps = steps_of(httpx.get(url + "/debug/steps", headers=headers, timeout=10))
    return steps[-1]["step"] if steps else 0


def test_steps_of_a_request_carry_its_exact_tokens(shared_server):
    url = shared_server.url
    before = last_step(url)  # the engine is idle between requests: no step runs
    r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    steps = steps_of(httpx.get(url + "/debug/steps", params={"since": before}, timeout=10))
    assert steps and all(s["step"] > before for s in steps)
    lane = [s["lanes"]["interactive"] for s in steps]
    # The 5 prompt tokens in one prefill chunk (it samples the first token), then 3 decodes.
    assert sum(x["prefill_tokens"] for x in lane) == 5
    assert sum(x["decode_tokens"] for x in lane) == 3
    assert sum(x["queued"] for x in lane) == sum(x["started"] for x in lane) == 1
    assert sum(s["finished"].get("interactive", {}).get("max_tokens", 0) for s in steps) == 1
    assert all(s["lanes"]["batch"]["prefill_tokens"] == s["lanes"]["batch"]["decode_tokens"] == 0 for s in steps)
    assert steps[0]["kv"]["blocks_total"] == 256 and steps[0]["kv"]["blocks_used"] == 1
    # A unix time selects by when the step was recorded.
    assert [s["step"] for s in steps_of(httpx.get(url + "/debug/steps", params={"since": steps[1]["time"]}))] == \
        [s["step"] for s in steps[2:]]


def test_since_must_be_a_number(shared_server):
    r = httpx.get(shared_server.url + "/debug/steps", params={"since": "yesterday"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "since"


def test_steps_need_the_api_key_when_keys_are_configured(serve):
    live = serve(KEYED.replace("{alpha}", hash_api_key("alpha-secret")))
    missing = httpx.get(live.url + "/debug/steps", timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    wrong = httpx.get(live.url + "/debug/steps", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    r = httpx.post(live.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True},
                   headers=ALPHA, timeout=60)
    assert r.status_code == 200
    assert last_step(live.url, ALPHA) >= 2


def test_a_dump_that_cannot_be_written_is_logged_not_raised(shared_server, tmp_path, caplog):
    state = shared_server.state
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    old = state.options.dump_dir
    state.options.dump_dir = blocker
    try:
        with caplog.at_level("ERROR", logger="tokenlane.server"):
            assert asyncio.run(state.dump("test")) is None
    finally:
        state.options.dump_dir = old
    assert any("dump (test)" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)


SIM_CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 4096}}
engine: {{blockSize: 16, kvCacheBlocks: 1024, device: cpu, executor: simulated}}
scheduler: {{maxActiveSequences: 8, maxBatchedTokens: 256, prefillChunkSize: 128}}
"""


def test_sigusr1_dumps_steps_metrics_and_config(tiny_model_dir, tmp_path):
    config = tmp_path / "runtime.yaml"
    config.write_text(SIM_CONFIG.format(model=tiny_model_dir))
    dumps = tmp_path / "dumps"
    proc, url = start_serve(config, "--dump-dir", str(dumps), "--flight-recorder-steps", "64", "--log-level", "info")
    try:
        deadline = time.monotonic() + 60
        r = httpx.post(url + "/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text

        proc.send_signal(signal.SIGUSR1)
        while not list(dumps.glob("tokenlane-dump-*.json")):  # renamed into place when complete
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no dump was written"
            time.sleep(0.05)
        [path] = dumps.glob("tokenlane-dump-*.json")
        document = json.loads(path.read_text())
        assert document["reason"] == "SIGUSR1" and document["pid"] == proc.pid
        lane = [s["lanes"]["default"] for s in document["steps"]]
        assert sum(x["prefill_tokens"] for x in lane) == 3 and sum(x["decode_tokens"] for x in lane) == 2
        finished = [s.value for family in text_string_to_metric_families(document["metrics"])
                    for s in family.samples if s.name == "tokenlane_requests_total"
                    and s.labels["outcome"] == "finished" and s.labels["reason"] == "max_tokens"
                    and s.labels["endpoint"] == "/v1/completions"]
        assert finished == [1.0]
        assert "servedName: tiny" in document["config"] and "executor: simulated" in document["config"]
        assert httpx.get(url + "/ready", timeout=5).status_code == 200  # still serving

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert f"written to {path}" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_negative_recorder_size_is_refused(capsys):
    from tokenlane.runtime.entrypoints.server import main

    assert main(["--model", "/nowhere", "--flight-recorder-steps", "-1"]) == 2
    assert "--flight-recorder-steps must be 0 (off) or more" in capsys.readouterr().err
