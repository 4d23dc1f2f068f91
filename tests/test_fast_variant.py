"""QUANT=fast served by a real tritonserver: 32 concurrent greedy requests (joining and leaving the slot cache as
they finish) get the same text each gets alone, and the KV cache's gauge counts the rows' tokens, back to zero
when the batch is done."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from python_backend.model_files import MODEL_DIR_ENV
from scripts.clients.llm_client import GrpcStreamClient
from scripts.launcher.triton_server import running_server
from scripts.prepare.variant_parity import load_test_prompts
from tests.helpers import metrics, variant_folder, wait_for

pytestmark = pytest.mark.server
REQUESTS = [{"text_input": text, "max_tokens": (8, 16, 24, 32)[i % 4]}
            for i, text in enumerate(load_test_prompts()[:32])]


@pytest.fixture(scope="module")
def fast_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fast") / "server.log"
    with running_server(log_path=log, env={MODEL_DIR_ENV: str(variant_folder(model_dir, "fast"))}) as ports:
        yield ports


def test_32_concurrent_requests_get_their_answers_alone(fast_server):
    client = GrpcStreamClient(f"127.0.0.1:{fast_server.grpc}")
    alone = [client.complete(r).text for r in REQUESTS]
    kv_seen = []
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        pending = [pool.submit(client.complete, r) for r in REQUESTS]
        while not all(p.done() for p in pending):
            kv_seen.append(metrics(fast_server).get("llm_kv_cache_bytes", 0))
            time.sleep(0.2)
        together = [p.result().text for p in pending]
    assert together == alone
    assert max(kv_seen) > 0, "the gauge showed the rows' cache while they ran"
    wait_for(lambda: metrics(fast_server).get("llm_kv_cache_bytes", 0) == 0, 120,
             message="the KV cache's gauge back to zero once every row has left")
