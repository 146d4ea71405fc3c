"""The streamed chunks' encoding (runtime/entrypoints/sse.py): a token chunk from its template is exactly
the event the whole payload encodes to, for any text."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from property_examples import examples

from tokenlane.runtime.entrypoints.sse import TextEventTemplate, sse_event

SLOT = TextEventTemplate.TEXT_SLOT


def completion_chunk(text: str, model: str = "tiny", usage: bool = False) -> dict:
    payload = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
               "choices": [{"index": 3, "text": text, "logprobs": None, "finish_reason": None}]}
    if usage:
        payload["usage"] = None
    return payload


@settings(max_examples=examples(200, thorough_run=2000), deadline=None)
@given(text=st.text(), usage=st.booleans())
def test_a_template_event_equals_the_encoded_payload(text, usage):
    template = TextEventTemplate.of(completion_chunk(SLOT, usage=usage))
    event = template(text)
    assert event == sse_event(completion_chunk(text, usage=usage))
    assert json.loads(event.removeprefix("data: "))["choices"][0]["text"] == text


def test_chat_delta_template():
    def chunk(content):
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}]}

    for text in ["", " the", "\x00", "\"\\\n\u2028", "日本語 😀"]:
        assert TextEventTemplate.of(chunk(SLOT))(text) == sse_event(chunk(text))


def test_no_template_where_the_slot_appears_in_a_fixed_field():
    assert TextEventTemplate.of(completion_chunk(SLOT, model=SLOT)) is None
    # Inside a longer string it is no slot: the template stays exact.
    template = TextEventTemplate.of(completion_chunk(SLOT, model=f"a{SLOT}b"))
    assert template(" x") == sse_event(completion_chunk(" x", model=f"a{SLOT}b"))
    assert TextEventTemplate.of({"choices": []}) is None  # no slot at all
