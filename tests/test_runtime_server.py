"""The runtime switch on a real server: a repository rendered for the device code path (torch tensors through IO
binding, on the CPU here) serves the same greedy text as the default one, and a GPU runtime that cannot run fails
the llm model's load with a message naming what is missing, while the loaded version keeps serving."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from python_backend.model_files import MODEL_DIR_ENV
from scripts.clients.llm_client import GenerateClient
from scripts.launcher.model_control import SERVED_MODELS, reload_llm
from scripts.launcher.model_config import read_config
from scripts.launcher.render_model_repository import render
from scripts.launcher.triton_server import running_server

pytestmark = pytest.mark.server

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "用一句话介绍一下长城。",
           "List three colors.", "def add(a, b):", "Name a famous painter."]


@pytest.fixture(scope="module")
def device_path_server(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("io_binding")
    repository = render(folder / "model_repository", "onnxruntime", io_binding=True)
    with running_server(repository, log_path=folder / "server.log", explicit_models=SERVED_MODELS,
                        env={MODEL_DIR_ENV: str(model_dir)}) as ports:
        yield ports, folder / "server.log"


def answers(ports) -> list[str]:
    client = GenerateClient(f"127.0.0.1:{ports.http}")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once, so that the engine batches them
        return list(pool.map(lambda p: client.complete({"text_input": p, "apply_chat_template": True, "max_tokens": 24}).text, PROMPTS))


def test_the_rendered_repository_sets_the_runtime_and_only_that(device_path_server, tmp_path):
    gpu = render(tmp_path / "gpu", "onnxruntime-tensorrt", precision="fp32")
    llm = read_config(gpu / "llm" / "config.pbtxt")
    assert llm.parameters["runtime"].string_value == "onnxruntime-tensorrt"
    assert llm.parameters["precision"].string_value == "fp32"
    assert [group.kind for group in llm.instance_group] == [llm.instance_group[0].KIND_GPU]
    assert llm.parameters["model_dir"].string_value.startswith("/")
    front = read_config(gpu / "ensemble" / "config.pbtxt")
    assert [group.kind for group in front.instance_group] != [llm.instance_group[0].KIND_GPU]
    assert (gpu / "ensemble_unary" / "1" / "model.py").is_symlink()


def test_the_device_path_serves_the_same_greedy_text(server, device_path_server):
    ports, log = device_path_server
    assert ": OnnxDeviceDecoder, KV cache on cpu" in log.read_text()  # the device path, not the default one
    expected = answers(server)
    assert "Paris" in expected[0]
    assert answers(ports) == expected


def test_an_unavailable_gpu_runtime_fails_the_load_clearly_and_the_old_version_serves(device_path_server):
    ports, log = device_path_server
    reason = "RuntimeUnavailableError: runtime 'onnxruntime-cuda' keeps the KV cache in torch CUDA tensors"
    with pytest.raises(InferenceServerException, match=reason):  # the client that asked sees why
        reload_llm(f"127.0.0.1:{ports.http}", runtime="onnxruntime-cuda")
    assert reason in log.read_text()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{ports.http}")
    assert client.is_model_ready("llm")
    config = client.get_model_config("llm")
    assert config["parameters"]["runtime"]["string_value"] == "onnxruntime", json.dumps(config["parameters"])
    assert "Paris" in answers(ports)[0]
