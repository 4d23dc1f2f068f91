"""Tool calling on /v1/chat/completions: OpenAI's ``tools`` shown to the model, its answer read back as ``tool_calls``.

A chat template that knows tools (its source mentions ``tools``) gets them as transformers passes them. Any other
template, SmolLM2's included, gets the Hermes-style format that Qwen and NousResearch use, as a block appended to the
first system message (``prompt_block``): a call is one line
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; earlier calls and their results are rendered in the
same words (``generic_messages``).

``tool_choice`` "auto" leaves the model free, and an answer that is nothing but well-formed calls of known functions
becomes ``tool_calls``. "required" and a named function make the call certain: a Lark grammar (``call_grammar``)
whose JSON schema allows only the functions' names with arguments valid against their parameters. Streamed, the text
is held back while it may still become calls (``CallStream``), so a stream says what the whole answer says."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import Field

from openai_api.errors import InvalidRequest
from openai_api.structured import NAME_PATTERN, Guide, Strict
from openai_api.triton_backend import Piece
from python_backend.guided.strict_schema import strict_schema

MAX_TOOLS = 128  # OpenAI's limit
OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")
# The JSON style of the engine's json_schema guides (python_backend/guided/grammars.py JSON_OPTIONS), which a Lark
# grammar's %json does not get unless its schema asks for it: ", " and ": ", no free whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CHOICE_SHAPE = '"none", "auto", "required" or {"type": "function", "function": {"name": <function name>}}'


class FunctionDefinition(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # accepted; a forced call's grammar enforces the parameters strictly in any case

    def signature(self) -> dict:
        shown = {"name": self.name, "description": self.description, "parameters": self.schema()}
        return {k: v for k, v in shown.items() if v is not None}

    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCall(Strict):
    """An earlier call, in an assistant message of the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


def check_tool_choice(value):
    """tool_choice's shape (whether the named function exists is checked with the tools)."""
    if value is None or value in TOOL_CHOICES:
        return value
    if (isinstance(value, dict) and set(value) == {"type", "function"} and value["type"] == "function"
            and isinstance(value["function"], dict) and set(value["function"]) == {"name"}
            and isinstance(value["function"]["name"], str)):
        return value
    raise ValueError(f"tool_choice must be {TOOL_CHOICE_SHAPE}")


@dataclass(frozen=True)
class ToolUse:
    """What one request asks: the functions shown to the model, whether a call is forced, and how many calls."""

    functions: list[FunctionDefinition]
    forced: bool  # "required" or a named function: only calls of `functions` can be generated
    parallel: bool

    @classmethod
    def of(cls, tools: list[Tool] | None, tool_choice, parallel: bool | None) -> ToolUse | None:
        """None when no tool is shown ("none", or no tools)."""
        if not tools or tool_choice == "none":
            return None
        functions = [tool.function for tool in tools]
        if isinstance(tool_choice, dict):
            functions = [f for f in functions if f.name == tool_choice["function"]["name"]]
        return cls(functions, forced=tool_choice not in (None, "auto"), parallel=parallel is not False)

    def guide(self) -> Guide | None:
        return Guide("lark", call_grammar(self.functions, self.parallel)) if self.forced else None

    def answer(self, piece: Piece) -> Piece:
        """A whole answer: its calls if it is complete and nothing but calls; cut short by max_tokens inside its
        calls, the calls as far as they got with finish_reason "length" (as OpenAI returns them: never the template's
        <tool_call> text as content); else the piece as it is."""
        names = {f.name for f in self.functions}
        if piece.finish_reason == "stop":
            calls, finish_reason = parse_calls(piece.text, names), "tool_calls"
        elif piece.finish_reason == "length":
            calls, finish_reason = cut_calls(piece.text, names, self.forced), "length"
        else:
            calls = None
        if not calls:
            return piece
        return replace(piece, tool_calls=calls if self.parallel else calls[:1], finish_reason=finish_reason)


def check_tools(tools: list[Tool] | None, tool_choice) -> None:
    names = [tool.function.name for tool in tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(f"Invalid value for 'tools': two functions are named {name!r}",
                                 param=f"tools[{i}].function.name")
    if tool_choice is not None and not tools:
        raise InvalidRequest("tool_choice is only allowed when tools are specified", param="tool_choice")
    if isinstance(tool_choice, dict) and tool_choice["function"]["name"] not in names:
        raise InvalidRequest(f"tool_choice names the function {tool_choice['function']['name']!r}, which is not "
                             f"among the tools", param="tool_choice")


# --- the prompt ---

def prompt_block(functions: list[FunctionDefinition], parallel: bool) -> str:
    signatures = "\n".join(json.dumps(f.signature(), ensure_ascii=False) for f in functions)
    how_many = "for each call" if parallel else "for one call at most"
    return ("# Tools\n\n"
            "You may call functions to answer. They are listed within <tools></tools>, one JSON object per line:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "To call a function, answer with nothing but\n"
            f'{OPEN}{{"name": "<function name>", "arguments": {{<arguments>}}}}{CLOSE}\n'
            f"{how_many}. Otherwise answer as usual.")


def generic_messages(messages: list[dict], use: ToolUse | None) -> list[dict]:
    """Messages for a chat template that knows nothing of tools: the tools block in the first system message,
    earlier calls as their <tool_call> lines, tool results as user turns."""
    out = [_generic(message) for message in messages]
    if use is not None:
        block = prompt_block(use.functions, use.parallel)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _generic(message: dict) -> dict:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if "tool_calls" in message:
        lines = [call_line(call["function"]["name"], call["function"]["arguments"]) for call in message["tool_calls"]]
        return {"role": "assistant", "content": "\n".join(([message["content"]] if message["content"] else []) + lines)}
    return message


def call_line(name: str, arguments: str) -> str:
    """One call as the model writes it; the arguments' JSON text as it was returned."""
    return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}{CLOSE}'


def native_messages(messages: list[dict]) -> list[dict]:
    """Messages for a chat template that knows tools, as transformers documents them: call arguments as objects."""
    out = []
    for message in messages:
        if "tool_calls" in message:
            calls = [{"type": "function", "function": {"name": c["function"]["name"],
                                                       "arguments": _object_or_text(c["function"]["arguments"])}}
                     for c in message["tool_calls"]]
            message = {**message, "content": message["content"] or "", "tool_calls": calls}
        out.append(message)
    return out


def _object_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# --- the grammar of a forced call ---

def call_grammar(functions: list[FunctionDefinition], parallel: bool) -> str:
    """llguidance's Lark: a call (or several) of one of the functions, its arguments valid against the function's
    parameters, read strictly (python_backend/guided/strict_schema.py). Nothing between calls: after a call SmolLM2
    prefers a newline to the end, and after a newline it goes on with the same call again, up to max_tokens; without
    the newline it ends."""
    # Each function's parameters get a base of their own, so that their "#/$defs/..." references resolve in them.
    calls = [{"type": "object",
              "properties": {"name": {"const": f.name},
                             "arguments": {"$id": f"urn:tool:{f.name}", **strict_schema(f.schema())}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {"x-guidance": JSON_STYLE, "anyOf": calls}
    start = "start: call+" if parallel else "start: call"
    return f'{start}\ncall: "{OPEN}" %json {json.dumps(schema, ensure_ascii=False)} "{CLOSE}"\n'


# --- reading the answer ---

def parse_calls(text: str, names: set[str]) -> list[dict] | None:
    """OpenAI's tool_calls of an answer that is nothing but <tool_call>{"name", "arguments"}</tool_call> blocks
    (whitespace around them allowed), each of a known function with an object of arguments; else None."""
    decoder = json.JSONDecoder()
    calls = []
    at = _skip_space(text, 0)
    while at < len(text):
        if not text.startswith(OPEN, at):
            return None
        try:
            call, at = decoder.raw_decode(text, _skip_space(text, at + len(OPEN)))
        except ValueError:
            return None
        at = _skip_space(text, at)
        if not (text.startswith(CLOSE, at) and isinstance(call, dict) and isinstance(call.get("name"), str)
                and call["name"] in names and isinstance(call.get("arguments"), dict)):
            return None
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
        at = _skip_space(text, at + len(CLOSE))
    return calls or None


def cut_calls(text: str, names: set[str], forced: bool) -> list[dict] | None:
    """OpenAI's tool_calls of an answer that max_tokens cut inside its calls: the whole calls before the cut, then
    the cut call with as much of its name and arguments' text as was generated (not valid JSON). None when the
    answer is not calls: it does not start with (a part of) <tool_call>, or, unless a call was forced (the grammar
    then allowed nothing else), it names a function that does not exist."""
    text = text.lstrip()
    if not (text.startswith(OPEN) or (text and OPEN.startswith(text))):
        return None
    blocks = [block.strip() for block in text.split(OPEN)[1:]] or [""]
    whole = [parse_calls(f"{OPEN}{block}", names) for block in blocks[:-1]]
    if not all(whole):
        return None
    name, arguments = _cut_call(blocks[-1])
    if not forced and not any(known.startswith(name) for known in names):
        return None
    cut = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
           "function": {"name": name, "arguments": arguments}}
    return [call for calls in whole for call in calls] + [cut]


CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?:(?P<named>")\s*,\s*"arguments"\s*:\s*)?')


def _cut_call(block: str) -> tuple[str, str]:
    """(name, arguments' text) of the JSON of a call cut short, `{"name": "f", "arguments": {"city": "Os`."""
    head = CUT_CALL.match(block)
    if head is None:
        return "", ""
    if not head.group("named"):
        return head.group("name"), ""
    try:  # the name as JSON wrote it; one the model wrote with an escape JSON does not know stays as it was written
        name = json.loads(f'"{head.group("name")}"')
    except ValueError:
        name = head.group("name")
    rest = block[head.end():]
    try:  # the arguments were whole: the cut fell in the call's closing `}` or `</tool_call>`
        arguments, _ = json.JSONDecoder().raw_decode(rest)
        return name, json.dumps(arguments, ensure_ascii=False)
    except ValueError:
        return name, rest


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def may_become_calls(text: str) -> bool:
    """Whether an answer that starts with this text may still be calls: it is (leading whitespace aside) the start
    of <tool_call>, or starts with it."""
    text = text.lstrip()
    return OPEN.startswith(text) or text.startswith(OPEN)


class CallStream:
    """One choice's answer, piece by piece (a whole answer is one piece): the text held back while it may become
    calls (all of it when a call is forced), then released as one piece, with its calls or as text after all."""

    def __init__(self, use: ToolUse):
        self._use = use
        self._held: list[Piece] = []
        self._text = ""
        self._passing = False

    def feed(self, piece: Piece) -> Piece | None:
        """The piece to send now, or None while it is held back."""
        if self._passing:
            return piece
        self._held.append(piece)
        self._text += piece.text
        if piece.finish_reason is None and (self._use.forced or may_become_calls(self._text)):
            return None
        self._passing = True
        whole, self._held = Piece.join(self._held), []
        return self._use.answer(whole)
