"""Far more concurrent requests than the lane can queue: the excess is refused at once with
429/503 + Retry-After, every admitted request completes, and the server stays healthy."""

from __future__ import annotations

import asyncio
import time

import httpx

SMALL_QUEUE = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler: {{maxActiveSequences: 4, maxWaitingRequests: 64, maxBatchedTokens: 256, prefillChunkSize: 128}}
lanes:
  - {{name: interactive, default: true, maxWaitingRequests: 4}}
"""

N = 80
MAX_TOKENS = 24


def test_overload_is_refused_quickly_and_admitted_work_completes(serve):
    live = serve(SMALL_QUEUE)

    async def one(client: httpx.AsyncClient, i: int):
        started = time.monotonic()
        r = await client.post("/v1/completions", json={"prompt": [11 + i % 50] * 12, "max_tokens": MAX_TOKENS,
                                                       "ignore_eos": True})
        return r, time.monotonic() - started

    async def health_during(client: httpx.AsyncClient, stop: asyncio.Event):
        codes = []
        while not stop.is_set():
            codes.append((await client.get("/health")).status_code)
            await asyncio.sleep(0.05)
        return codes

    async def main():
        limits = httpx.Limits(max_connections=N + 4, max_keepalive_connections=N + 4)
        async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as client:
            stop = asyncio.Event()
            health = asyncio.create_task(health_during(client, stop))
            results = await asyncio.gather(*[one(client, i) for i in range(N)])
            stop.set()
            return results, await health

    results, health_codes = asyncio.run(main())
    ok = [(r, dt) for r, dt in results if r.status_code == 200]
    refused = [(r, dt) for r, dt in results if r.status_code != 200]
    assert all(r.status_code in (429, 503) for r, _ in refused), {r.status_code for r, _ in refused}
    assert len(refused) >= N // 2, f"only {len(refused)} of {N} refused"
    assert len(ok) >= 4  # at least the running set + queue were admitted
    for r, _ in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    for r, _ in ok:
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    # Refusals are answered without waiting for generation: faster than any admitted request.
    slowest_refusal = max(dt for _, dt in refused)
    slowest_ok = max(dt for _, dt in ok)
    assert slowest_refusal < max(2.0, slowest_ok), (slowest_refusal, slowest_ok)
    assert health_codes and set(health_codes) == {200}
    assert live.metric("tokenlane_requests_total", outcome="rejected", reason="queue_full") == len(refused)
    assert live.metric("tokenlane_requests_total", outcome="finished") == len(ok)
    live.wait_metric("tokenlane_requests_running", lambda v: v == 0)
