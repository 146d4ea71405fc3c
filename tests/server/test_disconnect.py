"""Clients that go away: their requests are aborted in the engine, counted as cancelled,
and their KV blocks come back."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

import httpx
import pytest

from tokenlane.runtime.executor.fake import StepGate


def idle_kv(live) -> tuple[float, float]:
    return live.metric("tokenlane_kv_cache_usage_ratio"), live.metric("tokenlane_kv_blocks_free")


async def _stream_then_vanish(url: str, i: int) -> int:
    payload = {"prompt": list(range(20 + i, 60 + i)), "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=payload) as r:
            assert r.status_code == 200
            received = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    received += 1
                    if received == 2:
                        break  # leave mid-generation: the connection is closed on exit
    return received


# Room for all twenty at once: one step prefills every prompt, then they decode in lockstep.
TWENTY = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler: {{maxActiveSequences: 32, maxWaitingRequests: 64, maxBatchedTokens: 1024, prefillChunkSize: 1024}}
"""


def test_twenty_streaming_clients_disconnect(serve, caplog):
    live = serve(TWENTY)
    caplog.set_level(logging.INFO, logger="tokenlane.server")
    usage0, free0 = idle_kv(live)
    cancelled0 = live.metric("tokenlane_requests_total", outcome="cancelled")

    async def main():
        return await asyncio.gather(*[_stream_then_vanish(live.url, i) for i in range(20)])

    with StepGate(live.engine.executor) as gate:
        # Held until all twenty are in, so they start within a step; held again once they
        # have 64 of their 400 tokens each (far more than two events' worth), until every
        # client has gone and its abort is staged: none can run to the end.
        gate.pause()
        clients = concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, main())
        while live.metric("tokenlane_requests_waiting") + live.metric("tokenlane_requests_running") < 20:
            time.sleep(0.02)
        gate.pause_when(lambda plan: any(chunk.request.num_output_tokens >= 64 for chunk in plan.chunks))
        gate.resume()
        assert clients.result(timeout=120) == [2] * 20
        deadline = time.monotonic() + 20
        while sum("client_disconnect" in r.getMessage() for r in caplog.records) < 20:
            assert time.monotonic() < deadline, "not every disconnect was noticed"
            time.sleep(0.02)
    live.wait_metric("tokenlane_requests_total", lambda v: v == cancelled0 + 20, outcome="cancelled")
    assert live.metric("tokenlane_requests_total", outcome="finished") == 0  # none ran to the end
    live.wait_metric("tokenlane_requests_running", lambda v: v == 0)
    live.wait_metric("tokenlane_kv_blocks_free", lambda v: v == free0)
    assert live.metric("tokenlane_kv_cache_usage_ratio") == usage0
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}


def stall_sends(app):
    """ASGI middleware: after N body messages of a response whose request carries
    `X-Test-Stall-After: N`, `send` blocks (a client that stopped reading)."""

    async def wrapped(scope, receive, send):
        headers = dict(scope.get("headers") or [])
        limit = headers.get(b"x-test-stall-after")
        if scope["type"] != "http" or limit is None:
            return await app(scope, receive, send)
        sent = 0

        async def stalling_send(message):
            nonlocal sent
            if message["type"] == "http.response.body":
                sent += 1
                if sent > int(limit):
                    await asyncio.Event().wait()  # until cancelled
            await send(message)

        return await app(scope, receive, stalling_send)

    return wrapped


def wait_log(caplog, text: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in record.getMessage() for record in caplog.records):
        assert time.monotonic() < deadline, f"no log line with {text!r}"
        time.sleep(0.02)


def test_non_streaming_client_disconnect_and_stalled_reader(serve, caplog):
    live = serve(
        """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler: {{streamIdleTimeoutMs: 300, maxBatchedTokens: 256, prefillChunkSize: 128}}
""",
        wrap=stall_sends,
    )
    caplog.set_level(logging.INFO, logger="tokenlane.server")
    free0 = live.metric("tokenlane_kv_blocks_free")

    def generating(plan) -> bool:  # well into its 480 tokens: it cannot finish while held
        return any(chunk.request.num_output_tokens >= 100 for chunk in plan.chunks)

    with StepGate(live.engine.executor) as gate:
        # A non-streaming client that gives up (read timeout) while the request is generating.
        gate.pause_when(generating)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", timeout=0.3,
                       json={"prompt": [7] * 20, "max_tokens": 480, "ignore_eos": True})
        wait_log(caplog, "client_disconnect")  # the server noticed: its abort is staged
        gate.resume()
        live.wait_metric("tokenlane_requests_total", lambda v: v == 1, outcome="cancelled",
                         reason="client_disconnect")

        # A consumer that stops reading: the transport's flow control then blocks the server's
        # writes. Loopback socket buffers hold more than a tiny model generates, so the block is
        # injected under the app (a `send` that never returns after two events, as a full
        # transport's would); the stream idle timeout (300 ms) must cancel the request.
        gate.pause_when(generating)
        with pytest.raises(httpx.RemoteProtocolError):  # two events, then the server closes
            httpx.post(live.url + "/v1/completions", headers={"X-Test-Stall-After": "2"}, timeout=30,
                       json={"prompt": [9, 9, 9], "max_tokens": 480, "ignore_eos": True, "stream": True})
        wait_log(caplog, "stream_idle_timeout")
        gate.resume()
    live.wait_metric("tokenlane_requests_total", lambda v: v == 1, outcome="cancelled",
                     reason="stream_idle_timeout")
    live.wait_metric("tokenlane_kv_blocks_free", lambda v: v == free0)
    assert live.metric("tokenlane_requests_total", outcome="finished") == 0
