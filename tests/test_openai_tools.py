"""Structured outputs and tool calling on the OpenAI-compatible front, without a server: response_format and tools
as requests and as the guide the ensemble gets, the prompt the model sees, the Lark grammar of a forced call (compiled
and run by llguidance on the model's tokenizer), reading calls back from the text, and the stream that holds text
back until it knows whether it is calls."""

from __future__ import annotations

import asyncio
import json
import re

import llguidance
import pytest

from openai_api.app import Service, ServiceConfig
from openai_api.errors import InvalidRequest
from openai_api.generation import Choice, complete, first_pieces, stream_events
from openai_api.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from openai_api.responses import ChatFormat
from openai_api.structured import Guide
from openai_api.tools import (
    JSON_STYLE,
    CallStream,
    FunctionDefinition,
    ToolUse,
    call_grammar,
    cut_calls,
    generic_messages,
    may_become_calls,
    parse_calls,
    prompt_block,
)
from openai_api.triton_backend import EnsembleRequest, Piece
from python_backend.guided.grammars import JSON_OPTIONS
from scripts.paths import MODEL_REPOSITORY

MODEL = "test-model"
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": USER, **fields}
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"model": MODEL, "prompt": "Hi", **fields}).encode())


def refused(parse, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(**fields)
    assert caught.value.status == 400
    return caught.value


def functions(*tools) -> list[FunctionDefinition]:
    return [FunctionDefinition.model_validate(tool["function"]) for tool in tools]


def tool(name: str, **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def piece(text: str, finish: str | None = None, **fields) -> Piece:
    return Piece(text, finish_reason=finish, output_tokens=1, **fields)


# --- response_format ---

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.mark.parametrize("parse", [chat, completion])
def test_response_format_becomes_the_guide(parse):
    assert parse().guide() is None and parse(response_format={"type": "text"}).guide() is None
    assert parse(response_format={"type": "json_object"}).guide() == Guide("json_schema", '{"type": "object"}')
    request = parse(response_format={"type": "json_schema", "json_schema": {
        "name": "answer-1", "schema": SCHEMA, "strict": True, "description": "é"}})
    assert request.guide().type == "json_schema" and json.loads(request.guide().text) == SCHEMA
    assert request.sampling()["guide"] == request.guide()


BAD_FORMATS = [
    ({"type": "json"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_object", "json_schema": {"name": "a", "schema": {}}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "x": 1}}, "response_format.json_schema.x"),
    ({"type": "text", "extra": 1}, "response_format.extra"),
]


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize(("value", "param"), BAD_FORMATS, ids=[p for _, p in BAD_FORMATS])
def test_a_bad_response_format_is_a_400_that_names_the_field(parse, value, param):
    assert refused(parse, response_format=value).param == param


def test_the_guide_is_sent_as_two_string_inputs_of_the_ensemble_only_when_set():
    config = (MODEL_REPOSITORY / "ensemble" / "config.pbtxt").read_text().split("output [")[0]
    declared = dict(re.findall(r'name: "(\w+)" data_type: TYPE_(\w+)', config))
    request = EnsembleRequest("Hi", 8, stream=False, temperature=0.0, guide=Guide("lark", 'start: "é"'))
    tensors = {t.name(): t for t in request.inputs()}
    for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
        assert tensors[name].datatype() == "BYTES" and declared[name] == "STRING" and tensors[name].shape() == [1, 1]
    plain = {t.name() for t in EnsembleRequest("Hi", 8, stream=False, temperature=0.0).inputs()}
    assert not {name for name in plain if name.startswith("guided")}


# --- tools, as requests ---

def test_tools_and_tool_choice_as_openai_defines_them():
    assert chat(tools=[WEATHER]).tool_use() == ToolUse(functions(WEATHER), forced=False, parallel=True)
    assert chat(tools=[WEATHER], tool_choice="none").tool_use() is None
    assert chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).tool_use() == ToolUse(
        functions(WEATHER, TIME), forced=True, parallel=False)
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tool_use() == ToolUse(functions(TIME), forced=True, parallel=True)
    assert named.guide().type == "lark" and chat(tools=[WEATHER]).guide() is None
    assert chat(tools=[WEATHER], tool_choice="auto", response_format={"type": "json_object"}).guide().type == (
        "json_schema")
    assert len(chat(tools=[tool(f"f{i}") for i in range(128)]).tools) == 128
    assert functions(TIME)[0].schema() == {"type": "object", "properties": {}}


BAD_TOOLS = [
    ({"tools": [tool(f"f{i}") for i in range(129)]}, "tools"),
    ({"tools": [tool("a"), tool("a")]}, "tools[1].function.name"),
    ({"tools": [tool("a b")]}, "tools[0].function.name"),
    ({"tools": [tool("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [tool("a", parameters=[])]}, "tools[0].function.parameters"),
    ({"tools": [tool("a", parameters="{}")]}, "tools[0].function.parameters"),
    ({"tools": [tool("a", strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [tool("a", other=1)]}, "tools[0].function.other"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_TOOLS)])
def test_bad_tools_are_400s_that_name_the_field(fields, param):
    assert refused(chat, **fields).param == param


def test_a_forced_call_and_a_response_format_cannot_both_shape_the_answer():
    error = refused(chat, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert "tool call" in error.message and "json_schema" in error.message
    assert chat(tools=[WEATHER], tool_choice="required", response_format={"type": "text"}).guide().type == "lark"


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}


def test_messages_with_calls_and_their_results_are_accepted_as_openai_shapes_them():
    request = chat(messages=[*USER, CALLED, ANSWERED], tools=[WEATHER])
    assert [m.template_message() for m in request.messages][1:] == [
        {"role": "assistant", "content": None, "tool_calls": CALLED["tool_calls"]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}]
    assert chat(messages=[{"role": "user", "content": "x", "name": "ann"}]).messages[0].name == "ann"
    parts = {**ANSWERED, "content": [{"type": "text", "text": "18 C"}]}
    assert chat(messages=[*USER, CALLED, parts]).messages[2].content == "18 C"


BAD_MESSAGES = [
    ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": "c"}, "messages[1].content"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": CALLED["tool_calls"]}, "messages[1].tool_calls"),
    ({"role": "assistant", "content": None}, "messages[1].content"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages[1].content"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, "messages[1].tool_calls[0].function"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
                                                                                       "arguments": {}}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "function", "content": "x", "name": "f"}, "messages[1].role"),
]


@pytest.mark.parametrize(("message", "param"), BAD_MESSAGES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_MESSAGES)])
def test_bad_message_shapes_are_400s_that_name_the_field(message, param):
    assert refused(chat, messages=[*USER, message]).param == param


# --- the prompt ---

def test_the_generic_tools_block_lists_one_signature_a_line_and_how_to_call():
    assert prompt_block(functions(WEATHER, TIME), parallel=True) == (
        "# Tools\n\n"
        "You may call functions to answer. They are listed within <tools></tools>, one JSON object per line:\n"
        "<tools>\n"
        '{"name": "get_weather", "description": "The weather in a city.", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
        '{"name": "get_time", "parameters": {"type": "object", "properties": {}}}\n'
        "</tools>\n\n"
        "To call a function, answer with nothing but\n"
        '<tool_call>{"name": "<function name>", "arguments": {<arguments>}}</tool_call>\n'
        "for each call. Otherwise answer as usual.")
    assert "for one call at most." in prompt_block(functions(WEATHER), parallel=False)


def test_the_block_joins_the_first_system_message_or_opens_one():
    use = ToolUse(functions(WEATHER), forced=False, parallel=True)
    block = prompt_block(use.functions, True)
    system = [{"role": "system", "content": "Be brief."}, *USER]
    assert generic_messages(system, use) == [{"role": "system", "content": f"Be brief.\n\n{block}"}, *USER]
    assert generic_messages(USER, use) == [{"role": "system", "content": block}, *USER]
    assert generic_messages(system, None) == system


def test_earlier_calls_become_their_lines_and_results_become_user_turns():
    messages = [m.template_message() for m in chat(messages=[*USER, CALLED, ANSWERED]).messages]
    assert generic_messages(messages, None)[1:] == [
        {"role": "assistant",
         "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'},
        {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}]
    said = {**CALLED, "content": "Let me look.", "tool_calls": CALLED["tool_calls"] * 2}
    messages = [m.template_message() for m in chat(messages=[*USER, said]).messages]
    line = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert generic_messages(messages, None)[1]["content"] == f"Let me look.\n{line}\n{line}"


@pytest.fixture(scope="module")
def service(model_dir):
    return Service(ServiceConfig(triton_url="127.0.0.1:9", model_dir=model_dir))


def rendered(service, **fields) -> str:
    request = chat(**fields)
    ids = service.render_chat([m.template_message() for m in request.messages], request.tool_use())
    return service.tokenizer.tokenizer.decode(ids)


def test_smollm2s_template_gets_the_generic_format(service):
    assert not service.template_knows_tools
    plain = rendered(service)
    assert rendered(service, tools=[WEATHER], tool_choice="none") == plain
    shown = rendered(service, tools=[WEATHER])
    assert shown.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in shown
    assert shown.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    turns = rendered(service, messages=[*USER, CALLED, ANSWERED])
    assert turns.endswith("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n")


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_a_template_that_knows_tools_gets_them_and_calls_with_object_arguments(model_dir):
    service = Service(ServiceConfig(triton_url="127.0.0.1:9", model_dir=model_dir))
    service.tokenizer.tokenizer.chat_template = TOOLS_TEMPLATE
    service.template_knows_tools = True
    text = rendered(service, messages=[*USER, CALLED, ANSWERED], tools=[WEATHER])
    assert text.startswith('<|im_start|>system\n{"type": "function", "function": {"name": "get_weather"')
    assert 'get_weather{"city": "Paris"}<|im_end|>\n<|im_start|>tool\n18 C, sunny<|im_end|>' in text
    assert "<|im_start|>system" not in rendered(service, tools=[WEATHER], tool_choice="none")


# --- the grammar of a forced call ---

@pytest.fixture(scope="module")
def ll_tokenizer(model_dir):
    return llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), eos_token=2)


def matches(ll_tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    return matcher.consume_tokens(ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_the_tools_json_style_is_the_engines():
    assert JSON_STYLE == JSON_OPTIONS


TRICKY = tool("quote_me", description='braces } { and "quotes", a newline\n, a %json {', parameters={
    "type": "object", "properties": {"s": {"type": "string", "description": '}"\\'}}, "required": ["s"]})
REFS = tool("refs", parameters={"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
                                "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                "required": ["x"], "additionalProperties": False}}})


def test_the_grammar_compiles_for_any_schema_text(ll_tokenizer):
    for parallel in (True, False):
        grammar = call_grammar(functions(WEATHER, TIME, TRICKY, REFS), parallel)
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        assert llguidance.LLMatcher.validate_grammar(compiled, ll_tokenizer) == ""


def test_the_grammar_allows_only_calls_of_the_functions_with_valid_arguments(ll_tokenizer):
    one = call_grammar(functions(WEATHER, TIME, TRICKY, REFS), parallel=False)
    weather = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert matches(ll_tokenizer, one, weather)
    assert matches(ll_tokenizer, one, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert matches(ll_tokenizer, one, '<tool_call>{"name": "refs", "arguments": {"p": {"x": 1}}}</tool_call>')
    assert matches(ll_tokenizer, one, '<tool_call>{"name": "quote_me", "arguments": {"s": "}\\""}}</tool_call>')
    for wrong in ['<tool_call>{"name": "get_wether", "arguments": {"city": "Paris"}}</tool_call>',
                  '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>',
                  '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
                  '<tool_call>{"name":"get_weather", "arguments": {"city": "Paris"}}</tool_call>',
                  '<tool_call>{"name": "refs", "arguments": {"p": {"y": 1}}}</tool_call>',
                  f"{weather}\n{weather}", f"Sure. {weather}"]:
        assert not matches(ll_tokenizer, one, wrong), wrong
    several = call_grammar(functions(WEATHER, TIME), parallel=True)
    assert matches(ll_tokenizer, several, weather + weather) and matches(ll_tokenizer, several, weather)
    assert not matches(ll_tokenizer, several, f"{weather}\n{weather}")
    assert not matches(ll_tokenizer, several, f"{weather}\n")


def test_a_calls_arguments_take_only_the_properties_its_schema_names(ll_tokenizer):
    """LangChain's schemas say nothing of additionalProperties: read strictly, a forced call cannot copy the schema's
    own keys into its arguments (seen before: `"unit": "celsius", "properties": {"type": ...` up to max_tokens)."""
    langchain = tool("get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"], "default": "celsius"}},
        "required": ["city"]})
    one = call_grammar(functions(langchain), parallel=False)
    assert matches(ll_tokenizer, one, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert not matches(ll_tokenizer, one, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
                                          '"properties": {}}}</tool_call>')


def test_a_bad_parameters_schema_fails_to_compile_naming_the_problem(ll_tokenizer):
    grammar = call_grammar(functions(tool("f", parameters={"type": "objekt"})), parallel=True)
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar), ll_tokenizer)
    assert "objekt" in error


# --- reading the answer ---

NAMES = {"get_weather", "get_time"}


def test_an_answer_of_nothing_but_known_calls_is_read_as_calls():
    text = ('\n <tool_call>{"name": "get_weather", "arguments": {"city":"Zürich", "note": "</tool_call>"}}'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>  ')
    calls = parse_calls(text, NAMES)
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Zürich", "note": "</tool_call>"}'},
        {"name": "get_time", "arguments": "{}"}]
    assert all(CALL_ID.match(c["id"]) and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("text", [
    "", "Hello", "Sure: <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and more',
    '<tool_call>{"name": "get_time", "arguments": {}}', '<tool_call>{"name": "get_time", "arguments": {}</tool_call>',
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',
    '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>', "<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>'])
def test_anything_else_stays_text(text):
    assert parse_calls(text, NAMES) is None


def test_only_a_complete_answer_becomes_calls_and_parallel_false_keeps_the_first():
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n' * 2
    use = ToolUse(functions(WEATHER, TIME), forced=False, parallel=True)
    answer = use.answer(piece(two, "stop"))
    assert answer.finish_reason == "tool_calls" and len(answer.tool_calls) == 2 and answer.text == two
    cut = use.answer(piece(two, "length"))
    assert cut.finish_reason == "length" and [c["function"]["name"] for c in cut.tool_calls] == ["get_time"] * 2
    assert len(ToolUse(use.functions, forced=False, parallel=False).answer(piece(two, "stop")).tool_calls) == 1
    assert use.answer(piece("Hi", "stop")) == piece("Hi", "stop")


@pytest.mark.parametrize(("text", "may"), [("", True), ("  \n", True), (" <tool", True), ("<tool_call>", True),
                                           ('<tool_call>{"x"', True), ("<tools>", False), ("Hi", False),
                                           ("a <tool_call>", False)])
def test_text_may_become_calls_only_while_it_is_or_starts_with_the_tag(text, may):
    assert may_become_calls(text) is may


# --- the stream ---

def fed(stream: CallStream, *pieces: Piece) -> list[Piece | None]:
    return [stream.feed(p) for p in pieces]


def test_auto_text_passes_as_soon_as_it_cannot_be_calls():
    stream = CallStream(ToolUse(functions(TIME), forced=False, parallel=True))
    out = fed(stream, piece(" <to"), piece("ols>"), piece(" x"), piece("y", "stop"))
    assert out[0] is None and out[1].text == " <tools>" and out[1].output_tokens == 2
    assert [p.text for p in out[2:]] == [" x", "y"] and out[3].tool_calls is None
    stream = CallStream(ToolUse(functions(TIME), forced=False, parallel=True))
    assert fed(stream, piece("Hi"), piece("<tool_call>"))[1].text == "<tool_call>"


def test_calls_are_held_to_the_end_then_sent_whole():
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    for forced in (False, True):
        stream = CallStream(ToolUse(functions(TIME), forced=forced, parallel=True))
        out = fed(stream, piece("<tool_call>", input_tokens=5), piece(call[11:30]), piece(call[30:], "stop"))
        assert out[:2] == [None, None]
        assert out[2].finish_reason == "tool_calls" and out[2].tool_calls[0]["function"]["name"] == "get_time"
        assert (out[2].input_tokens, out[2].output_tokens) == (5, 3)


def test_a_call_cut_short_comes_back_as_openai_returns_it_never_as_the_templates_text():
    for forced in (True, False):
        stream = CallStream(ToolUse(functions(TIME, WEATHER), forced=forced, parallel=True))
        out = fed(stream, piece("<tool_call>"), piece('{"name": "get_weather", "arguments": {"city": "Os', "length"))
        assert out[0] is None and out[1].finish_reason == "length" and out[1].output_tokens == 2
        assert [c["function"] for c in out[1].tool_calls] == [{"name": "get_weather", "arguments": '{"city": "Os'}]
    stream = CallStream(ToolUse(functions(TIME), forced=True, parallel=True))
    assert fed(stream, piece("Hello"), piece("!", "stop"))[1].text == "Hello!"


@pytest.mark.parametrize(("text", "forced", "calls"), [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Os', False, [("get_weather", '{"city": "Os')]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_', False,
     [("get_weather", '{"city": "Oslo"}')]),
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", "argu', False,
     [("get_time", "{}"), ("get_weather", "")]),
    ('<tool_call>{"name": "get_wea', False, [("get_wea", "")]),
    (" <tool_ca", True, [("", "")]),
    ('<tool_call>{"name": "unknown", "arguments": {"x', True, [("unknown", '{"x')]),
    ('<tool_call>{"name": "unknown", "arguments": {"x', False, None),
    # A name written with an escape JSON does not know (`\x`) is kept as written, not a 500.
    ('<tool_call>{"name": "get\\x", "arguments": {"x', True, [("get\\x", '{"x')]),
    ("Hello", False, None), ("Hello <tool_call>", True, None), ("", True, None),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "get_time"', False, None)])
def test_the_calls_of_a_cut_answer_are_what_was_generated(text, forced, calls):
    found = cut_calls(text, NAMES, forced)
    assert (None if found is None else [(c["function"]["name"], c["function"]["arguments"]) for c in found]) == calls


class StandIn:
    """An ensemble stream that plays its pieces."""

    def __init__(self, *pieces):
        self.pieces = list(pieces)
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = self.pieces.pop(0)
        self.finished = item.finish_reason is not None
        return item

    def cancel(self):
        self.finished = True


def answers(pieces: list[Piece], use: ToolUse) -> tuple[dict, list[dict]]:
    """(the whole answer, the stream's chunks) of the same pieces."""
    def choice():
        return Choice(0, 0, StandIn(*[Piece(**vars(p)) for p in pieces]), calls=CallStream(use))

    async def stream():
        choices = [choice()]
        firsts = await first_pieces(choices)
        return [e async for e in stream_events(choices, firsts, ChatFormat(MODEL, include_usage=True))]

    whole = asyncio.run(complete([choice()], ChatFormat(MODEL)))
    chunks = [json.loads(e[len(b"data: "):]) for e in asyncio.run(stream())[:-1]]
    return whole, chunks


def reassembled(chunks: list[dict]) -> dict:
    """A stream's message, as OpenAI's clients put it together."""
    message, calls, finish = {"content": None}, [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content") is not None:
                message["content"] = (message["content"] or "") + delta["content"]
            for call in delta.get("tool_calls", []):
                if call["index"] == len(calls):
                    calls.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
                else:
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    if calls:
        message["tool_calls"] = calls
    return {"message": message, "finish_reason": finish, "usage": chunks[-1]["usage"]}


def without_ids(calls: list[dict]) -> list[dict]:
    return [{**call, "id": None} for call in calls]


def test_a_streamed_call_reassembles_to_the_whole_answer_in_openais_chunks():
    use = ToolUse(functions(WEATHER, TIME), forced=False, parallel=True)
    pieces = [piece(" <tool", input_tokens=7), piece('_call>{"name": "get_time", "arguments": {}}</tool_call>\n'),
              piece('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'),
              piece("</tool_call>", "stop")]
    whole, chunks = answers(pieces, use)
    answer = whole["choices"][0]
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
    assert [c["function"] for c in answer["message"]["tool_calls"]] == [
        {"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    streamed = reassembled(chunks)
    assert streamed["finish_reason"] == "tool_calls" and streamed["message"]["content"] is None
    assert without_ids(streamed["message"]["tool_calls"]) == without_ids(answer["message"]["tool_calls"])
    assert streamed["usage"] == whole["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["tool_calls"][0]["function"] == {"name": "get_time",
                                                                                           "arguments": ""}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert set(deltas[2]["tool_calls"][0]) == {"index", "id", "type", "function"} and deltas[-1] == {}


def test_a_streamed_cut_call_reassembles_to_the_whole_answers_calls():
    use = ToolUse(functions(WEATHER, TIME), forced=True, parallel=True)
    pieces = [piece("<tool_call>", input_tokens=4), piece('{"name": "get_weather", "arguments": {"ci', "length")]
    whole, chunks = answers(pieces, use)
    answer, streamed = whole["choices"][0], reassembled(chunks)
    assert answer["finish_reason"] == streamed["finish_reason"] == "length"
    assert answer["message"]["content"] is None and streamed["message"]["content"] is None
    assert [c["function"] for c in answer["message"]["tool_calls"]] == [{"name": "get_weather", "arguments": '{"ci'}]
    assert without_ids(streamed["message"]["tool_calls"]) == without_ids(answer["message"]["tool_calls"])


@pytest.mark.parametrize("texts", [["Hello", " there", "!"], [" <to", "ols> are", " fun"], ["Hi <tool_call>", "{"]])
def test_a_streamed_text_reassembles_to_the_whole_answer(texts):
    use = ToolUse(functions(TIME), forced=False, parallel=True)
    pieces = [piece(t, input_tokens=3 if i == 0 else None) for i, t in enumerate(texts)]
    pieces[-1].finish_reason = "length"
    whole, chunks = answers(pieces, use)
    streamed = reassembled(chunks)
    assert streamed["message"] == {"content": "".join(texts)}
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "".join(texts)}
    assert streamed["finish_reason"] == "length" and streamed["usage"] == whole["usage"]
    assert [c["choices"][0]["delta"].get("role") for c in chunks if c["choices"]][0] == "assistant"


def test_held_logprobs_go_with_the_released_chunk():
    from openai_api.responses import ChatLogprobs

    class Texts:
        def text(self, i):
            return str(i)

        def bytes(self, i):
            return [48 + i]

    async def stream():
        choice = Choice(0, 0, StandIn(piece(" <to", token_ids=[1], token_logprobs=[-1.0]),
                                      piece("ols>", "stop", token_ids=[2], token_logprobs=[-2.0])),
                        ChatLogprobs(Texts()), CallStream(ToolUse(functions(TIME), forced=False, parallel=True)))
        firsts = await first_pieces([choice])
        return [json.loads(e[6:]) async for e in stream_events([choice], firsts, ChatFormat(MODEL)) if e[6:7] == b"{"]

    chunks = asyncio.run(stream())
    assert len(chunks) == 1
    assert [t["token"] for t in chunks[0]["choices"][0]["logprobs"]["content"]] == ["1", "2"]
