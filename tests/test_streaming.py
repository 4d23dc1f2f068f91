"""Streaming, cancellation, batch invariance under continuous batching, the bounded queue and the metrics,
against the real server."""

from __future__ import annotations

import functools
import http.client
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from python_backend.model_files import MODEL_DIR_ENV
from scripts.clients.llm_client import (GenerateClient, GenerateStreamClient, GrpcClient, GrpcStreamClient, HttpClient,
                                RequestError, triton_inputs)
from tritonclient.utils import InferenceServerException
from scripts.launcher.processes import process_with_argument, zombie_children
from scripts.launcher.triton_server import running_server
from scripts.paths import MODEL_REPOSITORY
from tests.helpers import (LEFTOVER_TOKENS, NO_EOS, BackgroundStream, assert_ready, at_once, long_request,
                           metric_samples, metrics, wait_for, wait_idle)

pytestmark = pytest.mark.server

STREAM_PROMPTS = [
    "Write two sentences about the sea.",
    "用一句话介绍一下长城。",
    "Reply with three emoji that describe summer, then explain them.",
    "Write a Python function that returns the square of a number.",
]
PROTOCOLS = {"unary gRPC": GrpcClient, "gRPC stream": GrpcStreamClient, "SSE": GenerateStreamClient,
             "/generate": GenerateClient}


def test_streamed_deltas_add_up_to_the_unary_answer(server):
    """Each prompt sent on the four protocols, all at once (the engine batches them; a batch changes no answer)."""
    def complete(prompt, protocol):
        port = server.http if protocol in ("SSE", "/generate") else server.grpc
        request = {"apply_chat_template": True, "text_input": prompt, "max_tokens": 48}
        return PROTOCOLS[protocol](f"127.0.0.1:{port}").complete(request)

    cases = [(prompt, protocol) for prompt in STREAM_PROMPTS for protocol in PROTOCOLS]
    results = dict(zip(cases, at_once(*(functools.partial(complete, *case) for case in cases)), strict=True))
    for prompt in STREAM_PROMPTS:
        unary, grpc_stream, sse, generate = (results[prompt, protocol] for protocol in PROTOCOLS)
        assert grpc_stream.text == sse.text == generate.text == unary.text, prompt
        assert grpc_stream.output_tokens == sse.output_tokens == unary.output_tokens, prompt
        assert len(grpc_stream.deltas) > 3 and len(sse.deltas) > 3, f"text arrives in several deltas: {prompt}"
        assert all("\ufffd" not in d for d in grpc_stream.deltas[:-1]), f"no broken character mid-stream: {prompt}"
        if prompt.isascii():
            assert any(d.startswith(" ") for d in grpc_stream.deltas), f"leading spaces are kept: {prompt}"


def test_stream_true_is_refused_by_the_unary_model(server):
    with pytest.raises(RequestError, match="stream=true needs the decoupled model 'ensemble'"):
        GrpcClient(f"127.0.0.1:{server.grpc}").complete({"text_input": "Hi", "max_tokens": 4, "stream": True})


def test_cancelling_a_grpc_stream_frees_the_sequence(server):
    before = wait_idle(server)
    with BackgroundStream(server, long_request()) as stream:
        wait_for(lambda: stream.tokens >= 3, 120)
        assert metrics(server)["llm_running_sequences"] == 1
        received = stream.cancel()
    after = wait_idle(server)
    generated = after["llm_output_tokens_total"] - before["llm_output_tokens_total"]
    print(f"gRPC cancel: {generated - received:.0f} tokens generated beyond the {received} the client received")
    assert received <= generated <= received + LEFTOVER_TOKENS, "generation stops soon after the cancel"
    assert not stream.final
    assert_ready(server)


def test_a_killed_client_s_thirty_streams_are_freed_and_the_front_model_lives(server):
    """A client holding many streams killed (as the OpenAI API mid-batch): every sequence is freed and the front
    model's process survives. A BLS cancel request per stream crashed it in Triton 2.51's python backend
    (docs/operations.md): that path failed this test in 1 of 10 runs with two busy loops beside it (three rounds
    each; scripts/bench/disconnect_storm.py repeats the round as long as asked)."""
    from scripts.bench.disconnect_storm import kill_a_client

    server_pid = process_with_argument(f"--http-port={server.http}")
    assert server_pid, "the shared server's process was not found"

    def settled():  # the engine idle, or a model process dead: it would never be
        values = metrics(server)
        return zombie_children(server_pid) or values["llm_running_sequences"] + values["llm_waiting_sequences"] == 0

    for _ in range(3):
        wait_idle(server)
        kill_a_client(f"127.0.0.1:{server.grpc}", 30)
        at_kill = metrics(server)["llm_output_tokens_total"]
        wait_for(settled, 300, message="the engine did not become idle")
        assert zombie_children(server_pid) == {}, "a model process of the server died"
        generated = wait_idle(server)["llm_output_tokens_total"] - at_kill
        assert generated <= 30 * LEFTOVER_TOKENS, "generation goes on for nobody"
    assert_ready(server)


def test_closing_an_sse_connection_frees_the_sequence(server):
    before = wait_idle(server)
    connection = http.client.HTTPConnection("127.0.0.1", server.http, timeout=120)
    connection.request("POST", "/v2/models/ensemble/generate_stream", json.dumps({**long_request(), "stream": True,
                                                                                    "return_num_output_tokens": True}))
    response = connection.getresponse()
    events, received = 0, 0
    while events < 3:
        line = response.readline()
        if line.startswith(b"data:"):
            events += 1
            received += json.loads(line[5:])["num_output_tokens"]
    assert metrics(server)["llm_running_sequences"] == 1
    connection.sock.close()
    connection.close()
    after = wait_idle(server)
    generated = after["llm_output_tokens_total"] - before["llm_output_tokens_total"]
    print(f"SSE close: {generated - received:.0f} tokens generated beyond the {received} the client received")
    assert received <= generated <= received + LEFTOVER_TOKENS, "generation stops soon after the connection closes"
    assert_ready(server)


def test_a_prompt_joining_31_running_requests_mid_flight_gets_the_same_tokens(server):
    target = {"apply_chat_template": True, "text_input": "What are the three primary colors?", "max_tokens": 40}
    alone = GrpcClient(f"127.0.0.1:{server.grpc}").complete(target).text
    others = [{"apply_chat_template": True, "text_input": f"{p} (variant {i})", "max_tokens": 16 + 8 * (i % 10)}
              for i, p in enumerate(STREAM_PROMPTS * 8)][:30]
    client = GrpcStreamClient(f"127.0.0.1:{server.grpc}")
    # The 31st runs until cancelled, so the target surely joins, and leaves, a running batch.
    with BackgroundStream(server, long_request()) as long_one, ThreadPoolExecutor(30) as pool:
        background = [pool.submit(client.complete, r) for r in others]
        wait_for(lambda: metrics(server)["llm_running_sequences"] >= 16, 120)
        joined = client.complete(target)
        assert not long_one.final, "the target joined and left while others ran"
        assert all(f.result().output_tokens > 0 for f in background)
    assert joined.text == alone


def test_metrics_count_one_request_exactly_and_carry_model_and_strategy_labels(server, tokenizer):
    request = {"apply_chat_template": True, "text_input": "Hi there", "max_tokens": 8}
    before = wait_idle(server)
    completion = GrpcStreamClient(f"127.0.0.1:{server.grpc}").complete(request)
    n = completion.output_tokens
    wait_for(lambda: metrics(server)["llm_output_tokens_total"] - before["llm_output_tokens_total"] >= n, 60)
    after = wait_idle(server)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["llm_output_tokens_total"] == n
    assert delta["llm_time_to_first_token_seconds_count"] == 1 and delta["llm_time_to_first_token_seconds_sum"] > 0
    decode_steps = delta["llm_batch_size_count"]
    assert delta["llm_batch_size_sum"] == decode_steps  # alone: every step had one row
    # Alone and greedy, the request decodes speculatively (the config's speculative_draft): a step gives it the
    # drafts it kept and one token more. The first token comes from the prefill; the last step may end at EOS.
    drafts, kept = delta["llm_spec_decode_draft_tokens_total"], delta.get("llm_spec_decode_accepted_tokens_total", 0)
    assert drafts > 0 and kept <= drafts
    assert n - 1 in (decode_steps + kept, decode_steps + kept - 1)
    # one response per step that gave tokens: the TTFT's, then one inter-token latency each
    assert delta["llm_inter_token_latency_seconds_count"] in (decode_steps, decode_steps - 1)
    prompt_tokens = len(tokenizer.encode(request["text_input"], apply_chat_template=True))
    cached = delta.get("llm_prefix_cache_hits_total", 0)  # the chat template's opening, when another request left it
    assert delta["llm_computed_tokens_total"] == prompt_tokens - cached + decode_steps + drafts
    assert delta["llm_padding_tokens_total"] == 0
    assert after["llm_kv_cache_bytes"] == 0 and 0 <= after["llm_padding_waste_ratio"] < 1
    # Every llm_ sample on this server is labelled with its model and a strategy: the request above was counted
    # under continuous (the shared server may also hold the series of the strategies other files reloaded it with).
    unlabelled = [s.name for s in metric_samples(server)
                  if s.name.startswith("llm_") and not {"model", "strategy"} <= set(s.labels)]
    assert unlabelled == [] and "llm_kv_cache_bytes" in after


@pytest.fixture(scope="module")
def tiny_queue_server(model_dir, tmp_path_factory):
    """The same models with one running sequence and one waiting slot."""
    repository = tmp_path_factory.mktemp("repo") / "model_repository"
    shutil.copytree(MODEL_REPOSITORY, repository, symlinks=True)
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
    wait_idle(server)
    queued = {"apply_chat_template": True, "text_input": "Name a color.", "max_tokens": 16, "end_id": NO_EOS}
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(HttpClient(f"127.0.0.1:{server.http}").complete(queued)))
    with BackgroundStream(server, long_request()) as running:  # holds the one running slot until cancelled
        wait_for(lambda: metrics(server)["llm_running_sequences"] == 1, 120)
        waiter.start()
        wait_for(lambda: metrics(server)["llm_waiting_sequences"] == 1, 120)  # the one waiting slot is taken
        with pytest.raises(RequestError, match=r"^HTTP 503: .*queue is full"):
            HttpClient(f"127.0.0.1:{server.http}").complete(queued)
        with pytest.raises(InferenceServerException) as grpc_error:
            grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}").infer(
                "ensemble_unary", triton_inputs(grpcclient, queued))
        assert grpc_error.value.status() == "StatusCode.UNAVAILABLE" and "queue is full" in grpc_error.value.message()
        # Triton's /generate reports every model error as HTTP 400; the message still says what happened.
        with pytest.raises(RequestError, match="HTTP 400.*queue is full"):
            GenerateClient(f"127.0.0.1:{server.http}").complete(queued)
        assert not running.final
    waiter.join(timeout=300)
    assert [c.output_tokens for c in outcome] == [16], "the waiting request is served once the slot frees"
    assert_ready(server)


@pytest.mark.parametrize("protocol", ["grpc", "sse"])
def test_a_waiting_request_whose_client_leaves(tiny_queue_server, protocol):
    """gRPC: the request leaves the queue at once and never runs. SSE: Triton tells the model nothing while the
    request waits (its HTTP server reads nothing from a connection until the request's first response), so the
    request runs once admitted and stops within a few tokens, when its first response meets the closed
    connection."""
    server = tiny_queue_server
    before = wait_idle(server)
    leaving = {**long_request(), "stream": True}
    with BackgroundStream(server, long_request()) as running:  # holds the one running slot until cancelled
        wait_for(lambda: metrics(server)["llm_running_sequences"] == 1, 120)
        if protocol == "grpc":
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
            client.start_stream(callback=lambda result, error: None)
            client.async_stream_infer("ensemble", triton_inputs(grpcclient, leaving))
            wait_for(lambda: metrics(server)["llm_waiting_sequences"] == 1, 120)
            client.stop_stream(cancel_requests=True)
            client.close()
            wait_for(lambda: metrics(server)["llm_waiting_sequences"] == 0, 120)
            assert metrics(server)["llm_running_sequences"] == 1 and not running.final, "left while the other ran"
        else:
            connection = http.client.HTTPConnection("127.0.0.1", server.http, timeout=120)
            connection.request("POST", "/v2/models/ensemble/generate_stream", json.dumps(leaving))
            wait_for(lambda: metrics(server)["llm_waiting_sequences"] == 1, 120)
            connection.sock.close()
            connection.close()
            # Give the front model's cancellation watch (a look every 0.1 s) 20 engine steps to hear of it: at
            # least 0.4 s on this CPU, and longer on a slower one.
            steps = metrics(server)["llm_batch_size_count"]
            wait_for(lambda: metrics(server)["llm_batch_size_count"] >= steps + 20, 120)
            assert metrics(server)["llm_waiting_sequences"] == 1, "Triton now reports a gone SSE client early"
        received = running.cancel()
    after = wait_idle(server)
    first_tokens = after["llm_time_to_first_token_seconds_count"] - before["llm_time_to_first_token_seconds_count"]
    leftover = after["llm_output_tokens_total"] - before["llm_output_tokens_total"] - received
    print(f"{protocol}: {leftover:.0f} tokens beyond the {received} the running request's client received")
    if protocol == "grpc":
        assert first_tokens == 1, "the request whose client left never ran"
    else:
        assert first_tokens == 2, "the request whose client left ran once admitted"
    assert 0 <= leftover <= LEFTOVER_TOKENS, "and it stopped within a few tokens"
    assert_ready(server)
