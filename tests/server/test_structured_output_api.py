"""Structured output and tools over HTTP with the `openai` SDK: response_format json_schema
and json_object, vLLM's guided_json, tool calls (forced, named, streamed, and a history with a
tool result), and the 400s. The tiny checkpoint has random weights, so whatever parses and
validates does so because of the grammar."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                                    "required": ["zone"], "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def client(shared_server):
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)


def test_one_hundred_json_schema_generations_all_validate(client):
    # Completions take vLLM's guided_json; 5 batches of 20 prompts, sampled at temperature 1.
    outputs = []
    for batch in range(5):
        prompts = [f"person {batch * 20 + i}:" for i in range(20)]
        out = client.completions.create(model="tiny", prompt=prompts, max_tokens=160, temperature=1.0,
                                        seed=batch, extra_body={"guided_json": PERSON})
        outputs += out.choices
    assert len(outputs) == 100
    for choice in outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)
    assert len({c.text for c in outputs}) > 20  # sampled, not one fixed document


def test_chat_json_schema_and_json_object(client, shared_server):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a person"}], max_tokens=160, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    assert out.choices[0].finish_reason == "stop"
    # Any object: a strong '}' bias makes the random model close it early, so it ends in budget.
    brace = shared_server.state.codec.encode_text("}", add_special_tokens=False)
    assert len(brace) == 1
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json please"}],
                                         max_tokens=64, temperature=0, logit_bias={str(brace[0]): 30},
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_tool_call_round_trip_through_the_sdk(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=64, temperature=1.0, seed=1)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {WEATHER["function"]["name"]: WEATHER, TIME["function"]["name"]: TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])

    # A named function, with the first call and its result in the history.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                         tool_choice={"type": "function", "function": {"name": "get_time"}},
                                         max_tokens=64, temperature=1.0, seed=2)
    (call2,) = out.choices[0].message.tool_calls
    assert call2.function.name == "get_time" and out.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call2.function.arguments), TIME["function"]["parameters"])
    # The tool result made it into the prompt.
    plain = client.chat.completions.create(model="tiny", messages=messages[:1], max_tokens=1)
    with_result = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                                 tool_choice="none", max_tokens=1)
    assert with_result.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert with_result.choices[0].message.tool_calls is None


def test_streamed_tool_call_has_openai_delta_shape(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "time?"}],
                                            tools=[TIME], tool_choice="required", max_tokens=96, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.tool_calls:
                deltas += choice.delta.tool_calls
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1
    assert deltas[0].index == 0 and deltas[0].function.name == "get_time" and deltas[0].id.startswith("call_")
    jsonschema.validate(json.loads(deltas[0].function.arguments), TIME["function"]["parameters"])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_invalid_structured_output_is_a_400_naming_its_param(shared_server, body, param):
    with shared_server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                 **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_simulated_executor_refuses_structured_output(serve):
    live = serve("""
model: {{path: simulated/llama3-8b, servedName: sim, maxModelLen: 4096}}
engine: {{executor: simulated, kvCacheBlocks: 512}}
""")
    with live.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                 "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                 "tools": [WEATHER], "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        # Tools without a forced call need no grammar: served (the reply is text).
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                 "tools": [WEATHER]})
        assert r.status_code == 200, r.text
