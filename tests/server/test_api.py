"""The OpenAI API over real HTTP (uvicorn on loopback): httpx and the official client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tokenlane.runtime.config import load_config
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.engine.output import OfflineFront
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.engine.tokenizer import apply_chat_template, encode_prompt

PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"


@pytest.fixture(scope="module")
def reference(shared_server):
    """A second engine on the same config: what the server must answer, run offline."""
    engine = LLMEngine.from_config(load_config(shared_server.config_path))
    front = OfflineFront(engine)  # text and stop strings, as the server's front end makes them

    def run(prompt_ids, **sampling):
        request = Request(f"ref-{len(prompt_ids)}-{sorted(sampling.items())}", list(prompt_ids),
                          SamplingParams(**sampling))
        front.add_request(request)
        text, ids, last = "", [], None
        while front.has_unfinished_requests():
            for out in front.step():
                text += out.new_text
                ids += out.new_token_ids
                last = out
        return text, ids, last.finish_reason.value

    run.tokenizer = engine.tokenizer
    return run


def test_probes_and_models(shared_server):
    with shared_server.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/ready").status_code == 200
        models = c.get("/v1/models").json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["max_model_len"] == 512
        metrics = c.get("/metrics")
        assert metrics.status_code == 200 and "tokenlane_kv_blocks_total" in metrics.text


def test_metrics_name_filter_renders_only_the_named_samples(shared_server):
    """`tokenlane router` scrapes replicas several times a second with prometheus_client's
    `name[]` filter: only those samples come back, the rest of the exposition is left out."""
    with shared_server.client() as c:
        full = c.get("/metrics").text
        some = c.get("/metrics", params=[("name[]", "tokenlane_kv_cache_usage_ratio"),
                                         ("name[]", "tokenlane_requests_waiting")]).text
    samples = {line.split("{")[0].split(" ")[0] for line in some.splitlines() if line and not line.startswith("#")}
    assert samples == {"tokenlane_kv_cache_usage_ratio", "tokenlane_requests_waiting"}
    assert "tokenlane_kv_blocks_total" in full and len(some) < len(full) / 5


def test_greedy_completion_equals_engine(shared_server, reference):
    ids = encode_prompt(reference.tokenizer, PROMPT)
    ref_text, ref_ids, ref_reason = reference(ids, max_tokens=12, temperature=0.0, ignore_eos=True)
    with shared_server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 12,
                                            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert r.headers["x-lane"] == "interactive" and r.headers["x-tenant"] == "default"
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert body["choices"][0]["text"] == ref_text
        assert body["choices"][0]["finish_reason"] == "length" == ref_reason
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
        # Token-id prompts (also as a list of one prompt) give the same answer.
        for prompt in (ids, [ids]):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                "ignore_eos": True})
            assert r.json()["choices"][0]["text"] == ref_text


def test_streaming_equals_non_streaming(shared_server, reference, sse):
    ids = encode_prompt(reference.tokenizer, PROMPT)
    ref_text, _, _ = reference(ids, max_tokens=10, temperature=0.0, ignore_eos=True)
    with shared_server.client() as c:
        payload = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/completions", json=payload) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-lane"] == "interactive"
            events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    text_chunks = chunks[:-1]
    assert "".join(ch["choices"][0]["text"] for ch in text_chunks) == ref_text
    assert len(text_chunks) >= 2  # streamed incrementally, not in one piece
    assert [ch["choices"][0]["finish_reason"] for ch in text_chunks][-1] == "length"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in text_chunks[:-1])


def test_a_middleware_added_to_the_app_sees_every_streamed_chunk(serve, reference, sse):
    # Streams write their chunks past Starlette's wrappers of `send` (runtime/entrypoints/sse.py,
    # RAW_SEND) only while the app has no middleware of its own: one added (it could rewrite
    # the body) must get them all.
    seen: list[bytes] = []

    class RecordBodies:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            async def recording_send(message):
                if message["type"] == "http.response.body":
                    seen.append(message.get("body", b""))
                await send(message)

            await self.app(scope, receive, recording_send)

    def with_middleware(app):
        app.add_middleware(RecordBodies)
        return app

    live = serve(wrap=with_middleware)
    ids = encode_prompt(reference.tokenizer, PROMPT)
    ref_text, _, _ = reference(ids, max_tokens=8, temperature=0.0, ignore_eos=True)
    with live.client() as c:
        payload = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=payload) as r:
            assert r.status_code == 200
            received = b"".join(r.iter_bytes())
    events = sse(received.decode().splitlines())
    assert events[-1] == "[DONE]"
    assert "".join(ch["choices"][0]["text"] for ch in events[:-1]) == ref_text
    assert b"".join(seen) == received


def test_openai_client_completions_and_chat(shared_server, reference):
    client = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)
    ids = encode_prompt(reference.tokenizer, PROMPT)
    ref_text, _, _ = reference(ids, max_tokens=8, temperature=0.0, ignore_eos=True)
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == ref_text and done.usage.completion_tokens == 8
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    )
    assert streamed == ref_text

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    chat_ids = apply_chat_template(reference.tokenizer, messages)
    ref_chat, _, ref_reason = reference(chat_ids, max_tokens=8, temperature=0.0)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == ref_chat
    assert chat.choices[0].finish_reason == ref_reason
    assert chat.usage.prompt_tokens == len(chat_ids)
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == ref_chat
    assert usage is not None and usage.prompt_tokens == len(chat_ids)
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_seeded_sampling_and_stop_strings(shared_server, reference):
    ids = encode_prompt(reference.tokenizer, PROMPT)
    ref_text, _, _ = reference(ids, max_tokens=16, temperature=0.0, ignore_eos=True)
    with shared_server.client() as c:
        def complete(**kw):
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, **kw})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        a = complete(temperature=1.0, top_p=0.9, top_k=50, seed=7)
        b = complete(temperature=1.0, top_p=0.9, top_k=50, seed=7)
        assert a["text"] == b["text"]
        # A stop string taken from the greedy output: text ends right before it.
        stop = ref_text[len(ref_text) // 2:][:3]
        if stop.strip():
            cut = complete(temperature=0, stop=stop)
            assert cut["finish_reason"] == "stop"
            assert cut["text"] == ref_text[: ref_text.index(stop)]


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": 9}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "presence_penalty": "1"}, "presence_penalty"),  # strict: no str -> float
        ({"prompt": "x", "frequency_penalty": -2.01}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "repetition_penalty": True}, "repetition_penalty"),  # strict: no bool -> float
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-5": 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"99999": 1.0}}, "logit_bias"),  # past the vocabulary
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),  # strict: no str -> int
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),  # strict: no bool -> int
        ({"prompt": "x", "temperature": "0.5"}, "temperature"),
        ({"prompt": "x", "stream": "true"}, "stream"),
        ({"prompt": "x", "seed": 1.5}, "seed"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),  # strict: no bool -> int
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[False]]}, "prompt"),  # strict: no bool -> token id
        ({"prompt": [[5], [99999]]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [-1, 5]}, "prompt"),
        ({"prompt": [5, 99999]}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "x", "max_tokens": 600}, "max_tokens"),  # prompt + max_tokens > maxModelLen 512
        ({"prompt": "x", "stop": ["a"] * 20}, "stop"),
        ({"prompt": "x", "stop": "a" * 5000}, "stop"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": {"nested": "object"}}, "prompt"),
    ],
)
def test_invalid_parameters_are_400(shared_server, payload, param):
    r = httpx.post(shared_server.url + "/v1/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param, error


def test_malformed_bodies_and_unknown_routes(shared_server):
    url = shared_server.url
    for content in (b"{not json", b"", b"[1, 2]", b"null"):
        r = httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (content, r.text)
        assert "error" in r.json()
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"X-Lane": "nope"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_lane"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Deadline-Ms": "soon"})
    assert r.status_code == 400
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(url + "/health").status_code == 200  # none of it hurt the server


def test_lane_rules_route_long_prompts(shared_server, reference):
    long_ids = encode_prompt(reference.tokenizer, PROMPT * 30)[:250]  # >= minPromptTokens 200
    with shared_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-lane"] == "batch"
        r = c.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 2}, headers={"X-Lane": "interactive"})
        assert r.headers["x-lane"] == "interactive"


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 1e-9},
        {"temperature": 2.0, "top_p": 1e-9},
        {"temperature": 1.0, "top_k": 10**20},
        {"temperature": 1.0, "seed": 2**64},
        {"temperature": 1.0, "seed": -(2**70)},
        {"temperature": 1.0, "seed": -1},
        {"stop_token_ids": [-1, 10**30]},
        {"stop": ["\x00", "🙂", "a" * 1000]},
        {"priority": 10**30},
        {"max_tokens": 10**18},
        {"prompt": [0, 1, 2, 3, 4]},  # special tokens only
        {"prompt": "🙂" * 50 + "\x00\ufffd"},
        {"user": "x" * 10000, "unknown_field": {"deep": [1, 2]}},
    ],
)
def test_edge_values_are_served_or_refused_never_500(shared_server, extra):
    body = {"prompt": "hello", "max_tokens": 3, **extra}
    r = httpx.post(shared_server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        assert r.json()["usage"]["completion_tokens"] >= 1
    # Whatever it was, the next request is served normally.
    ok = httpx.post(shared_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_simulated_executor_serves_text_and_chat(serve):
    """`engine.executor: simulated` has no tokenizer: text becomes synthetic ids (4 bytes each)."""
    live = serve("""
model: {{path: simulated/llama3-8b, servedName: sim, maxModelLen: 4096}}
engine: {{executor: simulated, kvCacheBlocks: 512}}
""")
    with live.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 400, "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert len(r.json()["choices"][0]["message"]["content"].split()) == 3  # a placeholder word per token
        # Streaming sends a chunk per token (not everything at the end), so TTFT is measurable.
        for path, body in (("/v1/completions", {"prompt": "hi there"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            with c.stream("POST", path, json={**body, "max_tokens": 6, "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                events = [json.loads(line[5:]) for line in r.iter_lines()
                          if line.startswith("data:") and line != "data: [DONE]"]
            texts = [ch.get("text") or (ch.get("delta") or {}).get("content")
                     for e in events for ch in e["choices"]]
            assert len([t for t in texts if t]) == 6, texts


def test_long_text_prompt_is_tokenized_off_loop_and_served(shared_server, reference):
    text = PROMPT * 200  # > 8192 characters: tokenized in a worker thread
    ids = encode_prompt(reference.tokenizer, text)
    with shared_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert len(ids) > 512
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"prompt ({len(ids)} tokens)" in r.json()["error"]["message"]


def test_openai_requests_do_not_pass_through_the_thread_pool(shared_server, monkeypatch):
    """A plain `def` dependency or endpoint would go through FastAPI's thread pool: a round trip
    through a worker thread, and through the GIL that the step thread holds between kernels, on
    every request (served TTFT p50 0.76-0.92x without it, docs/benchmarks.md)."""
    import fastapi.dependencies.utils
    import fastapi.routing

    pooled = []

    async def recording(func, *args, **kwargs):
        pooled.append(getattr(func, "__name__", repr(func)))
        return func(*args, **kwargs)

    monkeypatch.setattr(fastapi.dependencies.utils, "run_in_threadpool", recording)
    monkeypatch.setattr(fastapi.routing, "run_in_threadpool", recording)
    url = shared_server.url
    assert httpx.get(url + "/v1/models").status_code == 200
    assert httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "hello", "max_tokens": 2}).status_code == 200
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "stream": True}) as response:
        assert response.status_code == 200
        assert "data: [DONE]" in response.read().decode()
    assert httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "hello"}).status_code == 200
    assert pooled == []
