"""The OpenAI-compatible front without a server: request validation (what is refused, and what at the edge of each
range is still accepted), the tensors a request becomes, token bytes for logprobs, the response and chunk builders,
and the stream's event order with stand-in ensemble streams. Error paths that never reach Triton go through the real
app (FastAPI's TestClient) with nothing listening at its Triton address."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient

from openai_api.app import ServiceConfig, create_app
from openai_api.errors import APIError, InvalidRequest
from openai_api.generation import Choice, complete, first_pieces, stream_events
from openai_api.protocol import (MAX_CHOICES, UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETIONS, ChatCompletionRequest,
                                 CompletionRequest, parse_request)
from openai_api.responses import ChatFormat, ChatLogprobs, CompletionFormat, CompletionLogprobs, Usage
from openai_api.token_text import TokenTexts, byte_decoder
from openai_api.triton_backend import EnsembleRequest, Piece
from scripts.launcher.processes import Ports
from scripts.paths import MODEL_REPOSITORY

MODEL = "test-model"
VOCAB = 49152


def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"model": MODEL, "prompt": "Hi", **fields}).encode(), VOCAB)


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_request(ChatCompletionRequest, json.dumps(body).encode(), VOCAB)


def refused(parse, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(**fields)
    return caught.value


# --- validation ---

@pytest.mark.parametrize("parse", [completion, chat])
@pytest.mark.parametrize("field", ["foo", "max_token", "temprature"])
def test_an_unknown_field_is_refused_by_name(parse, field):
    error = refused(parse, **{field: 1})
    assert error.param == field and field in error.message and error.status == 400


@pytest.mark.parametrize("field", UNSUPPORTED_COMPLETIONS)
def test_unsupported_completions_fields_are_refused_by_name(field):
    error = refused(completion, **{field: "x"})
    assert error.param == field and "not supported" in error.message
    completion(**{field: None})  # an explicit null is "not given"


@pytest.mark.parametrize("field", UNSUPPORTED_CHAT)
def test_unsupported_chat_fields_are_refused_by_name(field):
    error = refused(chat, **{field: [{"type": "function"}]})
    assert error.param == field and "not supported" in error.message
    chat(**{field: None})


OUT_OF_RANGE = [
    ("temperature", 5), ("temperature", -0.1), ("top_p", 1.5), ("top_p", -0.1), ("n", 0), ("n", MAX_CHOICES + 1),
    ("max_tokens", 0), ("seed", -1), ("seed", 2**64), ("presence_penalty", 2.5), ("frequency_penalty", -2.1),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", ""), ("stop", ["ok", ""]), ("logit_bias", {"12": 101}),
    ("logit_bias", {"12": -100.5}), ("logit_bias", {"abc": 1}), ("logit_bias", {str(VOCAB): 1}),
    ("logit_bias", {"-1": 1}), ("max_tokens", "5"), ("temperature", "0.5"), ("stream", "yes"), ("n", 1.5),
    ("temperature", float("nan")), ("user", 5), ("stream_options", {"include_usage": True, "x": 1}),
]


@pytest.mark.parametrize("parse", [completion, chat])
@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE, ids=[f"{f}={v!r}" for f, v in OUT_OF_RANGE])
def test_values_out_of_range_or_of_the_wrong_type_are_refused(parse, field, value):
    error = refused(parse, **{field: value, **({"stream": True} if field == "stream_options" else {})})
    assert error.param.startswith(field), error.message


AT_THE_EDGE = [
    ("temperature", 0), ("temperature", 2), ("top_p", 0), ("top_p", 1), ("n", 1), ("n", MAX_CHOICES),
    ("max_tokens", 1), ("seed", 0), ("seed", 2**63 - 1), ("presence_penalty", -2), ("frequency_penalty", 2),
    ("stop", ["a", "b", "c", "d"]), ("stop", "a"), ("logit_bias", {"0": -100, str(VOCAB - 1): 100}),
    ("temperature", 1), ("user", "someone"), ("stream", False),
]


@pytest.mark.parametrize("parse", [completion, chat])
@pytest.mark.parametrize(("field", "value"), AT_THE_EDGE, ids=[f"{f}={v!r}" for f, v in AT_THE_EDGE])
def test_values_at_the_edge_of_each_range_are_accepted(parse, field, value):
    assert getattr(parse(**{field: value}), field) is not None


def test_completion_only_rules():
    assert refused(completion, logprobs=6).param == "logprobs"
    assert refused(completion, logprobs=-1).param == "logprobs"
    assert completion(logprobs=5).logprobs == 5 and completion(logprobs=0).logprobs == 0
    assert completion(echo=True, logprobs=0).scores_prompt and not completion(echo=True).scores_prompt
    assert completion(echo=True).echo and not completion(logprobs=1).scores_prompt
    assert completion(echo=True, max_tokens=0).scores_prompt and completion(max_tokens=0, echo=True).max_tokens == 0
    assert refused(completion, max_tokens=0).param == "max_tokens"  # nothing to generate and nothing echoed
    assert refused(completion, max_tokens=-1).param == "max_tokens"
    assert refused(completion, best_of=3).param == "best_of"
    assert completion(best_of=3, n=3).n == 3 and completion(best_of=1).best_of == 1
    assert refused(completion, prompt="").param == "prompt"
    assert refused(completion, prompt=[]).param == "prompt"
    assert refused(completion, prompt=["a"] * 3, n=MAX_CHOICES // 2).param == "n"
    assert completion(prompt=["a", "b"], n=MAX_CHOICES // 2).prompt == ["a", "b"]
    assert completion(prompt="one").prompt == ["one"]
    assert refused(completion, stream_options={"include_usage": True}).param == "stream_options"
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True, stream_options={"include_usage": False}).include_usage


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("Hi", ["Hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [VOCAB - 1]], [[1, 2], [VOCAB - 1]]),
    ([0], [[0]])])
def test_a_prompt_in_every_form_openai_takes_is_a_list_of_prompts(prompt, prompts):
    assert completion(prompt=prompt).prompt == prompts


@pytest.mark.parametrize(("prompt", "message"), [
    ([1, VOCAB], f"prompt 0 holds token id {VOCAB}, which is not in this model's vocabulary (0..{VOCAB - 1})"),
    ([[5], [-1]], "prompt 1 holds token id -1"), ([[1], []], "prompt 1 is empty"), ([[]], "a prompt must not be empty"),
    ([[1, 2], "a"], "all text or all token ids, not both"), (["a", ""], "prompt 1 is empty"),
    ([1.5], None), ([True], None), ([[1, "2"]], None)])
def test_bad_token_id_prompts_are_400s_that_name_the_prompt(prompt, message):
    error = refused(completion, prompt=prompt)
    assert error.param.startswith("prompt") and (message is None or message in error.message), error.message


def test_chat_only_rules():
    assert refused(chat, top_logprobs=2).param == "top_logprobs"
    assert refused(chat, top_logprobs=2, logprobs=False).param == "top_logprobs"
    assert refused(chat, logprobs=True, top_logprobs=21).param == "top_logprobs"
    assert chat(logprobs=True, top_logprobs=20).top_logprobs == 20
    assert refused(chat, logprobs=3).param == "logprobs"  # chat's logprobs is a bool
    assert refused(chat, messages=[]).param == "messages"
    assert refused(chat, messages=[{"role": "function", "content": "x"}]).param == "messages[0].role"
    assert refused(chat, messages=[{"role": "tool", "content": "x"}]).param == "messages[0].tool_call_id"
    assert chat(messages=[{"role": "user", "content": "x", "name": "bob"}]).messages[0].name == "bob"
    assert refused(chat, messages=[{"role": "assistant", "content": None}]).param == "messages[0].content"
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    error = refused(chat, messages=[{"role": "user", "content": "a"}, {"role": "user", "content": image}])
    assert error.param == "messages[1].content" and "image_url" in error.message
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens == 7
    assert chat().requested_max_tokens is None


def test_chat_content_parts_and_roles_as_the_template_takes_them():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = chat(messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}])
    assert [m.template_message() for m in request.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]


def test_sampling_defaults_are_openais_and_temperature_0_is_greedy():
    assert completion().sampling()["temperature"] == 1.0
    assert completion().completion_max_tokens == 16
    assert completion(max_tokens=3).completion_max_tokens == 3
    assert completion(temperature=0).sampling()["temperature"] == 0.0
    assert completion(temperature=0.7, top_p=0).sampling()["temperature"] == 0.0  # only the most likely token
    assert completion(top_p=1).sampling()["top_p"] is None and completion(top_p=0.9).sampling()["top_p"] == 0.9
    sampled = completion(stop="x", presence_penalty=0.5, frequency_penalty=-1, logit_bias={"7": 5}).sampling()
    assert sampled["stop"] == ["x"] and sampled["presence_penalty"] == 0.5 and sampled["frequency_penalty"] == -1
    assert sampled["logit_bias"] == {7: 5.0}
    assert [completion(seed=10).seed_of(i) for i in range(3)] == [10, 11, 12]
    assert completion().seed_of(2) is None


# --- what the ensemble is sent ---

def ensemble_config_inputs() -> dict[str, str]:
    text = (MODEL_REPOSITORY / "ensemble" / "config.pbtxt").read_text()
    return dict(re.findall(r'name: "(\w+)" data_type: TYPE_(\w+)', text.split("output [")[0]))


def test_every_tensor_a_request_can_send_is_an_input_of_the_ensemble_with_its_type():
    request = EnsembleRequest("Hi", 8, stream=True, temperature=0.5, top_p=0.9, seed=3, stop=["a", "bc"],
                              presence_penalty=0.5, frequency_penalty=0.5, logit_bias={5: 1.0, 6: -2.0}, echo=True,
                              log_probs=True, top_log_probs=3)
    declared = ensemble_config_inputs()
    sent = {tensor.name(): tensor.datatype() for tensor in request.inputs()}
    types = {"BYTES": "STRING", "INT32": "INT32", "UINT64": "UINT64", "FP32": "FP32", "BOOL": "BOOL"}
    assert {name: types[t] for name, t in sent.items()} == {name: declared.get(name) for name in sent}
    shapes = {tensor.name(): tensor.shape() for tensor in request.inputs()}
    assert shapes["stop_words"] == [1, 2] and shapes["logit_bias_ids"] == [1, 2] and shapes["text_input"] == [1, 1]


def test_a_plain_request_sends_only_what_it_needs():
    sent = {t.name() for t in EnsembleRequest("Hi", 8, stream=False, temperature=1.0).inputs()}
    assert sent == {"text_input", "max_tokens", "stream", "temperature", "apply_chat_template",
                    "return_num_input_tokens", "return_num_output_tokens"}


# --- token bytes ---

def test_the_byte_level_alphabet_maps_256_characters_to_256_bytes():
    decoder = byte_decoder()
    assert sorted(decoder.values()) == list(range(256)) and len(decoder) == 256
    assert decoder["A"] == ord("A") and decoder["Ġ"] == ord(" ") and decoder["Ċ"] == ord("\n")


def test_token_bytes_add_up_to_the_text_and_match_each_decodable_token(tokenizer):
    hf = tokenizer.tokenizer
    texts = TokenTexts(hf)
    text = "Hello, 世界! 🙂 naïve\ttabs\n  code: x = 1"
    ids = hf.encode(text, add_special_tokens=False)
    assert b"".join(bytes(texts.bytes(i)) for i in ids) == text.encode("utf-8")
    assert any("\ufffd" in texts.text(i) for i in ids), "some tokens hold part of a character"
    for token_id in range(0, len(hf), 97):
        decoded = hf.decode([token_id])
        if "\ufffd" not in decoded:
            assert bytes(texts.bytes(token_id)).decode("utf-8") == decoded, token_id
    assert bytes(texts.bytes(2)) == b"<|im_end|>" and texts.text(2) == "<|im_end|>"


class AddedTokensOnly:
    """A tokenizer whose vocabulary is two entries: an added token and the byte-level spelling of the same text."""

    def __init__(self):
        from tokenizers import AddedToken

        self.added_tokens_decoder = {0: AddedToken("café", special=True)}
        self.vocab = {0: "café", 1: "cafÃ©"}

    def convert_ids_to_tokens(self, token_id):
        return self.vocab[token_id]


def test_an_added_token_is_its_text_in_utf8_and_a_vocabulary_entry_its_byte_level_spelling():
    texts = TokenTexts(AddedTokensOnly())
    assert bytes(texts.bytes(0)) == "café".encode("utf-8")
    assert bytes(texts.bytes(1)) == "café".encode("utf-8")


# --- response builders ---

def piece(text="", finish=None, ids=None, logprobs=None, top_ids=None, top=None, inputs=5, outputs=None) -> Piece:
    return Piece(text=text, finish_reason=finish, input_tokens=inputs,
                 output_tokens=len(ids) if outputs is None and ids else (outputs or 0),
                 token_ids=ids, token_logprobs=logprobs, top_ids=top_ids, top_logprobs=top)


def test_completion_logprobs_hold_the_chosen_token_among_the_top_ones_and_offsets_run_on(tokenizer):
    texts = TokenTexts(tokenizer.tokenizer)
    ids = tokenizer.encode_plain(" Paris is")
    formatter = CompletionLogprobs(texts)
    first = formatter.format(piece(ids=ids[:1], logprobs=[-0.5], top_ids=[[ids[1], ids[0]]], top=[[-0.1, -0.5]]))
    second = formatter.format(piece(ids=ids[1:], logprobs=[-1.5], top_ids=[[ids[0]]], top=[[-0.2]]))
    assert first["tokens"] == [" Paris"] and first["token_logprobs"] == [-0.5] and first["text_offset"] == [0]
    assert first["top_logprobs"] == [{" is": -0.1, " Paris": -0.5}]
    assert second["text_offset"] == [len(" Paris")]
    assert second["top_logprobs"] == [{" Paris": -0.2, " is": -1.5}], "the chosen token joins the top ones"
    no_top = CompletionLogprobs(texts).format(piece(ids=ids, logprobs=[-0.5, -1.5]))
    assert no_top["top_logprobs"] == [{" Paris": -0.5}, {" is": -1.5}]


def test_chat_logprobs_carry_token_bytes_and_top_entries(tokenizer):
    texts = TokenTexts(tokenizer.tokenizer)
    [paris] = tokenizer.encode_plain(" Paris")
    formatted = ChatLogprobs(texts).format(piece(ids=[paris], logprobs=[-0.25], top_ids=[[paris]], top=[[-0.25]]))
    entry = {"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris")}
    assert formatted == {"content": [{**entry, "top_logprobs": [entry]}]}
    assert ChatLogprobs(texts).format(piece(ids=[paris], logprobs=[-0.25]))["content"][0]["top_logprobs"] == []


def test_an_impossible_token_gets_openais_floor_and_not_infinity(tokenizer):
    texts = TokenTexts(tokenizer.tokenizer)
    impossible = piece(ids=[5], logprobs=[float("-inf")], top_ids=[[6, 5]], top=[[-0.1, float("-inf")]])
    formatted = CompletionLogprobs(texts).format(impossible)
    assert formatted["token_logprobs"] == [-9999.0] and list(formatted["top_logprobs"][0].values()) == [-0.1, -9999.0]
    entry = ChatLogprobs(texts).format(impossible)["content"][0]
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"][1]["logprob"] == -9999.0
    json.dumps(formatted, allow_nan=False)


def test_usage_counts_each_prompt_once_and_every_output_token():
    usage = Usage()
    usage.add(0, piece(inputs=5, outputs=3))
    usage.add(0, piece(inputs=5, outputs=2))  # a second choice of the same prompt
    usage.add(1, piece(inputs=7, outputs=1))
    assert usage.as_dict() == {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}


def test_bodies_and_chunks_have_openais_shape():
    fmt = CompletionFormat(MODEL)
    body = fmt.body([fmt.choice(0, piece("hi", "stop"), None)], Usage())
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}]
    assert "usage" not in fmt.chunk(fmt.chunk_choice(0, piece("a"), None, True))
    with_usage = CompletionFormat(MODEL, include_usage=True)
    assert with_usage.chunk(with_usage.chunk_choice(0, piece("a"), None, True))["usage"] is None
    assert with_usage.usage_chunk(Usage())["choices"] == []

    fmt = ChatFormat(MODEL)
    assert fmt.id.startswith("chatcmpl-") and fmt.object == "chat.completion"
    assert fmt.choice(1, piece("hi", "length"), None) == {
        "index": 1, "message": {"role": "assistant", "content": "hi"}, "logprobs": None, "finish_reason": "length"}
    assert fmt.chunk_choice(0, piece("a"), None, first=True)["delta"] == {"role": "assistant", "content": "a"}
    assert fmt.chunk_choice(0, piece("b"), None, first=False)["delta"] == {"content": "b"}
    assert fmt.chunk_choice(0, piece("", "stop"), None, first=False) == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert fmt.chunk(fmt.chunk_choice(0, piece("a"), None, True))["object"] == "chat.completion.chunk"


def test_pieces_join_into_the_whole_answer():
    whole = Piece.join([piece("a", ids=[1], logprobs=[-1.0]), piece("b", "stop", ids=[2], logprobs=[-2.0])])
    assert (whole.text, whole.finish_reason, whole.output_tokens) == ("ab", "stop", 2)
    assert whole.token_ids == [1, 2] and whole.token_logprobs == [-1.0, -2.0] and whole.top_ids is None


# --- running choices, with stand-in ensemble streams ---

class StandIn:
    """Plays an ensemble stream: its pieces (an exception is raised in turn), then the end."""

    def __init__(self, *pieces, wait_s: float = 0.0):
        self.pieces = list(pieces)
        self.wait_s = wait_s
        self.finished = False
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        await asyncio.sleep(self.wait_s)
        item = self.pieces.pop(0)
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finish_reason is not None
        return item

    def cancel(self):
        if not self.finished:
            self.finished = self.cancelled = True


def events(choices, fmt) -> list:
    async def run():
        firsts = await first_pieces(choices)
        return [event async for event in stream_events(choices, firsts, fmt)]

    raw = asyncio.run(run())
    assert raw[-1] == b"data: [DONE]\n\n"
    return [json.loads(event[len(b"data: "):]) for event in raw[:-1]]


def test_a_stream_sends_each_choices_pieces_finish_last_then_usage_then_done():
    choices = [Choice(0, 0, StandIn(piece("a"), piece(""), piece("b", "stop", outputs=2))),
               Choice(1, 0, StandIn(piece("c"), piece("d", "length", outputs=2), wait_s=0.01))]
    chunks = events(choices, ChatFormat(MODEL, include_usage=True))
    by_choice = {i: [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i] for i in (0, 1)}
    assert [c["delta"] for c in by_choice[0]] == [{"role": "assistant", "content": "a"}, {"content": "b"}]
    assert [c["finish_reason"] for c in by_choice[0]] == [None, "stop"]
    assert [c["delta"] for c in by_choice[1]] == [{"role": "assistant", "content": "c"}, {"content": "d"}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert all(c["usage"] is None for c in chunks[:-1])


def test_an_error_after_the_first_response_is_an_error_event_and_cancels_the_other_choices():
    other = StandIn(piece("x"), *[piece("y")] * 50, piece("z", "stop"), wait_s=0.01)
    choices = [Choice(0, 0, StandIn(piece("a"), InvalidRequest("bad stop word"))), Choice(1, 0, other)]
    chunks = events(choices, CompletionFormat(MODEL))
    assert chunks[-1] == {"error": {"message": "bad stop word", "type": "invalid_request_error", "param": None,
                                    "code": None}}
    assert other.cancelled


def test_a_first_response_error_cancels_every_choice_before_anything_is_sent():
    slow = StandIn(piece("a"), piece("b", "stop"), wait_s=0.2)
    choices = [Choice(0, 0, StandIn(InvalidRequest("no"))), Choice(1, 0, slow)]
    with pytest.raises(InvalidRequest):
        asyncio.run(first_pieces(choices))
    assert slow.cancelled


def test_a_stream_closed_by_the_server_cancels_its_choices():
    running = StandIn(piece("a"), *[piece("b")] * 100, piece("c", "stop"), wait_s=0.01)
    choices = [Choice(0, 0, running)]

    async def run():
        firsts = await first_pieces(choices)
        stream = stream_events(choices, firsts, CompletionFormat(MODEL))
        await anext(stream)
        await anext(stream)
        await stream.aclose()  # what Starlette does when the client goes away

    asyncio.run(run())
    assert running.cancelled


def test_whole_answers_join_each_choices_pieces_in_choice_order():
    choices = [Choice(0, 0, StandIn(piece("a"), piece("b", "stop"), wait_s=0.02)),
               Choice(1, 0, StandIn(piece("c", "length")))]
    body = asyncio.run(complete(choices, CompletionFormat(MODEL)))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "ab", "stop"),
                                                                                      (1, "c", "length")]


# --- the app, with nothing listening at its Triton address ---

@pytest.fixture(scope="module")
def app_client(model_dir):
    app = create_app(ServiceConfig(triton_url=f"127.0.0.1:{Ports.free().grpc}", model_dir=model_dir,
                                   served_model_name=MODEL))
    with TestClient(app) as client:
        yield client


def assert_openai_error(response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize("body", [b"{bad json", b"", b"\xff\xfe", b"[1, 2]", b'"text"'])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_a_400(app_client, path, body):
    error = assert_openai_error(app_client.post(path, content=body), 400)
    assert error["type"] == "invalid_request_error"


def test_a_body_over_a_mebibyte_is_a_413(app_client):
    body = json.dumps({"model": MODEL, "prompt": "x" * (1 << 20)}).encode()
    assert_openai_error(app_client.post("/v1/completions", content=body), 413)


def test_invalid_requests_are_400s_that_name_the_field(app_client):
    response = app_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "temperature": 5})
    assert "temperature" in assert_openai_error(response, 400, "temperature")["message"]
    response = app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": [], "tools": [{}]})
    assert_openai_error(response, 400, "messages")
    response = app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                             "content": "Hi"}], "tools": [{}]})
    assert_openai_error(response, 400, "tools[0].type")
    response = app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user"}]})
    assert_openai_error(response, 400, "messages[0].content")


def test_an_unknown_model_is_a_404(app_client):
    response = app_client.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi"})
    assert assert_openai_error(response, 404, "model")["code"] == "model_not_found"
    assert_openai_error(app_client.get("/v1/models/gpt-4"), 404, "model")
    assert app_client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert [m["id"] for m in app_client.get("/v1/models").json()["data"]] == [MODEL]
    assert_openai_error(app_client.get("/v1/nothing"), 404)
    unserved = assert_openai_error(app_client.post("/v1/responses", json={"model": MODEL, "input": "Hi"}), 404)
    assert unserved["message"].startswith("Invalid URL (POST /v1/responses): this server serves /v1/chat/completions")


def test_triton_unreachable_is_a_503_with_retry_after_and_not_ready(app_client):
    response = app_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert_openai_error(response, 503)
    assert response.headers["Retry-After"].isdigit()
    ready = app_client.get("/health/ready")
    assert ready.status_code == 503 and "does not answer" in ready.json()["reason"]
    assert app_client.get("/health/live").status_code == 200


def test_a_model_triton_has_not_loaded_yet_is_a_503_and_a_failing_one_a_500():
    from openai_api.triton_backend import model_error

    loading = model_error("Request for unknown model: 'ensemble' has no available versions")  # a restarted server
    assert loading.status == 503 and loading.headers()["Retry-After"].isdigit()
    assert model_error("in ensemble 'ensemble', model 'llm' is not ready").status == 503
    assert model_error("onnxruntime: bad allocation").status == 500


def test_the_served_name_defaults_to_the_exported_models_name(model_dir, settings):
    with TestClient(create_app(ServiceConfig(triton_url="127.0.0.1:9", model_dir=model_dir))) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == settings["model_name"]


def test_api_errors_have_openais_shape():
    assert APIError("boom").body() == {"error": {"message": "boom", "type": "server_error", "param": None,
                                                 "code": None}}


# --- reading the ensemble's responses ---

def infer_result(outputs: dict[str, np.ndarray]):
    """A gRPC response as Triton sends it: every output's data in raw_output_contents."""
    from tritonclient.grpc import InferResult, service_pb2
    from tritonclient.utils import np_to_triton_dtype

    response = service_pb2.ModelInferResponse(model_name="ensemble")
    for name, value in outputs.items():
        response.outputs.add(name=name, datatype=np_to_triton_dtype(value.dtype), shape=value.shape)
        if value.dtype == np.object_:  # each element: its 4-byte little-endian length, then its bytes
            raw = b"".join(len(x).to_bytes(4, "little") + x for x in value.reshape(-1))
        else:
            raw = value.tobytes()
        response.raw_output_contents.append(raw)
    return InferResult(response)


def test_a_response_becomes_a_piece():
    outputs = {
        "text_output": np.array([["Paris, 世界 🙂".encode()]], np.object_),
        "finish_reason": np.array([[b"length"]], np.object_),
        "num_input_tokens": np.array([[5]], np.uint32),
        "num_output_tokens": np.array([[2]], np.uint32),
        "output_ids": np.array([[7, 8]], np.int32),
        "output_log_probs": np.array([[-0.5, -1.5]], np.float32),
        "top_log_probs": np.array([[[-0.5, -2.0, -3.0], [-1.5, -2.5, -3.5]]], np.float32),
        "top_log_prob_ids": np.array([[[7, 1, 2], [8, 3, 4]]], np.int32),
    }
    piece = Piece.from_result(infer_result(outputs))
    assert (piece.text, piece.finish_reason, piece.input_tokens, piece.output_tokens) == (
        "Paris, 世界 🙂", "length", 5, 2)
    assert piece.token_ids == [7, 8] and piece.token_logprobs == [-0.5, -1.5]
    assert piece.top_ids == [[7, 1, 2], [8, 3, 4]] and piece.top_logprobs == [[-0.5, -2.0, -3.0], [-1.5, -2.5, -3.5]]
    plain = Piece.from_result(infer_result({"text_output": np.array([[b""]], np.object_)}))
    assert (plain.text, plain.finish_reason, plain.input_tokens, plain.output_tokens, plain.token_ids) == (
        "", None, None, 0, None)
    empty = Piece.from_result(infer_result({**outputs, "output_ids": np.zeros((1, 0), np.int32),
                                            "output_log_probs": np.zeros((1, 0), np.float32),
                                            "top_log_probs": np.zeros((1, 0, 3), np.float32),
                                            "top_log_prob_ids": np.zeros((1, 0, 3), np.int32)}))
    assert empty.token_ids == [] and empty.top_ids == [] and empty.top_logprobs == []
