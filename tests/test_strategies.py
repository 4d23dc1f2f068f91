"""The three batching strategies on one model, switched by a config parameter on a running server (explicit model
control, load with a config override): the answers stay the same, and only static batching computes finished rows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from python_backend.model_files import MODEL_DIR_ENV
from scripts.llm_client import GrpcStreamClient
from scripts.model_control import SERVED_MODELS, reload_llm
from scripts.triton_server import running_server

REQUESTS = [
    {"text_input": "What is the capital of France?", "max_tokens": 24},
    {"text_input": "Hi", "max_tokens": 8},
    {"text_input": "用一句话介绍一下长城。", "max_tokens": 32},
    {"text_input": "Write a Python function that adds two numbers.", "max_tokens": 40},
    {"text_input": "Name a color.", "max_tokens": 4},
    {"text_input": "Why do we dream? Answer in detail.", "max_tokens": 48},
]


@pytest.fixture(scope="module")
def explicit_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("explicit") / "server.log"
    with running_server(log_path=log, explicit_models=SERVED_MODELS, env={MODEL_DIR_ENV: str(model_dir)}) as ports:
        yield ports


def run_concurrently(server):
    client = GrpcStreamClient(f"127.0.0.1:{server.grpc}")
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return [c.text for c in pool.map(client.complete, REQUESTS)]


@pytest.fixture(scope="module")
def alone(explicit_server):
    client = GrpcStreamClient(f"127.0.0.1:{explicit_server.grpc}")
    return [client.complete(r).text for r in REQUESTS]


@pytest.mark.parametrize("strategy, extra", [
    ("static", {"static_batch_size": len(REQUESTS), "static_timeout_ms": 2000}),
    ("dynamic", {"length_buckets": "40"}),
    ("dynamic", {"length_buckets": ""}),
    ("continuous", {}),
])
def test_every_strategy_gives_the_same_answers(explicit_server, alone, strategy, extra):
    config = reload_llm(f"127.0.0.1:{explicit_server.http}", batching_strategy=strategy, **extra)
    assert config["parameters"]["batching_strategy"]["string_value"] == strategy
    assert run_concurrently(explicit_server) == alone


def test_a_bad_strategy_fails_the_load_and_the_old_version_keeps_serving(explicit_server, alone):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="batching strategy must be one of"):
        reload_llm(f"127.0.0.1:{explicit_server.http}", batching_strategy="magic")
    client = GrpcStreamClient(f"127.0.0.1:{explicit_server.grpc}")
    assert client.complete(REQUESTS[0]).text == alone[0]
