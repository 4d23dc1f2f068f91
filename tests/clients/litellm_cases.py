"""LiteLLM against the server as an `openai/` model with `api_base`, written as its users write it. Run with the
client libraries' venv (`make clients`) by tests/test_client_libraries.py: `python litellm_cases.py BASE_URL MODEL`
prints one JSON object, case -> what came back, and the test asserts on it."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # nothing fetched from the network at import

import litellm  # noqa: E402

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = [{"role": "user", "content": "What is the weather like in Oslo?"}]
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}


def main(base_url: str, model: str) -> dict:
    common = dict(model=f"openai/{model}", api_base=base_url, api_key="x", temperature=0, max_tokens=48,
                  num_retries=0, timeout=300)
    whole = litellm.completion(messages=CAPITAL, **common)
    chunks = list(litellm.completion(messages=CAPITAL, stream=True, stream_options={"include_usage": True}, **common))
    called = litellm.completion(messages=WEATHER, tools=[TOOL], tool_choice="required", **common)
    message = called.choices[0].message
    return {
        "completion": {"content": whole.choices[0].message.content, "finish_reason": whole.choices[0].finish_reason,
                       "usage": whole.usage.model_dump(include={"prompt_tokens", "completion_tokens"})},
        "stream": {"content": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                   "finish_reasons": [c.choices[0].finish_reason for c in chunks if c.choices
                                      and c.choices[0].finish_reason],
                   "usage": [c.usage.model_dump(include={"prompt_tokens", "completion_tokens"}) for c in chunks
                             if getattr(c, "usage", None)]},
        "tools": {"content": message.content, "finish_reason": called.choices[0].finish_reason,
                  "calls": [{"name": c.function.name, "arguments": c.function.arguments}
                            for c in message.tool_calls or []]},
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
