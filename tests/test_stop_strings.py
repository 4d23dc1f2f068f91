"""Stop strings against a real tritonserver: matched on the generated text, whatever the token boundaries, on every
protocol, streamed or not; a match stops the llm model's generation."""

from __future__ import annotations

import functools

import pytest

from scripts.clients.llm_client import GenerateClient, GenerateStreamClient, GrpcClient, GrpcStreamClient
from tests.helpers import NO_EOS, assert_ready, at_once, wait_idle

pytestmark = pytest.mark.server

PROMPT = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # greedy


def ask(**extra) -> dict:
    return {"apply_chat_template": True, "text_input": PROMPT, "max_tokens": 16, **extra}


def every_protocol(server, request: dict) -> dict:
    """The request's answer on each protocol, the four sent at once."""
    http, grpc = f"127.0.0.1:{server.http}", f"127.0.0.1:{server.grpc}"
    clients = {"generate": GenerateClient(http), "grpc": GrpcClient(grpc), "grpc-stream": GrpcStreamClient(grpc),
               "generate-stream": GenerateStreamClient(http)}
    return dict(zip(clients, at_once(*(functools.partial(c.complete, request) for c in clients.values()))))


@pytest.fixture(scope="module")
def unstopped(server):
    completion = GenerateClient(f"127.0.0.1:{server.http}").complete(ask())
    assert completion.text == ANSWER
    return completion


@pytest.mark.parametrize("stop, expected", [
    ("France is", "The capital of "),  # a phrase of two tokens, " France" and " is"
    ("aris", "The capital of France is P"),  # begins inside the token " Paris"
])
def test_the_answer_ends_before_the_stop_string_on_every_protocol(server, tokenizer, unstopped, stop, expected):
    answers = every_protocol(server, ask(stop_words=[stop]))
    tokens_to_the_match = len(tokenizer.encode_plain(ANSWER[:ANSWER.index(stop) + len(stop)]))
    for protocol, answer in answers.items():
        assert answer.text == expected, protocol
        assert answer.output_tokens == tokens_to_the_match < unstopped.output_tokens, protocol
    for protocol in ("grpc-stream", "generate-stream"):
        deltas = answers[protocol].deltas
        assert len(deltas) > 1 and not any(stop in delta for delta in deltas), (protocol, deltas)
    assert_ready(server)


@pytest.mark.parametrize("stop", ["Berlin", "What is"], ids=["never generated", "only in the prompt"])
def test_a_stop_string_that_is_not_generated_changes_nothing(server, unstopped, stop):
    for protocol, answer in every_protocol(server, ask(stop_words=["", stop])).items():
        assert answer.text == ANSWER and answer.output_tokens == unstopped.output_tokens, protocol
    assert_ready(server)


def test_the_first_of_several_stop_strings_in_the_text_ends_the_answer(server):
    answer = GrpcStreamClient(f"127.0.0.1:{server.grpc}").complete(ask(stop_words=["Paris", "of Fr", "zzz"]))
    assert answer.text == "The capital "


def test_a_match_stops_the_llm_models_generation(server):
    generated_before = wait_idle(server)["llm_output_tokens_total"]
    answer = GrpcStreamClient(f"127.0.0.1:{server.grpc}").complete(
        ask(max_tokens=400, end_id=NO_EOS, stop_words=["Paris"]))
    assert answer.text == "The capital of France is "
    generated = wait_idle(server)["llm_output_tokens_total"] - generated_before
    assert generated < 100, f"{generated} tokens generated: the llm model went on after the match"
    assert_ready(server)
