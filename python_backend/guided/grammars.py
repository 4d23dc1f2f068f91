"""A request's guide (TensorRT-LLM's ``guided_decoding_guide_type`` + ``guided_decoding_guide``) checked and turned
into an llguidance grammar. Nothing here needs a tokenizer: a guide that is malformed fails here, one that is
well-formed but unsatisfiable or too complex fails when the compiler builds its matcher."""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from python_backend.errors import InvalidRequestError
from python_backend.guided.strict_schema import strict_schema

# json: any JSON value (guide ignored); json_schema: a JSON schema, read strictly (strict_schema.py); regex: the
# whole output matches it; ebnf_grammar: a GBNF grammar (llama.cpp's and XGrammar's syntax, start rule `root`);
# lark: an extension, llguidance's Lark dialect, which can embed a schema (`%json {...}`), as the OpenAI front's tool
# calls do.
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "lark")

# JSON as the model writes it when left alone, and as OpenAI returns it: ", " and ": " between items, no other
# whitespace. Free whitespace lets a small model fill max_tokens with newlines inside a valid prefix.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GuideSpec:
    type: str
    text: str = ""

    @property
    def cache_key(self) -> tuple[str, str]:
        return self.type, "" if self.type == "json" else self.text


def guide_spec(guide_type: str | None, guide: str | None, max_bytes: int) -> GuideSpec | None:
    """The request's guide, or None when it has none; raises InvalidRequestError naming what is wrong."""
    if not guide_type:
        if guide:
            raise InvalidRequestError("guided_decoding_guide needs guided_decoding_guide_type "
                                      f"(one of {', '.join(GUIDE_TYPES)})")
        return None
    if guide_type not in GUIDE_TYPES:
        raise InvalidRequestError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, "
                                  f"got {guide_type!r}")
    guide = guide or ""
    size = len(guide.encode("utf-8"))
    if size > max_bytes:
        raise InvalidRequestError(f"guided_decoding_guide is {size} bytes, more than the limit of {max_bytes} "
                                  "(the llm model's max_guide_bytes)")
    if guide_type != "json" and not guide.strip():
        raise InvalidRequestError(f"guided_decoding_guide is empty: guided_decoding_guide_type {guide_type} needs one")
    return GuideSpec(guide_type, guide)


def grammar_text(spec: GuideSpec) -> str:
    """llguidance's grammar for the guide (its matcher reports what the grammar itself gets wrong)."""
    if spec.type == "json":
        return _from_schema({})
    if spec.type == "json_schema":
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"guided_decoding_guide is not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("guided_decoding_guide must be a JSON schema: an object (or true/false), "
                                      f"got {type(schema).__name__}")
        return _from_schema(strict_schema(schema))
    if spec.type == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.type == "ebnf_grammar":
        try:
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text))
        except GbnfToLarkError as error:
            raise InvalidRequestError(f"guided_decoding_guide is not a valid GBNF grammar: {error}") from None
    return llguidance.LLMatcher.grammar_from_lark(spec.text)


def _from_schema(schema) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as error:
        raise InvalidRequestError(f"guided_decoding_guide is not a usable JSON schema: {error}") from None
