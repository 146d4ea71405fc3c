"""Structured output: grammars that constrain what a request may generate (response_format
json_object / json_schema, and tool calls under tool_choice required or a named function).

A request's compiled grammar rides on its SamplingParams (`grammar`). The executor keeps one
`xgrammar` matcher per constrained request (GrammarMatchers): before each sampling step it
advances the matcher over the request's output tokens it has not seen yet (so recomputation
after a preemption and parallel sequences need no special case), fills a token bitmask for
the constrained rows only, and applies all of them in one vectorized call to the logits the
sampler draws from (a copy when the step reports logprobs, which stay the model's raw
distribution). EOS is allowed
only where the grammar accepts the text so far; once it is complete, only EOS is.

JSON is generated compactly (no free whitespace): a random or weak model cannot then spend
its whole budget on spaces.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tokenlane.structured_output")


def check_json_schema(schema: Any, where: str) -> None:
    """Raise ValueError unless `schema` is a JSON Schema object (Draft 2020-12 meta-schema)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{where} is not a valid JSON Schema: {exc.message}") from None


def tool_call_schema(tools: Sequence[dict], name: Optional[str] = None) -> dict:
    """The JSON Schema of one tool call, {"name": ..., "arguments": {...}}: of the function
    `name`, or of any of `tools` when name is None."""
    options = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        options.append({
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    assert options, f"no tool named {name!r}"
    return options[0] if len(options) == 1 else {"anyOf": options}


def parse_tool_call(text: str, tools: Sequence[dict]) -> Optional[dict]:
    """(name, arguments as a JSON string) of `text` when all of it is one tool call of one of
    `tools`, as an OpenAI function tool call without its id; else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    names = {tool["function"]["name"] for tool in tools}
    if not (isinstance(value, dict) and set(value) == {"name", "arguments"}
            and value["name"] in names and isinstance(value["arguments"], dict)):
        return None
    return {"name": value["name"], "arguments": json.dumps(value["arguments"])}


_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'  # a character of a maxLength string, as xgrammar prints it
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'  # the same, without the control characters


class GrammarCompiler:
    """Compiles grammars for one tokenizer (xgrammar's compiler caches compiled grammars)."""

    _lock = threading.Lock()
    _by_tokenizer: dict[int, "GrammarCompiler"] = {}

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                      stop_token_ids=stop)
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=1)

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int) -> "GrammarCompiler":
        key = id(tokenizer)
        with cls._lock:
            compiler = cls._by_tokenizer.get(key)
            if compiler is None:
                compiler = cls._by_tokenizer[key] = cls(tokenizer, vocab_size)
            return compiler

    def json_schema(self, schema: dict) -> Any:
        """A compiled grammar of the JSON documents `schema` accepts; ValueError if xgrammar
        cannot compile it (an unsupported keyword, an unsatisfiable schema)."""
        import xgrammar

        try:
            grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
            # xgrammar's rule for length-bounded strings lets raw control characters through,
            # which JSON forbids inside strings (json.loads refuses them): exclude them too.
            ebnf = str(grammar).replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)
            return self._compiler.compile_grammar(ebnf)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
            raise ValueError(f"the schema cannot be compiled to a grammar: {exc}") from None

    def load(self, serialized: str) -> Any:
        """A compiled grammar back from `serialize_json()` (made against the same tokenizer in
        another process: the engine core's requests)."""
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)

    def json_object(self) -> Any:
        """Any JSON object."""
        return self.json_schema({"type": "object"})


def allocate_bitmask(rows: int, vocab_size: int) -> "torch.Tensor":
    """[rows, ceil(vocab / 32)] int32 words: token t is bit t % 32 of word t // 32."""
    import xgrammar

    return xgrammar.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: "torch.Tensor", bitmask: "torch.Tensor", rows: list[int]) -> None:
    """Set to -inf, in place, the logits of each row i in `rows` whose bit is 0 in bitmask[i];
    the other rows are not touched. One call for all the rows (xgrammar's CPU kernel, or its
    GPU kernel on the logits' device)."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


class GrammarMatchers:
    """The executor's matchers, one per constrained request id."""

    def __init__(self) -> None:
        self._matchers: dict[str, Any] = {}
        self._accepted: dict[str, int] = {}  # output tokens each matcher has consumed
        self._bitmask: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self._matchers)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._accepted.pop(request_id, None)

    def _synced(self, request) -> Optional[Any]:
        """The request's matcher, advanced over its output tokens so far; None once the
        output left the grammar (then the row is no longer constrained)."""
        import xgrammar

        rid = request.request_id
        matcher = self._matchers.get(rid)
        if matcher is None:
            if rid in self._accepted:
                return None  # broken earlier
            matcher = self._matchers[rid] = xgrammar.GrammarMatcher(request.sampling_params.grammar)
            self._accepted[rid] = 0
        outputs = request.output_token_ids
        for token in outputs[self._accepted[rid]:]:
            if not matcher.accept_token(token):
                log.warning("request %s: token %d is outside its grammar; no longer constrained", rid, token)
                del self._matchers[rid]
                return None
        self._accepted[rid] = len(outputs)
        return matcher

    def masked(self, logits: "torch.Tensor", requests: Sequence[Any], copy: bool = True) -> "torch.Tensor":
        """`logits` [N, V] (row i samples for requests[i]) with each constrained row's
        disallowed tokens at -inf. With `copy` the result is a copy when any row is
        constrained (the caller still reads the raw logits: logprobs); without, the rows are
        masked in place. Unconstrained rows cost nothing but a check."""
        rows, matchers = [], []
        for i, request in enumerate(requests):
            if request.sampling_params.grammar is None:
                continue
            matcher = self._synced(request)
            if matcher is not None and not matcher.is_terminated():
                rows.append(i)
                matchers.append(matcher)
        if not rows:
            return logits
        n, vocab = logits.shape
        if self._bitmask is None or self._bitmask.shape[0] < n or self._bitmask.shape[1] * 32 < vocab:
            self._bitmask = allocate_bitmask(max(n, 64), vocab)
        bitmask = self._bitmask[:n]  # row i is request i's (only the constrained rows are filled)
        for i, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        out = logits.clone() if copy else logits
        apply_bitmask(out, bitmask, rows)
        return out
