"""Structured outputs and tool calling through the OpenAI-compatible service, against the real tritonserver and model,
driven by the official `openai` client: a JSON schema's answer validates against it, a forced tool call is a call of
one of the tools with arguments valid against its parameters, a streamed call is the whole answer's call, and a bad
schema or tool choice is a 400 that says what is wrong."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers import CITY, WEATHER, lazy_module

openai = lazy_module("openai")

pytestmark = pytest.mark.server

TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
MAX_TOKENS = 48


def ask(client, model, **fields):
    return client.chat.completions.create(model=model, **{"temperature": 0, "max_tokens": MAX_TOKENS, **fields})


def assert_valid_calls(choice) -> list:
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return choice.message.tool_calls


def test_a_json_schema_answer_validates_against_the_schema(client, model):
    answer = ask(client, model, messages=[{"role": "user", "content": "Which city is the capital of France?"}],
                 response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), CITY)
    assert answer.usage.completion_tokens > 0


def test_json_object_on_completions_gives_an_object(client, model):
    prompt = 'Italy: {"capital": "Rome"}\nSpain: {"capital": "Madrid"}\nFrance:'
    answer = client.completions.create(model=model, prompt=prompt, temperature=0,
                                       max_tokens=MAX_TOKENS, extra_body={"response_format": {"type": "json_object"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice.text
    assert isinstance(json.loads(choice.text), dict)


def test_a_required_call_is_a_call_of_one_of_the_tools_with_valid_arguments(client, model):
    answer = ask(client, model, messages=ASK, tools=TOOLS, tool_choice="required")
    assert_valid_calls(answer.choices[0])
    assert answer.usage.completion_tokens > 0


def test_a_named_function_is_the_one_called(client, model):
    answer = ask(client, model, messages=ASK, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    calls = assert_valid_calls(answer.choices[0])
    assert [call.function.name for call in calls] == ["get_time"]


def test_a_streamed_call_reassembles_to_the_whole_answer(client, model):
    fields = dict(messages=ASK, tools=TOOLS, tool_choice="required")
    whole = assert_valid_calls(ask(client, model, **fields).choices[0])
    calls, finish = {}, None
    for chunk in ask(client, model, stream=True, stream_options={"include_usage": True}, **fields):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.id:
                    calls[call.index] = {"name": call.function.name, "arguments": call.function.arguments}
                else:
                    calls[call.index]["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls.values()) == [{"name": c.function.name, "arguments": c.function.arguments} for c in whole]


def test_a_conversation_with_a_call_and_its_result_is_accepted(client, model):
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    choice = ask(client, model, messages=messages, tools=TOOLS).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason == "tool_calls":
        assert_valid_calls(choice)
    else:
        assert choice.message.content


def test_an_invalid_schema_is_a_400_that_names_the_problem(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, model, messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}})
    assert "objekt" in caught.value.message
    assert ask(client, model, messages=ASK, max_tokens=2).choices[0].message.content is not None  # still serving


def test_a_tool_choice_naming_an_unknown_function_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, model, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert caught.value.body["param"] == "tool_choice" and "nope" in caught.value.message
