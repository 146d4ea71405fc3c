"""Tokenizer loading, chat templates and streaming detokenization."""

from __future__ import annotations

import random

import pytest

from tokenlane.runtime.engine import tokenizer as tokenizer_module
from tokenlane.runtime.engine.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    byte_level_table,
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


# --------------------------------------------------------------------------- byte-level table


def _stream(tok, ids, prompt, skip_special_tokens, use_table):
    """Per-token deltas of one stream, then the flush; with or without the byte table."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
    if not use_table:
        detok._table, detok._table_applies = None, False
    return [detok.add_tokens([i]) for i in ids] + [detok.flush()], detok.text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_level_table_is_the_tokenizers_decode(tok, skip_special_tokens):
    table = byte_level_table(tok, skip_special_tokens)
    assert table is not None, "this repo's tokenizer is byte-level BPE"
    assert byte_level_table(tok, skip_special_tokens) is table  # built once
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(0, len(tok)) for _ in range(rng.randint(0, 10))]
        assert table.decode(ids) == tok.decode(ids, skip_special_tokens=skip_special_tokens,
                                               clean_up_tokenization_spaces=False)
    special = tok.eos_token_id
    assert (table.texts[special] == "") == skip_special_tokens


def test_table_path_streams_what_the_decodes_stream(tok):
    """Token by token, the detokenizer with the table emits exactly what the re-decoding one
    emits: special tokens (skipped or not), bytes that never complete a character, characters
    split over tokens, prompts that end inside a character, ids past the vocabulary."""
    rng = random.Random(3)
    lone = [i for i in range(5, 400) if tok.decode([i]) == "\ufffd"]
    text = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    specials = [tok.bos_token_id, tok.eos_token_id, 3, 4]
    beyond = [len(tok) + 8, len(tok) + 20_000, 3 * len(tok)]
    pools = [list(range(len(tok) + 8)), lone + text, specials + text + lone, text, lone + specials,
             text + beyond, lone + beyond]
    for _ in range(1500):
        pool = rng.choice(pools)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        prompt = [rng.choice(lone + text + specials) for _ in range(rng.randint(0, 8))]
        skip = rng.random() < 0.7
        assert _stream(tok, ids, prompt, skip, True) == _stream(tok, ids, prompt, skip, False), (ids, prompt, skip)


def test_table_path_decodes_nothing_for_plain_text(tok):
    """The point of the table: a stream of whole-character tokens after a prompt that ends on
    a character boundary is never re-decoded."""
    detok = IncrementalDetokenizer(tok, encode_prompt(tok, "Prompt:"))
    calls = []
    decode = detok._decode
    detok._decode = lambda ids: calls.append(ids) or decode(ids)
    ids = tok.encode("The quick brown fox jumps over the lazy dog, again and again.", add_special_tokens=False)
    assert "".join(detok.add_tokens([t]) for t in ids) == "The quick brown fox jumps over the lazy dog, again and again."
    assert calls == []
    # A character split over tokens takes the decodes, then the table again.
    split = tok.encode("東京", add_special_tokens=False)
    assert len(split) > 2
    assert "".join(detok.add_tokens([t]) for t in split) == "東京"
    assert calls
    calls.clear()
    assert detok.add_tokens(tok.encode(" ok", add_special_tokens=False)) == " ok"
    assert calls == []


def test_ids_past_the_vocabulary_decode_nothing_without_a_decode(tok):
    """A model's padded embedding rows (ids past the tokenizer's vocabulary, which its decode
    skips) stream nothing and cost no decode: random models and padded vocabularies emit them."""
    table = byte_level_table(tok, True)
    assert table.out_of_vocab_empty and table.text_of(len(tok) + 5) == ""
    detok = IncrementalDetokenizer(tok, encode_prompt(tok, "Prompt:"))
    calls = []
    decode = detok._decode
    detok._decode = lambda ids: calls.append(ids) or decode(ids)
    words = tok.encode(" alpha beta gamma", add_special_tokens=False)
    ids = [i for w in words for i in (w, len(tok) + 7, 2 * len(tok))]
    assert "".join(detok.add_tokens([t]) for t in ids) == " alpha beta gamma"
    assert calls == []
    assert detok.flush() == ""  # the held ids past the vocabulary: decoded once, to nothing


def test_no_table_unless_the_decode_is_byte_level(tok, monkeypatch):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "ab": 1, "##cd": 2}, unk_token="[UNK]"))
    word_piece.decoder = decoders.WordPiece()
    other = PreTrainedTokenizerFast(tokenizer_object=word_piece)
    assert byte_level_table(other) is None
    assert IncrementalDetokenizer(other).add_tokens([1, 2]) == "abcd"

    class Shouting(type(tok)):  # a decode of its own: the table would bypass it
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()

    assert byte_level_table(Shouting(tokenizer_object=tok.backend_tokenizer)) is None

    # A table that disagrees with the tokenizer's own decode is never used.
    def wrong_alphabet():
        table = dict(real_alphabet())
        table[ord("a")] = "b"
        return table

    real_alphabet = tokenizer_module._alphabet_to_latin1
    monkeypatch.setattr(tokenizer_module, "_alphabet_to_latin1", wrong_alphabet)
    fresh = load_tokenizer(tok.name_or_path)
    assert byte_level_table(fresh) is None
    assert tokenizer_module._build_byte_level_table(fresh, True) is None
