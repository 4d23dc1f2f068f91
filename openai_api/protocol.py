"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, validated before anything reaches Triton.

Fields OpenAI defines that this server does not implement get a 400 that names them (a client that asks for tools or a
JSON schema must not get an answer that silently ignores them); fields OpenAI does not define get a 400 too (pydantic
``extra="forbid"``). Types are strict: ``"max_tokens": "5"`` is refused, as OpenAI refuses it. An explicit ``null``
means "not given", for the fields this server implements and for the ones it does not."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from openai_api.errors import InvalidRequest

MAX_CHOICES = 32  # prompts x n of one request: the llm model's decode batch (max_batch_size)
MAX_STOP = 4  # OpenAI's limit
MAX_LOGPROBS = 5  # completions' `logprobs`, OpenAI's limit
MAX_TOP_LOGPROBS = 20  # chat's `top_logprobs`, OpenAI's limit (and the ensemble's num_top_log_probs)
MAX_SEED = 2**63 - 1  # the ensemble's seed is UINT64; choice i of n uses seed + i
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# OpenAI request fields this server does not implement.
UNSUPPORTED_COMPLETIONS = ("suffix",)
UNSUPPORTED_CHAT = (
    "tools", "tool_choice", "functions", "function_call", "response_format", "audio", "modalities", "prediction",
    "store", "metadata", "parallel_tool_calls", "service_tier", "reasoning_effort", "web_search_options",
    "verbosity", "prompt_cache_key", "safety_identifier",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _SamplingRequest(_Strict):
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
            "cache_salt": self.cache_salt or "",
        }

    def seed_of(self, choice: int) -> int | None:
        """The seed of the choice-th of n answers to one prompt: seed + choice, so that n answers differ and the same
        request gives the same n answers again. No seed given: none sent."""
        return None if self.seed is None else self.seed + choice


class CompletionRequest(_SamplingRequest):
    prompt: list[str]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value):
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and any(isinstance(p, (int, list)) for p in value):
            raise ValueError("token-id prompts are not supported; send the prompt as text")
        if isinstance(value, list) and not value:
            raise ValueError("at least one prompt is needed")
        return value

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, value: list[str]):
        if any(not p for p in value):
            raise ValueError("a prompt must not be empty")
        return value

    def _check(self) -> None:
        super()._check()
        if self.best_of not in (None, 1, self.choices_per_prompt):
            raise InvalidRequest("best_of is not supported (only best_of = n, or 1)", param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("echo together with logprobs is not supported", param="logprobs")
        if len(self.prompt) * self.choices_per_prompt > MAX_CHOICES:
            raise InvalidRequest(f"{len(self.prompt)} prompts x n={self.choices_per_prompt} is more than "
                                 f"{MAX_CHOICES} choices in one request", param="n")

    @property
    def completion_max_tokens(self) -> int:
        return self.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value):
        """A list of {"type": "text", "text": ...} parts is joined with newlines; other part types are refused."""
        if value is None:
            raise ValueError("content is required (tool calls are not supported)")
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

    def template_message(self) -> dict[str, str]:
        """As the chat template takes it ('developer' is OpenAI's newer name for 'system')."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def _check(self) -> None:
        super()._check()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
        return self.max_completion_tokens or self.max_tokens


def parse_request(model: type[_SamplingRequest], body: bytes, vocab_size: int | None = None) -> _SamplingRequest:
    """The request body -> a validated request, or InvalidRequest naming the field at fault."""
    try:
        data = json.loads(body)
    except ValueError as error:  # UnicodeDecodeError included
        raise InvalidRequest(f"The request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object")
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
