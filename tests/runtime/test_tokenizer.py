"""Tokenizer loading, chat templates and streaming detokenization."""

from __future__ import annotations

import random

import pytest

from tokenlane.runtime.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    encode_prompt,
    find_stop_string,
    load_tokenizer,
    text_decoder,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café — 東京 🚀 emoji 👩‍👩‍👧 and accents àéîõü",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented",
    "   leading spaces and trailing   ",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_load_and_encode(tok):
    ids = encode_prompt(tok, "Hello")
    assert ids[0] == tok.bos_token_id
    assert tok.eos_token_id == 2


def test_missing_folder_is_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_chat_template_ids(tok):
    ids = apply_chat_template(tok, [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hi"}])
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("</s>") == 2
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        apply_chat_template(tok, ["just a string"])


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text):
    prompt = encode_prompt(tok, "Prompt:")
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add_tokens([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in p for p in pieces)  # split UTF-8 is held back, never emitted


def test_incremental_random_token_streams(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(5, len(tok)) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tok)
        streamed = "".join(detok.add_tokens(ids[i:i + 3]) for i in range(0, len(ids), 3))
        streamed += detok.flush()
        assert streamed == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_skipped(tok):
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("ok", add_special_tokens=False) + [tok.eos_token_id]
    assert detok.add_tokens(ids) + detok.flush() == "ok"


def test_find_stop_string():
    assert find_stop_string("hello world", ["wor"], num_new_chars=3) == (6, "wor")
    # Only matches that end in the new text count (older ones were checked before).
    assert find_stop_string("hello world", ["hell"], num_new_chars=3) is None
    # A stop string split across two steps is found when its end arrives.
    assert find_stop_string("abc STO", ["STOP"], 3) is None
    assert find_stop_string("abc STOP", ["STOP"], 1) == (4, "STOP")
    assert find_stop_string("x END y STOP", ["STOP", "END"], 12) == (2, "END")
    assert find_stop_string("abc", [""], 3) is None


def test_invalid_bytes_do_not_grow_the_window(tok):
    """Byte tokens that never complete a character are emitted (as U+FFFD) after a few
    tokens instead of being re-decoded forever."""
    lone = [i for i in range(5, 300) if tok.decode([i]) == "\ufffd"]
    assert lone, "expected byte tokens that decode to U+FFFD alone"
    detok = IncrementalDetokenizer(tok)
    for _ in range(50):
        detok.add_tokens([lone[0]])
    assert len(detok.token_ids) - detok.prefix_offset < 12
    assert detok.text.count("\ufffd") >= 40


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_decoder_is_the_tokenizers_decode(tok, skip_special_tokens):
    """The direct Rust decode (taken for this fast tokenizer) gives what transformers' decode
    gives, special tokens included or skipped; a tokenizer class with a decode of its own keeps
    it."""
    decode = text_decoder(tok, skip_special_tokens)
    assert "backend" in decode.__code__.co_freevars  # the direct path
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(0, len(tok)) for _ in range(rng.randint(0, 12))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=skip_special_tokens,
                                         clean_up_tokenization_spaces=False)

    class Shouting(type(tok)):
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()

    loud = Shouting(tokenizer_object=tok.backend_tokenizer)
    ids = tok.encode("quiet words", add_special_tokens=False)
    assert text_decoder(loud, skip_special_tokens)(ids) == "QUIET WORDS"
