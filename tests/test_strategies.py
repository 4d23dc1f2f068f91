"""The three batching strategies on one model, switched by a config parameter on a running server (explicit model
control, load with a config override). Each gives the same answers, and each is checked on what only it does, as
the engine's own metrics show them under the strategy label of the model that served."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from scripts.clients.llm_client import GrpcStreamClient
from scripts.launcher.model_control import reload_llm
from tests.helpers import BackgroundStream, decode_steps_above, long_request, metrics, reconfigured_llm, wait_for, wait_idle

pytestmark = pytest.mark.server
WAIT_S = 300  # bounds a hung server only

REQUESTS = [
    {"apply_chat_template": True, "text_input": "What is the capital of France?", "max_tokens": 24},
    {"apply_chat_template": True, "text_input": "Hi", "max_tokens": 8},
    {"apply_chat_template": True, "text_input": "用一句话介绍一下长城。", "max_tokens": 32},
    {"apply_chat_template": True, "text_input": "Write a Python function that adds two numbers.", "max_tokens": 40},
    {"apply_chat_template": True, "text_input": "Name a color.", "max_tokens": 4},
    {"apply_chat_template": True, "text_input": "Why do we dream? Answer in detail.", "max_tokens": 48},
]
# With the chat template these prompts are 31 and 34 tokens ("Hi", "Name a color.") and 37-49 tokens (the others):
# a bucket boundary at 36 splits them into groups of 2 and 4.
LENGTH_BUCKETS, LARGEST_BUCKET_GROUP = "36", 4


@pytest.fixture(scope="module")
def explicit_server(server):
    """The session's fp32 server, its `llm` config put back once this file's reloads are done."""
    with reconfigured_llm(server):
        yield server


def run_concurrently(server):
    client = GrpcStreamClient(f"127.0.0.1:{server.grpc}")
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(client.complete, REQUESTS))


@pytest.fixture(scope="module")
def alone(explicit_server):
    client = GrpcStreamClient(f"127.0.0.1:{explicit_server.grpc}")
    return [client.complete(r).text for r in REQUESTS]


def reload(server, strategy, **parameters):
    config = reload_llm(f"127.0.0.1:{server.http}", batching_strategy=strategy, **parameters)
    assert config["parameters"]["batching_strategy"]["string_value"] == strategy


def test_static_batching_waits_for_its_batch_and_computes_finished_rows_to_the_end(explicit_server, alone):
    server = explicit_server
    # A timeout of an hour: the batch starts when all six have arrived, however slow the machine.
    reload(server, "static", static_batch_size=len(REQUESTS), static_timeout_ms=3_600_000)
    before = wait_idle(server, "static")
    answers = run_concurrently(server)
    after = wait_idle(server, "static")
    assert [a.text for a in answers] == alone
    delta = {name: after[name] - before[name] for name in after}
    tokens = sum(a.output_tokens for a in answers)
    assert delta["llm_output_tokens_total"] == tokens, "the model labelled static generated the answers"
    steps = delta["llm_batch_size_count"]
    assert steps > 0 and delta["llm_batch_size_sum"] == len(REQUESTS) * steps, \
        "every decode step ran all six rows, finished ones included"
    # Decode steps computed 6 x steps rows, of which at most `tokens` were live: the rest is counted as padding.
    assert delta["llm_padding_tokens_total"] >= len(REQUESTS) * steps - tokens > 0


@pytest.mark.parametrize("length_buckets", ["", LENGTH_BUCKETS])
def test_dynamic_batching_keeps_newcomers_waiting_until_the_group_has_finished(explicit_server, alone,
                                                                               length_buckets):
    server = explicit_server
    reload(server, "dynamic", length_buckets=length_buckets)
    wait_idle(server, "dynamic")
    wide_before = decode_steps_above(server, "dynamic", LARGEST_BUCKET_GROUP)
    client = GrpcStreamClient(f"127.0.0.1:{server.grpc}")
    with BackgroundStream(server, long_request()) as group, ThreadPoolExecutor(len(REQUESTS)) as pool:
        wait_for(lambda: metrics(server, "dynamic")["llm_running_sequences"] == 1, WAIT_S)
        futures = [pool.submit(client.complete, r) for r in REQUESTS]
        wait_for(lambda: metrics(server, "dynamic")["llm_waiting_sequences"] == len(REQUESTS), WAIT_S)
        steps = metrics(server, "dynamic")["llm_batch_size_count"]
        wait_for(lambda: metrics(server, "dynamic")["llm_batch_size_count"] >= steps + 10, WAIT_S)
        now = metrics(server, "dynamic")
        assert (now["llm_running_sequences"], now["llm_waiting_sequences"]) == (1, len(REQUESTS)), \
            "ten decode steps later, none of the six has joined the running group"
        assert not group.final
        group.cancel()  # the group ends: what waited becomes the next group
        answers = [f.result() for f in futures]
    wait_idle(server, "dynamic")
    assert [a.text for a in answers] == alone
    wide_steps = decode_steps_above(server, "dynamic", LARGEST_BUCKET_GROUP) - wide_before
    if length_buckets:
        assert wide_steps == 0, "each length bucket ran as a group of its own (2 and 4 requests)"
    else:
        assert wide_steps > 0, "all six that waited ran as one group"


def test_continuous_batching_lets_requests_join_and_leave_a_running_batch(explicit_server, alone):
    server = explicit_server
    reload(server, "continuous")
    wait_idle(server, "continuous")
    with BackgroundStream(server, long_request()) as long_one:
        wait_for(lambda: metrics(server, "continuous")["llm_running_sequences"] == 1, WAIT_S)
        answers = run_concurrently(server)
        assert not long_one.final, "the six joined, finished and left while the long request kept running"
    wait_idle(server, "continuous")
    assert [a.text for a in answers] == alone


def test_a_bad_strategy_fails_the_load_and_the_old_version_keeps_serving(explicit_server, alone):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="batching strategy must be one of"):
        reload_llm(f"127.0.0.1:{explicit_server.http}", batching_strategy="magic")
    client = GrpcStreamClient(f"127.0.0.1:{explicit_server.grpc}")
    assert client.complete(REQUESTS[0]).text == alone[0]
