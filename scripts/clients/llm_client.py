"""Calling the model five ways: tritonclient HTTP and gRPC (unary, model `ensemble_unary`), gRPC streaming, and
Triton's /generate and /generate_stream (model `ensemble`).

A request is a dict of ensemble inputs, e.g. ``{"text_input": "Hi", "max_tokens": 32, "temperature": 0.7}``;
``text_input`` is the raw prompt unless ``"apply_chat_template": True``. Every client asks for ``num_output_tokens``."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np

MODEL = "ensemble"  # decoupled: gRPC streaming, /generate, /generate_stream
UNARY_MODEL = "ensemble_unary"  # the same model for HTTP /infer and gRPC ModelInfer
# Ensemble input name -> (Triton dtype, numpy dtype). Shapes: [1, 1], or [1, n] for lists (stop_words, input_ids).
INPUT_TYPES = {
    "text_input": ("BYTES", np.object_),
    "max_tokens": ("INT32", np.int32),
    "temperature": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "top_p": ("FP32", np.float32),
    "seed": ("UINT64", np.uint64),
    "repetition_penalty": ("FP32", np.float32),
    "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32),
    "logit_bias_ids": ("INT32", np.int32),
    "logit_bias_values": ("FP32", np.float32),
    "end_id": ("INT32", np.int32),
    "apply_chat_template": ("BOOL", np.bool_),
    "input_ids": ("INT32", np.int32),
    "stop_words": ("BYTES", np.object_),
    "stream": ("BOOL", np.bool_),
    "exclude_input_in_output": ("BOOL", np.bool_),
    "return_num_input_tokens": ("BOOL", np.bool_),
    "return_num_output_tokens": ("BOOL", np.bool_),
    "return_log_probs": ("BOOL", np.bool_),
    "num_top_log_probs": ("INT32", np.int32),
    "return_prompt_log_probs": ("BOOL", np.bool_),
    "cache_salt": ("BYTES", np.object_),
    "lora_name": ("BYTES", np.object_),
    "guided_decoding_guide_type": ("BYTES", np.object_),
    "guided_decoding_guide": ("BYTES", np.object_),
    "priority": ("INT32", np.int32),
}
PROTOCOLS = ("http", "grpc", "generate", "grpc-stream", "generate-stream")


@dataclass
class Completion:
    text: str
    output_tokens: int
    latency_s: float
    first_token_s: float | None = None  # streaming clients only: time to the first text delta
    deltas: list[str] | None = None  # streaming clients only


class RequestError(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


def triton_inputs(module, request: dict) -> list:
    """InferInputs for tritonclient.http or tritonclient.grpc (passed as `module`), asking for num_output_tokens."""
    inputs = []
    for name, value in with_token_counts(request).items():
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


def with_token_counts(request: dict) -> dict:
    return {"return_num_output_tokens": True, **request}


def _completion(result, started: float) -> Completion:
    text = result.as_numpy("text_output").reshape(-1)[0]
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    return Completion(text, int(result.as_numpy("num_output_tokens").reshape(-1)[0]), time.perf_counter() - started)


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
        outputs = [http.InferRequestedOutput("text_output"), http.InferRequestedOutput("num_output_tokens")]
        try:
            result = self._client().infer(UNARY_MODEL, triton_inputs(http, request), outputs=outputs)
        except InferenceServerException as error:
            raise RequestError(f"HTTP {error.status()}: {error.message()}") from None
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
        outputs = [grpc.InferRequestedOutput("text_output"), grpc.InferRequestedOutput("num_output_tokens")]
        try:
            result = self.client.infer(
                UNARY_MODEL, triton_inputs(grpc, request), outputs=outputs, client_timeout=self.timeout_s
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
        body = json.dumps(with_token_counts(request)).encode("utf-8")
        http_request = urllib.request.Request(self.endpoint, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(http_request, timeout=self.timeout_s) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise RequestError(f"HTTP {error.code}: {error.read().decode('utf-8', 'replace')}") from None
        return Completion(reply["text_output"], int(reply["num_output_tokens"]), time.perf_counter() - started)


def _streamed(deltas, started: float) -> Completion:
    """Collects (text, token_count) deltas into a Completion with its time to first token."""
    texts, tokens, first = [], 0, None
    for text, count in deltas:
        if first is None and text:
            first = time.perf_counter() - started
        texts.append(text)
        tokens += count
    return Completion("".join(texts), tokens, time.perf_counter() - started, first, texts)


class GrpcStreamClient:
    """gRPC bidirectional streaming (start_stream / async_stream_infer) with stream=true: text arrives in deltas.
    One stream per request, as Locust and genai-perf do."""

    def __init__(self, url: str = "127.0.0.1:8001", timeout_s: float = 600):
        self.url, self.timeout_s = url, timeout_s

    def stream(self, request: dict, on_open=None):
        """Yields (text, token_count) per response. on_open(client) gets the client, e.g. to cancel the stream."""
        import tritonclient.grpc as grpc

        client = grpc.InferenceServerClient(self.url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)),
                            stream_timeout=self.timeout_s)
        try:
            if on_open:
                on_open(client)
            client.async_stream_infer(MODEL, triton_inputs(grpc, {**request, "stream": True}),
                                      enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=self.timeout_s)
                if error is not None:
                    raise RequestError(error.message() if hasattr(error, "message") else str(error))
                response = result.get_response()
                if result.as_numpy("text_output") is not None:
                    text = result.as_numpy("text_output").reshape(-1)[0]
                    yield (text.decode("utf-8") if isinstance(text, bytes) else str(text),
                           int(result.as_numpy("num_output_tokens").reshape(-1)[0]))
                if response.parameters.get("triton_final_response").bool_param:
                    return
        finally:
            client.stop_stream()
            client.close()

    def complete(self, request: dict) -> Completion:
        return _streamed(self.stream(request), time.perf_counter())


class GenerateStreamClient:
    """POST /v2/models/ensemble/generate_stream (server-sent events) with stream=true."""

    def __init__(self, url: str = "127.0.0.1:8000", timeout_s: float = 600):
        self.endpoint = f"http://{url}/v2/models/{MODEL}/generate_stream"
        self.timeout_s = timeout_s

    def stream(self, request: dict):
        body = json.dumps({**with_token_counts(request), "stream": True}).encode("utf-8")
        http_request = urllib.request.Request(self.endpoint, body, {"Content-Type": "application/json"})
        try:
            response = urllib.request.urlopen(http_request, timeout=self.timeout_s)
        except urllib.error.HTTPError as error:
            raise RequestError(f"HTTP {error.code}: {error.read().decode('utf-8', 'replace')}") from None
        with response:
            for line in response:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RequestError(event["error"])
                yield event["text_output"], int(event["num_output_tokens"])

    def complete(self, request: dict) -> Completion:
        return _streamed(self.stream(request), time.perf_counter())


def make_client(protocol: str, http_url: str, grpc_url: str):
    clients = {
        "http": lambda: HttpClient(http_url),
        "grpc": lambda: GrpcClient(grpc_url),
        "generate": lambda: GenerateClient(http_url),
        "grpc-stream": lambda: GrpcStreamClient(grpc_url),
        "generate-stream": lambda: GenerateStreamClient(http_url),
    }
    if protocol not in clients:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    return clients[protocol]()
