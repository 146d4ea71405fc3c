"""n > 1 and best_of through the HTTP API (real uvicorn, the tiny model, the openai SDK): the
sequences share the prompt's KV blocks, measured through the KV metrics."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from tokenlane.runtime.executor.fake import StepGate

CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 1024}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler:
  maxActiveSequences: 16
  maxWaitingRequests: 64
  maxBatchedTokens: 1024
  prefillChunkSize: 1024
  queueTimeoutMs: 30000
  streamIdleTimeoutMs: 30000
"""


@pytest.fixture(scope="module")
def live(serve):
    return serve(CONFIG)


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def used_blocks(live) -> float:
    return live.metric("tokenlane_kv_blocks_total") - live.metric("tokenlane_kv_blocks_free")


def test_n4_shares_the_prompt_blocks_and_cancel_frees_them(live):
    """n=4 on a 512-token prompt (32 blocks of 16). The prompt is computed once; the four
    sequences share its blocks. When the leader's decode reaches position 520 (block 32,
    inside it: the step before allocated nothing new), the pool holds the 32 prompt blocks,
    3 copies of the last prompt block (each follower writes its own last prompt token into
    it) and one decode block per sequence: 39 blocks, where four separate requests hold
    4 x 33 = 132. Closing the stream then frees all of them."""
    free0 = live.metric("tokenlane_kv_blocks_free")
    body = {"prompt": [100 + (i * 7) % 800 for i in range(512)], "n": 4, "max_tokens": 200,
            "ignore_eos": True, "temperature": 1.0, "seed": 5, "stream": True}

    def stream_until_held(url):
        with httpx.Client(base_url=url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                indexes = set()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        indexes.update(c["index"] for c in json.loads(line[6:])["choices"])
                    if indexes == {0, 1, 2, 3} and held.done():
                        return indexes  # leave mid-generation: the connection closes

    held: concurrent.futures.Future = concurrent.futures.Future()
    with StepGate(live.engine.executor) as gate:
        gate.pause_when(lambda plan: any(c.start == 520 for c in plan.chunks))
        reader = concurrent.futures.ThreadPoolExecutor(1).submit(stream_until_held, live.url)
        gate.wait_paused()
        assert used_blocks(live) == 32 + 3 + 4
        held.set_result(True)
        gate.resume()  # the reader leaves at its next event, long before 200 tokens
        assert reader.result(timeout=120) == {0, 1, 2, 3}
    live.wait_metric("tokenlane_kv_blocks_free", lambda v: v == free0)
    live.wait_metric("tokenlane_requests_running", lambda v: v == 0)


def test_openai_sdk_n2_completions_and_chat(client):
    greedy = client.completions.create(model="tiny", prompt="The sky is", max_tokens=8, temperature=0)
    both = client.completions.create(model="tiny", prompt="The sky is", max_tokens=8, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [greedy.choices[0].text] * 2  # greedy: all the same
    assert both.usage.prompt_tokens == greedy.usage.prompt_tokens  # the prompt counts once
    assert both.usage.completion_tokens == 2 * greedy.usage.completion_tokens

    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=2, seed=9,
                                          logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=2, seed=9,
                                           logprobs=True, top_logprobs=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == [c.message.content for c in again.choices]
    assert chat.choices[0].message.content != chat.choices[1].message.content  # own seeds
    for choice in chat.choices:
        assert len(choice.logprobs.content) == 6
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert chat.usage.completion_tokens == 12


def test_streamed_chat_interleaves_choices_by_index(live):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 3, "seed": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    whole = httpx.post(live.url + "/v1/chat/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=60).json()
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    usage = None
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
                if choice["finish_reason"]:
                    finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage == whole["usage"] and usage["completion_tokens"] == 15


def test_best_of_returns_the_highest_cumulative_logprob(live):
    prompt = {"prompt": "Once upon a time", "max_tokens": 6, "seed": 21, "temperature": 1.0}
    every = httpx.post(live.url + "/v1/completions", json={**prompt, "n": 4, "logprobs": 0}, timeout=60).json()
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]]
    ranked = sorted(range(4), key=lambda j: -totals[j])
    best = httpx.post(live.url + "/v1/completions", json={**prompt, "n": 2, "best_of": 4}, timeout=60).json()
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [c["text"] for c in best["choices"]] == [every["choices"][j]["text"] for j in ranked[:2]]
    assert best["choices"][0]["logprobs"] is None  # not asked for: computed only to rank
    assert best["usage"] == every["usage"]  # all four sequences were computed


def test_echo_and_prompt_logprobs_in_every_choice(live):
    """The followers take the leader's prompt logprobs at the fork: each choice has them."""
    body = {"prompt": "one two three", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "prompt_logprobs": 1}
    single = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    out = httpx.post(live.url + "/v1/completions", json={**body, "n": 3}, timeout=60).json()
    for choice in out["choices"]:
        assert choice["text"] == single["text"] and choice["text"].startswith("one two three")
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["tokens"] == single["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(single["logprobs"]["token_logprobs"][1:],
                                                                         abs=1e-4)
        assert len(choice["prompt_logprobs"]) == len(single["prompt_logprobs"])


def test_batched_prompts_with_n_index_prompt_major(live):
    body = {"prompt": ["a b c", "x y"], "n": 2, "max_tokens": 3, "temperature": 0}
    out = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in out["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]
    single = httpx.post(live.url + "/v1/completions", json={**body, "n": 1}, timeout=60).json()
    assert out["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"n": 2, "best_of": 1}, "best_of"),  # best_of < n
        ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),  # best_of > n streamed
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"n": 129}, "n"),
        ("/v1/completions", {"n": True}, "n"),  # strict: no bool -> int
        ("/v1/chat/completions", {"best_of": 2}, "best_of"),  # completions only
        ("/v1/completions", {"n": 17}, None),  # more than maxActiveSequences: the engine's 400
    ],
)
def test_invalid_parallel_sampling_is_400(live, path, extra, param):
    body = {"max_tokens": 2, **extra}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = httpx.post(live.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    else:
        assert "maxActiveSequences" in error["message"], error
