"""The libraries people point at an OpenAI server, unchanged, against the shared service: LangChain's ChatOpenAI,
instructor's modes for OpenAI, LiteLLM's `openai/` models. They live in a venv of their own (`make clients`,
requirements-clients.txt: instructor pins an older `openai` than the project's), so each library's cases run there as
a script (tests/clients/) that prints what came back; the assertions are here. Where SmolLM2-135M's judgement
decides (prose or a call under "auto", which keys a free JSON object gets), only what the server guarantees is
asserted: a valid object, a complete call of a known function with valid arguments, the same text streamed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from scripts.paths import PROJECT_ROOT

pytestmark = pytest.mark.server

CLIENTS_PYTHON = PROJECT_ROOT / ".venv-clients" / "bin" / "python"
CASES = Path(__file__).parent / "clients"
CALL_TIMEOUT_S = 900  # bounds a hung server only


def run_cases(library: str, service: int, model: str) -> dict:
    if not CLIENTS_PYTHON.exists():
        pytest.skip("the client libraries' venv is missing: make clients")
    done = subprocess.run([str(CLIENTS_PYTHON), str(CASES / f"{library}_cases.py"), f"http://127.0.0.1:{service}/v1",
                           model], capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def city_answer(parsed) -> bool:
    return isinstance(parsed, dict) and set(parsed) == {"city", "country"} and all(
        isinstance(v, str) and v for v in parsed.values())


def weather_call(name: str, args: dict) -> bool:
    """A complete call of get_weather whose arguments the tool's schema allows, and nothing it does not name."""
    return (name == "get_weather" and isinstance(args, dict) and isinstance(args.get("city"), str)
            and set(args) <= {"city", "unit"} and args.get("unit", "celsius") in ("celsius", "fahrenheit"))


# --- LangChain ---

@pytest.fixture(scope="module")
def langchain(service, model):
    return run_cases("langchain", service, model)


def test_langchain_invoke_stream_and_batch_agree(langchain):
    assert langchain["invoke"] and langchain["stream"] == langchain["invoke"]
    assert len(langchain["batch"]) == 3 and langchain["batch"][0] == langchain["batch"][2] == langchain["invoke"]


def test_langchain_structured_output_by_json_schema_and_by_function_calling_parse(langchain):
    by_schema, by_call = langchain["structured_json_schema"], langchain["structured_function_calling"]
    assert city_answer(by_schema["parsed"]) and by_schema["error"] is None and by_schema["finish_reason"] == "stop"
    assert city_answer(by_call["parsed"]) and by_call["error"] is None
    assert by_call["finish_reason"] == "tool_calls" and [c["name"] for c in by_call["calls"]] == ["CityAnswer"]


def test_langchain_json_mode_gets_a_json_object(langchain):
    """json_mode names no keys to the server (response_format json_object): the object is guaranteed, its keys are
    the model's."""
    json_mode = langchain["structured_json_mode"]
    assert json_mode["finish_reason"] == "stop" and isinstance(json.loads(json_mode["content"]), dict)


@pytest.mark.parametrize("choice", ["any", "get_weather"])
def test_langchain_bind_tools_with_a_forced_choice_gets_one_complete_call(langchain, choice):
    """LangChain's schema says nothing of additionalProperties: read loosely, the model copied the schema's keys into
    the arguments up to max_tokens and the call came back as <tool_call> text (issue 32)."""
    answer = langchain[f"tool_choice_{choice}"]
    assert answer["finish_reason"] == "tool_calls" and answer["invalid"] == [] and answer["content"] == ""
    assert len(answer["calls"]) == 1 and weather_call(answer["calls"][0]["name"], answer["calls"][0]["args"])


def test_langchain_tool_results_sent_back_get_a_final_answer(langchain):
    trip = langchain["round_trip"]
    assert len(trip["calls"]) == 1 and weather_call(trip["calls"][0]["name"], trip["calls"][0]["args"])
    assert trip["results"] == [f"18 degrees {trip['calls'][0]['args'].get('unit', 'celsius')}, sunny in "
                               f"{trip['calls'][0]['args']['city']}"]
    if trip["finish_reason"] == "tool_calls":  # "auto": calling again is the model's choice
        assert all(weather_call(c["name"], c["args"]) for c in trip["final_calls"])
    else:
        assert trip["final"] and "<tool_call>" not in trip["final"] and trip["final_calls"] == []


# --- instructor ---

@pytest.fixture(scope="module")
def instructor(service, model):
    return run_cases("instructor", service, model)


@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT", "JSON_SCHEMA", "JSON_O1", "FUNCTIONS"])
def test_instructor_modes_the_server_constrains_parse(instructor, mode):
    answer = instructor[mode]
    assert "error" not in answer, answer.get("error")
    assert len(answer["parsed"]) == 1 and city_answer(answer["parsed"][0])


def test_instructor_json_mode_gets_a_json_object_or_its_start(instructor):
    """JSON mode sends response_format json_object and the schema in words: the object is guaranteed, its keys (and
    whether they end within max_tokens) are the model's."""
    completion = instructor["JSON"]["completion"]
    assert "status" not in instructor["JSON"] and completion["content"].startswith("{")
    if completion["finish_reason"] == "stop":
        assert isinstance(json.loads(completion["content"]), dict)


@pytest.mark.parametrize("mode", ["PARALLEL_TOOLS", "MD_JSON"])
def test_instructor_modes_that_leave_the_model_free_are_served(instructor, mode):
    """PARALLEL_TOOLS sends tool_choice "auto" and MD_JSON asks for a fenced block in words: the server answers; a
    call, if the model makes one, is complete."""
    answer = instructor[mode]
    assert "status" not in answer and answer["completion"]["finish_reason"] in ("stop", "length", "tool_calls")
    for call in answer["completion"]["tool_calls"]:
        assert city_answer(json.loads(call["function"]["arguments"]))


def test_instructor_responses_mode_gets_a_404_naming_the_route(instructor):
    answer = instructor["RESPONSES_TOOLS"]
    assert answer["status"] == 404 and answer["body"]["message"].startswith("Invalid URL (POST /v1/responses)")


# --- LiteLLM ---

@pytest.fixture(scope="module")
def litellm(service, model):
    return run_cases("litellm", service, model)


def test_litellm_completion_and_stream_agree(litellm):
    whole, stream = litellm["completion"], litellm["stream"]
    assert whole["content"] and stream["content"] == whole["content"]
    assert whole["finish_reason"] == "stop" and stream["finish_reasons"] == ["stop"]
    assert stream["usage"] == [whole["usage"]]


def test_litellm_tools_get_a_complete_call(litellm):
    answer = litellm["tools"]
    assert answer["finish_reason"] == "tool_calls" and answer["content"] is None and len(answer["calls"]) == 1
    assert weather_call(answer["calls"][0]["name"], json.loads(answer["calls"][0]["arguments"]))
