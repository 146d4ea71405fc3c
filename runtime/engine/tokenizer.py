"""Tokenizer loading, chat templates, and incremental detokenization for streaming.

Loading goes through transformers (`AutoTokenizer`, falling back to `PreTrainedTokenizerFast`
on the folder's tokenizer.json), so any local Hugging Face checkpoint works the same way.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas the way vLLM
does: it re-decodes a short window of tokens (from `prefix_offset`) and emits only the text
past `read_offset`, so byte-level tokens that split a UTF-8 character, and tokenizers that
merge spaces across token boundaries, never produce garbage or duplicated text. For byte-level
BPE tokenizers a `ByteLevelTable` (each token's bytes, checked against the tokenizer's own
decode when built) gives the same text for the usual token, a whole UTF-8 piece, without the
two decodes: 0.1-0.2 against 1.3-3 us a token.
"""

from __future__ import annotations

import random
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

# How many tokens before the unread ones are re-decoded for context (vLLM uses 5).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to
_MAX_HELD_TOKENS = 4


def load_tokenizer(path: str | Path) -> Any:
    """Load the tokenizer of a local checkpoint folder; ValueError if there is none."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"tokenizer folder {str(folder)!r} does not exist")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # unknown tokenizer class, missing sentencepiece, ...
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"cannot load a tokenizer from {str(folder)!r}: {exc}") from exc
        return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of a chat conversation rendered by the checkpoint's own template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    # The template writes BOS itself when it wants one; don't add a second (unless asked:
    # /tokenize's add_special_tokens, as vLLM has it).
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain-text prompt, with the tokenizer's usual special tokens (BOS)."""
    return tokenizer.encode(text, add_special_tokens=True)


def _direct_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer whose `decode` is exactly `tokenizer`'s (a fast tokenizer whose class
    keeps transformers' own decoding), or None."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode and hasattr(backend, "decode")):
        return backend
    return None


def text_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`ids -> text` as `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.
    For a fast (Rust-backed) tokenizer whose class keeps transformers' own decoding, that is
    the Rust tokenizer's `decode` itself, called directly: transformers' wrapper around it (a
    conversion of the ids, the keyword handling) took about twice as long as the decode (1.6
    against 4.7 us for 6 tokens), twice per streamed token."""
    backend = _direct_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


def _alphabet_to_latin1() -> dict[int, str]:
    """A `str.translate` table that reads byte-level BPE's alphabet back to bytes: the
    character standing for each byte becomes the Latin-1 character of that byte. Printable
    bytes stand for themselves; the other 68 are shifted, in byte order, to U+0100 onwards.
    Those 68 characters themselves are not in the alphabet: they become U+FFFF, which no
    Latin-1 encode takes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {256 + i: chr(b) for i, b in enumerate(shifted)}
    table.update({b: "\uffff" for b in shifted})
    return table


class ByteLevelTable:
    """What each token id decodes to, for a tokenizer whose `decode(ids)` is byte-level BPE's:
    the ids' byte strings concatenated, then read as UTF-8 with U+FFFD for invalid bytes.

    `pieces[id]`: the token's bytes (b"" for an id the decode skips: a special token when
    skipping them, an id outside the vocabulary). `texts[id]`: what the streaming decoder may
    use without decoding (see IncrementalDetokenizer): "" for a token of no bytes, the token's
    text when its bytes are UTF-8 on their own and it does not end in U+FFFD, else None."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        # The text of an id past the table (a model's padded embedding rows: Qwen2's 151936
        # rows hold 151646 tokens): "" once the tokenizer's decode is seen to skip such ids,
        # else unknown (None). The table's own decode always skips them.
        self.beyond_text: Optional[str] = None
        self.texts: list[Optional[str]] = []
        for piece in pieces:
            try:
                text: Optional[str] = piece.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            self.texts.append(None if text is None or text.endswith(_REPLACEMENT) else text)

    @property
    def out_of_vocab_empty(self) -> bool:
        return self.beyond_text == ""

    def text_of(self, token_id: int) -> Optional[str]:
        texts = self.texts
        return texts[token_id] if token_id < len(texts) else self.beyond_text

    def decode(self, ids: Sequence[int]) -> str:
        pieces, size = self.pieces, len(self.pieces)
        return b"".join(pieces[i] if i < size else b"" for i in ids).decode("utf-8", "replace")

    def is_utf8(self, ids: Sequence[int]) -> bool:
        """Whether the ids' bytes are valid UTF-8 (so they end on a character boundary)."""
        pieces, size = self.pieces, len(self.pieces)
        if any(i >= size for i in ids):
            if not self.out_of_vocab_empty:
                return False
            ids = [i for i in ids if i < size]
        try:
            b"".join(pieces[i] for i in ids).decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True


_BYTE_LEVEL_TABLES: "weakref.WeakKeyDictionary[Any, dict[bool, Optional[ByteLevelTable]]]" = weakref.WeakKeyDictionary()


def byte_level_table(tokenizer: Any, skip_special_tokens: bool = True) -> Optional[ByteLevelTable]:
    """The tokenizer's `ByteLevelTable` (built once per tokenizer), or None when its decode is
    not plain byte-level BPE: another decoder (SentencePiece's, WordPiece's), a class with a
    decode of its own, or a table that disagrees with the tokenizer's own decode on any single
    id or on a sample of id sequences (checked when built, so the table never changes what a
    client sees)."""
    try:
        cached = _BYTE_LEVEL_TABLES.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: build, don't cache
        cached = {}
    if skip_special_tokens not in cached:
        cached[skip_special_tokens] = _build_byte_level_table(tokenizer, skip_special_tokens)
    return cached[skip_special_tokens]


def _build_byte_level_table(tokenizer: Any, skip_special_tokens: bool) -> Optional[ByteLevelTable]:
    backend = _direct_backend(tokenizer)
    if backend is None:
        return None
    from tokenizers import decoders, models

    if not isinstance(backend.decoder, decoders.ByteLevel) or not isinstance(backend.model, models.BPE):
        return None
    to_latin1 = _alphabet_to_latin1()
    added = backend.get_added_tokens_decoder()
    size = backend.get_vocab_size(with_added_tokens=True)
    size = max([size, *(i + 1 for i in added)])
    pieces: list[bytes] = []
    for token_id in range(size):
        if token_id in added:
            token = None if skip_special_tokens and added[token_id].special else added[token_id].content
        else:
            token = backend.id_to_token(token_id)
        if token is None:
            pieces.append(b"")
            continue
        try:
            pieces.append(token.translate(to_latin1).encode("latin-1"))
        except UnicodeEncodeError:  # as the Rust decoder does with a token outside the alphabet
            pieces.append(token.encode("utf-8"))
    table = ByteLevelTable(pieces)
    rng = random.Random(0)
    checks = [[i] for i in range(size)]
    checks += [[rng.randrange(size) for _ in range(rng.randint(2, 8))] for _ in range(256)]
    if backend.decode_batch(checks, skip_special_tokens=skip_special_tokens) != [table.decode(ids) for ids in checks]:
        return None
    # Ids past the vocabulary, alone and between tokens: skipped by the decode, or not.
    beyond = [[size], [size + 1, size * 2 + 7]]
    beyond += [[rng.randrange(size), size + rng.randrange(1 << 16), rng.randrange(size)] for _ in range(64)]
    try:
        decoded = backend.decode_batch(beyond, skip_special_tokens=skip_special_tokens)
    except Exception:  # a decoder that rejects such ids: they keep the decodes' path
        return table
    if decoded == [table.decode(ids) for ids in beyond]:
        table.beyond_text = ""
    return table


class IncrementalDetokenizer:
    """Streaming text of one request's output tokens.

    `add_tokens(ids)` returns the new text they complete (possibly "" while a multi-byte
    character is still incomplete); `text` is everything emitted so far. The prompt's last
    tokens seed the window so the first output token is decoded in context (leading spaces).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = text_decoder(tokenizer, skip_special_tokens)
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the re-decoded window
        self.read_offset = len(self.token_ids)  # tokens before this were already emitted
        self.text = ""
        # Byte-level BPE: while the window's bytes are whole UTF-8 and the tokens held back
        # have no bytes, a token whose bytes are UTF-8 on their own adds exactly its own
        # text, so the table gives what the two decodes would (see _add_one).
        self._table = byte_level_table(tokenizer, skip_special_tokens)
        self._table_applies = self._table is not None and self._table.is_utf8(self.token_ids)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        delta = ""
        for token_id in token_ids:
            delta += self._add_one(int(token_id))
        self.text += delta
        return delta

    def _add_one(self, token_id: int) -> str:
        token_ids = self.token_ids
        token_ids.append(token_id)
        if self._table_applies:
            # The window decodes to W, the window plus the held tokens and this one to
            # W + text (the held ones add no bytes; both whole UTF-8). An empty text is held
            # like the decodes below hold it. Any other text is longer and ends in no U+FFFD:
            # the decodes would emit it and make the window end with this token, whose
            # bytes are whole UTF-8 again.
            text = self._table.text_of(token_id)
            if text == "":
                return ""
            if text is not None:
                self.prefix_offset = self.read_offset
                self.read_offset = len(token_ids)
                return text
            self._table_applies = False  # until the decodes below emit again
        prefix_text = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(token_ids[self.prefix_offset :])
        # A UTF-8 character spans at most 4 bytes: if that many tokens still end in an
        # incomplete one, the bytes are invalid (random models emit such) and stay U+FFFD;
        # emit them rather than re-decode an ever-growing window.
        stuck = len(token_ids) - self.read_offset > _MAX_HELD_TOKENS
        if len(full_text) > len(prefix_text) and (stuck or not full_text.endswith(_REPLACEMENT)):
            new_text = full_text[len(prefix_text) :]
            self._advance()
            return new_text
        # Incomplete UTF-8 sequence (or a token that decodes to nothing): wait for more.
        return ""

    def _advance(self) -> None:
        """Everything read is emitted: the unread tokens become the window."""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        if self._table is not None:
            self._table_applies = self._table.is_utf8(self.token_ids[self.prefix_offset : self.read_offset])

    def flush(self) -> str:
        """At the end of a request: emit whatever is still held back (even if it ends in
        an incomplete character, which then shows as U+FFFD like any decoder would)."""
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        new_text = full_text[len(prefix_text) :]
        self._advance()
        self.text += new_text
        return new_text


def find_stop_string(
    text: str, stop: Sequence[str], num_new_chars: int
) -> Optional[tuple[int, str]]:
    """Earliest stop string that ends within the last `num_new_chars` characters of `text`.

    Returns (index where the stop string starts, the stop string), or None. Searching only
    the tail that could contain a new match keeps this O(new text) per step.
    """
    best: Optional[tuple[int, str]] = None
    for s in stop:
        if not s:
            continue
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best
