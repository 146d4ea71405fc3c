"""Tokenizer loading, chat templates, and incremental detokenization for streaming.

Loading goes through transformers (`AutoTokenizer`, falling back to `PreTrainedTokenizerFast`
on the folder's tokenizer.json), so any local Hugging Face checkpoint works the same way.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas the way vLLM
does: it re-decodes a short window of tokens (from `prefix_offset`) and emits only the text
past `read_offset`, so byte-level tokens that split a UTF-8 character, and tokenizers that
merge spaces across token boundaries, never produce garbage or duplicated text.
"""

from __future__ import annotations

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


def text_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`ids -> text` as `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.
    For a fast (Rust-backed) tokenizer whose class keeps transformers' own decoding, that is
    the Rust tokenizer's `decode` itself, called directly: transformers' wrapper around it (a
    conversion of the ids, the keyword handling) took about twice as long as the decode (1.6
    against 4.7 us for 6 tokens), twice per streamed token."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode and hasattr(backend, "decode")):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


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

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        delta = ""
        for token_id in token_ids:
            delta += self._add_one(int(token_id))
        self.text += delta
        return delta

    def _add_one(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        # A UTF-8 character spans at most 4 bytes: if that many tokens still end in an
        # incomplete one, the bytes are invalid (random models emit such) and stay U+FFFD;
        # emit them rather than re-decode an ever-growing window.
        stuck = len(self.token_ids) - self.read_offset > _MAX_HELD_TOKENS
        if len(full_text) > len(prefix_text) and (stuck or not full_text.endswith(_REPLACEMENT)):
            new_text = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return new_text
        # Incomplete UTF-8 sequence (or a token that decodes to nothing): wait for more.
        return ""

    def flush(self) -> str:
        """At the end of a request: emit whatever is still held back (even if it ends in
        an incomplete character, which then shows as U+FFFD like any decoder would)."""
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
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
