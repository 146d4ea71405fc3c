"""engine.coreProcess: the engine and its step loop in a process of their own, behind the
same HTTP API (real uvicorn on loopback, the official openai client). What a client sees must
not change: greedy text equal to an offline engine's, admission's refusals with their status,
disconnects that free KV in the core, hot reloads applied in the core, metrics and the flight
recorder fed from the core; a core that dies fails its streams and the health probe instead
of hanging them."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from core_hooks import hold_decoding_until_aborted, hold_from_step
from serve_process import start_serve

from tokenlane.runtime.config import load_config
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.engine.output import OfflineFront
from tokenlane.runtime.engine.client import EngineClient
from tokenlane.runtime.engine.core_client import CoreProcessClient
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.engine.tokenizer import apply_chat_template, encode_prompt

CORE = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu, coreProcess: true}}
scheduler:
  maxActiveSequences: 16
  maxWaitingRequests: 64
  maxBatchedTokens: 256
  prefillChunkSize: 128
  queueTimeoutMs: 30000
  streamIdleTimeoutMs: 10000
lanes:
  - {{name: interactive, default: true, priority: 100, weight: 4}}
  - {{name: batch, class: batch, priority: 10, weight: 1, match: {{minPromptTokens: 200}}}}
tenants:
  - {{name: capped, tokensPerMinute: 60}}
"""

# The simulated executor (no weights, no torch): the processes start in a second or two.
SIMULATED_CORE = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 4096}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu, executor: simulated, coreProcess: true}}
"""

PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"


@pytest.fixture(scope="module")
def core_gate(tmp_path_factory):
    """A file that arms core_hooks.hold_decoding_until_aborted in core_server (absent: off)."""
    return tmp_path_factory.mktemp("core-gate") / "hold"


@pytest.fixture(scope="module")
def core_server(serve, core_gate):
    return serve(CORE, on_core_start=functools.partial(hold_decoding_until_aborted, str(core_gate)))


@pytest.fixture(scope="module")
def offline(core_server):
    """An engine in this process on the same config: what the server must answer."""
    engine = LLMEngine.from_config(load_config(core_server.config_path))
    front = OfflineFront(engine)  # text and stop strings, as the server's front end makes them
    count = iter(range(10**6))

    def run(prompt_ids, **sampling):
        front.add_request(Request(f"ref-{next(count)}", list(prompt_ids), SamplingParams(**sampling)))
        text = ""
        while front.has_unfinished_requests():
            text += "".join(out.new_text for out in front.step())
        return text

    run.tokenizer = engine.tokenizer
    return run


def _stream_chunks(url: str, payload: dict, on_first=None) -> tuple[int, list]:
    """(status, the `data:` events) of one streamed completion; `on_first()` runs after the
    first event."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**payload, "stream": True}, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if len(events) == 1 and on_first is not None:
                    on_first()
    return 200, events


def test_the_engine_runs_in_its_own_process(core_server):
    client = core_server.state.client
    assert isinstance(client, CoreProcessClient) and isinstance(client, EngineClient)
    assert client._process.is_alive() and client._process.pid != os.getpid()
    assert client.max_model_len == 512 and client.vocab_size > 0
    assert httpx.get(core_server.url + "/ready").json()["status"] == "ready"


def test_greedy_text_equals_an_offline_engine(core_server, offline):
    client = openai.OpenAI(base_url=core_server.url + "/v1", api_key="unused", max_retries=0)
    ids = encode_prompt(offline.tokenizer, PROMPT)
    expected = offline(ids, max_tokens=12, temperature=0.0, ignore_eos=True)
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == expected and done.usage.completion_tokens == 12
    streamed = [chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(streamed) == expected and len(streamed) >= 2

    messages = [{"role": "user", "content": "Say something."}]
    expected_chat = offline(apply_chat_template(offline.tokenizer, messages), max_tokens=8, temperature=0.0)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == expected_chat


def test_stop_strings_are_found_in_the_api_process_and_end_the_request_in_the_core(core_server, offline):
    """The core returns token ids; the API process detokenizes and cuts at a stop string,
    as the in-process engine does, and the request ends in the core (its blocks freed)."""
    core_server.wait_metric("tokenlane_requests_running", lambda v: v == 0)
    free0 = core_server.metric("tokenlane_kv_blocks_free")
    ids = encode_prompt(offline.tokenizer, PROMPT)
    text = offline(ids, max_tokens=12, temperature=0.0, ignore_eos=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = offline(ids, max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    assert expected == text[: text.index(stop)]
    client = openai.OpenAI(base_url=core_server.url + "/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    core_server.wait_metric("tokenlane_requests_running", lambda v: v == 0)
    core_server.wait_metric("tokenlane_kv_blocks_free", lambda v: v == free0)


def test_structured_output_reaches_the_core(core_server):
    """The request's compiled grammar travels to the core with it."""
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["age"], "additionalProperties": False}
    client = openai.OpenAI(base_url=core_server.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "an age"}], max_tokens=64, temperature=1.0, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "age", "schema": schema, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    assert set(json.loads(out.choices[0].message.content)) == {"age"}


def test_parallel_sampling_and_routing_headers(core_server):
    with core_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "n": 3, "temperature": 1.0,
                                            "seed": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert [choice["index"] for choice in r.json()["choices"]] == [0, 1, 2]
        assert r.json()["usage"]["completion_tokens"] == 15
        # The core resolved the default lane; the queue delay is the core's first schedule.
        assert r.headers["x-lane"] == "interactive"
        assert float(r.headers["x-queue-delay-ms"]) >= 0
        long = c.post("/v1/completions", json={"prompt": [5] * 220, "max_tokens": 2, "ignore_eos": True})
        assert long.status_code == 200 and long.headers["x-lane"] == "batch"


def test_the_cores_refusals_keep_their_status_and_are_counted(core_server):
    with core_server.client() as c:
        payload = {"prompt": [11] * 50, "max_tokens": 10, "ignore_eos": True}
        first = c.post("/v1/completions", headers={"X-Tenant": "capped"}, json=payload)
        assert first.status_code == 200, first.text
        refused = c.post("/v1/completions", headers={"X-Tenant": "capped"}, json=payload)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "tenant_rate_limit"
        assert 30 <= int(refused.headers["retry-after"]) <= 50
        served = c.post("/v1/completions", json=payload)  # another tenant, same lane
        assert served.status_code == 200
    core_server.wait_metric("tokenlane_requests_total", lambda v: v == 1, tenant="capped", outcome="rejected",
                            reason="tenant_rate_limit")
    assert core_server.metric("tokenlane_tenant_throttled_total", tenant="capped") == 1


def test_a_client_that_leaves_frees_its_blocks_in_the_core(core_server, core_gate):
    core_server.wait_metric("tokenlane_requests_running", lambda v: v == 0)
    free0 = core_server.metric("tokenlane_kv_blocks_free")
    cancelled0 = core_server.metric("tokenlane_requests_total", outcome="cancelled")

    async def leave_mid_stream(i):
        payload = {"prompt": list(range(30 + i, 70 + i)), "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=core_server.url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=payload) as r:
                # The stream's headers come once the request has its first token (its text may
                # still be held back by the detokenizer, so no data line is awaited).
                assert r.status_code == 200

    async def main():
        await asyncio.gather(*(leave_mid_stream(i) for i in range(6)))

    # The core gives none of the six a second token before its abort is staged there: every
    # client leaves mid-generation, by construction.
    core_gate.write_text("armed")
    try:
        asyncio.run(main())
        core_server.wait_metric("tokenlane_requests_running", lambda v: v == 0)
    finally:
        core_gate.unlink()
    core_server.wait_metric("tokenlane_kv_blocks_free", lambda v: v == free0)
    assert core_server.metric("tokenlane_requests_total", outcome="cancelled") == cancelled0 + 6
    assert httpx.get(core_server.url + "/health").json() == {"status": "ok"}


def test_metrics_and_flight_recorder_are_fed_by_the_core(core_server):
    with core_server.client() as c:
        assert c.post("/v1/completions", json={"prompt": [9] * 20, "max_tokens": 4}).status_code == 200
        assert core_server.metric("tokenlane_kv_blocks_total") == 256  # the core's snapshot
        assert core_server.metric("tokenlane_requests_total", outcome="finished") >= 1
        assert core_server.metric("tokenlane_generation_tokens_total") > 0
        steps = [json.loads(line) for line in c.get("/debug/steps").text.splitlines()]
    assert any(step["batched_tokens"] > 0 and step["execute_s"] > 0 for step in steps)


def test_a_hot_reload_is_applied_in_the_core(serve):
    live = serve(SIMULATED_CORE + "lanes:\n  - {{name: interactive, default: true}}\n")
    original = live.config_path.read_text()
    live.config_path.write_text(original.replace(
        "lanes:\n", "lanes:\n  - {name: evening, priority: 50, weight: 2}\n"))
    deadline = time.monotonic() + 30
    while "evening" not in [lane.name for lane in live.state.config.lanes]:  # applied in the core, relayed
        assert time.monotonic() < deadline, "the reload never reached the API process"
        time.sleep(0.02)
    with live.client() as c:
        r = c.post("/v1/completions", headers={"X-Lane": "evening"}, json={"prompt": [3] * 8, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.headers["x-lane"] == "evening"  # the core's scheduler knows the new lane
    assert live.metric("tokenlane_config_reloads_total", result="success") == 1
    # A restart-only field: refused, the config in force stays.
    live.config_path.write_text(original.replace("blockSize: 16", "blockSize: 32"))
    live.wait_metric("tokenlane_config_reloads_total", lambda v: v == 1, result="restart_required")
    assert live.state.config.engine.block_size == 16


def test_a_core_that_dies_fails_its_streams_and_the_health_probe(serve, tmp_path):
    gate = tmp_path / "hold"
    gate.write_text("3")  # the core holds before its third step: streams stay open
    live = serve(SIMULATED_CORE, on_core_start=functools.partial(hold_from_step, str(gate)))
    core = live.state.client._process

    status, events = _stream_chunks(live.url, {"prompt": [4] * 10, "max_tokens": 100, "ignore_eos": True},
                                    on_first=lambda: os.kill(core.pid, signal.SIGKILL))
    assert status == 200
    # The stream's last event says why it ended (not a silent truncation), after the text so far.
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_error" and "engine core" in events[-2]["error"]["message"]
    assert all("choices" in e for e in events[:-2]) and len(events) >= 3

    deadline = time.monotonic() + 30
    while httpx.get(live.url + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert httpx.get(live.url + "/health").json()["error"]["code"] == "engine_dead"
    refused = httpx.post(live.url + "/v1/completions", json={"prompt": [4] * 5, "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
    assert "retry-after" in refused.headers


def test_an_admission_waiting_on_a_dead_core_is_answered(serve):
    live = serve(SIMULATED_CORE)
    core = live.state.client._process
    os.kill(core.pid, signal.SIGSTOP)  # the core cannot answer: the admission waits
    try:
        async def main():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
                pending = asyncio.create_task(client.post("/v1/completions", json={"prompt": [4] * 5, "max_tokens": 2}))
                while not live.state.client._calls:  # the add is on its way to the core
                    await asyncio.sleep(0.01)
                assert not pending.done()
                os.kill(core.pid, signal.SIGKILL)
                return await pending

        answer = asyncio.run(main())
    finally:
        if core.is_alive():
            os.kill(core.pid, signal.SIGKILL)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "unavailable"


def test_a_core_that_cannot_load_is_a_clear_start_up_error(tmp_path):
    config = load_config(_write(tmp_path, CORE.format(model=tmp_path / "missing")))
    with pytest.raises(ValueError, match="missing"):
        CoreProcessClient.from_config(config)
    proc = subprocess.run([sys.executable, "-m", "tokenlane.cli", "serve", "--model", str(tmp_path / "missing"),
                           "--core-process", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot load" in proc.stderr and "missing" in proc.stderr


def _write(tmp_path, text):
    path = tmp_path / "runtime.yaml"
    path.write_text(text)
    return path


def _core_of(pid: int) -> int:
    """The server's engine core: its spawned child (not multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    cores = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                cores.append(child)
    (core,) = cores
    return core


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):  # exited, not yet reaped
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_tokenlane_serve_drains_on_sigterm_and_leaves_no_core_behind(tiny_model_dir, tmp_path):
    config = _write(tmp_path, SIMULATED_CORE.format(model=tiny_model_dir))
    proc, url = start_serve(config)
    try:
        core_pid = _core_of(proc.pid)
        r = httpx.post(url + "/v1/completions", json={"prompt": [4] * 5, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # Ctrl-C in a terminal signals the whole process group: the core ignores it, and the
        # server's drain stops the core.
        os.kill(core_pid, signal.SIGINT)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "shutdown complete" in proc.stdout.read()
        assert _gone(core_pid)
    finally:
        proc.kill()

    proc, url = start_serve(config)
    try:
        core_pid = _core_of(proc.pid)
        proc.kill()  # no drain at all: the core sees its pipe close and exits by itself
        proc.wait(30)
        assert _gone(core_pid)
    finally:
        proc.kill()
