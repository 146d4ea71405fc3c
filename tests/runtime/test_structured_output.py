"""Structured output's parts: the bitmask application against a per-token reference, the
matchers following a request's output, tool-call schemas and parsing, and the rendering of
tools for a chat template that knows nothing of them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tokenlane.runtime.core.request import SamplingParams
from tokenlane.runtime.executor.structured_output import (
    GrammarCompiler,
    GrammarMatchers,
    allocate_bitmask,
    apply_bitmask,
    parse_tool_call,
    tool_call_schema,
)
from tokenlane.runtime.entrypoints.text_codec import TextCodec
from tokenlane.runtime.engine.tokenizer import load_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},
]


def test_apply_bitmask_equals_a_per_token_reference():
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 9, 1000  # not a multiple of 32: the last word is partly past the vocabulary
    logits = torch.randn(rows, vocab, generator=gen)
    constrained = [1, 4, 8]
    bitmask = allocate_bitmask(rows, vocab)
    bitmask.copy_(torch.randint(-2**31, 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int64).to(torch.int32))
    out = logits.clone()
    apply_bitmask(out, bitmask, constrained)
    expected = logits.clone()
    for row in constrained:
        for token in range(vocab):
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(out, expected)
    assert torch.equal(out[[0, 2, 3, 5, 6, 7]], logits[[0, 2, 3, 5, 6, 7]])  # the others untouched


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _request(rid, grammar, outputs=()):
    return SimpleNamespace(request_id=rid, sampling_params=SamplingParams(grammar=grammar),
                           output_token_ids=list(outputs))


def test_matchers_follow_each_requests_output_and_end_on_eos(tokenizer):
    compiler = GrammarCompiler(tokenizer, 1024)
    grammar = compiler.json_schema({"type": "object", "properties": {"x": {"enum": ["yes"]}},
                                    "required": ["x"], "additionalProperties": False})
    matchers = GrammarMatchers()
    free = _request("free", None)
    constrained = _request("c", grammar)
    logits = torch.zeros(2, 1024)
    text = ""
    for _ in range(40):  # greedy walk: the lowest allowed id each step
        masked = matchers.masked(logits, [free, constrained])
        assert torch.equal(masked[0], logits[0]) and torch.equal(logits, torch.zeros(2, 1024))
        allowed = torch.nonzero(masked[1] > float("-inf")).flatten().tolist()
        assert allowed
        if allowed == [tokenizer.eos_token_id]:
            break
        constrained.output_token_ids.append(allowed[0])
        text = tokenizer.decode(constrained.output_token_ids)
    assert json.loads(text) == {"x": "yes"}
    # A request without a constrained row leaves the logits as they are (no copy).
    assert matchers.masked(logits, [free]) is logits
    # Without copy the constrained rows are masked in place.
    fresh = _request("c2", grammar)
    in_place = torch.zeros(2, 1024)
    assert matchers.masked(in_place, [fresh, free], copy=False) is in_place
    assert torch.isinf(in_place[0]).sum() > 1000 - 50 and not torch.isinf(in_place[1]).any()
    matchers.release("c2")
    matchers.release("c")
    assert len(matchers) == 0


def test_tool_call_schema_and_parsing():
    one = tool_call_schema(TOOLS, "add")
    assert one["properties"]["name"] == {"const": "add"}
    assert one["properties"]["arguments"] == TOOLS[0]["function"]["parameters"]
    both = tool_call_schema(TOOLS)
    assert [o["properties"]["name"]["const"] for o in both["anyOf"]] == ["add", "now"]
    assert both["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    call = parse_tool_call('{"name": "add", "arguments": {"a": 1, "b": 2}}', TOOLS)
    assert call == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert parse_tool_call('{"name": "sub", "arguments": {}}', TOOLS) is None
    assert parse_tool_call("the answer is 3", TOOLS) is None
    assert parse_tool_call('{"name": "add", "arguments": {}} and more', TOOLS) is None


def test_tools_rendered_for_a_template_without_tool_support():
    messages = [
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    out = TextCodec.messages_without_tool_support(messages, TOOLS)
    assert out[0]["role"] == "system" and '"name": "add"' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert out[3] == {"role": "tool", "content": "[result of call_1] 3"}
    # Without tools (a history only): no system message added.
    assert TextCodec.messages_without_tool_support(messages, [])[0]["role"] == "user"


def test_invalid_schema_cannot_compile(tokenizer):
    compiler = GrammarCompiler(tokenizer, 1024)
    with pytest.raises(ValueError, match="cannot be compiled"):
        compiler.json_schema({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}})
