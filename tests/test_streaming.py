"""Streaming, cancellation, batch invariance under continuous batching, the bounded queue and the metrics,
against the real server."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from python_backend.model_files import MODEL_DIR_ENV
from scripts.llm_client import (GenerateClient, GenerateStreamClient, GrpcClient, GrpcStreamClient, HttpClient,
                                RequestError, triton_inputs)
from tritonclient.utils import InferenceServerException
from scripts.server_metrics import read_metrics
from scripts.triton_server import DEFAULT_MODEL_REPOSITORY, running_server

STREAM_PROMPTS = [
    "Write two sentences about the sea.",
    "用一句话介绍一下长城。",
    "Reply with three emoji that describe summer, then explain them.",
    "Write a Python function that returns the square of a number.",
]
NO_EOS = 49151  # end_id that the model practically never emits: generation runs to max_tokens


def metrics(server) -> dict[str, float]:
    """The llm model's custom metrics (one llm model on this server)."""
    return read_metrics(f"127.0.0.1:{server.metrics}")


def wait_for(condition, timeout_s: float, interval_s: float = 0.02) -> float:
    """Seconds until condition() held; fails after timeout_s."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not met in time"
        time.sleep(interval_s)
    return time.monotonic() - started


@pytest.mark.parametrize("prompt", STREAM_PROMPTS)
def test_streamed_deltas_add_up_to_the_unary_answer(server, prompt):
    request = {"text_input": prompt, "max_tokens": 48}
    unary = GrpcClient(f"127.0.0.1:{server.grpc}").complete(request)
    grpc_stream = GrpcStreamClient(f"127.0.0.1:{server.grpc}").complete(request)
    sse = GenerateStreamClient(f"127.0.0.1:{server.http}").complete(request)
    generate = GenerateClient(f"127.0.0.1:{server.http}").complete(request)
    assert grpc_stream.text == sse.text == generate.text == unary.text
    assert grpc_stream.output_tokens == sse.output_tokens == unary.output_tokens
    assert len(grpc_stream.deltas) > 3 and len(sse.deltas) > 3, "text arrives in several deltas"
    assert all("\ufffd" not in d for d in grpc_stream.deltas[:-1]), "no broken character mid-stream"
    if prompt.isascii():
        assert any(d.startswith(" ") for d in grpc_stream.deltas), "leading spaces are kept"


def test_stream_true_is_refused_by_the_unary_model(server):
    with pytest.raises(RequestError, match="stream=true needs the decoupled model 'ensemble'"):
        GrpcClient(f"127.0.0.1:{server.grpc}").complete({"text_input": "Hi", "max_tokens": 4, "stream": True})


def long_request():
    return {"text_input": "Tell me a very long story about a dragon.", "max_tokens": 1000, "end_id": NO_EOS}


def test_cancelling_a_grpc_stream_frees_the_sequence(server):
    wait_for(lambda: metrics(server)["llm_running_sequences"] == 0, 60)
    opened = {}
    deltas = GrpcStreamClient(f"127.0.0.1:{server.grpc}").stream(long_request(),
                                                                  on_open=lambda c: opened.update(client=c))
    for _, _ in zip(range(3), deltas):
        pass
    assert metrics(server)["llm_running_sequences"] == 1
    opened["client"].stop_stream(cancel_requests=True)
    freed_after = wait_for(lambda: metrics(server)["llm_running_sequences"] == 0, 5)
    tokens = metrics(server)["llm_output_tokens_total"]
    time.sleep(0.5)
    assert metrics(server)["llm_output_tokens_total"] == tokens, "nothing is generated after the cancel"
    print(f"gRPC cancel freed the sequence after {freed_after:.3f} s")
    assert_ready(server)


def test_closing_an_sse_connection_frees_the_sequence(server):
    wait_for(lambda: metrics(server)["llm_running_sequences"] == 0, 60)
    connection = http.client.HTTPConnection("127.0.0.1", server.http, timeout=60)
    connection.request("POST", "/v2/models/ensemble/generate_stream", json.dumps({**long_request(), "stream": True}))
    response = connection.getresponse()
    events = 0
    while events < 3:
        events += response.readline().startswith(b"data:")
    assert metrics(server)["llm_running_sequences"] == 1
    connection.sock.close()
    connection.close()
    freed_after = wait_for(lambda: metrics(server)["llm_running_sequences"] == 0, 5)
    print(f"SSE close freed the sequence after {freed_after:.3f} s")
    assert_ready(server)


def assert_ready(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http}/v2/health/ready", timeout=5) as response:
        assert response.status == 200
    assert GenerateClient(f"127.0.0.1:{server.http}").complete({"text_input": "Hi", "max_tokens": 2}).output_tokens


def test_a_prompt_joining_31_running_requests_mid_flight_gets_the_same_tokens(server):
    target = {"text_input": "What are the three primary colors?", "max_tokens": 40}
    alone = GrpcClient(f"127.0.0.1:{server.grpc}").complete(target).text
    others = [{"text_input": f"{p} (variant {i})", "max_tokens": 16 + 8 * (i % 10)}
              for i, p in enumerate(STREAM_PROMPTS * 8)][:31]
    client = GrpcStreamClient(f"127.0.0.1:{server.grpc}")
    with ThreadPoolExecutor(32) as pool:
        background = [pool.submit(client.complete, r) for r in others]
        wait_for(lambda: metrics(server)["llm_running_sequences"] >= 16, 60)
        running_when_joined = metrics(server)["llm_running_sequences"]
        joined = client.complete(target)
        assert all(f.result().output_tokens > 0 for f in background)
    assert joined.text == alone
    assert running_when_joined >= 16


def test_metrics_are_exported(server):
    GrpcStreamClient(f"127.0.0.1:{server.grpc}").complete({"text_input": "Hi there", "max_tokens": 8})
    values = metrics(server)
    for name in ("llm_time_to_first_token_seconds_count", "llm_inter_token_latency_seconds_count",
                 "llm_batch_size_count", "llm_output_tokens_total", "llm_computed_tokens_total"):
        assert values[name] > 0, name
    for name in ("llm_running_sequences", "llm_waiting_sequences", "llm_kv_cache_bytes",
                 "llm_padding_waste_ratio", "llm_padding_tokens_total"):
        assert name in values, name
    assert 0 <= values["llm_padding_waste_ratio"] < 1


@pytest.fixture(scope="module")
def tiny_queue_server(model_dir, tmp_path_factory):
    """The same models with one running sequence and one waiting slot."""
    repository = tmp_path_factory.mktemp("repo") / "model_repository"
    shutil.copytree(DEFAULT_MODEL_REPOSITORY, repository, symlinks=True)
    config = repository / "llm" / "config.pbtxt"
    text = config.read_text().replace("max_batch_size: 32", "max_batch_size: 1")
    text = text.replace('key: "max_queue_size" value: { string_value: "256" }',
                        'key: "max_queue_size" value: { string_value: "1" }')
    config.write_text(text)
    for name in ("ensemble", "ensemble_unary"):
        path = repository / name / "config.pbtxt"
        path.write_text(path.read_text().replace("max_batch_size: 32", "max_batch_size: 1"))
    log = Path(repository).parent / "server.log"
    with running_server(repository, log_path=log, env={MODEL_DIR_ENV: str(model_dir)}) as ports:
        yield ports


def test_beyond_the_queue_bound_requests_get_503_and_unavailable(tiny_queue_server):
    server = tiny_queue_server
    request = {**long_request(), "max_tokens": 64}
    client = HttpClient(f"127.0.0.1:{server.http}")
    outcomes = []

    def one():
        try:
            outcomes.append(client.complete(request).output_tokens)
        except RequestError as error:
            outcomes.append(str(error))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    with pytest.raises(InferenceServerException) as grpc_error:
        grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}").infer(
            "ensemble_unary", triton_inputs(grpcclient, request))
    # Triton's /generate reports every model error as HTTP 400; the message still says what happened.
    with pytest.raises(RequestError, match="HTTP 400.*queue is full"):
        GenerateClient(f"127.0.0.1:{server.http}").complete(request)
    for thread in threads:
        thread.join()
    refused = [o for o in outcomes if isinstance(o, str)]
    assert outcomes.count(64) >= 2 and refused, outcomes
    assert all(o.startswith("HTTP 503") and "queue is full" in o for o in refused), refused
    assert grpc_error.value.status() == "StatusCode.UNAVAILABLE" and "queue is full" in grpc_error.value.message()
    assert_ready(server)


@pytest.mark.parametrize("protocol", ["grpc", "sse"])
def test_a_waiting_request_whose_client_leaves_is_dropped_from_the_queue(tiny_queue_server, protocol):
    server = tiny_queue_server
    wait_for(lambda: metrics(server)["llm_running_sequences"] + metrics(server)["llm_waiting_sequences"] == 0, 60)
    running = threading.Thread(target=lambda: GenerateClient(f"127.0.0.1:{server.http}").complete(
        {**long_request(), "max_tokens": 200}))
    running.start()
    wait_for(lambda: metrics(server)["llm_running_sequences"] == 1, 30)
    if protocol == "grpc":
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
        client.start_stream(callback=lambda result, error: None)
        client.async_stream_infer("ensemble", triton_inputs(grpcclient, {**long_request(), "stream": True}))
        wait_for(lambda: metrics(server)["llm_waiting_sequences"] == 1, 10)
        client.stop_stream(cancel_requests=True)
    else:
        connection = http.client.HTTPConnection("127.0.0.1", server.http, timeout=60)
        connection.request("POST", "/v2/models/ensemble/generate_stream",
                           json.dumps({**long_request(), "stream": True}))
        wait_for(lambda: metrics(server)["llm_waiting_sequences"] == 1, 10)
        connection.sock.close()
        connection.close()
    dropped_after = wait_for(lambda: metrics(server)["llm_waiting_sequences"] == 0, 10)
    still_running = metrics(server)["llm_running_sequences"]
    print(f"{protocol}: a waiting request left the queue {dropped_after:.3f} s after its client went away")
    running.join()
    if protocol == "grpc":
        assert still_running == 1 and dropped_after < 1, "a cancelled gRPC stream leaves the queue at once"
