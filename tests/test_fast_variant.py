"""QUANT=fast served by the session's shared tritonserver: 32 concurrent greedy requests (joining and leaving the slot
cache as they finish) get the same text each gets alone, and decode steps ran many of them at once; the KV cache's
gauge holds a running row's tokens, growing with them, and is back to zero once the row has left."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from scripts.clients.llm_client import GrpcStreamClient
from scripts.prepare.variant_parity import load_test_prompts
from tests.helpers import BackgroundStream, decode_steps_above, long_request, metrics, wait_for, wait_idle

pytestmark = pytest.mark.server
REQUESTS = [{"text_input": text, "max_tokens": (8, 16, 24, 32)[i % 4]}
            for i, text in enumerate(load_test_prompts()[:32])]
WAIT_S = 300  # bounds a hung server only


@pytest.fixture(scope="module")
def fast_server(variant_server):
    return variant_server("fast")


def test_32_concurrent_requests_get_their_answers_alone(fast_server):
    client = GrpcStreamClient(f"127.0.0.1:{fast_server.grpc}")
    alone = [client.complete(r).text for r in REQUESTS]
    wait_idle(fast_server)
    wide_before = decode_steps_above(fast_server, "continuous", 8)
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = [answer.text for answer in pool.map(client.complete, REQUESTS)]
    wait_idle(fast_server)
    assert together == alone
    assert decode_steps_above(fast_server, "continuous", 8) > wide_before, \
        "decode steps ran more than 8 of the 32 at once"


def test_the_kv_gauge_holds_a_running_rows_tokens_and_is_zero_once_it_has_left(fast_server):
    def kv_bytes() -> float:
        return metrics(fast_server)["llm_kv_cache_bytes"]

    wait_idle(fast_server)
    with BackgroundStream(fast_server, long_request()):  # runs until cancelled: its row stays in the cache
        wait_for(lambda: kv_bytes() > 0, WAIT_S, message="the gauge counts the running row")
        held = kv_bytes()
        wait_for(lambda: kv_bytes() > held, WAIT_S, message="the gauge grows with the row's tokens")
    wait_idle(fast_server)
    wait_for(lambda: kv_bytes() == 0, WAIT_S, message="the gauge back to zero once the row has left")
