"""Clients that go away: their requests are aborted in the engine, counted as cancelled,
and their KV blocks come back."""

from __future__ import annotations

import asyncio

import httpx
import pytest


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


def test_twenty_streaming_clients_disconnect(serve):
    live = serve()
    usage0, free0 = idle_kv(live)
    cancelled0 = live.metric("tokenlane_requests_total", outcome="cancelled")

    async def main():
        return await asyncio.gather(*[_stream_then_vanish(live.url, i) for i in range(20)])

    assert asyncio.run(main()) == [2] * 20
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


def test_non_streaming_client_disconnect_and_stalled_reader(serve):
    live = serve(
        """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler: {{streamIdleTimeoutMs: 300, maxBatchedTokens: 256, prefillChunkSize: 128}}
""",
        wrap=stall_sends,
    )
    free0 = live.metric("tokenlane_kv_blocks_free")
    # A non-streaming client that gives up (read timeout) while the request is generating.
    try:
        httpx.post(live.url + "/v1/completions", timeout=0.3,
                   json={"prompt": [7] * 20, "max_tokens": 480, "ignore_eos": True})
        raise AssertionError("the request should still be running after 0.3 s")
    except httpx.ReadTimeout:
        pass
    live.wait_metric("tokenlane_requests_total", lambda v: v == 1, outcome="cancelled", reason="client_disconnect")

    # A consumer that stops reading: the transport's flow control then blocks the server's
    # writes. Loopback socket buffers hold more than a tiny model generates, so the block is
    # injected under the app (a `send` that never returns after two events, as a full
    # transport's would); the stream idle timeout (300 ms) must cancel the request.
    with pytest.raises(httpx.RemoteProtocolError):  # two events, then the server closes
        httpx.post(live.url + "/v1/completions", headers={"X-Test-Stall-After": "2"}, timeout=30,
                   json={"prompt": [9, 9, 9], "max_tokens": 480, "ignore_eos": True, "stream": True})
    live.wait_metric("tokenlane_requests_total", lambda v: v == 1, outcome="cancelled",
                     reason="stream_idle_timeout")
    live.wait_metric("tokenlane_kv_blocks_free", lambda v: v == free0)
    assert live.metric("tokenlane_requests_total", outcome="finished") == 0
