"""LangChain's ChatOpenAI against the server, written as its users write it. Run with the client libraries' venv
(`make clients`) by tests/test_client_libraries.py: `python langchain_cases.py BASE_URL MODEL` prints one JSON object,
case -> what came back, and the test asserts on it."""

from __future__ import annotations

import json
import sys
from typing import Literal

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """The current weather in a city."""
    return f"18 degrees {unit}, sunny in {city}"


class CityAnswer(BaseModel):
    """A city and the country it is in."""

    city: str = Field(description="the city's name")
    country: str = Field(description="the country's name")


QUESTION = "What is the weather like in Oslo?"
CAPITAL = "What is the capital of France? Answer with the city and its country."


def calls(message) -> list[dict]:
    return [{"name": c["name"], "args": c["args"]} for c in message.tool_calls]


def main(base_url: str, model: str) -> dict:
    llm = ChatOpenAI(base_url=base_url, api_key="x", model=model, temperature=0, max_tokens=48, max_retries=0,
                     timeout=300)
    out = {"invoke": llm.invoke(CAPITAL).content,
           "stream": "".join(chunk.content for chunk in llm.stream(CAPITAL)),
           "batch": [m.content for m in llm.batch([CAPITAL, "Name a color.", CAPITAL])]}
    for method in ("json_schema", "function_calling", "json_mode"):
        answer = llm.with_structured_output(CityAnswer, method=method, include_raw=True).invoke(CAPITAL)
        out[f"structured_{method}"] = {
            "parsed": answer["parsed"].model_dump() if answer["parsed"] is not None else None,
            "error": repr(answer["parsing_error"]) if answer["parsing_error"] else None,
            "content": answer["raw"].content, "calls": calls(answer["raw"]),
            "finish_reason": answer["raw"].response_metadata.get("finish_reason")}
    for choice in ("any", "get_weather"):
        message = llm.bind_tools([get_weather], tool_choice=choice).invoke(QUESTION)
        out[f"tool_choice_{choice}"] = {"calls": calls(message), "invalid": message.invalid_tool_calls,
                                        "content": message.content,
                                        "finish_reason": message.response_metadata.get("finish_reason")}
    # The round trip: the forced call, the tool's answer sent back as a ToolMessage, then a final answer in words.
    asked = HumanMessage(QUESTION)
    call = llm.bind_tools([get_weather], tool_choice="any").invoke([asked])
    results = [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in call.tool_calls]
    final = llm.bind_tools([get_weather]).invoke([asked, call, *results])
    out["round_trip"] = {"calls": calls(call), "results": [r.content for r in results], "final": final.content,
                         "final_calls": calls(final), "finish_reason": final.response_metadata.get("finish_reason")}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
