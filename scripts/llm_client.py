"""Calling the `ensemble` model three ways: tritonclient HTTP, tritonclient gRPC, and Triton's /generate.

A request is a dict of ensemble inputs, e.g. ``{"text_input": "Hi", "max_tokens": 32, "temperature": 0.7}``."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np

MODEL = "ensemble"
# Ensemble input name -> (Triton dtype, numpy dtype). Shapes are [1, 1] except stop_words, [1, n].
INPUT_TYPES = {
    "text_input": ("BYTES", np.object_),
    "max_tokens": ("INT32", np.int32),
    "temperature": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "top_p": ("FP32", np.float32),
    "seed": ("UINT64", np.uint64),
    "repetition_penalty": ("FP32", np.float32),
    "end_id": ("INT32", np.int32),
    "apply_chat_template": ("BOOL", np.bool_),
    "stop_words": ("BYTES", np.object_),
}
PROTOCOLS = ("http", "grpc", "generate")


@dataclass
class Completion:
    text: str
    output_tokens: int
    latency_s: float


class RequestError(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


def triton_inputs(module, request: dict) -> list:
    """InferInputs for tritonclient.http or tritonclient.grpc (passed as `module`)."""
    inputs = []
    for name, value in request.items():
        if name not in INPUT_TYPES:
            raise ValueError(f"unknown input {name!r}; expected one of {sorted(INPUT_TYPES)}")
        triton_type, numpy_type = INPUT_TYPES[name]
        values = value if isinstance(value, list) else [value]
        if triton_type == "BYTES":
            values = [str(v).encode("utf-8") for v in values]
        array = np.array([values], dtype=numpy_type)
        tensor = module.InferInput(name, list(array.shape), triton_type)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _completion(result, started: float) -> Completion:
    text = result.as_numpy("text_output").reshape(-1)[0]
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    return Completion(text, int(result.as_numpy("output_token_count").reshape(-1)[0]), time.perf_counter() - started)


class HttpClient:
    """tritonclient.http; one connection per thread (the HTTP client is not thread-safe)."""

    def __init__(self, url: str = "127.0.0.1:8000", timeout_s: float = 600):
        self.url, self.timeout_s = url, timeout_s
        self._local = threading.local()

    def _client(self):
        import tritonclient.http as http

        if not hasattr(self._local, "client"):
            self._local.client = http.InferenceServerClient(
                self.url, connection_timeout=self.timeout_s, network_timeout=self.timeout_s
            )
        return self._local.client

    def complete(self, request: dict) -> Completion:
        import tritonclient.http as http
        from tritonclient.utils import InferenceServerException

        started = time.perf_counter()
        outputs = [http.InferRequestedOutput("text_output"), http.InferRequestedOutput("output_token_count")]
        try:
            result = self._client().infer(MODEL, triton_inputs(http, request), outputs=outputs)
        except InferenceServerException as error:
            raise RequestError(error.message()) from None
        return _completion(result, started)


class GrpcClient:
    def __init__(self, url: str = "127.0.0.1:8001", timeout_s: float = 600):
        import tritonclient.grpc as grpc

        self.client = grpc.InferenceServerClient(url)
        self.timeout_s = timeout_s

    def complete(self, request: dict) -> Completion:
        import tritonclient.grpc as grpc
        from tritonclient.utils import InferenceServerException

        started = time.perf_counter()
        outputs = [grpc.InferRequestedOutput("text_output"), grpc.InferRequestedOutput("output_token_count")]
        try:
            result = self.client.infer(
                MODEL, triton_inputs(grpc, request), outputs=outputs, client_timeout=self.timeout_s
            )
        except InferenceServerException as error:
            raise RequestError(error.message()) from None
        return _completion(result, started)


class GenerateClient:
    """POST /v2/models/ensemble/generate with a JSON body of the same inputs."""

    def __init__(self, url: str = "127.0.0.1:8000", timeout_s: float = 600):
        self.endpoint = f"http://{url}/v2/models/{MODEL}/generate"
        self.timeout_s = timeout_s

    def complete(self, request: dict) -> Completion:
        started = time.perf_counter()
        body = json.dumps(request).encode("utf-8")
        http_request = urllib.request.Request(self.endpoint, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(http_request, timeout=self.timeout_s) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise RequestError(f"HTTP {error.code}: {error.read().decode('utf-8', 'replace')}") from None
        return Completion(reply["text_output"], int(reply["output_token_count"]), time.perf_counter() - started)


def make_client(protocol: str, http_url: str, grpc_url: str):
    if protocol == "http":
        return HttpClient(http_url)
    if protocol == "grpc":
        return GrpcClient(grpc_url)
    if protocol == "generate":
        return GenerateClient(http_url)
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
