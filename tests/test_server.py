"""End-to-end against a real tritonserver: real HTTP, gRPC and /generate clients, the real model."""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from python_backend.runtime.fault_injection import FAULT_ENV
from scripts.clients.llm_client import GenerateClient, GrpcClient, HttpClient, RequestError, triton_inputs
from scripts.launcher.processes import Ports
from scripts.launcher.triton_server import server_environment
from tests.helpers import SUITE_MIN_STEP_MS, assert_ready, at_once, hf_greedy, llm_request, llm_stream, metrics

pytestmark = pytest.mark.server

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "用一句话介绍一下长城。",
    "Name three primary colors.",
    "Why do cats purr?",
]
MAX_TOKENS = 32


def http_url(server):
    return f"127.0.0.1:{server.http}"


def grpc_url(server):
    return f"127.0.0.1:{server.grpc}"


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer, settings):
    """transformers' greedy generate() for each prompt, one at a time: {prompt: token ids without EOS}."""
    return {prompt: hf_greedy(hf_model, settings, tokenizer.encode(prompt, apply_chat_template=True), MAX_TOKENS)
            for prompt in PROMPTS}


def test_the_shared_server_s_llm_model_runs_with_the_suite_s_step_floor(servers, server):
    """tests/helpers.py's SUITE_MIN_STEP_MS reaches the llm model, which paces its decoder
    (python_backend/runtime/fault_injection.py) and says so at its load."""
    said = f"[llm] {FAULT_ENV}=min_step_ms={SUITE_MIN_STEP_MS}: faults are injected on purpose"
    assert said in servers.log(server).read_text(errors="replace")


def test_served_greedy_text_equals_transformers_generate(server, reference, tokenizer):
    client = GrpcClient(grpc_url(server))
    completions = at_once(*(functools.partial(client.complete, {"text_input": prompt, "max_tokens": MAX_TOKENS,
                                                                "apply_chat_template": True}) for prompt in PROMPTS))
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        assert completion.text == tokenizer.decode(reference[prompt]), prompt
        assert completion.output_tokens == len(reference[prompt])


def test_llm_model_output_ids_equal_transformers_token_for_token(server, reference, tokenizer):
    requests = [llm_request(tokenizer.encode(prompt, apply_chat_template=True), MAX_TOKENS) for prompt in PROMPTS]
    answers = at_once(*(functools.partial(llm_stream, server, request) for request in requests))
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer == (reference[prompt], None), prompt


def test_http_grpc_and_generate_give_the_same_answer(server):
    request = {"text_input": "What is the capital of France?", "max_tokens": 16, "apply_chat_template": True}
    answers = {
        "http": HttpClient(http_url(server)).complete(request).text,
        "grpc": GrpcClient(grpc_url(server)).complete(request).text,
        "generate": GenerateClient(http_url(server)).complete(request).text,
    }
    assert len(set(answers.values())) == 1, answers
    assert "Paris" in answers["generate"]


POEM = "Write a poem about the sea."


def test_repetition_penalty_reaches_the_model_as_transformers_defines_it(server, hf_model, tokenizer, settings):
    """The penalty applies to every token seen, prompt included, as in transformers and vLLM."""
    ids = tokenizer.encode(POEM, apply_chat_template=True)
    expected = tokenizer.decode(hf_greedy(hf_model, settings, ids, MAX_TOKENS, repetition_penalty=1.5))
    client = GrpcClient(grpc_url(server))
    request = {"text_input": POEM, "max_tokens": MAX_TOKENS, "apply_chat_template": True}
    plain, answer = (c.text for c in at_once(lambda: client.complete(request),
                                              lambda: client.complete({**request, "repetition_penalty": 1.5})))
    assert plain == tokenizer.decode(hf_greedy(hf_model, settings, ids, MAX_TOKENS))
    assert answer == expected != plain


def test_top_k_1_at_temperature_1_is_greedy_whatever_the_seed(server):
    client = GrpcClient(grpc_url(server))
    request = {"text_input": POEM, "max_tokens": 24, "apply_chat_template": True}
    seeds = (1, 2, 3)
    options = [{}] + [{"temperature": 1.0, "seed": seed} for seed in seeds] + [
        {"temperature": 1.0, "top_k": 1, "seed": seed} for seed in seeds]
    texts = [c.text for c in at_once(*(functools.partial(client.complete, {**request, **o}) for o in options))]
    greedy, sampled, top_1 = texts[0], dict(zip(seeds, texts[1:4])), dict(zip(seeds, texts[4:]))
    assert any(text != greedy for text in sampled.values()), "these seeds sample off the greedy path"
    assert all(text == greedy for text in top_1.values()), top_1


def test_text_input_is_the_raw_prompt_unless_the_chat_template_is_asked_for(server, hf_model, tokenizer, settings):
    """As TensorRT-LLM's ensemble: a client moving over gets the same continuation of the same raw prompt."""
    text = "The capital of France is"
    raw_ids = tokenizer.encode(text, apply_chat_template=False)
    expected = tokenizer.decode(hf_greedy(hf_model, settings, raw_ids, 16))
    client = GenerateClient(http_url(server))
    raw, explicit, chat = (c.text for c in at_once(
        lambda: client.complete({"text_input": text, "max_tokens": 16}),
        lambda: client.complete({"text_input": text, "max_tokens": 16, "apply_chat_template": False}),
        lambda: client.complete({"text_input": text, "max_tokens": 16, "apply_chat_template": True})))
    assert raw == explicit == expected != chat
    assert raw.startswith(" Paris"), raw


def llm_inference_count(server) -> int:
    stats = httpclient.InferenceServerClient(http_url(server)).get_inference_statistics("llm")
    return int(stats["model_stats"][0]["inference_count"])


def test_answer_is_the_same_alone_and_among_8_concurrent_requests_which_are_batched(server, reference, tokenizer):
    target = PROMPTS[0]
    others = [("Hi", 8), (PROMPTS[1], 48), ("Tell me a long story about a dragon.", 64), (PROMPTS[2], 24),
              ("2+2=", 4), (PROMPTS[4], 40), ("Translate 'good morning' to Spanish.", 16)]
    client = GrpcClient(grpc_url(server))
    alone = client.complete({"apply_chat_template": True, "text_input": target, "max_tokens": MAX_TOKENS}).text
    inferences_before, before = llm_inference_count(server), metrics(server)
    requests = [{"apply_chat_template": True, "text_input": target, "max_tokens": MAX_TOKENS}] + [
        {"apply_chat_template": True, "text_input": p, "max_tokens": n} for p, n in others]
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(client.complete, requests))
    # Each step's batch size is recorded before that step's tokens are sent: complete once every answer is in.
    after = metrics(server)
    assert results[0].text == alone == tokenizer.decode(reference[target])
    assert llm_inference_count(server) - inferences_before == 8
    steps = after["llm_batch_size_count"] - before["llm_batch_size_count"]
    rows = after["llm_batch_size_sum"] - before["llm_batch_size_sum"]
    assert rows > steps, "the engine decoded some of the 8 together (a step with more than one row)"


def test_seeded_sampling_is_reproducible(server):
    client = GenerateClient(http_url(server))
    sampled = {"text_input": "Write a short poem about rain.", "max_tokens": 24, "temperature": 1.0, "top_p": 0.95}
    first = client.complete({**sampled, "seed": 123}).text
    assert client.complete({**sampled, "seed": 123}).text == first
    assert len({client.complete({**sampled, "seed": s}).text for s in (1, 2, 3)} | {first}) > 1


LONG_PROMPT = "hello " * 2100

BAD_REQUESTS = [
    ({"text_input": "", "max_tokens": 8}, "text_input is empty"),
    ({"text_input": "Hi", "max_tokens": 0}, "max_tokens must be > 0"),
    ({"text_input": "Hi", "max_tokens": -5}, "max_tokens must be > 0"),
    ({"text_input": "Hi", "max_tokens": 100000}, "exceeds the context length"),
    ({"text_input": LONG_PROMPT, "max_tokens": 8}, "longer than the context length"),
    ({"text_input": "Hi", "max_tokens": 8, "temperature": -0.5}, "temperature must be >= 0"),
    ({"text_input": "Hi", "max_tokens": 8, "top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"text_input": "Hi", "max_tokens": 8, "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"text_input": "Hi", "max_tokens": 8, "top_k": -2}, "top_k must be >= 0"),
    ({"text_input": "Hi", "max_tokens": 8, "repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"text_input": "Hi"}, "max_tokens is required"),
    ({"text_input": "Hi", "max_tokens": 8, "input_ids": [1, 99999999]},
     "input_ids holds token id 99999999, outside the vocabulary"),
]


@pytest.mark.parametrize("request_, message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_input_gets_a_clear_400_and_invalid_argument(server, request_, message):
    with pytest.raises(RequestError, match=r"^HTTP 400: .*" + _escape(message)):
        GenerateClient(http_url(server)).complete(request_)
    with pytest.raises(InferenceServerException) as http_error:
        httpclient.InferenceServerClient(http_url(server)).infer("ensemble_unary", triton_inputs(httpclient, request_))
    assert http_error.value.status() == "400" and message in http_error.value.message()
    with pytest.raises(InferenceServerException) as grpc_error:
        grpcclient.InferenceServerClient(grpc_url(server)).infer("ensemble_unary", triton_inputs(grpcclient, request_))
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT" and message in grpc_error.value.message()
    assert_ready(server)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_wrong_dtype_gets_a_clear_400(server):
    inputs = triton_inputs(httpclient, {"text_input": "Hi"})
    wrong = httpclient.InferInput("max_tokens", [1, 1], "FP32")
    wrong.set_data_from_numpy(np.array([[8.0]], np.float32))
    with pytest.raises(InferenceServerException) as error:
        httpclient.InferenceServerClient(http_url(server)).infer("ensemble_unary", inputs + [wrong])
    assert error.value.status() == "400" and "max_tokens" in error.value.message()
    assert "TYPE_INT32" in error.value.message() or "INT32" in error.value.message()
    assert_ready(server)


def test_client_cli_writes_jsonl(server, tmp_path):
    from scripts.clients import client

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text_input": "What is 2+2?", "max_tokens": 8, "apply_chat_template": true}\n'
                       '{"text_input": "Say hi", "apply_chat_template": true}\n')
    output = tmp_path / "answers.jsonl"
    code = client.main([str(prompts), "--protocol", "grpc", "--grpc-url", grpc_url(server),
                        "--max-tokens", "4", "--output", str(output)])
    import json

    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert code == 0 and len(records) == 2
    assert all(r["text_output"] and r["output_tokens"] > 0 for r in records)
    assert records[1]["max_tokens"] == 4 and records[1]["output_tokens"] <= 4


def test_serve_command_stops_cleanly_on_sigterm(model_dir):
    ports = Ports.free()
    process = subprocess.Popen(
        [sys.executable, "-m", "scripts.launcher.triton_server", "--no-openai", "--http-port", str(ports.http),
         "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics), "--health-port", str(Ports.free().http)],
        env={**server_environment(), "TRITON_LLM_MODEL_DIR": str(model_dir)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    from scripts.launcher.triton_server import wait_until_ready

    try:
        wait_until_ready(process, ports, timeout_s=120)
    except Exception:
        process.kill()
        raise
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 0  # the timeout bounds a hung stop only
