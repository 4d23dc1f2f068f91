import json
import os
from pathlib import Path

import pytest

from python_backend.model_files import MODEL_DIR_ENV, ONNX_FILE, SETTINGS_FILE
from scripts.launcher.triton_server import running_server
from scripts.paths import PROJECT_ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = Path(os.environ.get(MODEL_DIR_ENV, PROJECT_ROOT / "build" / "model"))
    if not (path / ONNX_FILE).is_file():
        pytest.fail(f"no exported model at {path}: run `make model` (make test does it)")
    return path


@pytest.fixture(scope="session")
def settings(model_dir) -> dict:
    return json.loads((model_dir / SETTINGS_FILE).read_text())


@pytest.fixture(scope="session")
def decoder(model_dir):
    from python_backend.runtime.onnx_decoder import OnnxDecoder

    return OnnxDecoder(model_dir / ONNX_FILE)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from python_backend.serving.tokenization import PromptTokenizer

    return PromptTokenizer(model_dir)


@pytest.fixture(scope="session")
def hf_model(settings):
    """The same model in transformers (the folder the export wrote or read), for reference outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(settings["hf_dir"], dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    """A real tritonserver with the project's model repository, on free loopback ports."""
    log = tmp_path_factory.mktemp("triton") / "server.log"
    with running_server(log_path=log, env={MODEL_DIR_ENV: str(model_dir)}) as ports:
        yield ports
    print(f"server log: {log}")
