"""Sampling parameters over HTTP: penalties, logit_bias, min_p and min_tokens through the
`openai` SDK, against transformers' greedy generation on the same tiny checkpoint."""

from __future__ import annotations

import openai
import pytest
import torch

from tokenlane.runtime.engine.tokenizer import load_tokenizer

PROMPT = [17, 300, 45, 17, 300, 45, 17, 300, 45, 99]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def client(shared_server):
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)


def tokens_of(choice, tokenizer) -> list[str]:
    return choice.logprobs.tokens


def test_repetition_penalty_equals_transformers_generate(client, hf_model, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    n = 8
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False,
                                repetition_penalty=1.7, pad_token_id=0)[0, len(PROMPT):].tolist()
        plain = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ref != plain  # the penalty changes the greedy output here
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, temperature=0, logprobs=0,
                                    extra_body={"repetition_penalty": 1.7, "ignore_eos": True})
    choice = out.choices[0]
    expected = [tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in ref]
    assert choice.logprobs.tokens == expected
    # The reported logprobs are the raw model's, not the penalized distribution's.
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + ref])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)
    for j, (token, lp) in enumerate(zip(ref, choice.logprobs.token_logprobs)):
        assert lp == pytest.approx(raw[len(PROMPT) - 1 + j, token].item(), abs=1e-4)


def test_logit_bias_min_tokens_and_penalties_through_the_sdk(client, shared_server):
    eos = shared_server.engine.executor.eos_token_id
    # EOS is the greedy pick everywhere; min_tokens holds it back for 3 tokens.
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                    logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 4
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                    logit_bias={str(eos): 100})
    assert out.usage.completion_tokens == 1
    # A strongly biased token is picked, in chat too, with every other parameter accepted.
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.7, seed=3,
        logit_bias={"42": 100}, presence_penalty=0.5, frequency_penalty=0.5, logprobs=True,
        extra_body={"min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 3
    assert {e.token for e in chat.choices[0].logprobs.content} == {chat.choices[0].logprobs.content[0].token}


def test_min_tokens_over_max_tokens_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"min_tokens": 3})
    assert err.value.body["param"] == "min_tokens"
