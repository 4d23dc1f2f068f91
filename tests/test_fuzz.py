"""A seeded fuzz of bad requests over HTTP /generate, HTTP /infer and gRPC: every request the project parses gets a
clear client error (400 / INVALID_ARGUMENT with a message) or, when the mutation happens to be valid, an answer;
nothing gets an internal error from the project, nothing hangs, and the server stays ready.

Triton's own JSON parser answers some type errors on /generate with HTTP 500 before any model runs (a string for
an integer, say): those are Triton's, recognised by their messages below and listed in docs/api.md ("Errors")."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from scripts.clients.llm_client import GenerateClient

pytestmark = pytest.mark.server

BASE = {"text_input": "Hi", "max_tokens": 4, "apply_chat_template": True}  # a chat answer ends at EOS soon
TRITON_PARSER_ERRORS = ("Unable to parse", "failed to parse the request JSON", "attempt to get members for non-object")
REQUEST_TIMEOUT_S = 120

# (field, value) mutations typed as JSON could carry them; some are valid on purpose.
JSON_MUTATIONS = [
    ("text_input", v) for v in ["", " ", "\n\t", "x" * 70000, 5, None, ["a", "b"], "\udcff", "<|im_end|>", "长" * 30000]
] + [
    ("max_tokens", v) for v in [0, -1, 10**6, 2**31, "abc", 1.5, None, [1, 2], True, 2047]
] + [
    ("temperature", v) for v in [-1, -1e-9, 1e38, 1e-38, "x", None, 0.7]
] + [
    ("top_p", v) for v in [0, -0.5, 1.0000001, 2, 1e-30, 0.9]
] + [
    ("top_k", v) for v in [-1, 2**31, 10**9, 1, "a"]
] + [
    ("seed", v) for v in [-1, 2**64, 2**63, 0, "s"]
] + [
    ("repetition_penalty", v) for v in [0, -1, 1e-38, 1e38, 1.2]
] + [
    ("end_id", v) for v in [-5, -1, 10**6, 49152, 49151, 2]
] + [
    ("stop_words", v) for v in [["x"] * 17, ["a" * 257], 5, [1, 2], [""], ["é" * 129], ["Paris"]]
] + [
    ("apply_chat_template", v) for v in ["yes", 2, False, None]
] + [
    ("stream", v) for v in [True, "no"]
]


def mutated(rng: random.Random) -> dict:
    request = dict(BASE)
    for field, value in rng.sample(JSON_MUTATIONS, rng.choice([1, 1, 2])):
        if value is None:
            request.pop(field, None)
        else:
            request[field] = value
    return request


def post_generate(server, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http}/v2/models/ensemble/generate", body)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]


def test_fuzzed_generate_requests_get_clear_client_errors(server):
    rng, tally = random.Random(8), {}
    for _ in range(200):
        request = mutated(rng)
        status, message = post_generate(server, json.dumps(request).encode())
        tally[status] = tally.get(status, 0) + 1
        if status == 500:
            assert message.startswith(TRITON_PARSER_ERRORS), (request, message)
        else:
            assert status in (200, 400), (request, status, message)
            assert status == 200 or message.strip(), request
    for body in (b"not json", b"[]", b'{"text_input": "Hi"', b""):
        status, message = post_generate(server, body)
        assert status in (400, 500) and (status == 400 or message.startswith(TRITON_PARSER_ERRORS)), (body, message)
    print(f"/generate fuzz: {tally}")
    assert tally.get(400, 0) > 50, tally
    assert GenerateClient(f"127.0.0.1:{server.http}").complete(BASE).output_tokens > 0


TYPED = {  # values that fit the declared type, many of them bad
    "text_input": [b"", b" ", b"\xff\xfe", "长".encode() * 30000, b"x" * 70000, b"Hi"],
    "max_tokens": [0, -1, 10**6, 2**31 - 1, -(2**31), 3],
    "temperature": [-1.0, float("nan"), float("inf"), 1e-38, 0.5],
    "top_p": [0.0, float("nan"), 2.0, 1.0],
    "top_k": [-1, 2**31 - 1, 0],
    "seed": [0, 2**64 - 1],
    "repetition_penalty": [0.0, -1.0, float("inf"), float("nan"), 1e-38],
    "end_id": [-5, -1, 2**31 - 1, 49152, 2],
    "stop_words": [[b"x"] * 17, [b"a" * 257], [b"\xff"], [b""]],
}
DTYPES = {"text_input": (np.object_, "BYTES"), "max_tokens": (np.int32, "INT32"), "temperature": (np.float32, "FP32"),
          "top_p": (np.float32, "FP32"), "top_k": (np.int32, "INT32"), "seed": (np.uint64, "UINT64"),
          "repetition_penalty": (np.float32, "FP32"), "end_id": (np.int32, "INT32"),
          "stop_words": (np.object_, "BYTES")}


def typed_inputs(module, rng: random.Random, wrong_dtype: bool):
    request = {"text_input": b"Hi", "max_tokens": 4}
    for field in rng.sample(sorted(TYPED), rng.choice([1, 2])):
        request[field] = rng.choice(TYPED[field])
    inputs = []
    for name, value in request.items():
        dtype, triton_type = DTYPES[name]
        if wrong_dtype and name == "max_tokens":
            dtype, triton_type = np.float32, "FP32"
        array = np.array([value if isinstance(value, list) else [value]], dtype)
        tensor = module.InferInput(name, list(array.shape), triton_type)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return request, inputs


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_fuzzed_typed_infer_requests_get_invalid_argument(server, protocol):
    module = httpclient if protocol == "http" else grpcclient
    url = f"127.0.0.1:{server.http if protocol == 'http' else server.grpc}"
    client = (httpclient.InferenceServerClient(url, network_timeout=REQUEST_TIMEOUT_S) if protocol == "http"
              else grpcclient.InferenceServerClient(url))
    rng, refused = random.Random(9), 0
    for index in range(80):
        request, inputs = typed_inputs(module, rng, wrong_dtype=index % 10 == 0)
        try:
            kwargs = {} if protocol == "http" else {"client_timeout": REQUEST_TIMEOUT_S}
            client.infer("ensemble_unary", inputs, **kwargs)
        except InferenceServerException as error:
            refused += 1
            expected = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
            assert error.status() == expected and error.message(), (request, error.status(), error.message())
    assert refused > 30
    assert GenerateClient(f"127.0.0.1:{server.http}").complete(BASE).output_tokens > 0
