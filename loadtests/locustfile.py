"""Locust users for the Triton LLM server and its OpenAI-compatible service.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000                      # web UI, all users
    locust -f loadtests/locustfile.py StreamUser --headless -u 16 -r 16 -t 60s --host http://127.0.0.1:8000
    locust -f loadtests/locustfile.py GrpcStreamUser --headless -u 8 -t 30s --host http://127.0.0.1:8000
    locust -f loadtests/locustfile.py ChatStreamUser --headless -u 8 -t 30s --openai-url http://127.0.0.1:9000
    locust -f loadtests/locustfile.py --master ...   /   --worker --master-host ...   (distributed, unchanged)

Users (each waits for its answer, then sends the next request: N users = N requests in flight):
- GenerateUser: POST /v2/models/ensemble/generate (one response); entry "generate".
- StreamUser: POST /v2/models/ensemble/generate_stream (SSE); entries "generate_stream" (whole request),
  "generate_stream TTFT" (time to the first text) and "generate_stream ITL" (each gap between two text events,
  divided by the tokens it carried).
- GrpcStreamUser: tritonclient gRPC streaming, same three entries named "grpc_stream ...".
- ChatStreamUser: POST /v1/chat/completions of the OpenAI-compatible service, streamed with a usage chunk at the end;
  entries "chat_stream", "chat_stream TTFT" (time to the first content delta) and "chat_stream ITL". The chat API
  does not say how many tokens a chunk carries: a content chunk counts as 1 unless it reports usage
  (endpoints.chat_deltas), so an ITL entry is a gap between two content chunks. The prompt is the user message:
  the service applies the chat template, and --raw-prompts does not apply. Greedy, as the Triton users are.
The content size of the whole-request entries is the number of output tokens (the chat user's: the usage chunk's
completion_tokens).

Where requests go: --host is Triton's HTTP endpoint. --grpc-url defaults to the host of --host with its port + 1
(Triton's convention, 8000 -> 8001: its HTTP endpoint does not report the gRPC port); --openai-url to
http://<host of --host>:9000; --model to the first id of the service's GET /v1/models, asked once. When the test
starts, each selected user checks its endpoint (gRPC: the ensemble is ready; chat: GET /v1/models answers); when one
is not there, Locust ends the run with the reason and exit code 2 before any request (the web UI stays up and only
stops the test). A failed request is recorded with the server's message: Triton's error text, the HTTP body's error,
gRPC's status and message.

--stop-after-requests N ends a run once every selected user class has sent N requests (answered or failed), -t
staying the upper bound: a smoke run that waits on requests, not on a guess of how long they take.
"""

from __future__ import annotations

import http.client
import json
import logging
import sys
import time
from urllib.parse import urlsplit

from grpc.experimental import gevent as grpc_gevent  # before any gRPC object: makes grpcio cooperate with gevent

grpc_gevent.init_gevent()

import gevent  # noqa: E402
import gevent.queue  # noqa: E402
from locust import FastHttpUser, User, constant, events, task  # noqa: E402
from locust.runners import MasterRunner, WorkerRunner  # noqa: E402
from locust.stats import CSV_STATS_INTERVAL_SEC  # noqa: E402

from loadtests.endpoints import (  # noqa: E402
    EndpointError,
    RequestFailed,
    chat_deltas,
    check_grpc,
    error_text,
    first_model_id,
    grpc_url_from_host,
    http_error_text,
    openai_url_from_host,
    sse_events,
)
from loadtests.workload import DEFAULT_PROMPTS, MaxTokens, Workload, chat_request, load_prompts  # noqa: E402

MODEL = "ensemble"
FAILURE_BACKOFF_S = 0.2  # after a failed request, so that a down server is not hammered in a tight loop
START_FAILED_EXIT_CODE = 2  # an endpoint was not there at start (1 is Locust's "some requests failed")


@events.init_command_line_parser.add_listener
def _arguments(parser):
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL file with a text_input per line")
    parser.add_argument("--max-tokens", default="choice:16,32,64,128",
                        help="choice:16,32,64 | uniform:16:128 | fixed:64")
    parser.add_argument("--grpc-url", default="",
                        help="host:port of Triton's gRPC endpoint (default: the host of --host, its port + 1)")
    parser.add_argument("--openai-url", default="",
                        help="the OpenAI-compatible service for ChatStreamUser (default: http://<host of --host>:9000)")
    parser.add_argument("--model", default="", help="model id for ChatStreamUser (default: the first of /v1/models)")
    parser.add_argument("--raw-prompts", action="store_true", help="send prompts without the chat template")
    parser.add_argument("--workload-seed", type=int, default=None)
    parser.add_argument("--stop-after-requests", type=int, default=0, metavar="N",
                        help="end the run once every selected user class has sent N requests, answered or failed "
                             "(-t stays the upper bound; 0: off)")


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


def _triton_request(environment) -> dict:
    return {**_workload_for(environment).next_request(), "return_num_output_tokens": True}


def _endpoint_problems(environment) -> str:
    """Empty when the endpoint of every selected user answers, else what is wrong and what to pass."""
    problems = []
    for user_class in sorted(environment.user_classes, key=lambda c: c.__name__):
        try:
            if hasattr(user_class, "check_endpoint"):
                user_class.check_endpoint(environment)
        except EndpointError as error:
            problems.append(f"{user_class.__name__}: {error}")
    return "\n".join(problems)


def _headless_here(environment) -> bool:
    return environment.parsed_options.headless and not isinstance(environment.runner, WorkerRunner)


@events.init.add_listener
def _check_before_a_headless_run(environment, **_kwargs):
    """A headless run whose endpoint is not there ends before its first request, with the reason."""
    if _headless_here(environment) and (problems := _endpoint_problems(environment)):
        logging.error(problems)
        sys.exit(START_FAILED_EXIT_CODE)


@events.test_start.add_listener
def _check_at_each_start(environment, **_kwargs):
    """The web UI (whose host and options change between tests) and each worker check at every start; a missing
    endpoint stops that test, and the web UI stays up to start again."""
    if _headless_here(environment) or isinstance(environment.runner, MasterRunner):
        return
    if problems := _endpoint_problems(environment):
        logging.error(problems)
        gevent.spawn(environment.runner.stop)


@events.test_start.add_listener
def _stop_after_requests(environment, **_kwargs):
    wanted = environment.parsed_options.stop_after_requests
    if wanted > 0 and not isinstance(environment.runner, WorkerRunner):
        gevent.spawn(_end_once_each_class_has, environment, wanted)  # not in the runner's group, which quit() kills


def _requests_sent(stats, entry: str) -> int:
    """Whole requests of a user class's entry, answered or failed (Locust counts a failure as a request too); on a
    master, as far as its workers have reported."""
    return sum(counts.num_requests for (name, _method), counts in stats.entries.items() if name == entry)


def _end_once_each_class_has(environment, wanted: int) -> None:
    runner = environment.runner
    while min(_requests_sent(runner.stats, user.ENTRY) for user in environment.user_classes) < wanted:
        gevent.sleep(0.2)
    logging.info(f"every user class has sent {wanted} requests (--stop-after-requests), ending the run")
    if environment.parsed_options.headless:
        runner.quit()
    else:
        runner.stop()  # the web UI stays up


@events.quitting.add_listener
def _csv_files_hold_the_end(environment, **_kwargs):
    """Locust rewrites its --csv files once a second and not again when it ends: the requests answered in a run's last
    second, or drained after -t within --stop-timeout, were missing from them (a sweep cell of 8 requests all drained
    after its 3 s counted none). Sleeping past one period lets the writer's timer, due first, write the final numbers
    whatever the load: gevent fires due timers in the order they fall due."""
    if environment.parsed_options.csv_prefix and not isinstance(environment.runner, WorkerRunner):
        gevent.sleep(CSV_STATS_INTERVAL_SEC * 1.5)


def _fire(environment, kind: str, name: str, seconds: float, length: int = 0, error: str | None = None):
    environment.events.request.fire(request_type=kind, name=name, response_time=seconds * 1000,
                                    response_length=length, exception=error, context={})


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

    def done(self, error: BaseException | None = None) -> None:
        _fire(self.environment, self.kind, self.name, time.perf_counter() - self.started, self.tokens,
              error_text(error) if error is not None else None)


class GenerateUser(FastHttpUser):
    ENTRY = "generate"
    wait_time = constant(0)

    @task
    def generate(self):
        with self.client.post(f"/v2/models/{MODEL}/generate", json=_triton_request(self.environment),
                              name=self.ENTRY, catch_response=True) as response:
            try:
                reply = json.loads(response.content or b"{}")
            except ValueError:
                reply = {}
            if response.status_code == 200 and "text_output" in reply:
                response.request_meta["response_length"] = int(reply["num_output_tokens"])
                return
            # status 0: no answer at all (the connection failed)
            response.failure(http_error_text(response.status_code, response.content) if response.status_code
                             else error_text(response.error))
        gevent.sleep(FAILURE_BACKOFF_S)


class StreamUser(User):
    """SSE over a plain (gevent-patched) http.client connection, kept alive between requests."""

    ENTRY = "generate_stream"
    wait_time = constant(0)

    def on_start(self):
        url = urlsplit(self.host)
        self.connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=600)

    def on_stop(self):
        self.connection.close()

    @task
    def generate_stream(self):
        timer = _StreamTimer(self.environment, "SSE", self.ENTRY)
        body = json.dumps({**_triton_request(self.environment), "stream": True})
        try:
            self.connection.request("POST", f"/v2/models/{MODEL}/generate_stream", body,
                                    {"Content-Type": "application/json"})
            response = self.connection.getresponse()
            if response.status != 200:
                raise RequestFailed(http_error_text(response.status, response.read()))
            for event in sse_events(response):
                timer.on_delta(event["text_output"], int(event["num_output_tokens"]))
        except Exception as error:  # noqa: BLE001 - recorded as a failure
            self.connection.close()  # reconnects on the next request
            timer.done(error)
            gevent.sleep(FAILURE_BACKOFF_S)
            return
        timer.done()


class GrpcStreamUser(User):
    ENTRY = "grpc_stream"
    wait_time = constant(0)

    @staticmethod
    def grpc_url(environment) -> str:
        return environment.parsed_options.grpc_url or grpc_url_from_host(environment.host)

    @classmethod
    def check_endpoint(cls, environment) -> None:
        url = cls.grpc_url(environment)
        try:
            check_grpc(url, MODEL)
        except EndpointError as error:
            if environment.parsed_options.grpc_url:
                raise
            raise EndpointError(f"{error} (derived from --host {environment.host}: its port + 1; "
                                "pass --grpc-url HOST:PORT)") from None

    def on_start(self):
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(self.grpc_url(self.environment))
        self._start_stream()

    def _start_stream(self):
        """A stream and its own queue. After a failure the stream is replaced: a broken stream fails every later
        request with a client-side message, and a failed request's late responses must not reach the next one."""
        self.responses = responses = gevent.queue.Queue()
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))

    def _queued_error(self):
        """The error the callback received, if any: a broken stream's cause (async_stream_infer only says the
        stream is "no longer in valid state")."""
        while not self.responses.empty():
            _, error = self.responses.get_nowait()
            if error is not None:
                return error
        return None

    def on_stop(self):
        self.client.stop_stream(cancel_requests=True)  # a request still in flight would block the stream's reader
        del self.client  # closed once, by its __del__: a second close() can hang grpcio under gevent (check_grpc)

    @task
    def grpc_stream(self):
        from scripts.clients.llm_client import triton_inputs

        timer = _StreamTimer(self.environment, "gRPC", self.ENTRY)
        try:
            request = {**_triton_request(self.environment), "stream": True}
            self.client.async_stream_infer(MODEL, triton_inputs(self.grpc, request), enable_empty_final_response=True)
            while True:
                result, error = self.responses.get(timeout=600)
                if error is not None:
                    raise RequestFailed(error_text(error))
                text = result.as_numpy("text_output")
                if text is not None:
                    value = text.reshape(-1)[0]
                    timer.on_delta(value.decode() if isinstance(value, bytes) else str(value),
                                   int(result.as_numpy("num_output_tokens").reshape(-1)[0]))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        except Exception as error:  # noqa: BLE001 - recorded as a failure
            timer.done(self._queued_error() or error)
            self.client.stop_stream(cancel_requests=True)
            self._start_stream()
            gevent.sleep(FAILURE_BACKOFF_S)
            return
        timer.done()


_model_ids: dict[str, str] = {}  # OpenAI service URL -> the first id of its /v1/models


class ChatStreamUser(User):
    """Streamed chat completions from the OpenAI-compatible service, over a kept-alive http.client connection."""

    ENTRY = "chat_stream"
    wait_time = constant(0)

    @staticmethod
    def openai_url(environment) -> str:
        return (environment.parsed_options.openai_url or openai_url_from_host(environment.host)).rstrip("/")

    @classmethod
    def check_endpoint(cls, environment) -> None:
        url = cls.openai_url(environment)
        try:
            _model_ids[url] = first_model_id(url)
        except EndpointError as error:
            raise EndpointError(f"{error}; pass --openai-url, start the service (python -m scripts.launcher.openai_server), "
                                "or name the users to run without it") from None

    @classmethod
    def model_id(cls, environment) -> str:
        """--model, else the first id of the service's GET /v1/models, asked once."""
        url = cls.openai_url(environment)
        if not environment.parsed_options.model and url not in _model_ids:
            _model_ids[url] = first_model_id(url)
        return environment.parsed_options.model or _model_ids[url]

    def on_start(self):
        url = urlsplit(self.openai_url(self.environment))
        self.base_path = url.path
        self.connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=600)
        self.model = self.model_id(self.environment)

    def on_stop(self):
        self.connection.close()

    @task
    def chat_stream(self):
        timer = _StreamTimer(self.environment, "SSE", self.ENTRY)
        body = json.dumps(chat_request(_workload_for(self.environment).next_request(), self.model))
        try:
            self.connection.request("POST", f"{self.base_path}/v1/chat/completions", body,
                                    {"Content-Type": "application/json"})
            response = self.connection.getresponse()
            if response.status != 200:
                raise RequestFailed(http_error_text(response.status, response.read()))
            for content, tokens in chat_deltas(sse_events(response)):
                timer.on_delta(content, tokens)
            response.read()  # what follows "data: [DONE]", so that the connection can carry the next request
        except Exception as error:  # noqa: BLE001 - recorded as a failure
            self.connection.close()  # reconnects on the next request
            timer.done(error)
            gevent.sleep(FAILURE_BACKOFF_S)
            return
        timer.done()
