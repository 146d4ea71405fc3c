"""Far more concurrent requests than the lane can queue: the excess is refused at once with
429 + Retry-After (while the engine is held, so before any generation), every admitted
request completes, and the server stays healthy."""

from __future__ import annotations

import asyncio

import httpx

from tokenlane.runtime.executor.fake import StepGate

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
        r = await client.post("/v1/completions", json={"prompt": [11 + i % 50] * 12, "max_tokens": MAX_TOKENS,
                                                       "ignore_eos": True})
        return r

    async def health_during(client: httpx.AsyncClient, stop: asyncio.Event):
        codes = []
        while not stop.is_set():
            codes.append((await client.get("/health")).status_code)
            await asyncio.sleep(0.05)
        return codes

    async def main(gate: StepGate):
        limits = httpx.Limits(max_connections=N + 4, max_keepalive_connections=N + 4)
        async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as client:
            stop = asyncio.Event()
            health = asyncio.create_task(health_during(client, stop))
            requests = asyncio.gather(*[one(client, i) for i in range(N)])
            # Every refusal is answered while the engine is held: at once, not after
            # generation. Only then does the engine run the admitted requests.
            while True:
                admitted = live.metric("tokenlane_requests_running") + live.metric("tokenlane_requests_waiting")
                if live.metric("tokenlane_requests_total", outcome="rejected") + admitted == N:
                    break
                await asyncio.sleep(0.02)
            gate.resume()
            results = await requests
            stop.set()
            return results, admitted, await health

    with StepGate(live.engine.executor) as gate:
        gate.pause()
        results, admitted, health_codes = asyncio.run(main(gate))
    ok = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code != 200]
    # The lane's queue (4), plus what the held step had started (at most 4 running).
    assert 4 <= admitted <= 8
    assert (len(ok), len(refused)) == (admitted, N - admitted)
    for r in refused:
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert health_codes and set(health_codes) == {200}
    assert live.metric("tokenlane_requests_total", outcome="rejected", reason="queue_full") == len(refused)
    assert live.metric("tokenlane_requests_total", outcome="finished") == len(ok)
    live.wait_metric("tokenlane_requests_running", lambda v: v == 0)
