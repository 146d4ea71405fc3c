"""A flood of long prompts in the batch lane does not stall the interactive lane: its
streams get a token at every engine step while the flood is being prefilled."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx

from tokenlane.runtime.executor.fake import StepGate

LANES = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 512, device: cpu}}
scheduler: {{maxActiveSequences: 32, maxWaitingRequests: 256, maxBatchedTokens: 96, prefillChunkSize: 64}}
lanes:
  - {{name: interactive, default: true, priority: 100, weight: 4}}
  - {{name: batch, class: batch, priority: 10, weight: 1, match: {{minPromptTokens: 200}}}}
"""

BATCH_REQUESTS = 16
INTERACTIVE_STREAMS = 3
INTERACTIVE_TOKENS = 24


class StepLog:
    """An engine observer recording, per step, each lane's scheduled tokens and sizes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.steps = []

    def on_step(self, stats):
        with self.lock:
            self.steps.append({name: (lane.scheduled_tokens, lane.running, lane.waiting)
                               for name, lane in stats.lanes.items()})

    def on_request_finished(self, request):
        pass

    def on_config_applied(self, config, ok, message):
        pass


def test_batch_flood_does_not_stall_interactive_streams(serve):
    live = serve(LANES)
    log = StepLog()
    live.engine.add_observer(log)

    async def batch(client, i):
        r = await client.post("/v1/completions", json={"prompt": [100 + i] * 400, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.headers["x-lane"] == "batch"
        return asyncio.get_running_loop().time()

    async def interactive(client, i):
        events = []
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": [30 + i] * 8, "max_tokens": INTERACTIVE_TOKENS, "ignore_eos": True,
                                       "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.headers["x-lane"] == "interactive"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        assert len(events) > 2  # streamed, not one piece
        return events[-1]["usage"]["completion_tokens"], asyncio.get_running_loop().time()

    def queued(lane: str) -> float:
        return live.metric("tokenlane_requests_waiting", lane=lane) + live.metric("tokenlane_requests_running", lane=lane)

    async def main(gate: StepGate):
        async with httpx.AsyncClient(base_url=live.url, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            # The engine is held until the whole flood and every interactive stream are in,
            # so the streams meet the flood at its start however slowly the clients start.
            flood = [asyncio.create_task(batch(client, i)) for i in range(BATCH_REQUESTS)]
            while queued("batch") < BATCH_REQUESTS:
                await asyncio.sleep(0.01)
            streams = asyncio.gather(*[interactive(client, i) for i in range(INTERACTIVE_STREAMS)])
            while queued("interactive") < INTERACTIVE_STREAMS:
                await asyncio.sleep(0.01)
            gate.resume()
            return await streams, await asyncio.gather(*flood)

    with StepGate(live.engine.executor) as gate:
        gate.pause()
        streams, batch_done = asyncio.run(main(gate))
    assert [tokens for tokens, _ in streams] == [INTERACTIVE_TOKENS] * INTERACTIVE_STREAMS
    # The interactive streams were done before the flood was.
    assert max(t for _, t in streams) < max(batch_done)

    with log.lock:
        steps = list(log.steps)
    # Every step after one in which interactive sequences were running gave each of them a
    # token (decode-first), also while the batch lane had prompts left to prefill.
    contended = 0
    for prev, cur in zip(steps, steps[1:]):
        running_before = prev.get("interactive", (0, 0, 0))[1]
        if running_before == 0:
            continue
        assert cur["interactive"][0] >= running_before, (prev, cur)
        if cur["batch"][0] > 0 or cur["batch"][2] > 0:
            contended += 1
    assert contended >= INTERACTIVE_TOKENS // 2, f"only {contended} steps shared with the batch flood"
