"""`tokenlane router` in front of real `tokenlane serve` processes on loopback: the openai
client unchanged, SSE passed through, lanes, prefix affinity, cancellation that frees the
replica's KV, saturation answered with 429 + Retry-After, and a replica killed mid-run that
loses no request that had not started streaming."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from fleet_helpers import (
    RouterProcess,
    metric,
    simulated_config,
    start_replicas,
    start_router,
    wait_for,
)

from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.fleet.pick import LaneLoad, Refusal, affine_replica, affinity_key, pick
from tokenlane.runtime.fleet.router import RouterOptions
from tokenlane.runtime.fleet.state import BackendSet, parse_replica_metrics

SYSTEM = ("You are the release assistant of a small team. Answer in one short paragraph, cite the "
          "changelog entry you used, and never invent version numbers. ") * 5  # ~720 characters


# --------------------------------------------------------------------------- no servers


def test_scrape_reads_the_runtimes_own_exposition():
    from tokenlane.runtime.observability.metrics import PrometheusMetrics

    metrics = PrometheusMetrics("sim")
    metrics.set_config(RuntimeConfig.from_dict(simulated_config()))
    metrics.waiting.labels("sim", "batch").set(3)
    metrics.running.labels("sim", "interactive").set(1)
    metrics.kv_usage.labels("sim").set(0.42)
    load = parse_replica_metrics(metrics.render().decode())
    assert load.lanes == {
        "interactive": LaneLoad(waiting=0, running=1, max_waiting=1, max_running=1),
        "batch": LaneLoad(waiting=3, running=0, max_waiting=16, max_running=4),
    }
    assert (load.kv_usage, load.kv_reject_watermark) == (0.42, 0.95)
    with pytest.raises(ValueError, match="unreadable"):
        parse_replica_metrics('tokenlane_requests_waiting{lane="a"}\n')


@pytest.mark.parametrize("url, error", [
    ("127.0.0.1:8001", "http:// or https://"),
    ("ftp://host", "http:// or https://"),
    ("http://host:8001/?x=1", "query"),
])
def test_backend_urls_are_checked(url, error):
    with pytest.raises(ValueError, match=error):
        BackendSet([url])
    assert BackendSet(["http://a:1/", "http://a:1", "http://b:2"]).urls == ("http://a:1", "http://b:2")


def test_router_command_line_errors(capsys):
    from tokenlane.runtime.fleet.router import main

    assert main([]) == 2 and "--backend" in capsys.readouterr().err
    assert main(["--backend", "localhost:1"]) == 2 and "http://" in capsys.readouterr().err
    assert main(["--backend", "http://a:1", "--affinity-slack", "-1"]) == 2
    assert "affinity_slack" in capsys.readouterr().err


def test_router_imports_without_torch():
    """The router needs no model code: its image can be a slim one."""
    code = ("import sys\n"
            "for blocked in ('torch', 'triton', 'transformers', 'tokenizers'):\n"
            "    sys.modules[blocked] = None\n"
            "import tokenlane.runtime.fleet.router\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- the tiny model fleet


@pytest.fixture(scope="module")
def tiny_router(tiny_replicas, tmp_path_factory):
    """`tokenlane router --config` (the replicas' runtime.yaml) as a process."""
    router = RouterProcess.start([p.url for p in tiny_replicas], tmp_path_factory.mktemp("router"),
                                 "--config", str(tiny_replicas[0].config_path), "--scrape-interval-ms", "100")
    yield router
    assert router.stop() == 0, router.log_path.read_text()


def test_openai_client_works_unchanged(tiny_router):
    client = openai.OpenAI(base_url=tiny_router.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    greedy = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}

    whole = client.completions.create(model="tiny", prompt="def parse(text):", **greedy)
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="tiny", prompt="def parse(text):", stream=True, **greedy)
    # Every replica serves the same weights: greedy text is the same whichever one answered.
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text

    messages = [{"role": "user", "content": "What changed in the last release?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, **greedy)
    assert reply.usage.completion_tokens == 6 and reply.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True, **greedy))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content


def _normalized(raw: bytes) -> bytes:
    """An SSE body without what differs between two runs of one request (ids, timestamps)."""
    raw = re.sub(rb'"id":"(chat)?cmpl-[0-9a-f]+"', b'"id":"ID"', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def test_sse_passes_through_byte_for_byte(tiny_router):
    body = {"prompt": "import os\n", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", tiny_router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        via_router = b"".join(r.iter_raw())
        replica = r.headers["x-tokenlane-replica"]
    with httpx.stream("POST", replica + "/v1/completions", json=body, timeout=60) as r:
        direct = b"".join(r.iter_raw())
    assert via_router.endswith(b"data: [DONE]\n\n") and via_router.count(b"data: ") == 8 + 2
    assert _normalized(via_router) == _normalized(direct)


def test_lanes_follow_the_runtime_rules(tiny_router, tiny_replicas):
    r = httpx.post(tiny_router.url + "/v1/completions", headers={"X-Lane": "batch"},
                   json={"prompt": "hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.headers["x-lane"] == "batch"
    # No header: a prompt over 200 tokens matches the batch lane's rule (on the replica too).
    long_prompt = "Return the value of the named attribute of object. " * 20  # ~280 tokens
    r = httpx.post(tiny_router.url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.headers["x-lane"] == "batch"
    r = httpx.post(tiny_router.url + "/v1/completions", json={"prompt": "short", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.headers["x-lane"] == "interactive"
    # The router applies the same rules itself: an unknown lane is its own 400, never forwarded.
    rejected_before = sum(metric(p.url, "tokenlane_requests_total", outcome="invalid") for p in tiny_replicas)
    r = httpx.post(tiny_router.url + "/v1/completions", headers={"X-Lane": "gold"},
                   json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "x-tokenlane-replica" not in r.headers
    assert r.json()["error"] == {"message": "unknown lane 'gold'; lanes: ['interactive', 'batch']",
                                 "type": "invalid_request_error", "param": "X-Lane", "code": "unknown_lane"}
    assert sum(metric(p.url, "tokenlane_requests_total", outcome="invalid") for p in tiny_replicas) == rejected_before


def test_shared_prefix_lands_on_one_replica_and_hits_its_cache(tiny_router, tiny_replicas):
    hits_before = {p.url: metric(p.url, "tokenlane_prefix_cache_hits_total") for p in tiny_replicas}
    affinity_before = metric(tiny_router.url, "tokenlane_router_picks_total", reason="affinity")
    served_by = set()
    for question in ("What is new?", "Which bugs were fixed?", "Is 2.1 out?", "Who released it?", "When?"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        r = httpx.post(tiny_router.url + "/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
        served_by.add(r.headers["x-tokenlane-replica"])
    assert len(served_by) == 1
    (warm,) = served_by
    assert metric(warm, "tokenlane_prefix_cache_hits_total") - hits_before[warm] >= 4 * 100  # 4 repeats x ~150 tokens
    assert metric(tiny_router.url, "tokenlane_router_picks_total", reason="affinity") == affinity_before + 5


def test_router_probes_and_metrics(tiny_router, tiny_replicas):
    assert httpx.get(tiny_router.url + "/health").json() == {"status": "ok"}
    assert httpx.get(tiny_router.url + "/ready").json() == {"status": "ready", "healthy_replicas": 3, "replicas": 3}
    for p in tiny_replicas:
        assert metric(tiny_router.url, "tokenlane_router_backend_up", backend=p.url) == 1
    assert metric(tiny_router.url, "tokenlane_router_upstream_errors_total") == 0
    r = httpx.get(tiny_router.url + "/v2/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# --------------------------------------------------------------------------- the simulated fleet

LONG = {"prompt": "x" * 400, "max_tokens": 20000, "ignore_eos": True}  # minutes of 6 ms steps


@pytest.fixture(scope="module")
def sim_router(sim_replicas):
    router = start_router([p.url for p in sim_replicas], RuntimeConfig.from_dict(simulated_config()),
                          RouterOptions(scrape_interval_s=0.05))
    yield router
    router.stop()


def _idle(urls) -> bool:
    return all(metric(u, "tokenlane_requests_running") == 0 and metric(u, "tokenlane_requests_waiting") == 0
               for u in urls)


def test_client_disconnect_aborts_the_upstream_request_and_frees_its_kv(sim_router, sim_replicas):
    urls = [p.url for p in sim_replicas]
    free_before = {u: metric(u, "tokenlane_kv_blocks_free") for u in urls}
    cancelled_before = sum(metric(u, "tokenlane_requests_total", outcome="cancelled") for u in urls)
    finished_before = sum(metric(u, "tokenlane_requests_total", outcome="finished") for u in urls)

    with httpx.stream("POST", sim_router.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        replica = r.headers["x-tokenlane-replica"]
        # Kept referenced: dropping a half-read httpx line iterator closes the connection.
        lines = r.iter_lines()
        events = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert len(events) == 3  # each event is a data line and a blank line
        assert metric(replica, "tokenlane_requests_running", lane="interactive") == 1
        assert metric(replica, "tokenlane_kv_blocks_free") < free_before[replica]
    # The client closed its connection mid-stream: the router closes the upstream one at once.
    wait_for(lambda: metric(replica, "tokenlane_requests_total", outcome="cancelled",
                            reason="client_disconnect") >= 1, "the replica to cancel the request")
    wait_for(lambda: metric(replica, "tokenlane_kv_blocks_free") == free_before[replica], "KV blocks to come back")

    # A non-streaming client that gives up while its request runs (minutes long by construction).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim_router.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=1.0))
    wait_for(lambda: sum(metric(u, "tokenlane_requests_total", outcome="cancelled") for u in urls)
             == cancelled_before + 2, "the second cancellation")
    wait_for(lambda: _idle(urls), "every replica idle")
    assert {u: metric(u, "tokenlane_kv_blocks_free") for u in urls} == free_before
    assert sum(metric(u, "tokenlane_requests_total", outcome="finished") for u in urls) == finished_before
    assert metric(sim_router.url, "tokenlane_router_client_disconnects_total") == 2


async def test_saturated_lane_gets_429_with_retry_after(sim_router, sim_replicas):
    """Each replica's interactive lane takes one running and one queued request; with two
    long requests on every replica the router refuses the lane itself, while the batch lane
    (its own queue) is still served."""
    urls = [p.url for p in sim_replicas]
    rejected_before = sum(metric(u, "tokenlane_requests_total", outcome="rejected") for u in urls)
    async with httpx.AsyncClient(timeout=120) as client:

        async def hold(url: str) -> None:
            async with client.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}) as r:
                assert r.status_code == 200
                await asyncio.Event().wait()  # until cancelled

        fillers = []
        try:
            for u in urls:  # one at a time: the second must find the first running, not queued
                fillers.append(asyncio.create_task(hold(u)))
                await asyncio.to_thread(wait_for, lambda: metric(
                    u, "tokenlane_requests_running", lane="interactive") == 1, "the first request to run")
                fillers.append(asyncio.create_task(hold(u)))
                await asyncio.to_thread(wait_for, lambda: metric(
                    u, "tokenlane_requests_waiting", lane="interactive") == 1, "the second request to queue")
            await asyncio.to_thread(wait_for, lambda: isinstance(
                pick(sim_router.fleet.views(), "interactive", b""), Refusal), "the router to see it")

            r = await client.post(sim_router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json() == {"error": {"message": "every replica's queue for lane 'interactive' is full",
                                          "type": "rate_limit_error", "param": None, "code": "queue_full"}}
            r = await client.post(sim_router.url + "/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 429
            r = await client.post(sim_router.url + "/v1/completions", headers={"X-Lane": "batch"},
                                  json={"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200 and r.headers["x-lane"] == "batch"
        finally:
            for task in fillers:
                task.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)
    assert metric(sim_router.url, "tokenlane_router_refusals_total", code="queue_full") == 2
    # The refused requests never reached a replica.
    assert sum(metric(u, "tokenlane_requests_total", outcome="rejected") for u in urls) == rejected_before
    await asyncio.to_thread(wait_for, lambda: _idle(urls), "every replica idle")


def _prompt_affine_to(url: str, urls: list[str]) -> str:
    for i in range(1000):
        prompt = f"ticket {i}: " + "x" * 200
        if affine_replica(urls, affinity_key({"prompt": prompt}, False, 256)) == url:
            return prompt
    raise AssertionError("no prompt found")


async def test_killing_a_replica_loses_no_request_that_had_not_started_streaming(tmp_path):
    doomed, survivor = start_replicas(simulated_config(), tmp_path, 2)
    # The router scrapes once at start-up only: it learns of the death from the requests alone.
    router = start_router([doomed.url, survivor.url], RuntimeConfig.from_dict(simulated_config()),
                          RouterOptions(scrape_interval_s=3600))
    try:
        prompt = _prompt_affine_to(doomed.url, [doomed.url, survivor.url])
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as client:
            # Streaming on the doomed replica (its interactive lane runs one request at a time).
            streaming = await client.send(client.build_request(
                "POST", "/v1/completions", json={**LONG, "prompt": prompt, "stream": True}), stream=True)
            assert streaming.status_code == 200 and streaming.headers["x-tokenlane-replica"] == doomed.url
            lines = streaming.aiter_lines()
            assert (await lines.__anext__()).startswith("data: ")
            # Queued behind it on the same replica: no byte of its response exists yet.
            queued = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "stream": True}))
            await asyncio.to_thread(wait_for, lambda: metric(
                doomed.url, "tokenlane_requests_waiting", lane="interactive") == 1, "the request to queue")

            doomed.proc.kill()

            # The stream that had started is lost, and the client sees that it broke.
            with pytest.raises(httpx.RemoteProtocolError):
                async for _ in lines:
                    pass
            await streaming.aclose()
            # The queued one is retried on the survivor and completes.
            r = await queued
            assert r.status_code == 200 and r.headers["x-tokenlane-replica"] == survivor.url
            assert r.text.count("data: ") == 5 + 1 and r.text.endswith("data: [DONE]\n\n")
            # New requests for the dead replica's prefix: one finds it refusing connections, then
            # it is marked down; none is lost.
            # (One after another: the survivor's interactive lane holds two requests at a time.)
            later = [await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3,
                                                                 "ignore_eos": True}) for _ in range(4)]
            assert [x.status_code for x in later] == [200] * 4
            assert {x.headers["x-tokenlane-replica"] for x in later} == {survivor.url}
        assert metric(router.url, "tokenlane_router_upstream_errors_total", kind="reset") == 1
        assert metric(router.url, "tokenlane_router_upstream_errors_total", kind="mid_stream") == 1
        assert metric(router.url, "tokenlane_router_upstream_errors_total", kind="connect") >= 1
        assert metric(router.url, "tokenlane_router_picks_total", reason="retry") >= 2
        assert metric(router.url, "tokenlane_router_backend_up", backend=doomed.url) == 0
    finally:
        router.stop()
        survivor.stop()
        doomed.stop()


async def test_a_draining_replica_is_skipped_before_the_first_byte(tmp_path):
    """A replica shutting down answers 503 `draining` to new requests (it never admits them): the
    router sends such a request to another replica, and skips the draining one afterwards."""
    draining, other = start_replicas(simulated_config(), tmp_path, 2, grace_s=120)
    router = start_router([draining.url, other.url], RuntimeConfig.from_dict(simulated_config()),
                          RouterOptions(scrape_interval_s=3600))  # it learns of the drain from a request only
    try:
        prompt = _prompt_affine_to(draining.url, [draining.url, other.url])
        async with httpx.AsyncClient(timeout=120) as client:
            # In flight on the replica, so its drain lasts until this request ends (grace 120 s).
            held = await client.send(client.build_request(
                "POST", draining.url + "/v1/completions", json={**LONG, "stream": True}), stream=True)
            assert held.status_code == 200
            draining.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(wait_for, lambda: httpx.get(draining.url + "/ready").status_code == 503,
                                    "the replica to drain")
            for _ in range(2):
                r = await client.post(router.url + "/v1/completions",
                                      json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
                assert r.status_code == 200 and r.headers["x-tokenlane-replica"] == other.url
            await held.aclose()  # the drain ends with its last request
        assert metric(router.url, "tokenlane_router_upstream_errors_total", kind="draining") == 1
        assert metric(router.url, "tokenlane_router_picks_total", reason="retry") == 1
    finally:
        router.stop()
        other.stop()
        draining.stop()
