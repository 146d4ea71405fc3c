"""The OpenAI wire format: request and response bodies of the completions and chat APIs.

(Streaming chunks are built as plain dicts in server.py, on the hot path.)

Pydantic models only (no engine logic). Requests accept what OpenAI's API accepts for the
features we implement; parameters we do not implement (suffix...) are refused
with a 400 whose `param` names them rather than silently ignored, so a client never gets a
different answer from the one it asked for. Unknown fields are ignored, as OpenAI-compatible
servers do.

Types are strict: no bool -> int and no string -> number coercion (`"max_tokens": "3"` and
`"prompt": [[false]]` are 400s); an integer is accepted where a number is, and an integral
number (`3.0`) where an integer is, as JSON Schema's `integer` (the OpenAPI document) says.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictStr,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError



def _integer_not_bool_or_text(value: Any) -> Any:
    """JSON Schema's `integer`, as the OpenAPI document declares it: 3 and 3.0 are the same
    number (both accepted), 3.5, true and "3" are not integers (400)."""
    if isinstance(value, (bool, str, bytes)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


StrictInt = Annotated[int, BeforeValidator(_integer_not_bool_or_text)]

INT32_MAX = 2**31 - 1
# Stop strings are matched on every token's text (cost grows with their length).
MAX_STOP_STRING_CHARS = 1024
MAX_LOGPROBS = 20  # top logprobs per position, as OpenAI allows
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: each bias in [-100, 100]
# Parallel sampling: most sequences per prompt (n, best_of); each one is a running sequence.
MAX_PARALLEL_SEQUENCES = 128


class ParamError(ValueError):
    """A body validation error that names its field: the 400's `param` (the server reads it
    from the validation error's context)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class APIError(Exception):
    """An error that the server answers in OpenAI's shape with the given HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: Optional[str] = None,
        param: Optional[str] = None,
        retry_after_s: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: Optional[str], param: Optional[str] = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """Every error body (the OpenAPI document declares it for each error status)."""

    error: ErrorDetail


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


def _check_json_schema(schema: Any, param: str, where: str) -> None:
    """A 400 naming `param` unless `schema` is a JSON Schema object (Draft 2020-12)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ParamError(param, f"{where} must be a JSON Schema object")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ParamError(param, f"{where} is not a valid JSON Schema: {exc.message}") from None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(min_length=1, max_length=64)
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[StrictStr] = None
    strict: Optional[StrictBool] = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON of a schema. The
    output is constrained by a grammar either way (runtime/executor/structured_output.py); `strict`
    is accepted and always honoured."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ParamError("response_format", "response_format of type json_schema needs json_schema")
            if self.json_schema.schema_ is None:
                self.json_schema.schema_ = {"type": "object"}
            _check_json_schema(self.json_schema.schema_, "response_format", "response_format.json_schema.schema")
        return self

    @property
    def constrained(self) -> bool:
        return self.type != "text"


def _response_format(value):
    """Parse response_format with its errors reported under param response_format."""
    if value is None or isinstance(value, ResponseFormat):
        return value
    if not isinstance(value, dict):
        raise ParamError("response_format", "response_format must be an object")
    try:
        return ResponseFormat.model_validate(value)
    except ParamError:
        raise
    except ValueError as exc:
        raise ParamError("response_format", f"invalid response_format: {exc}") from None


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    # 0 or -1 disable top-k (vLLM accepts -1); the engine uses 0. Values past the vocabulary
    # mean "all", but must fit the sampler's integer tensors.
    top_k: StrictInt = Field(default=0, ge=-1, le=INT32_MAX)
    seed: Optional[StrictInt] = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch generators take
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stop_token_ids: Optional[list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]]] = Field(default=None, max_length=64)
    ignore_eos: StrictBool = False  # extension: generate exactly max_tokens tokens
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    # Sequences sampled per prompt; they share the prompt's KV (see runtime/core/request.py).
    n: StrictInt = Field(default=1, ge=1, le=MAX_PARALLEL_SEQUENCES)
    priority: StrictInt = Field(default=0, ge=-INT32_MAX, le=INT32_MAX)  # extension: higher first within its lane
    user: Optional[StrictStr] = None

    # Logits processors (runtime/executor/sampler.py); they change the pick, not the reported logprobs.
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI, generated tokens
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI, generated tokens
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0, allow_inf_nan=False)  # vLLM, prompt + output
    # Token id (a decimal string, as JSON keys are) -> bias added to its logit, in [-100, 100].
    logit_bias: Optional[dict[StrictStr, StrictFloat]] = None
    min_p: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)  # vLLM
    min_tokens: StrictInt = Field(default=0, ge=0, le=INT32_MAX)  # vLLM: no EOS / stop token id before
    # Completions only (chat refuses it): sample best_of sequences, return the n with the
    # highest cumulative logprob.
    best_of: Optional[StrictInt] = Field(default=None, ge=1, le=MAX_PARALLEL_SEQUENCES)
    # Structured output: the output follows a grammar (runtime/executor/structured_output.py).
    response_format: Optional[Any] = None
    guided_json: Optional[Any] = None  # vLLM's extension: a JSON Schema the output follows

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format_field(cls, value):
        return _response_format(value)

    @field_validator("guided_json", mode="before")
    @classmethod
    def _guided_json(cls, value):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ParamError("guided_json", "guided_json must be a JSON Schema (an object or its JSON text)")
        if value is not None:
            _check_json_schema(value, "guided_json", "guided_json")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        if value is None:
            return value
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
                raise ParamError("logit_bias", f"logit_bias keys must be token ids (decimal strings), got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for {key}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        if isinstance(value, str):
            value = [value]
        if value is not None:
            if len(value) > 16:
                raise ValueError("at most 16 stop strings")
            if any(s == "" for s in value):
                raise ValueError("stop strings must not be empty")
            if any(len(s) > MAX_STOP_STRING_CHARS for s in value):
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        if self.guided_json is not None and self.response_format is not None and self.response_format.constrained:
            raise ParamError("guided_json", "give response_format or guided_json, not both")
        if self.output_schema is not None:
            # The grammar decides where the output ends: EOS must stay drawable once it is complete.
            if self.ignore_eos:
                raise ParamError("ignore_eos", "ignore_eos cannot be combined with structured output")
            if self.min_tokens:
                raise ParamError("min_tokens", "min_tokens cannot be combined with structured output")
        return self

    @property
    def output_schema(self) -> Optional[dict[str, Any]]:
        """The JSON Schema the output must follow (json_object: any object), or None."""
        if self.guided_json is not None:
            return self.guided_json
        if self.response_format is None or not self.response_format.constrained:
            return None
        if self.response_format.type == "json_object":
            return {"type": "object"}
        return self.response_format.json_schema.schema_

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _json_kind(value: Any) -> str:
    """How a JSON value reads in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


_INT_ONLY = {int}  # bool is a subclass of int, not int: `type` tells them apart


def token_ids(value: Any, where: str, param: str) -> list[int]:
    """`value` as token ids: a JSON array of integers in [0, INT32_MAX] (an integral number
    such as 3.0 is an integer, as in JSON Schema; true and "3" are not). ParamError naming the
    first bad element otherwise.

    The common case (every element a Python int within bounds) is three C-level passes with
    no Python call per id; a validator per element cost the event loop 9x as much
    (docs/benchmarks.md, "Prompt token ids in one pass").
    """
    if type(value) is not list:
        raise ParamError(param, f"{where} must be an array of token ids, not {_json_kind(value)}")
    if not value or (set(map(type, value)) == _INT_ONLY and min(value) >= 0 and max(value) <= INT32_MAX):
        return value
    ids = []
    for i, v in enumerate(value):
        if type(v) is float and v.is_integer():
            v = int(v)
        if type(v) is not int:
            raise ParamError(param, f"{where}[{i}] must be a token id (an integer), not {_json_kind(v)}")
        if not 0 <= v <= INT32_MAX:
            raise ParamError(param, f"{where}[{i}]: token id {v} is outside [0, {INT32_MAX}]")
        ids.append(v)
    return ids


def _prompt(value: Any, _handler: ValidatorFunctionWrapHandler) -> Any:
    """One prompt (text or token ids) or a batch of them, told apart by the first element;
    the declared union stays the schema (OpenAPI), the checks are these."""
    if isinstance(value, str):
        return value
    if type(value) is not list:
        raise ParamError("prompt", "prompt must be a string, an array of strings, an array of token ids "
                                   f"or an array of token-id arrays, not {_json_kind(value)}")
    if not value:
        return value  # CompletionRequest._prompts names the empty prompt
    first = value[0]
    if isinstance(first, str):
        for i, text in enumerate(value):
            if not isinstance(text, str):
                raise ParamError("prompt", f"prompt[{i}] must be a string, as prompt[0] is, not {_json_kind(text)}")
        return value
    if type(first) is list:
        return [token_ids(ids, f"prompt[{i}]", "prompt") for i, ids in enumerate(value)]
    return token_ids(value, "prompt", "prompt")


TokenIds = list[Annotated[int, Field(ge=0, le=INT32_MAX)]]  # the schema; `token_ids` checks
# One prompt (text or token ids) or a batch of them (each its own engine request).
Prompt = Annotated[Union[str, TokenIds, list[str], list[TokenIds]], WrapValidator(_prompt)]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Prompt
    # 0 is allowed with echo or prompt_logprobs: score the prompt, generate nothing.
    max_tokens: Optional[StrictInt] = Field(default=None, ge=0)
    # Legacy logprobs: each token's logprob plus this many most likely tokens (0: none).
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    # vLLM's extension: per prompt token, its logprob and this many most likely tokens.
    prompt_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's extension: each choice also carries prompt_token_ids and token_ids (the generated
    # ids; streamed: the prompt's in a choice's first chunk, each chunk's new ids in it).
    return_token_ids: Optional[StrictBool] = None
    suffix: Optional[StrictStr] = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        """A list of prompts (strings or token-id lists) is a batch; each must be non-empty."""
        batch = value if isinstance(value, list) and value and isinstance(value[0], (str, list)) else [value]
        if not batch or (isinstance(value, list) and not value):
            raise ValueError("prompt must not be empty")
        for i, prompt in enumerate(batch):
            if len(prompt) == 0:
                where = f"prompt[{i}]" if len(batch) > 1 else "prompt"
                raise ValueError(f"{where} must not be empty")
        return value

    @model_validator(mode="after")
    def _unsupported_completion(self):
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ParamError("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
            if self.stream and self.best_of > self.n:
                raise ParamError("best_of", "best_of > n is not supported with stream (the best "
                                 "sequences are only known at the end)")
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ParamError("max_tokens", "max_tokens must be at least 1 (0 only with echo or prompt_logprobs)")
        return self

    @property
    def num_sequences(self) -> int:
        """Sequences sampled per prompt: best_of when set, else n."""
        return self.best_of or self.n

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """The batch: one entry per prompt, in order."""
        value = self.prompt
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            return list(value)
        return [value]


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        raise ParamError("messages", f"tool call arguments must be JSON, got {arguments[:80]!r}") from None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: StrictStr  # a JSON object's text, as OpenAI sends it


class ToolCall(BaseModel):
    """A tool call of an assistant turn (in the history, and in our answers)."""

    model_config = ConfigDict(extra="ignore")

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON Schema of the arguments object
    strict: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _valid(self):
        if not FUNCTION_NAME.match(self.name):
            raise ParamError("tools", f"function name {self.name!r} must be 1-64 of a-z, A-Z, 0-9, _ and -")
        if self.parameters is not None:
            _check_json_schema(self.parameters, "tools", f"the parameters of function {self.name!r}")
        return self


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    class Name(BaseModel):
        model_config = ConfigDict(extra="ignore")

        name: StrictStr

    type: Literal["function"]
    function: Name


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None  # assistant turns
    tool_call_id: Optional[StrictStr] = None  # tool turns: the call this is the result of

    @model_validator(mode="after")
    def _content_required(self):
        # Only an assistant turn may come without content (OpenAI: when it has tool calls).
        if self.content is None and self.role != "assistant":
            raise ParamError("messages", f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ParamError("messages", "only an assistant message may have tool_calls")
        for call in self.tool_calls or []:
            _arguments_object(call.function.arguments)  # a 400 here, not in the template
        if self.role == "tool" and self.tool_call_id is None:
            raise ParamError("messages", "a tool message needs tool_call_id")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (tool calls' arguments as objects, as the
        Hugging Face templates expect them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    # Each generated token's logprob, and top_logprobs most likely tokens per position.
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Tool]] = Field(default=None, max_length=128)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None

    @model_validator(mode="after")
    def _unsupported_chat(self):
        if self.best_of not in (None, 1):
            raise ParamError("best_of", "best_of is only supported on /v1/completions")
        if self.tool_choice is not None and not self.tools:
            raise ParamError("tool_choice", "tool_choice is only allowed with tools")
        if self.tools:
            names = [t.function.name for t in self.tools]
            if len(set(names)) != len(names):
                raise ParamError("tools", "function names must be unique")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise ParamError("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, "
                                 "which is not one of the tools")
            if self.forced_tool_call and self.output_schema is not None:
                raise ParamError("response_format", "response_format cannot be combined with a forced tool call")
            if self.forced_tool_call and (self.ignore_eos or self.min_tokens):
                raise ParamError("tool_choice", "ignore_eos and min_tokens cannot be combined with a forced tool call")
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs: true")
        return self

    @property
    def num_sequences(self) -> int:
        return self.n

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    @property
    def effective_tool_choice(self) -> Union[str, NamedToolChoice]:
        """OpenAI's default: "auto" with tools, "none" without."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    @property
    def forced_tool_call(self) -> Optional[Union[str, NamedToolChoice]]:
        """tool_choice when it forces a tool call (required or a named function), else None."""
        choice = self.effective_tool_choice
        return choice if choice == "required" or isinstance(choice, NamedToolChoice) else None

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a text `prompt` or chat `messages`, not both."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    # Text: the tokenizer's special tokens (BOS), as /v1/completions adds them. Chat: the
    # template writes its own, so only an explicit true adds more (vLLM's defaults).
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: StrictBool = True  # chat only

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


MAX_DETOKENIZE_IDS = 1_000_000


def _detokenize_tokens(value: Any, _handler: ValidatorFunctionWrapHandler) -> list[int]:
    ids = token_ids(value, "tokens", "tokens")
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise ParamError("tokens", f"tokens holds {len(ids)} ids; at most {MAX_DETOKENIZE_IDS} are decoded at once")
    return ids


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    tokens: Annotated[TokenIds, WrapValidator(_detokenize_tokens)] = Field(max_length=MAX_DETOKENIZE_IDS)


class DetokenizeResponse(BaseModel):
    prompt: str


# --------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    # {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (OpenAI's legacy shape)
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    # vLLM's extension, only present when asked for: one entry per prompt token (the first
    # None), each {token id: {"logprob", "rank", "decoded_token"}}.
    prompt_logprobs: Optional[list[Optional[dict[str, dict[str, Any]]]]] = None
    # vLLM's extension (return_token_ids), only present when asked for: the prompt's ids and
    # the generated ids (echo or not).
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: Optional[dict[str, Any]] = None  # {"content": [{token, logprob, bytes, top_logprobs}]}
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenlane"
    max_model_len: Optional[int] = None
    # vLLM's fields: the base's root is its checkpoint, a LoRA adapter's is its source and its
    # parent the base's name.
    root: Optional[str] = None
    parent: Optional[str] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body (`lora_int_id` is accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: Optional[int] = None
