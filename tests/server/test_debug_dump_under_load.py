"""POST /debug/dump and GET /debug/steps answer while the runtime is flooded (the operator
asks for a dump at a rollback, with a few seconds' timeout): a full flight recorder ring, streams held in flight by
a paused engine step, and every thread of asyncio's default executor busy tokenizing long
prompts. Each is held by construction (a StepGate, a gated tokenizer), not by timing."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import httpx

from tokenlane.runtime.entrypoints.completions import TOKENIZE_INLINE_MAX_CHARS
from tokenlane.runtime.executor.fake import StepGate

CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler: {{maxActiveSequences: 16, maxWaitingRequests: 128, maxBatchedTokens: 256, prefillChunkSize: 128}}
"""
STREAMS = 12
# asyncio's default executor is a ThreadPoolExecutor of the documented default size.
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)
LONG_PROMPT = "a " * (TOKENIZE_INLINE_MAX_CHARS // 2 + 1)  # tokenized in the default executor
BOUND_S = 60  # a bound for a broken test, not a timing assumption


class HeldTokenizer:
    """Holds the tokenization of long prompts (in the default executor's threads) until
    release(); short prompts pass."""

    def __init__(self, encode) -> None:
        self._encode = encode
        self._released = threading.Event()
        self._condition = threading.Condition()
        self.holding = 0

    def __call__(self, text: str) -> list[int]:
        if len(text) <= TOKENIZE_INLINE_MAX_CHARS:
            return self._encode(text)
        with self._condition:
            self.holding += 1
            self._condition.notify_all()
        self._released.wait()
        return self._encode("A long prompt, held")

    def wait_holding(self, count: int) -> None:
        with self._condition:
            assert self._condition.wait_for(lambda: self.holding >= count, BOUND_S), self.holding

    def release(self) -> None:
        self._released.set()


async def first_chunk_then_rest(client: httpx.AsyncClient, started: asyncio.Queue) -> list[str]:
    payload = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200
        lines = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                if not lines:
                    started.put_nowait(None)
                lines.append(line[6:])
    return lines


def test_a_dump_answers_while_the_runtime_is_flooded(serve, tmp_path):
    live = serve(CONFIG)
    state = live.state
    state.options.dump_dir = tmp_path
    stats = live.engine.snapshot()
    for _ in range(state.recorder.capacity):  # the ring a long flood leaves: full
        state.recorder.on_step(stats)
    tokenizer = HeldTokenizer(state.codec.encode)
    state.codec.encode = tokenizer

    async def main(gate: StepGate):
        limits = httpx.Limits(max_connections=STREAMS + DEFAULT_EXECUTOR_THREADS + 8)
        async with httpx.AsyncClient(base_url=live.url, timeout=BOUND_S, limits=limits) as client:
            started: asyncio.Queue = asyncio.Queue()
            streams = [asyncio.create_task(first_chunk_then_rest(client, started)) for _ in range(STREAMS)]
            for _ in range(STREAMS):
                await asyncio.wait_for(started.get(), BOUND_S)
            gate.pause()  # every stream is in flight; the next step is held
            await asyncio.to_thread(gate.wait_paused)
            long_ones = [asyncio.create_task(client.post("/v1/completions", json={"prompt": LONG_PROMPT,
                                                                                   "max_tokens": 2}))
                         for _ in range(DEFAULT_EXECUTOR_THREADS + 2)]
            # (The test's own loop and executor are not the server's.)
            await asyncio.to_thread(tokenizer.wait_holding, DEFAULT_EXECUTOR_THREADS)
            assert tokenizer.holding == DEFAULT_EXECUTOR_THREADS  # the default executor is full

            dump = await client.post("/debug/dump", params={"reason": "rollback under load"})
            steps = await client.get("/debug/steps")

            tokenizer.release()
            gate.resume()
            return dump, steps, await asyncio.gather(*streams), await asyncio.gather(*long_ones)

    with StepGate(live.engine.executor) as gate:
        try:
            dump, steps, streamed, long_answers = asyncio.run(main(gate))
        finally:
            tokenizer.release()
    assert dump.status_code == 200, dump.text
    document = json.loads(Path(dump.json()["path"]).read_text())
    assert document["reason"] == "rollback under load"
    assert len(document["steps"]) == state.recorder.capacity
    assert steps.status_code == 200, steps.text
    assert len(steps.text.splitlines()) == state.recorder.capacity
    assert all(lines[-1] == "[DONE]" for lines in streamed)  # the flood itself was served
    assert {r.status_code for r in long_answers} == {200}
