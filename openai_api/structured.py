"""Structured outputs: OpenAI's ``response_format`` as the guide the ensemble enforces token by token
(``guided_decoding_guide_type`` and ``guided_decoding_guide``, TensorRT-LLM's names;
docs/api.md#guided-decoding-structured-outputs).

The schema is passed on as given: whether it is valid is the server's grammar engine's to judge (an invalid one comes
back as a 400 that names the problem). The engine reads every schema strictly, whatever ``strict`` says: an object
that names its properties allows only those unless it says otherwise (python_backend/guided/strict_schema.py).
OpenAI's other rule for ``strict`` schemas (every property required) is not enforced."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from openai_api.errors import InvalidRequest

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for schema and function names


class Strict(BaseModel):
    """A request object: unknown fields and loose types are refused, as OpenAI refuses them."""

    model_config = ConfigDict(extra="forbid", strict=True)


@dataclass(frozen=True)
class Guide:
    type: str  # json, json_schema, regex, ebnf_grammar or lark
    text: str


class JsonSchema(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    schema_: dict = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def check(self) -> None:
        if self.type == "json_schema" and self.json_schema is None:
            raise InvalidRequest("Missing required parameter: 'response_format.json_schema'",
                                 param="response_format.json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise InvalidRequest(f"json_schema is only allowed with type 'json_schema', not {self.type!r}",
                                 param="response_format.json_schema")

    def guide(self) -> Guide | None:
        if self.type == "json_object":
            return Guide("json_schema", '{"type": "object"}')
        if self.type == "json_schema":
            return Guide("json_schema", json.dumps(self.json_schema.schema_, ensure_ascii=False))
        return None
