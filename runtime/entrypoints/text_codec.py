"""Text <-> token ids for the HTTP API: prompt encoding, chat templating, /tokenize and
/detokenize, through the engine's tokenizer (runtime/engine/tokenizer.py)."""

from __future__ import annotations

import json
import zlib
from typing import Any, Optional

from tokenlane.runtime.engine import tokenizer as tokenizer_lib
from tokenlane.runtime.entrypoints.protocol import APIError


class TextCodec:
    """Prompt encoding and chat templating through the engine's tokenizer.

    An engine without a tokenizer (`engine.executor: simulated`) still takes text and chat:
    each 4 bytes of UTF-8 (about a BPE token's worth of English) become one synthetic id, so
    any OpenAI load generator can drive a simulated server with realistic prompt lengths.
    """

    SYNTHETIC_BYTES_PER_TOKEN = 4
    SYNTHETIC_FIRST_ID = 10  # clear of the special ids

    def __init__(self, tokenizer: Any, vocab_size: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or 32000

    def _synthetic(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        step, low = self.SYNTHETIC_BYTES_PER_TOKEN, self.SYNTHETIC_FIRST_ID
        span = max(1, self.vocab_size - low)
        return [low + zlib.crc32(data[i:i + step]) % span for i in range(0, len(data), step)]

    @staticmethod
    def synthetic_text(token_ids: list[int]) -> str:
        """Placeholder text of generated ids when there is no tokenizer: one word per token,
        so streaming clients see a chunk per token (TTFT/TPOT measurable over HTTP)."""
        return "".join(f" t{t}" for t in token_ids)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return self._synthetic(text)
        return list(tokenizer_lib.encode_prompt(self.tokenizer, text))

    def decode(self, token_ids: list[int]) -> str:
        """Text of a token-id prompt (echo): special tokens skipped."""
        if self.tokenizer is None:
            return self.synthetic_text(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """/tokenize: a text with or without the tokenizer's special tokens."""
        if self.tokenizer is None:
            return self._synthetic(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_all(self, token_ids: list[int]) -> str:
        """/detokenize: the text of the ids, special tokens included (as vLLM does)."""
        if self.tokenizer is None:
            return self.synthetic_text(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids of a conversation. `tools` (OpenAI function tools) go to the template's
        own `tools` variable when it uses one; otherwise they are described in a system
        message (tools_system_prompt), and the history's tool calls are written as the JSON
        the model is asked to produce."""
        uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if uses_tools and not self.template_takes_tools:
            messages = self.messages_without_tool_support(messages, tools or [])
            tools = None
        if self.tokenizer is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return self._synthetic(text + ("assistant: " if add_generation_prompt else ""))
        try:
            if tools:
                text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)
                return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            return list(tokenizer_lib.apply_chat_template(self.tokenizer, messages,
                                                          add_generation_prompt=add_generation_prompt,
                                                          add_special_tokens=add_special_tokens))
        except ValueError as exc:  # e.g. no chat template in the checkpoint
            raise APIError(400, str(exc), code="no_chat_template", param="messages") from None
        except Exception as exc:  # jinja errors raised by the checkpoint's own template
            raise APIError(400, f"the chat template failed on these messages: {exc}",
                           code="chat_template_error", param="messages") from None

    @property
    def template_takes_tools(self) -> bool:
        """Whether the checkpoint's chat template renders a `tools` variable itself."""
        template = getattr(self.tokenizer, "chat_template", None)
        return isinstance(template, str) and "tools" in template

    @staticmethod
    def tools_system_prompt(tools: list[dict]) -> str:
        functions = [t["function"] for t in tools]
        return (
            "You can call these functions:\n" + json.dumps(functions) + "\n"
            'To call one, reply with only a JSON object {"name": <function name>, "arguments": <its arguments>}.'
        )

    @classmethod
    def messages_without_tool_support(cls, messages: list[dict[str, Any]], tools: list[dict]) -> list[dict]:
        """The conversation for a template that knows nothing of tools: the tools described
        in the system message, assistant tool calls as their JSON text, tool results as
        "tool" turns naming their call."""
        out: list[dict[str, Any]] = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                calls = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                         for c in m.pop("tool_calls")]
                m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            if m["role"] == "tool":
                m["content"] = f"[result of {m.pop('tool_call_id', '')}] {m['content']}"
            m.pop("tool_call_id", None)
            m.pop("name", None)
            out.append(m)
        if not tools:
            return out
        prompt = cls.tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
        return out
