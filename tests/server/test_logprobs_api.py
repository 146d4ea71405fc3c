"""Logprobs, echo, prompt_logprobs, batched prompts and GET /v1/models/{id} over real HTTP
(uvicorn on loopback), through the official `openai` client where it has the fields.

Values are checked against transformers' float32 `log_softmax` on the same checkpoint
(greedy decoding, so the generated tokens are transformers' greedy tokens too)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from tokenlane.runtime.engine.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """(tokenizer, fn(ids, max_new) -> (greedy new ids, [len, V] log_softmax over ids + new))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokenizer = load_tokenizer(tiny_model_dir)

    def run(ids, max_new):
        new = []
        if max_new:
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=max_new, do_sample=False, pad_token_id=0)
            new = out[0, len(ids):].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([ids + new])).logits[0].float()
        return new, torch.log_softmax(logits, dim=-1)

    run.tokenizer = tokenizer
    return run


@pytest.fixture(scope="module")
def client(shared_server):
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)


def tok_str(tokenizer, token_id):
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def wait_idle(live, timeout=20.0):
    """Wait until the engine holds no request; then its books must balance with no block used."""
    engine = live.engine
    kv = engine.scheduler.kv
    deadline = time.monotonic() + timeout
    # The step that finished the last request frees its blocks before it returns: wait for
    # both, rather than for a guessed time after the first.
    while engine.has_unfinished_requests() or kv.num_free_blocks != kv.num_blocks:
        assert time.monotonic() < deadline, (
            "requests left running" if engine.has_unfinished_requests() else "KV blocks leaked")
        time.sleep(0.02)
    engine.scheduler.check_invariants()


def legacy_as_dict(lp) -> dict:
    return lp if isinstance(lp, dict) else lp.model_dump()


def merge_legacy(parts: list[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key] += part[key]
    return out


# ---------------------------------------------------------------- completions (legacy shape)


def test_completions_logprobs_shape_and_values(client, hf):
    ids = encode_prompt(hf.tokenizer, PROMPT)
    new, lp = hf(ids, 6)
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    choice = done.choices[0]
    got = legacy_as_dict(choice.logprobs)
    assert set(got) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert got["tokens"] == [tok_str(hf.tokenizer, t) for t in new]
    for j, token in enumerate(new):
        row = lp[len(ids) - 1 + j]
        assert abs(got["token_logprobs"][j] - row[token].item()) < TOL
        top = got["top_logprobs"][j]
        assert 3 <= len(top) <= 4 and got["tokens"][j] in top  # the 3 most likely + the chosen one
        expected = row.topk(3).values.tolist()
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(expected, abs=TOL)
    offsets = got["text_offset"]
    assert offsets[0] == 0 and offsets == [sum(len(t) for t in got["tokens"][:i]) for i in range(len(new))]
    # logprobs: 0 -> only the chosen token in each top_logprobs
    zero = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    assert [list(d) for d in zero.choices[0].logprobs.top_logprobs] == [[t] for t in zero.choices[0].logprobs.tokens]
    # without logprobs: null, as before
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    whole = legacy_as_dict(client.completions.create(**kw).choices[0].logprobs)
    parts, text = [], ""
    for chunk in client.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                parts.append(legacy_as_dict(choice.logprobs))
    merged = merge_legacy(parts)
    assert merged["tokens"] == whole["tokens"] and merged["text_offset"] == whole["text_offset"]
    assert merged["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=TOL)
    assert len(parts) >= 2  # a chunk per token, not one at the end


def test_echo_with_logprobs_is_lm_eval_loglikelihood(client, hf):
    """What lm-eval's local-completions sends for loglikelihood: token ids, echo, logprobs 1,
    max_tokens 1, temperature 0; it reads token_logprobs[ctxlen:-1] and top_logprobs."""
    ids = encode_prompt(hf.tokenizer, PROMPT)
    new, lp = hf(ids, 1)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                  seed=1234)
    choice = r.choices[0]
    got = legacy_as_dict(choice.logprobs)
    n = len(ids)
    assert len(got["tokens"]) == n + 1
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["tokens"] == [tok_str(hf.tokenizer, t) for t in ids + new]
    for i in range(1, n + 1):
        token = (ids + new)[i]
        assert abs(got["token_logprobs"][i] - lp[i - 1][token].item()) < TOL, i
        assert abs(max(got["top_logprobs"][i].values()) - lp[i - 1].max().item()) < TOL
    assert choice.text.startswith(hf.tokenizer.decode(ids, skip_special_tokens=True))
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 1
    # max_tokens 0: the prompt scored, nothing generated
    r0 = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, logprobs=2, echo=True)
    got0 = legacy_as_dict(r0.choices[0].logprobs)
    assert r0.choices[0].text == PROMPT and r0.choices[0].finish_reason == "length"
    assert len(got0["tokens"]) == n and got0["token_logprobs"][1:] == pytest.approx(got["token_logprobs"][1:n], abs=TOL)
    assert r0.usage.completion_tokens == 0
    # echo without logprobs: the text only
    r1 = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True, temperature=0)
    assert r1.choices[0].text.startswith(PROMPT) and r1.choices[0].logprobs is None


def test_echo_streaming(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].choices[0].text == PROMPT  # the echoed prompt comes first, with its logprobs
    assert legacy_as_dict(chunks[0].choices[0].logprobs)["token_logprobs"][0] is None
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    merged = merge_legacy([legacy_as_dict(c.choices[0].logprobs) for c in chunks if c.choices[0].logprobs])
    assert merged["tokens"] == whole.logprobs.tokens and merged["text_offset"] == whole.logprobs.text_offset


def test_vllm_prompt_logprobs(shared_server, hf, sse):
    ids = encode_prompt(hf.tokenizer, PROMPT)
    _, lp = hf(ids, 0)
    with shared_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["logprobs"] is None
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i]
            own = entry[str(ids[i])]
            assert abs(own["logprob"] - lp[i - 1][ids[i]].item()) < TOL
            assert own["rank"] == int((lp[i - 1] > lp[i - 1][ids[i]]).sum()) + 1
            assert own["decoded_token"] == tok_str(hf.tokenizer, ids[i])
            assert 2 <= len(entry) <= 3
            best = max(entry.values(), key=lambda e: e["logprob"])
            assert best["rank"] == 1 and abs(best["logprob"] - lp[i - 1].max().item()) < TOL
        # absent unless asked for
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert "prompt_logprobs" not in r.json()["choices"][0]
        # streaming: in the prompt's first chunk
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                       "prompt_logprobs": 2, "stream": True}) as s:
            events = sse(s.iter_lines())
        assert events[0]["choices"][0]["prompt_logprobs"] == plp


# ---------------------------------------------------------------- chat


def test_chat_logprobs_shape_and_values(client, hf):
    messages = [{"role": "user", "content": "Say something."}]
    ids = apply_chat_template(hf.tokenizer, messages)
    new, lp = hf(ids, 5)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 == r.usage.completion_tokens
    for j, (entry, token) in enumerate(zip(content, new)):
        row = lp[len(ids) - 1 + j]
        assert entry.token == tok_str(hf.tokenizer, token)
        assert abs(entry.logprob - row[token].item()) < TOL
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes).decode("utf-8") == entry.token
        assert len(entry.top_logprobs) == 2
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=TOL)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen one is the most likely
    # logprobs without top_logprobs: empty top lists; without logprobs: null
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert r.choices[0].logprobs is None


def test_chat_logprobs_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    whole = [e.model_dump() for e in client.chat.completions.create(**kw).choices[0].logprobs.content]
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += [e.model_dump() for e in choice.logprobs.content]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=TOL)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),  # chat's logprobs is a boolean
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"best_of": 2}, "best_of"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"max_completion_tokens": "2"}, "max_completion_tokens"),
        ({"messages": [{"role": "user"}]}, "messages"),  # a user message needs content
        ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ],
)
def test_chat_unsupported_or_invalid_is_400_naming_the_field(shared_server, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(shared_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_parameter", error


# ---------------------------------------------------------------- batched prompts


def test_batched_prompts_order_index_and_usage(client, shared_server, hf):
    prompts = ["Hello there", PROMPT, "A", "One two three four five six"]
    singles = [client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True}) for p in prompts]
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 20
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + 20
    # token-id prompts, with lm-eval's loglikelihood fields
    ids = [encode_prompt(hf.tokenizer, p) for p in prompts]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, p in zip(r.choices, ids):
        assert len(c.logprobs.token_logprobs) == len(p) + 1 and c.logprobs.token_logprobs[0] is None
    wait_idle(shared_server)


def test_batched_prompts_streaming(shared_server, sse):
    prompts = ["Hello there", PROMPT, "A"]
    with shared_server.client() as c:
        whole = c.post("/v1/completions", json={"prompt": prompts, "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True}).json()
        body = {"prompt": prompts, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "logprobs": 1}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    texts, finishes, ids = {}, {}, set()
    for event in events[:-2]:
        ids.add(event["id"])
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert len(ids) == 1  # one response id for the whole batch
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    wait_idle(shared_server)


BATCH_REFUSAL_CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 64, device: cpu}}
scheduler: {{maxActiveSequences: 1, maxWaitingRequests: 2, maxBatchedTokens: 256, prefillChunkSize: 128}}
lanes:
  - {{name: interactive, default: true}}
"""


def test_a_refused_prompt_refuses_the_whole_batch_and_leaks_nothing(serve):
    live = serve(BATCH_REFUSAL_CONFIG)
    with live.client() as c:
        r = c.post("/v1/completions", json={"prompt": ["a b c"] * 6, "max_tokens": 30, "ignore_eos": True})
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "queue_full" and "of the batch was refused" in error["message"]
        assert r.headers["retry-after"]
    wait_idle(live)
    assert live.metric("tokenlane_requests_total", outcome="rejected") == 1
    cancelled = live.wait_metric("tokenlane_requests_total", lambda v: v >= 2, outcome="cancelled",
                                 reason="batch_rejected")
    assert cancelled in (2, 3)  # the prompts admitted before the refused one
    with live.client() as c:  # the server is fine afterwards
        r = c.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    wait_idle(live)


def test_a_prompt_failing_mid_generation_fails_the_batch(serve, sse):
    """One prompt of a batch fails after it started (an executor error for that request):
    the request answers that error (not the cancellations it caused), the other prompts are
    cancelled at once, and nothing leaks, streaming or not."""
    live = serve()
    executor = live.engine.executor
    real_execute = executor.execute

    def failing_execute(plan):
        out = real_execute(plan)
        for chunk in plan.chunks:
            r = chunk.request
            if r.request_id.endswith("-1") and r.num_output_tokens >= 2:
                out.errors[r.request_id] = "injected failure"
        return out

    executor.execute = failing_execute
    try:
        body = {"prompt": ["one", "two", "three"], "max_tokens": 200, "ignore_eos": True}
        with live.client() as c:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 500, r.text
            assert "injected failure" in r.json()["error"]["message"]
            wait_idle(live)
            assert live.metric("tokenlane_requests_total", outcome="cancelled", reason="batch_failed") == 2
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                assert s.status_code == 200
                events = sse(s.iter_lines())
        assert events[-1] == "[DONE]" and "injected failure" in events[-2]["error"]["message"]
        wait_idle(live)
        assert live.metric("tokenlane_requests_total", outcome="cancelled", reason="batch_failed") == 4
    finally:
        executor.execute = real_execute


# ---------------------------------------------------------------- models


def test_get_model_by_id(client, shared_server):
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    for path in ("/v1/models/gpt-4", "/v1/models/org/name"):
        r = httpx.get(shared_server.url + path, timeout=10)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["type"] == "not_found_error"


def test_simulated_executor_refuses_logprobs_and_echoes(serve):
    live = serve("""
model: {{path: simulated/llama3-8b, servedName: sim, maxModelLen: 4096}}
engine: {{executor: simulated, kvCacheBlocks: 512}}
""")
    with live.client() as c:
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        r = c.post("/v1/completions", json={"prompt": ["hello", "world"], "max_tokens": 2, "echo": True})
        assert r.status_code == 200, r.text
        texts = [ch["text"] for ch in r.json()["choices"]]
        assert texts[0].startswith("hello") and texts[1].startswith("world")
