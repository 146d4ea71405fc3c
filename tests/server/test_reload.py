"""Hot reload of runtime.yaml under load: a new lane budget shows in /metrics and nothing is
dropped; an invalid file or a restart-only change leaves the config in force alone."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx

from tokenlane.runtime.executor.fake import StepGate

CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler: {{maxActiveSequences: 16, maxBatchedTokens: 256, prefillChunkSize: 128}}
lanes:
  - {{name: interactive, default: true, maxBatchedTokens: 128}}
  - {{name: batch, class: batch}}
"""

N_REQUESTS = 8
MAX_TOKENS = 200


def budget(live, lane="interactive", key="maxBatchedTokens"):
    return live.metric("tokenlane_lane_budget", lane=lane, budget=key)


def test_budget_change_applies_under_load_and_bad_files_are_refused(serve, caplog):
    caplog.set_level(logging.INFO, logger="tokenlane.config")
    live = serve(CONFIG)
    original = live.config_path.read_text()
    assert budget(live) == 128

    async def one(client, i):
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": [40 + i] * 10, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                       "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
        return events[-1]["usage"]["completion_tokens"], events[-2]["choices"][0]["finish_reason"]

    def decoding(plan) -> bool:
        return any(chunk.request.num_output_tokens for chunk in plan.chunks)

    def reloaded(plan) -> bool:
        return live.engine.config.lane_budgets("interactive").max_batched_tokens == 48

    async def main(gate: StepGate):
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(N_REQUESTS)]
            await asyncio.to_thread(gate.wait_paused)
            # Requests are running, held mid-generation: change the interactive lane's token
            # budget in the file, and wait for the watcher to hand it to the engine.
            live.config_path.write_text(original.replace("maxBatchedTokens: 128}", "maxBatchedTokens: 48}"))
            while live.state.watcher.last_result != "success":
                await asyncio.sleep(0.02)
            # The engine applies it at the next step boundary; hold the step right after.
            gate.pause_when(reloaded)
            gate.resume()
            await asyncio.to_thread(gate.wait_paused)
            assert budget(live) == 48
            finished = live.metric("tokenlane_requests_total", outcome="finished")
            gate.resume()
            return await asyncio.gather(*tasks), finished

    with StepGate(live.engine.executor) as gate:
        gate.pause_when(decoding)
        results, finished_at_reload = asyncio.run(main(gate))
    assert finished_at_reload == 0  # the reload landed while the requests were in flight
    assert results == [(MAX_TOKENS, "length")] * N_REQUESTS  # nothing dropped or cut short
    assert live.engine.config.lane_budgets("interactive").max_batched_tokens == 48
    assert live.metric("tokenlane_config_reloads_total", result="success") == 1
    assert "config reloaded" in caplog.text
    assert live.metric("tokenlane_requests_total", outcome="finished") == N_REQUESTS

    # Invalid files: refused, the last good config stays.
    for bad in (original.replace("maxBatchedTokens: 128}", "maxBatchedTokens: -5}"),
                original + "\nunknownSection: 1\n",
                "lanes: [unclosed"):
        before = live.metric("tokenlane_config_reloads_total", result="invalid")
        live.config_path.write_text(bad)
        live.wait_metric("tokenlane_config_reloads_total", lambda v: v == before + 1, result="invalid")
    assert budget(live) == 48
    assert live.engine.config.lane_budgets("interactive").max_batched_tokens == 48

    # A model/engine change needs a restart: refused, budgets untouched.
    live.config_path.write_text(original.replace("kvCacheBlocks: 256", "kvCacheBlocks: 128")
                                .replace("maxBatchedTokens: 128}", "maxBatchedTokens: 32}"))
    live.wait_metric("tokenlane_config_reloads_total", lambda v: v == 1, result="restart_required")
    assert budget(live) == 48
    assert "need a restart" in live.state.watcher.last_message
    assert "need a restart" in caplog.text and "maxBatchedTokens" in caplog.text  # both logged

    # The server kept serving throughout.
    r = httpx.post(live.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
    assert r.status_code == 200
