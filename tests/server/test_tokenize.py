"""/tokenize and /detokenize in vLLM's shapes, errors in OpenAI's."""

from __future__ import annotations

import httpx
import pytest

from tokenlane.runtime.engine.tokenizer import apply_chat_template, encode_prompt, load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=30)


def test_tokenize_text_and_chat_match_what_generation_uses(shared_server, tok):
    r = post(shared_server, "/tokenize", {"model": "tiny", "prompt": "Hello there"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["tokens"] == encode_prompt(tok, "Hello there")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    # The same count as the completions API's usage.prompt_tokens.
    done = post(shared_server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == body["count"]

    plain = post(shared_server, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("Hello there", add_special_tokens=False)
    assert len(plain["tokens"]) < body["count"]  # no BOS

    messages = [{"role": "user", "content": "hi"}]
    chat = post(shared_server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == apply_chat_template(tok, messages)
    done = post(shared_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]
    no_gen = post(shared_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == apply_chat_template(tok, messages, add_generation_prompt=False)


def test_detokenize_round_trip(shared_server, tok):
    ids = post(shared_server, "/tokenize", {"prompt": "Hello there, world"}).json()["tokens"]
    r = post(shared_server, "/detokenize", {"model": "tiny", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)}
    assert r.json()["prompt"].endswith("Hello there, world")
    assert post(shared_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["1"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ],
)
def test_errors_are_openai_shaped(shared_server, path, body, status, param):
    r = post(shared_server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"], error
    assert error["code"] in ("invalid_parameter", "invalid_token_id", "model_not_found"), error
