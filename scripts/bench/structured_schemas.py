"""The held set of JSON schemas (and prompts) that structured outputs are checked and measured on: nested objects,
arrays, enums, numbers and integers with bounds, optional fields, anyOf, const, nullable values, string formats and
patterns. Used by tests/test_guided_engine.py, tests/test_structured_server.py and
scripts/bench/structured_benchmark.py."""

from __future__ import annotations

import json
from typing import NamedTuple


class SchemaCase(NamedTuple):
    name: str
    prompt: str
    schema: dict


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


SCHEMAS: list[SchemaCase] = [
    SchemaCase("person", "Describe a fictional person as JSON with name and age.",
               _obj({"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    SchemaCase("sentiment", "Classify the sentiment of: 'I loved the movie, the ending was great.'",
               _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}})),
    SchemaCase("product", "Give a product from a grocery store with its price in euros.",
               _obj({"product": {"type": "string"}, "price": {"type": "number", "minimum": 0},
                     "in_stock": {"type": "boolean"}})),
    SchemaCase("address", "Write the address of a museum in Paris.",
               _obj({"street": {"type": "string"}, "city": {"type": "string"},
                     "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"const": "France"}})),
    SchemaCase("nested", "Describe a company with its headquarters and its CEO.",
               _obj({"company": {"type": "string"},
                     "headquarters": _obj({"city": {"type": "string"}, "country": {"type": "string"}}),
                     "ceo": _obj({"name": {"type": "string"}, "since": {"type": "integer"}})})),
    SchemaCase("tags", "List three keywords for an article about renewable energy.",
               _obj({"keywords": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5}})),
    SchemaCase("numbers", "Give the first four prime numbers.",
               _obj({"primes": {"type": "array", "items": {"type": "integer"}, "minItems": 4, "maxItems": 4}})),
    SchemaCase("optional", "Describe a book: title, and the author if you know it.",
               _obj({"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}},
                    required=["title"])),
    SchemaCase("any_of", "Give the temperature in Paris today, as a number, or null if unknown.",
               _obj({"city": {"type": "string"}, "temperature": {"anyOf": [{"type": "number"}, {"type": "null"}]}})),
    SchemaCase("date", "When did the Apollo 11 mission land on the Moon? Answer with a date.",
               _obj({"event": {"type": "string"}, "date": {"type": "string", "format": "date"}})),
    SchemaCase("email", "Invent a contact for a support team.",
               _obj({"team": {"type": "string"}, "email": {"type": "string", "format": "email"}})),
    SchemaCase("uuid", "Make up an order record with an id.",
               _obj({"order_id": {"type": "string", "format": "uuid"}, "items": {"type": "integer", "minimum": 1}})),
    SchemaCase("list_of_objects", "List two planets and their order from the Sun.",
               _obj({"planets": {"type": "array", "minItems": 2, "maxItems": 2,
                                 "items": _obj({"name": {"type": "string"}, "order": {"type": "integer"}})}})),
    SchemaCase("enum_array", "Which primary colors are in the French flag?",
               _obj({"colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "white", "yellow"]},
                                "maxItems": 3}})),
    SchemaCase("bounded_string", "Give a short title for a story about a dragon.",
               _obj({"title": {"type": "string", "minLength": 3, "maxLength": 40}})),
    SchemaCase("nullable", "Who is the king of France today? Use null if there is none.",
               _obj({"king": {"type": ["string", "null"]}})),
    SchemaCase("rating", "Rate the restaurant review 'good food, slow service' from 1 to 5.",
               _obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "reason": {"type": "string"}})),
    SchemaCase("translation", "Translate 'good morning' into French and Spanish.",
               _obj({"fr": {"type": "string"}, "es": {"type": "string"}})),
    SchemaCase("boolean", "Is the Earth flat?", _obj({"answer": {"type": "boolean"}})),
    SchemaCase("any_of_objects", "Describe a pet: either a dog with a breed or a fish with a tank size.",
               {"anyOf": [_obj({"kind": {"const": "dog"}, "breed": {"type": "string"}}),
                          _obj({"kind": {"const": "fish"}, "litres": {"type": "number"}})]}),
    SchemaCase("matrix", "Write the 2x2 identity matrix.",
               _obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2,
                                "items": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                                          "maxItems": 2}}})),
    SchemaCase("event", "Describe a concert: the artist, the date and time, and the ticket price.",
               _obj({"artist": {"type": "string"}, "starts": {"type": "string", "format": "date-time"},
                     "price": {"type": "number", "exclusiveMinimum": 0}})),
    SchemaCase("recipe", "Give a simple pancake recipe: ingredients and steps.",
               _obj({"ingredients": {"type": "array", "items": _obj({"name": {"type": "string"},
                                                                     "grams": {"type": "integer"}}), "maxItems": 4},
                     "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 3}})),
    SchemaCase("extraction", "Extract the fields from: 'Call Anna Berg at +46 70 123 45 67 before Friday.'",
               _obj({"name": {"type": "string"}, "phone": {"type": "string", "pattern": "^\\+[0-9 ]+$"},
                     "deadline": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}})),
]


def schema_prompt(case: SchemaCase) -> str:
    """The prompt with the schema spelled out, as a client would send it, with or without enforcement."""
    return f"{case.prompt}\nAnswer only with JSON that follows this JSON schema: {json.dumps(case.schema)}"
