"""The completions `prompt` and detokenize `tokens` fields: what they accept, the 400 message
and `param` of what they do not, and the schema they declare (table-driven, no server)."""

from __future__ import annotations

import pydantic
import pytest
from fastapi.exceptions import RequestValidationError

from tokenlane.runtime.entrypoints.http_errors import validation_message
from tokenlane.runtime.entrypoints.protocol import INT32_MAX, CompletionRequest, DetokenizeRequest


def _message(model, body) -> tuple[str, str]:
    with pytest.raises(pydantic.ValidationError) as caught:
        model.model_validate(body)
    return validation_message(RequestValidationError(caught.value.errors()))


@pytest.mark.parametrize(
    "prompt, parsed",
    [
        ("hi", "hi"),
        (["a", "b"], ["a", "b"]),
        ([5, 6, 7], [5, 6, 7]),
        ([0, INT32_MAX], [0, INT32_MAX]),
        ([5, 6.0], [5, 6]),  # an integral number is an integer (JSON Schema)
        ([[1, 2], [3]], [[1, 2], [3]]),
        ([[1, 2], [3, 4.0]], [[1, 2], [3, 4]]),
    ],
)
def test_prompts_accepted(prompt, parsed):
    value = CompletionRequest.model_validate({"prompt": prompt}).prompt
    assert value == parsed
    assert [type(v) for v in value] == [type(v) for v in parsed]  # 6.0 became the int 6


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([1, True], "prompt[1] must be a token id (an integer), not true"),
        ([[5], [6, False]], "prompt[1][1] must be a token id (an integer), not false"),
        ([1, "3"], "prompt[1] must be a token id (an integer), not a string"),
        ([1, 3.5], "prompt[1] must be a token id (an integer), not 3.5"),
        ([1, None], "prompt[1] must be a token id (an integer), not null"),
        ([1, [2]], "prompt[1] must be a token id (an integer), not an array"),
        ([-1, 5], "prompt[0]: token id -1 is outside [0, 2147483647]"),
        ([5, INT32_MAX + 1], f"prompt[1]: token id {INT32_MAX + 1} is outside [0, 2147483647]"),
        ([5, 2**70], f"prompt[1]: token id {2**70} is outside [0, 2147483647]"),
        ([5, float("inf")], "prompt[1] must be a token id (an integer), not inf"),
        ([[1], 2], "prompt[1] must be an array of token ids, not 2"),
        (["a", 1], "prompt[1] must be a string, as prompt[0] is, not 1"),
        ({"nested": "object"}, "prompt must be a string, an array of strings, an array of token ids or "
                               "an array of token-id arrays, not an object"),
        (7, "prompt must be a string, an array of strings, an array of token ids or an array of "
            "token-id arrays, not 7"),
        ([], "prompt: prompt must not be empty"),
        ([[1], []], "prompt: prompt[1] must not be empty"),
    ],
)
def test_bad_prompts_name_the_element(prompt, message):
    assert _message(CompletionRequest, {"prompt": prompt}) == (message, "prompt")


def test_detokenize_tokens():
    assert DetokenizeRequest.model_validate({"tokens": [1, 2.0]}).tokens == [1, 2]
    assert _message(DetokenizeRequest, {"tokens": [1, True]}) == (
        "tokens[1] must be a token id (an integer), not true", "tokens")
    assert _message(DetokenizeRequest, {"tokens": "1 2"}) == (
        "tokens must be an array of token ids, not a string", "tokens")
    many = [1] * 1_000_001
    assert _message(DetokenizeRequest, {"tokens": many}) == (
        "tokens holds 1000001 ids; at most 1000000 are decoded at once", "tokens")


def test_schema_declares_token_id_bounds():
    """The OpenAPI document's token ids: JSON Schema's own bound keywords (clients and
    schemathesis read these), the union of prompt shapes kept."""
    ids = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
    prompt = CompletionRequest.model_json_schema()["properties"]["prompt"]
    assert prompt["anyOf"] == [
        {"type": "string"},
        {"type": "array", "items": ids},
        {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "array", "items": ids}},
    ]
    tokens = DetokenizeRequest.model_json_schema()["properties"]["tokens"]
    assert tokens["items"] == ids and tokens["maxItems"] == 1_000_000
