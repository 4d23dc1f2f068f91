"""Locust users for the Triton LLM server.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000                      # web UI, all users
    locust -f loadtests/locustfile.py StreamUser --headless -u 16 -r 16 -t 60s --host http://127.0.0.1:8000
    locust -f loadtests/locustfile.py GrpcStreamUser --grpc-url 127.0.0.1:8001 --headless -u 8 -t 30s
    locust -f loadtests/locustfile.py --master ...   /   --worker --master-host ...   (distributed, unchanged)

Users (each waits for its answer, then sends the next request: N users = N requests in flight):
- GenerateUser: POST /v2/models/ensemble/generate (one response); entry "generate".
- StreamUser: POST /v2/models/ensemble/generate_stream (SSE); entries "generate_stream" (whole request),
  "generate_stream TTFT" (time to the first text) and "generate_stream ITL" (each gap between two text events,
  divided by the tokens it carried).
- GrpcStreamUser: tritonclient gRPC streaming, same three entries named "grpc_stream ...".
The content size of the whole-request entries is the number of output tokens.
"""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

from grpc.experimental import gevent as grpc_gevent  # before any gRPC object: makes grpcio cooperate with gevent

grpc_gevent.init_gevent()

import gevent.queue  # noqa: E402
from locust import FastHttpUser, User, constant, events, task  # noqa: E402

from loadtests.workload import DEFAULT_PROMPTS, MaxTokens, Workload, load_prompts  # noqa: E402

MODEL = "ensemble"
FAILURE_BACKOFF_S = 0.2  # after a failed request, so that a down server is not hammered in a tight loop


@events.init_command_line_parser.add_listener
def _arguments(parser):
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL file with a text_input per line")
    parser.add_argument("--max-tokens", default="choice:16,32,64,128",
                        help="choice:16,32,64 | uniform:16:128 | fixed:64")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001", help="host:port of Triton's gRPC endpoint")
    parser.add_argument("--raw-prompts", action="store_true", help="send prompts without the chat template")
    parser.add_argument("--workload-seed", type=int, default=None)


_workloads: dict[tuple, Workload] = {}


def _workload_for(environment) -> Workload:
    """Built at first use, not at start-up: a distributed worker receives the master's options only when the
    master tells it to spawn users."""
    o = environment.parsed_options
    key = (o.prompts, o.max_tokens, o.workload_seed, o.raw_prompts)
    if key not in _workloads:
        _workloads[key] = Workload(load_prompts(o.prompts), MaxTokens.parse(o.max_tokens), o.workload_seed,
                                   apply_chat_template=not o.raw_prompts)
    return _workloads[key]


def _fire(environment, kind: str, name: str, seconds: float, length: int = 0, exception=None):
    environment.events.request.fire(request_type=kind, name=name, response_time=seconds * 1000,
                                    response_length=length, exception=exception, context={})


class _StreamTimer:
    """Records whole-request time, TTFT and per-token ITL of one streamed request."""

    def __init__(self, environment, kind: str, name: str):
        self.environment, self.kind, self.name = environment, kind, name
        self.started = self.last = time.perf_counter()
        self.tokens = 0
        self.first = True

    def on_delta(self, text: str, tokens: int) -> None:
        now = time.perf_counter()
        if text and self.first:
            _fire(self.environment, self.kind, f"{self.name} TTFT", now - self.started)
            self.first = False
        elif text and tokens:
            _fire(self.environment, self.kind, f"{self.name} ITL", (now - self.last) / tokens)
        if text:
            self.last = now
        self.tokens += tokens

    def done(self, exception=None) -> None:
        _fire(self.environment, self.kind, self.name, time.perf_counter() - self.started, self.tokens, exception)


class GenerateUser(FastHttpUser):
    wait_time = constant(0)

    @task
    def generate(self):
        request = _workload_for(self.environment).next_request()
        with self.client.post(f"/v2/models/{MODEL}/generate", json=request, name="generate",
                              catch_response=True) as response:
            try:
                reply = response.json()
            except Exception:  # noqa: BLE001 - Locust records the failure
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            if "text_output" not in reply:
                response.failure(reply.get("error", "no text_output"))


class StreamUser(User):
    """SSE over a plain (gevent-patched) http.client connection, kept alive between requests."""

    wait_time = constant(0)

    def on_start(self):
        url = urlsplit(self.host)
        self.connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=600)

    def on_stop(self):
        self.connection.close()

    @task
    def generate_stream(self):
        timer = _StreamTimer(self.environment, "SSE", "generate_stream")
        body = json.dumps({**_workload_for(self.environment).next_request(), "stream": True})
        try:
            self.connection.request("POST", f"/v2/models/{MODEL}/generate_stream", body,
                                    {"Content-Type": "application/json"})
            response = self.connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
            for line in response:
                if line.startswith(b"data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise RuntimeError(event["error"])
                    timer.on_delta(event["text_output"], int(event["output_token_count"]))
        except Exception as error:  # noqa: BLE001 - recorded as a failure
            self.connection.close()  # reconnects on the next request
            timer.done(error)
            gevent.sleep(FAILURE_BACKOFF_S)
            return
        timer.done()


class GrpcStreamUser(User):
    wait_time = constant(0)

    def on_start(self):
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(self.environment.parsed_options.grpc_url)
        self.responses = gevent.queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def on_stop(self):
        self.client.stop_stream(cancel_requests=True)  # a request still in flight would block the stream's reader
        self.client.close()

    @task
    def grpc_stream(self):
        from scripts.llm_client import triton_inputs

        timer = _StreamTimer(self.environment, "gRPC", "grpc_stream")
        try:
            request = {**_workload_for(self.environment).next_request(), "stream": True}
            self.client.async_stream_infer(MODEL, triton_inputs(self.grpc, request), enable_empty_final_response=True)
            while True:
                result, error = self.responses.get(timeout=600)
                if error is not None:
                    raise RuntimeError(str(error))
                text = result.as_numpy("text_output")
                if text is not None:
                    value = text.reshape(-1)[0]
                    timer.on_delta(value.decode() if isinstance(value, bytes) else str(value),
                                   int(result.as_numpy("output_token_count").reshape(-1)[0]))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        except Exception as error:  # noqa: BLE001 - recorded as a failure
            timer.done(error)
            gevent.sleep(FAILURE_BACKOFF_S)
            return
        timer.done()
