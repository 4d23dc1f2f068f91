"""JSON schemas read strictly, as XGrammar's ``strict_mode`` (vLLM's default) and OpenAI's strict mode read them: an
object schema that names its properties and says nothing of ``additionalProperties`` allows only those properties.

JSON Schema itself allows any other property there, and a small model given that freedom copies the schema's own
keys (``"type"``, ``"properties"``...) into its answer until ``max_tokens``. A schema that wants other properties
says so: ``"additionalProperties": true`` (or a schema for them), ``patternProperties`` or
``unevaluatedProperties``. An object that names no properties (``{"type": "object"}``) stays any object."""

from __future__ import annotations

from typing import Any

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
              "contains", "propertyNames", "not", "if", "then", "else")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
# What already says which other properties an object takes.
OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def strict_schema(schema: Any) -> Any:
    """A copy of the schema with ``"additionalProperties": false`` on every object schema that names properties
    and says nothing of others. The branches of an ``allOf`` describe one object together, so neither they nor the
    schema holding them are closed (closing each would refuse the properties the other branches name)."""
    return _strict(schema, close=True)


def _strict(schema: Any, close: bool) -> Any:
    if not isinstance(schema, dict):
        return schema  # true, false, or something the grammar engine will refuse with its own message
    out = {}
    for key, value in schema.items():
        if key in ONE_SCHEMA:
            out[key] = _strict(value, close=True)
        elif key in SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_strict(item, close=True) for item in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_strict(item, close=False) for item in value]
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _strict(item, close=True) for name, item in value.items()}
        else:
            out[key] = value
    if close and "properties" in schema and "allOf" not in schema and not any(k in schema for k in OPEN_KEYWORDS):
        out["additionalProperties"] = False
    return out
