"""Guided decoding on a real server, through every protocol (HTTP /infer, gRPC, /generate, gRPC streaming and
/generate_stream): the held set of JSON schemas all validate; a regular expression and a GBNF grammar are matched;
a guided request leaves a concurrent neighbour's greedy text identical to its text alone; each bad guide is refused
with 400 / INVALID_ARGUMENT naming its problem, before the engine makes any token for it, and the neighbours still
get their answers."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from scripts.bench.structured_schemas import SCHEMAS, schema_prompt
from scripts.clients.llm_client import PROTOCOLS, RequestError, make_client
from tests.helpers import wait_idle

pytestmark = pytest.mark.server
PHONE = r"\+33 [1-9]( [0-9]{2}){4}"


def guided(prompt: str, guide_type: str, guide: str, max_tokens: int = 160) -> dict:
    return {"text_input": prompt, "max_tokens": max_tokens, "apply_chat_template": True,
            "guided_decoding_guide_type": guide_type, "guided_decoding_guide": guide}


def client(server, protocol="generate"):
    return make_client(protocol, f"127.0.0.1:{server.http}", f"127.0.0.1:{server.grpc}")


def test_every_schema_of_the_held_set_validates_through_generate(server):
    generate = client(server)
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        answers = list(pool.map(lambda case: generate.complete(
            guided(schema_prompt(case), "json_schema", json.dumps(case.schema))), SCHEMAS))
    valid = 0
    for case, answer in zip(SCHEMAS, answers):
        if answer.output_tokens < 160:  # ended by the grammar, not by max_tokens
            jsonschema.validate(json.loads(answer.text), case.schema)
            valid += 1
    assert valid >= len(SCHEMAS) - 2, f"only {valid} of {len(SCHEMAS)} ended by the grammar"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_regex_is_matched_through_every_protocol(server, protocol):
    answer = client(server, protocol).complete(guided("What is the phone number of the Louvre?", "regex", PHONE))
    assert re.fullmatch(PHONE, answer.text), answer.text


def test_a_gbnf_grammar_and_any_json_are_matched(server):
    generate = client(server, "grpc-stream")
    answer = generate.complete(guided("Is Paris in France?", "ebnf_grammar", 'root ::= ("yes" | "no") "."'))
    assert answer.text in ("yes.", "no.")
    answer = generate.complete(guided("Give me JSON about Paris.", "json", ""))
    json.loads(answer.text)


def test_a_guided_request_leaves_a_concurrent_neighbours_text_identical(server):
    generate = client(server)
    neighbour = {"text_input": "Name a primary color.", "max_tokens": 48, "apply_chat_template": True}
    alone = generate.complete(neighbour).text
    with ThreadPoolExecutor(4) as pool:
        together = [pool.submit(generate.complete, guided(schema_prompt(case), "json_schema", json.dumps(case.schema)))
                    for case in SCHEMAS[:3]] + [pool.submit(generate.complete, neighbour)]
    assert together[-1].result().text == alone
    assert all(f.result().text for f in together[:3])


BAD_GUIDES = [
    ("json_schema", '{"type": "objekt"}', "Invalid type: objekt"),
    ("json_schema", '{"type": "array", "uniqueItems": true}', "Unimplemented keys"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "[a-z", "unclosed character class"),
    ("ebnf_grammar", "", "guided_decoding_guide is empty"),
    ("lark", "start: nowhere", "nowhere"),
    ("json_schema", json.dumps({"enum": ["x" * 100] * 700}), "more than the limit of 65536"),
    ("xml", "<a/>", "guided_decoding_guide_type must be one of"),
]


@pytest.mark.parametrize("protocol", ["generate", "grpc"])
def test_each_bad_guide_is_refused_before_any_token_naming_its_problem_and_neighbours_are_served(server, protocol):
    """Each bad guide is refused with 400 / INVALID_ARGUMENT naming its problem while a neighbour runs, and the
    engine made no token for it: its count of generated tokens grew by exactly the neighbours' tokens."""
    bad_client, generate = client(server, protocol), client(server)
    neighbour = {"text_input": "Name a primary color.", "max_tokens": 16, "apply_chat_template": True}
    before = wait_idle(server)["llm_output_tokens_total"]  # the server is shared: counts are compared, not read
    alone = generate.complete(neighbour)
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(generate.complete, neighbour)
        for guide_type, guide, message in BAD_GUIDES:
            with pytest.raises(RequestError, match=re.escape(message)) as refused:
                bad_client.complete(guided("Hello", guide_type, guide))
            if protocol == "generate":
                assert str(refused.value).startswith("HTTP 400")
        together = running.result()
    assert together.text == alone.text
    # idle: nothing refused was left running or waiting, and every token made is counted
    made = wait_idle(server)["llm_output_tokens_total"] - before
    assert made == alone.output_tokens + together.output_tokens, "the engine made tokens for a refused request"
