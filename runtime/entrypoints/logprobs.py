"""Logprobs on the wire: the engine's `TokenLogprob`s in OpenAI's and vLLM's JSON shapes.

- completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one
  entry per token; `top_logprobs[i]` maps token strings to logprobs: the k most likely
  tokens plus the chosen one (so up to k + 1 entries, as OpenAI documents); the first
  echoed prompt token has `null` logprob and `null` top_logprobs.
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`, one entry per generated token, exactly k top entries.
- vLLM's `prompt_logprobs`: per prompt token `null` (the first) or `{token id: {"logprob",
  "rank", "decoded_token"}}` holding the prompt token and the k most likely ones.

A token's string is its own decoding (`tokenizer.decode([id])`, special tokens included),
as vLLM returns it; `bytes` are the token's exact bytes for byte-level BPE and
SentencePiece byte-fallback tokens (so a token holding part of a UTF-8 character shows its
real bytes, not U+FFFD), else the UTF-8 of its string.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Optional, Sequence

from tokenlane.runtime.core.request import TokenLogprob

# JSON has no -inf: a logprob below this is reported as this (what OpenAI and vLLM do).
MIN_LOGPROB = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted (character -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Per-token strings and bytes, cached by token id (bounded by the vocabulary).

    Without a tokenizer (the simulated executor) a token's string is ` t<id>`, the same
    placeholder its generated text uses."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_level: Optional[dict[str, int]] = None
        if tokenizer is not None:
            try:
                backend = json.loads(tokenizer.backend_tokenizer.to_str())
                decoder = backend.get("decoder") or {}
                kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
                if "ByteLevel" in kinds:
                    self._byte_level = _byte_level_decoder()
            except Exception:  # a slow tokenizer, or an unusual backend: UTF-8 of the string
                self._byte_level = None

    def text(self, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            if self.tokenizer is None:
                s = f" t{token_id}"
            else:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
            self._text[token_id] = s
        return s

    def bytes(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._exact_bytes(token_id)
            if b is None:
                b = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = b
        return b

    def _exact_bytes(self, token_id: int) -> Optional[list[int]]:
        if self.tokenizer is None:
            return None
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:
            return None
        if not isinstance(piece, str):
            return None
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m:
            return [int(m.group(1), 16)]
        table = self._byte_level
        if table is not None and piece and all(ch in table for ch in piece):
            if piece in getattr(self.tokenizer, "all_special_tokens", ()):
                return None
            return [table[ch] for ch in piece]
        return None


def _lp(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


class CompletionLogprobs:
    """Builds the legacy completions `logprobs` object, possibly over several chunks
    (streaming): text offsets continue from one call to the next."""

    def __init__(self, texts: TokenTexts, k: int) -> None:
        self.texts = texts
        self.k = k
        self.offset = 0  # characters of token strings so far

    def build(self, token_ids: Sequence[int], entries: Iterable[Optional[TokenLogprob]]) -> dict[str, Any]:
        texts = self.texts
        tokens: list[str] = []
        token_logprobs: list[Optional[float]] = []
        top_logprobs: list[Optional[dict[str, float]]] = []
        text_offset: list[int] = []
        for token_id, entry in zip(token_ids, entries):
            s = texts.text(token_id)
            tokens.append(s)
            text_offset.append(self.offset)
            self.offset += len(s)
            if entry is None:  # the first prompt token: nothing to condition on
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_lp(entry.logprob))
            top: dict[str, float] = {}
            for tid, value in entry.top[: self.k]:
                top.setdefault(texts.text(tid), _lp(value))
            top.setdefault(s, _lp(entry.logprob))  # the chosen token is always there
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


def chat_logprobs_content(texts: TokenTexts, k: int, entries: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat `logprobs.content` entries of generated tokens."""
    out = []
    for entry in entries:
        out.append({
            "token": texts.text(entry.token_id),
            "logprob": _lp(entry.logprob),
            "bytes": texts.bytes(entry.token_id),
            "top_logprobs": [
                {"token": texts.text(tid), "logprob": _lp(value), "bytes": texts.bytes(tid)}
                for tid, value in entry.top[:k]
            ],
        })
    return out


def vllm_prompt_logprobs(texts: TokenTexts, k: int, entries: Sequence[Optional[TokenLogprob]]
                         ) -> list[Optional[dict[str, dict[str, Any]]]]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}} holding the prompt token and the k most likely tokens."""
    out: list[Optional[dict[str, dict[str, Any]]]] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        d = {str(entry.token_id): {"logprob": _lp(entry.logprob), "rank": entry.rank,
                                   "decoded_token": texts.text(entry.token_id)}}
        for rank, (tid, value) in enumerate(entry.top[:k], start=1):
            d.setdefault(str(tid), {"logprob": _lp(value), "rank": rank, "decoded_token": texts.text(tid)})
        out.append(d)
    return out
