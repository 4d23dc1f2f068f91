"""instructor against the server, each of its modes for OpenAI's API, written as its users write it. Run with the
client libraries' venv (`make clients`) by tests/test_client_libraries.py: `python instructor_cases.py BASE_URL
MODEL` prints one JSON object, mode -> what came back, and the test asserts on it."""

from __future__ import annotations

import json
import sys
from typing import Iterable

import instructor
import openai
from pydantic import BaseModel, Field

# The modes instructor offers for OpenAI's own API (the rest are other vendors' APIs).
MODES = ("TOOLS", "TOOLS_STRICT", "PARALLEL_TOOLS", "JSON_SCHEMA", "JSON", "JSON_O1", "MD_JSON", "FUNCTIONS",
         "RESPONSES_TOOLS")
CAPITAL = "What is the capital of France? Answer with the city and its country."


class CityAnswer(BaseModel):
    """A city and the country it is in."""

    city: str = Field(description="the city's name")
    country: str = Field(description="the country's name")


def one(client: openai.OpenAI, model: str, mode: str) -> dict:
    """What instructor parsed or raised, and the completion the server sent (None when it sent an error)."""
    patched = instructor.from_openai(client, mode=instructor.Mode[mode])
    sent: list = []
    patched.on("completion:response", sent.append)
    response_model = Iterable[CityAnswer] if mode == "PARALLEL_TOOLS" else CityAnswer
    out: dict = {}
    try:
        answer = patched.create(model=model, response_model=response_model, max_retries=0, temperature=0,
                                max_tokens=64, messages=[{"role": "user", "content": CAPITAL}])
        out["parsed"] = [a.model_dump() for a in (answer if mode == "PARALLEL_TOOLS" else [answer])]
    except Exception as error:  # what the user would see
        out["error"] = f"{type(error).__name__}: {error}"[:2000]
        cause = error
        while not isinstance(cause, openai.APIStatusError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, openai.APIStatusError):
            out["status"], out["body"] = cause.status_code, cause.body
    if sent and hasattr(sent[-1], "choices"):
        choice = sent[-1].choices[0]
        out["completion"] = {"content": choice.message.content, "finish_reason": choice.finish_reason,
                             "tool_calls": [c.model_dump() for c in choice.message.tool_calls or []]}
    return out


def main(base_url: str, model: str) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    return {mode: one(client, model, mode) for mode in MODES}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
