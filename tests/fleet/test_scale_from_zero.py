"""Scale from zero at the router: a request that finds no ready replica is held, and forwarded
once one becomes ready; a full hold queue or an expired wait is answered 503 + Retry-After.

The replica set is changed by the test, as EndpointSlice discovery changes it when a pod
becomes ready (`BackendSet.update`): the held requests are released by that event, not by time.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fleet_helpers import LANES, metric, simulated_config, start_replicas, start_router, wait_for

from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.fleet.router import RouterOptions, build_parser

BODY = {"model": "sim", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}


def _roomy_config() -> dict:
    """The simulated replica without the small interactive lane caps: the held burst all fits."""
    return {**simulated_config(), "lanes": LANES}


def _held(url: str) -> float:
    return metric(url, "tokenlane_router_held_requests")


def test_hold_options_are_checked():
    with pytest.raises(ValueError, match="hold queue size"):
        RouterOptions(hold_queue_size=-1)
    with pytest.raises(ValueError, match="hold_timeout_s"):
        RouterOptions(hold_timeout_s=0)
    args = build_parser().parse_args(["--backend", "http://127.0.0.1:1", "--hold-queue-size", "7",
                                      "--hold-timeout-s", "30"])
    assert (args.hold_queue_size, args.hold_timeout_s) == (7, 30.0)


def test_a_request_with_no_ready_replica_is_held_until_one_is_ready(tmp_path):
    router = start_router([], RuntimeConfig.from_dict(_roomy_config()),
                          RouterOptions(scrape_interval_s=0.05, hold_timeout_s=600))
    replicas = []
    try:
        # At zero replicas the router is ready: it must take the requests that wake the pool.
        ready = httpx.get(router.url + "/ready", trust_env=False)
        assert ready.status_code == 200 and ready.json()["healthy_replicas"] == 0

        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        greedy = {"model": "sim", "max_tokens": 4, "extra_body": {"ignore_eos": True}}
        with ThreadPoolExecutor(2) as pool:
            whole = pool.submit(client.completions.create, prompt="hello", **greedy)
            streamed = pool.submit(lambda: list(client.chat.completions.create(
                messages=[{"role": "user", "content": "hi"}], stream=True, **greedy)))
            wait_for(lambda: _held(router.url) == 2, "two held requests")
            assert metric(router.url, "tokenlane_router_requests_without_replica_total") == 2
            assert metric(router.url, "tokenlane_router_requests_total", model="sim") == 2
            assert not whole.done() and not streamed.done()

            # A replica becomes ready, as discovery reports a pod that passed its readiness probe.
            replicas = start_replicas(_roomy_config(), tmp_path, 1)
            router.fleet.backends.update([replicas[0].url])

            completion = whole.result(timeout=300)
            chunks = streamed.result(timeout=300)
        assert completion.usage.completion_tokens == 4
        assert chunks[-1].choices[0].finish_reason == "length"
        assert _held(router.url) == 0
        assert metric(router.url, "tokenlane_router_refusals_total") == 0
    finally:
        router.stop()
        for p in replicas:
            p.stop()


def test_a_full_hold_queue_answers_503_at_once_and_a_client_that_leaves_frees_its_place():
    router = start_router([], None, RouterOptions(scrape_interval_s=0.05, hold_queue_size=1, hold_timeout_s=600))
    try:
        # The first request on a raw socket, so the test can go away while it is held.
        host, port = router.url.removeprefix("http://").split(":")
        body = json.dumps(BODY).encode()
        first = socket.create_connection((host, int(port)))
        first.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: _held(router.url) == 1, "the first request to be held")

        second = httpx.post(router.url + "/v1/completions", json=BODY, trust_env=False, timeout=60)
        assert second.status_code == 503
        assert int(second.headers["retry-after"]) >= 1
        error = second.json()["error"]
        assert error["code"] == "hold_queue_full" and set(error) == {"message", "type", "param", "code"}
        assert metric(router.url, "tokenlane_router_refusals_total", code="hold_queue_full") == 1

        first.close()  # the held client goes away: its place in the queue is freed
        wait_for(lambda: _held(router.url) == 0, "the held request to leave the queue")
    finally:
        router.stop()


def test_a_held_request_past_its_wait_bound_gets_503_with_retry_after():
    router = start_router([], None, RouterOptions(scrape_interval_s=0.05, hold_timeout_s=0.05))
    try:
        for stream in (False, True):
            r = httpx.post(router.url + "/v1/completions", json={**BODY, "stream": stream}, trust_env=False,
                           timeout=60)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "hold_timeout"
        assert metric(router.url, "tokenlane_router_refusals_total", code="hold_timeout") == 2
        assert _held(router.url) == 0
    finally:
        router.stop()


def test_without_holding_no_replica_is_an_immediate_503():
    router = start_router([], None, RouterOptions(scrape_interval_s=0.05, hold_queue_size=0))
    try:
        assert httpx.get(router.url + "/ready", trust_env=False).status_code == 503
        r = httpx.post(router.url + "/v1/completions", json=BODY, trust_env=False, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
        assert "retry-after" in r.headers
        assert metric(router.url, "tokenlane_router_requests_without_replica_total") == 1
    finally:
        router.stop()
