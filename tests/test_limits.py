"""Each documented limit at its edge, on a real server whose limits are set small: the largest accepted value is
served, the smallest refused one gets a clear 400 (503 for capacity) that names the limit."""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from python_backend.model_files import MODEL_DIR_ENV
from scripts.clients.llm_client import GenerateClient, HttpClient, RequestError, triton_inputs
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.server_metrics import read_metrics
from scripts.launcher.triton_server import running_server
from scripts.paths import MODEL_REPOSITORY
from tests.helpers import NO_EOS, lazy_module, wait_for

openai = lazy_module("openai")

pytestmark = pytest.mark.server

FRONT_LIMITS = {"max_concurrent_requests": 2, "max_prompt_bytes": 64, "max_stop_strings": 2,
                "max_stop_string_bytes": 8}
CONTEXT = 256


def set_parameter(config: Path, key: str, value) -> None:
    text, count = re.subn(rf'(key: "{key}" value: {{ string_value: )"[^"]*"', rf'\1"{value}"', config.read_text())
    assert count == 1, key
    config.write_text(text)


@pytest.fixture(scope="module")
def limited(model_dir, tmp_path_factory):
    repository = tmp_path_factory.mktemp("limits") / "model_repository"
    shutil.copytree(MODEL_REPOSITORY, repository, symlinks=True)
    for name in ("ensemble", "ensemble_unary"):
        for key, value in FRONT_LIMITS.items():
            set_parameter(repository / name / "config.pbtxt", key, value)
    set_parameter(repository / "llm" / "config.pbtxt", "max_context_length", CONTEXT)
    with running_server(repository, log_path=repository.parent / "server.log",
                        env={MODEL_DIR_ENV: str(model_dir)}) as ports:
        yield ports


def generate(server, **request):
    return GenerateClient(f"127.0.0.1:{server.http}").complete({"max_tokens": 4, **request})


def refused(server, message, **request):
    with pytest.raises(RequestError, match=r"HTTP 400: .*" + re.escape(message)):
        generate(server, **request)


def test_prompt_bytes_are_checked_before_tokenization(limited):
    assert generate(limited, text_input="长" * 21 + "a").output_tokens > 0  # 64 bytes of UTF-8
    refused(limited, "text_input is 66 bytes, more than the limit of 64", text_input="长" * 22)
    refused(limited, "text_input is 65 bytes, more than the limit of 64", text_input="a" * 65)


def test_number_and_length_of_stop_strings(limited):
    assert generate(limited, text_input="Hi", stop_words=["12345678", "x"]).output_tokens > 0
    refused(limited, "stop_words has 3 strings, more than the limit of 2", text_input="Hi", stop_words=["a", "b", "c"])
    refused(limited, "stop_words has a string of 9 bytes, more than the limit of 8", text_input="Hi",
            stop_words=["123456789"])


def test_prompt_tokens_plus_max_tokens_within_the_context(limited, tokenizer):
    prompt = "What is the capital of France?"
    room = CONTEXT - len(tokenizer.encode(prompt, apply_chat_template=True))
    answer = generate(limited, text_input=prompt, max_tokens=room, apply_chat_template=True)
    assert "Paris" in answer.text  # stops at EOS long before
    refused(limited, f"max_tokens {room + 1} + prompt", text_input=prompt, max_tokens=room + 1, apply_chat_template=True)


def test_requests_beyond_max_concurrent_requests_get_503_at_once(limited):
    running = {"text_input": "Tell me a long story.", "end_id": NO_EOS, "max_tokens": 200}
    metrics = f"127.0.0.1:{limited.metrics}"
    outcomes = []

    def one():
        outcomes.append(HttpClient(f"127.0.0.1:{limited.http}").complete(running).output_tokens)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_for(lambda: read_metrics(metrics)["llm_running_sequences"] == 2, 120, 0.05,
             "two requests fill ensemble_unary's limit")
    with pytest.raises(InferenceServerException) as http_error:
        httpclient.InferenceServerClient(f"127.0.0.1:{limited.http}").infer(
            "ensemble_unary", triton_inputs(httpclient, {"text_input": "Hi", "max_tokens": 2}))
    with pytest.raises(InferenceServerException) as grpc_error:
        grpcclient.InferenceServerClient(f"127.0.0.1:{limited.grpc}").infer(
            "ensemble_unary", triton_inputs(grpcclient, {"text_input": "Hi", "max_tokens": 2}))
    for thread in threads:
        thread.join()
    assert http_error.value.status() == "503" and "its limit (max_concurrent_requests)" in http_error.value.message()
    assert grpc_error.value.status() == "StatusCode.UNAVAILABLE"
    assert outcomes == [200, 200], "the two admitted requests were served in full"
    assert HttpClient(f"127.0.0.1:{limited.http}").complete({"text_input": "Hi", "max_tokens": 2}).output_tokens


def test_the_openai_api_answers_503_with_retry_after_when_the_ensemble_is_full(limited, model_dir, tmp_path):
    metrics = f"127.0.0.1:{limited.metrics}"
    with running_openai_api(f"127.0.0.1:{limited.grpc}", model_dir, tmp_path / "openai.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        # EOS banned, so that both requests run their 200 tokens while the third one arrives.
        long = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 200, "temperature": 0,
                "logit_bias": {"2": -100}}
        outcomes = []

        def one():
            outcomes.append(client.completions.create(**long).usage.completion_tokens)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for thread in threads:
            thread.start()
        wait_for(lambda: read_metrics(metrics)["llm_running_sequences"] == 2, 120, 0.05,
                 "two requests fill the ensemble")
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=model, prompt="Hi", max_tokens=2)
        with pytest.raises(openai.APIStatusError) as refused_stream:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           stream=True)
        for thread in threads:
            thread.join()
        for response in (refused.value.response, refused_stream.value.response):
            assert response.status_code == 503, response.text
            assert int(response.headers["Retry-After"]) >= 1
            error = response.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "service_unavailable"
            assert "its limit (max_concurrent_requests)" in error["message"]
        assert outcomes == [200, 200], "the two admitted requests were served in full"
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
