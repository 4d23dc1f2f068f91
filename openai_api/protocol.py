"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, validated before anything reaches Triton.

Fields OpenAI defines that this server does not implement get a 400 that names them (a client that asks for audio
must not get an answer that silently ignores it); fields OpenAI does not define get a 400 too (pydantic
``extra="forbid"``). Types are strict: ``"max_tokens": "5"`` is refused, as OpenAI refuses it. An explicit ``null``
means "not given", for the fields this server implements and for the ones it does not."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from openai_api.errors import InvalidRequest
from openai_api.structured import Guide, ResponseFormat, Strict
from openai_api.tools import MAX_TOOLS, Tool, ToolCall, ToolUse, check_tool_choice, check_tools

MAX_CHOICES = 32  # prompts x n of one request: the llm model's decode batch (max_batch_size)
MAX_STOP = 4  # OpenAI's limit
MAX_LOGPROBS = 5  # completions' `logprobs`, OpenAI's limit
MAX_TOP_LOGPROBS = 20  # chat's `top_logprobs`, OpenAI's limit (and the ensemble's num_top_log_probs)
MAX_SEED = 2**63 - 1  # the ensemble's seed is UINT64; choice i of n uses seed + i
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# OpenAI request fields this server does not implement.
UNSUPPORTED_COMPLETIONS = ("suffix",)
UNSUPPORTED_CHAT = (
    "functions", "function_call", "audio", "modalities", "prediction", "store", "metadata", "service_tier",
    "reasoning_effort", "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier",
)


class StreamOptions(Strict):
    include_usage: bool | None = None


class _SamplingRequest(Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI uses it only for abuse monitoring
    # vLLM's extra field: cached prompt prefixes are shared only between requests with the same salt (the server
    # checks its 256-byte limit).
    cache_salt: str | None = None
    # vLLM's extra field: lower runs earlier (default 0); a batch job's lines run with a positive one.
    priority: int | None = Field(None, ge=-2**31, le=2**31 - 1)
    response_format: ResponseFormat | None = None

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt_size(cls, value: str | None):
        if value is not None and len(value.encode("utf-8")) > 256:
            raise ValueError("cache_salt is more than 256 bytes")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str] | None):
        if value is not None:
            if len(value) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop strings, got {len(value)}")
            if any(not s for s in value):
                raise ValueError("a stop string must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None, info: ValidationInfo):
        vocab_size = (info.context or {}).get("vocab_size")
        for key, bias in (value or {}).items():
            if not key.isdigit() or (vocab_size is not None and int(key) >= vocab_size):
                raise ValueError(f"{key!r} is not a token id of this model's vocabulary"
                                 + (f" (0..{vocab_size - 1})" if vocab_size else ""))
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} is {bias}; it must be in [-100, 100]")
        return value

    def _check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.response_format is not None:
            self.response_format.check()

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self) -> dict:
        """The ensemble's sampling inputs, OpenAI's defaults filled in (temperature 1; 0 is greedy, and so is top_p 0,
        which keeps only the most likely token)."""
        greedy = self.temperature == 0 or self.top_p == 0
        return {
            "temperature": 0.0 if greedy else (1.0 if self.temperature is None else self.temperature),
            "top_p": None if greedy or self.top_p is None or self.top_p == 1 else self.top_p,
            "stop": self.stop or [],
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()},
            "guide": self.guide(),
            "priority": self.priority or 0,
        }

    def guide(self) -> Guide | None:
        return self.response_format.guide() if self.response_format else None

    def seed_of(self, choice: int) -> int | None:
        """The seed of the choice-th of n answers to one prompt: seed + choice, so that n answers differ and the same
        request gives the same n answers again. No seed given: none sent."""
        return None if self.seed is None else self.seed + choice


class CompletionRequest(_SamplingRequest):
    # Every form OpenAI takes: a string, a list of strings, a list of token ids, a list of lists of token ids.
    prompt: list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt scored, nothing generated (as vLLM)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value):
        """One prompt or several, as a list of prompts (a list of ints is one prompt of token ids)."""
        if isinstance(value, str) or (isinstance(value, list) and value and all(
                isinstance(p, int) and not isinstance(p, bool) for p in value)):
            value = [value]
        if isinstance(value, list) and not value:
            raise ValueError("at least one prompt is needed")
        if isinstance(value, list) and len({isinstance(p, str) for p in value}) > 1:
            raise ValueError("the prompts must be all text or all token ids, not both")
        return value

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, value: list, info: ValidationInfo):
        vocab_size = (info.context or {}).get("vocab_size")
        for i, prompt in enumerate(value):
            if not prompt:
                raise ValueError(f"prompt {i} is empty" if len(value) > 1 else "a prompt must not be empty")
            if isinstance(prompt, list) and vocab_size is not None:
                outside = [t for t in prompt if not 0 <= t < vocab_size]
                if outside:
                    raise ValueError(f"prompt {i} holds token id {outside[0]}, which is not in this model's "
                                     f"vocabulary (0..{vocab_size - 1})")
        return value

    def _check(self) -> None:
        super()._check()
        if self.best_of not in (None, 1, self.choices_per_prompt):
            raise InvalidRequest("best_of is not supported (only best_of = n, or 1)", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens 0 generates nothing: it is allowed only with echo (the prompt, scored "
                                 "with logprobs)", param="max_tokens")
        if len(self.prompt) * self.choices_per_prompt > MAX_CHOICES:
            raise InvalidRequest(f"{len(self.prompt)} prompts x n={self.choices_per_prompt} is more than "
                                 f"{MAX_CHOICES} choices in one request", param="n")

    @property
    def completion_max_tokens(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    @property
    def scores_prompt(self) -> bool:
        """echo with logprobs (the prompt's tokens scored in front of the answer's), or max_tokens 0."""
        return bool(self.echo) and (self.logprobs is not None or self.max_tokens == 0)


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None  # accepted and not shown to the model
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value):
        """A list of {"type": "text", "text": ...} parts is joined with newlines; other part types are refused."""
        if not isinstance(value, list):
            return value
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} is of type {kind!r}; only 'text' parts are supported")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError(f"part {i} must be {{\"type\": \"text\", \"text\": <string>}}")
            texts.append(part["text"])
        return "\n".join(texts)

    def check(self, at: str) -> None:
        """The rules that depend on the role; `at` is the message's place, e.g. 'messages[2]'."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise InvalidRequest(f"Missing required parameter: '{at}.content'", param=f"{at}.content")
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequest("tool_calls is only allowed in assistant messages", param=f"{at}.tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise InvalidRequest(f"Missing required parameter: '{at}.tool_call_id'", param=f"{at}.tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise InvalidRequest("tool_call_id is only allowed in tool messages", param=f"{at}.tool_call_id")

    def template_message(self) -> dict:
        """As the chat template takes it ('developer' is OpenAI's newer name for 'system')."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value):
        return check_tool_choice(value)

    def _check(self) -> None:
        super()._check()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        for i, message in enumerate(self.messages):
            message.check(f"messages[{i}]")
        check_tools(self.tools, self.tool_choice)
        use = self.tool_use()
        if use and use.forced and self.response_format and self.response_format.type != "text":
            raise InvalidRequest(f"tool_choice forces a tool call, so the answer cannot also follow response_format "
                                 f"{self.response_format.type!r}: use one or the other", param="response_format")

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def tool_use(self) -> ToolUse | None:
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def guide(self) -> Guide | None:
        use = self.tool_use()
        return use.guide() if use and use.forced else super().guide()


def parse_request(model: type[_SamplingRequest], body: bytes, vocab_size: int | None = None) -> _SamplingRequest:
    """The request body -> a validated request, or InvalidRequest naming the field at fault."""
    try:
        data = json.loads(body)
    except ValueError as error:  # UnicodeDecodeError included
        raise InvalidRequest(f"The request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object")
    try:  # JSON's \ud800-style escapes can spell a lone surrogate, which no tokenizer can encode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("The request body holds a string that is not valid Unicode (a lone surrogate)") from None
    unsupported = UNSUPPORTED_CHAT if model is ChatCompletionRequest else UNSUPPORTED_COMPLETIONS
    for name in unsupported:
        if data.get(name) is not None:
            raise InvalidRequest(f"{name} is not supported by this server", param=name)
    data = {k: v for k, v in data.items() if not (k in unsupported and v is None)}
    try:
        request = model.model_validate(data, context={"vocab_size": vocab_size})
    except ValidationError as error:
        raise _invalid(error) from None
    request._check()
    return request


def _invalid(error: ValidationError) -> InvalidRequest:
    first = error.errors(include_url=False)[0]
    param = _param(first["loc"])
    if first["type"] == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'", param=param)
    message = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    shown = "" if isinstance(value, (dict, list)) else f" ({json.dumps(value)[:80]})"
    return InvalidRequest(f"Invalid value for '{param}'{shown}: {message}", param=param)


def _param(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class LoadLoraAdapterRequest(Strict):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(Strict):
    """vLLM's POST /v1/unload_lora_adapter body (its lora_int_id is accepted and not used)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


def parse_adapter_request(model: type[Strict], body: bytes) -> Strict:
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise _invalid(error) from None
