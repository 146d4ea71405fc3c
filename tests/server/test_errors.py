"""Every error status from a real request: 401, 403, 429 (queue full, deadline), 503 (KV
reject watermark), 504 (queue timeout); each in OpenAI's shape, with Retry-After where due."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from tokenlane.runtime.config import hash_api_key
from tokenlane.runtime.executor.fake import StepGate

# One sequence runs at a time; the batch lane queues one request; requests of the `expiring`
# lane time out after 300 ms in the queue (only the 504 test sends there: elsewhere a loaded
# machine's stall must not time a request out); the KV pool is 64 blocks of 16 tokens,
# rejecting at 40%.
TIGHT = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 64, device: cpu, enablePrefixCaching: false}}
scheduler:
  maxActiveSequences: 1
  maxWaitingRequests: 8
  maxBatchedTokens: 128
  prefillChunkSize: 128
  queueTimeoutMs: 30000
  kvCacheHighWatermark: 0.35
  kvCacheRejectWatermark: 0.4
lanes:
  - {{name: interactive, default: true, maxWaitingRequests: 1}}
  - {{name: expiring, maxWaitingRequests: 1, queueTimeoutMs: 300}}
  - {{name: batch, class: batch, maxWaitingRequests: 1}}
tenants:
  - {{name: alpha, apiKeySha256: "{alpha}", lanes: [interactive]}}
  - {{name: beta, apiKeySha256: "{beta}"}}
"""

ALPHA = {"Authorization": "Bearer alpha-secret"}
BETA = {"Authorization": "Bearer beta-secret"}


@pytest.fixture(scope="module")
def tight(serve):
    return serve(TIGHT.replace("{alpha}", hash_api_key("alpha-secret")).replace("{beta}", hash_api_key("beta-secret")))


def wait_idle(live, timeout=20.0):
    live.wait_metric("tokenlane_requests_running", lambda v: v == 0, timeout=timeout)
    live.wait_metric("tokenlane_requests_waiting", lambda v: v == 0, timeout=timeout)


def decoding(plan) -> bool:
    """A step that decodes: some request in it has its first token already."""
    return any(chunk.request.num_output_tokens for chunk in plan.chunks)


class Hog:
    """A long streaming request that holds the only running slot: the engine's steps are
    held (StepGate) from its first decode step until close(), so it cannot finish however
    fast the machine is. By default below the KV reject watermark (388 tokens are 25 of 64
    blocks). `hold_when` picks the step to hold at (default: its first decode step)."""

    def __init__(self, live, prompt_tokens=8, max_tokens=380, headers=BETA, hold_when=decoding):
        self.gate = StepGate(live.engine.executor).__enter__()
        self.gate.pause_when(hold_when)
        self.client = httpx.Client(base_url=live.url, timeout=60)
        self.cm = self.client.stream(
            "POST", "/v1/completions", headers=headers,
            json={"prompt": list(range(10, 10 + prompt_tokens)), "max_tokens": max_tokens,
                  "ignore_eos": True, "stream": True})
        self.response = self.cm.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self.gate.wait_paused()  # it runs, and its next step is held

    def release(self):
        """Let the engine step again (the hog then runs on, until closed)."""
        self.gate.resume()

    def close(self):
        self.cm.__exit__(None, None, None)
        self.client.close()
        self.gate.__exit__(None, None, None)


def assert_error(r, status, code=None, retry_after=False):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    if code:
        assert error["code"] == code, error
    if retry_after:
        assert int(r.headers["retry-after"]) >= 1


def test_401_and_403(tight):
    url = tight.url + "/v1/completions"
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    assert_error(httpx.post(url, json=body), 401, "missing_api_key")
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
    assert_error(httpx.post(url, json=body, headers={"X-Tenant": "alpha"}), 401)  # no header trust with keys
    assert_error(httpx.post(url, content=b"junk"), 401)  # the key is checked before the body
    assert_error(httpx.get(tight.url + "/v1/models"), 401)
    assert httpx.get(tight.url + "/v1/models", headers=ALPHA).status_code == 200
    assert_error(httpx.post(url, json=body, headers={**ALPHA, "X-Lane": "batch"}), 403, "lane_not_allowed")
    r = httpx.post(url, json=body, headers={**BETA, "X-Lane": "batch"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-tenant"] == "beta" and r.headers["x-lane"] == "batch"
    r = httpx.post(url, json=body, headers=ALPHA, timeout=30)
    assert r.status_code == 200 and r.headers["x-tenant"] == "alpha"
    # Probes and metrics stay open (kubelet and Prometheus have no key).
    assert httpx.get(tight.url + "/health").status_code == 200
    assert httpx.get(tight.url + "/metrics").status_code == 200


def test_429_queue_full(tight):
    wait_idle(tight)
    hog = Hog(tight)
    batch = {**BETA, "X-Lane": "batch"}
    results = {}

    def queued():  # waits in the batch queue behind the hog
        results["queued"] = httpx.post(tight.url + "/v1/completions", headers=batch, timeout=60,
                                       json={"prompt": [5, 6, 7], "max_tokens": 2})

    t = threading.Thread(target=queued)
    try:
        t.start()
        tight.wait_metric("tokenlane_requests_waiting", lambda v: v >= 1, lane="batch")
        # Answered while the engine is held: at once, not after the hog.
        full = httpx.post(tight.url + "/v1/completions", headers=batch, json={"prompt": [5, 6], "max_tokens": 2})
        assert_error(full, 429, "queue_full", retry_after=True)
        assert full.json()["error"]["type"] == "rate_limit_error"
        assert full.headers["x-lane"] == "batch"
    finally:
        hog.close()
    t.join(timeout=60)
    assert results["queued"].status_code == 200  # the admitted one is served once the hog leaves
    assert tight.metric("tokenlane_requests_total", outcome="rejected", reason="queue_full", lane="batch") >= 1


def test_504_queue_timeout(tight):
    wait_idle(tight)
    hog = Hog(tight)
    results = {}

    def queued():  # the expiring lane times out after 300 ms in the queue
        results["queued"] = httpx.post(tight.url + "/v1/completions", headers={**BETA, "X-Lane": "expiring"},
                                       timeout=60, json={"prompt": [5, 6, 7], "max_tokens": 2})

    t = threading.Thread(target=queued)
    try:
        t.start()
        tight.wait_metric("tokenlane_requests_waiting", lambda v: v >= 1, lane="expiring")
        # It arrived before it was counted: 0.4 s later its 300 ms in the queue are over for
        # sure. The hog still holds the only slot (the engine is held mid-generation), so the
        # next step boundary times the queued request out.
        time.sleep(0.4)
        hog.release()
        t.join(timeout=60)
    finally:
        hog.close()
    r = results["queued"]
    assert_error(r, 504, "queue_timeout")
    assert r.headers["x-lane"] == "expiring"
    tight.wait_metric("tokenlane_requests_total", lambda v: v >= 1, outcome="timeout", lane="expiring")


def test_429_deadline_cannot_be_met(tight):
    wait_idle(tight)
    # Warm the step-time estimate, then ask for 200 tokens within 1 ms.
    httpx.post(tight.url + "/v1/completions", headers=BETA, json={"prompt": [5, 6], "max_tokens": 4}, timeout=30)
    r = httpx.post(tight.url + "/v1/completions", headers={**BETA, "X-Request-Deadline-Ms": "1"},
                   json={"prompt": [5, 6, 7], "max_tokens": 200}, timeout=30)
    assert_error(r, 429, "deadline", retry_after=True)


def test_503_at_the_kv_reject_watermark(tight, caplog):
    wait_idle(tight)
    kv = tight.engine.scheduler.kv
    # 300 prompt + 200 output tokens pass 40% of the 64 blocks part way: the engine is held
    # at the first step that starts with the pool that full.
    hog = Hog(tight, prompt_tokens=300, max_tokens=200, headers={**BETA, "X-Lane": "batch"},
              hold_when=lambda plan: kv.usage >= 0.4)
    try:
        tight.wait_metric("tokenlane_kv_cache_usage_ratio", lambda v: v >= 0.4)
        with caplog.at_level(logging.INFO, logger="tokenlane.requests"):
            r = httpx.post(tight.url + "/v1/completions", headers=BETA, json={"prompt": [5, 6], "max_tokens": 2})
        assert_error(r, 503, "kv_watermark", retry_after=True)
        assert r.json()["error"]["type"] == "service_unavailable_error"
        # One structured log line, with the request id the client got.
        lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "tokenlane.requests"]
        (line,) = [x for x in lines if x["request_id"] == r.headers["X-Request-Id"]]
        assert (line["event"], line["status"], line["reason"]) == ("request_refused", 503, "kv_watermark")
        assert line["lane"] == r.headers["X-Lane"] and line["tenant"] == r.headers["X-Tenant"]
        assert httpx.get(tight.url + "/health").status_code == 200
    finally:
        hog.close()
    tight.wait_metric("tokenlane_kv_cache_usage_ratio", lambda v: v == 0)


def test_a_dead_engine_loop_fails_health_and_requests_cleanly(serve):
    live = serve("""
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{kvCacheBlocks: 64, device: cpu}}
""")
    assert httpx.get(live.url + "/health").status_code == 200

    def broken(plan):
        raise RuntimeError("device lost")

    live.engine.executor.execute = broken  # every step fails from now on
    r = httpx.post(live.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"  # the request that hit it
    deadline = time.monotonic() + 20
    while httpx.get(live.url + "/health").status_code == 200:
        httpx.post(live.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=30)
        assert time.monotonic() < deadline, "the step loop never gave up"
    health = httpx.get(live.url + "/health")
    assert_error(health, 503, "engine_dead")
    assert httpx.get(live.url + "/ready").status_code == 503
    r = httpx.post(live.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=30)
    assert_error(r, 503, retry_after=True)  # refused at once, not hung
