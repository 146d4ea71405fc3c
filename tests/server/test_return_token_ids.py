"""vLLM's `return_token_ids` on /v1/completions over real HTTP, through the official client:
each choice carries `prompt_token_ids` and `token_ids` (the generated ids); streamed, the
prompt's ids come in a choice's first chunk only and every chunk carries its new ids."""

from __future__ import annotations

import openai
import pytest

from tokenlane.runtime.config import load_config
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.engine.tokenizer import encode_prompt

PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(shared_server):
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def greedy(shared_server):
    """The engine offline on the server's config: (prompt ids, generated ids) of a greedy run."""
    engine = LLMEngine.from_config(load_config(shared_server.config_path))
    prompt_ids = encode_prompt(engine.tokenizer, PROMPT)
    engine.add_request(Request("ref", list(prompt_ids), SamplingParams(max_tokens=9, temperature=0.0,
                                                                        ignore_eos=True)))
    generated = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += out.new_token_ids
    return prompt_ids, generated


def extras(model) -> dict:
    return model.model_extra or {}


def test_a_completion_returns_the_prompt_and_generated_ids(client, greedy):
    prompt_ids, generated = greedy
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=9, temperature=0,
                                     extra_body={"ignore_eos": True, **IDS})
    choice = extras(done.choices[0])
    assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == generated
    # Echo puts the prompt's text before the completion; the ids stay apart, as in vLLM.
    echoed = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=9, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True, **IDS})
    assert extras(echoed.choices[0])["token_ids"] == generated
    assert extras(echoed.choices[0])["prompt_token_ids"] == prompt_ids
    # Not asked for: not there (the response is OpenAI's shape).
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert "token_ids" not in extras(plain.choices[0]) and "prompt_token_ids" not in extras(plain.choices[0])


def test_streamed_ids_add_up_to_the_generated_ids_per_choice(client, greedy):
    prompt_ids, generated = greedy
    chunks = list(client.completions.create(model="tiny", prompt=[PROMPT, PROMPT], max_tokens=9, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True, **IDS}))
    by_choice: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            by_choice.setdefault(choice.index, []).append(extras(choice))
    assert sorted(by_choice) == [0, 1]
    for pieces in by_choice.values():
        assert pieces[0]["prompt_token_ids"] == prompt_ids
        assert all(piece["prompt_token_ids"] is None for piece in pieces[1:])
        assert [t for piece in pieces for t in piece["token_ids"]] == generated
        assert len(pieces) >= 2  # streamed incrementally


def test_the_flag_is_strict(shared_server):
    with shared_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "return_token_ids": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"


def test_the_vs_vllm_greedy_probe_compares_token_ids(shared_server):
    """bench/vs_vllm.py asks for the ids on its greedy probes and compares them when both
    servers return them: tokenlane now does."""
    import asyncio

    from tokenlane.bench import vs_vllm
    from tokenlane.bench.trace import PlannedRequest

    probe = PlannedRequest(index=1, arrival_s=0.0, lane=None, tenant="bench", prompt_tokens=12, max_tokens=5,
                           stream=False)
    _, _, outputs = asyncio.run(vs_vllm.drive(shared_server.url, [], 1, 60.0, [probe]))
    assert outputs[0]["status"] == 200 and len(outputs[0]["token_ids"]) == 5
    same = vs_vllm.compare_greedy(outputs, outputs)
    assert (same["compared_by"], same["mismatched"]) == ("token_ids", 0)
    other = [{**outputs[0], "token_ids": outputs[0]["token_ids"][:-1] + [outputs[0]["token_ids"][-1] + 1]}]
    assert vs_vllm.compare_greedy(outputs, other)["mismatched"] == 1  # same text or not, the ids differ
