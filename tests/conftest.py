import ast
import functools
import inspect
import json
import os
import textwrap
from pathlib import Path

import pytest

from python_backend.model_files import MODEL_DIR_ENV, ONNX_FILE, SETTINGS_FILE
from scripts.launcher.triton_server import running_server
from scripts.paths import default_model_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = default_model_dir()
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


# --- the `server` marker: on every test that starts a real tritonserver, so that `-m "not server"` starts none ---

# What starts one: a call of the launcher's context managers, or the serve command or the sweep run as a process
# (`[sys.executable, "-m", module, ...]`; the serve command with a stand-in `--tritonserver`, as
# tests/test_supervisor.py runs it, starts none). The OpenAI service needs a server too, and counts with it.
SERVER_CALLS = {"running_server", "running_openai_api", "openai_service"}
SERVER_COMMANDS = {"scripts.launcher.triton_server", "loadtests.sweep"}


def _starts_one_itself(node: ast.AST) -> bool:
    for child in ast.walk(node):
        if isinstance(child, ast.Call):
            name = child.func.id if isinstance(child.func, ast.Name) else getattr(child.func, "attr", None)
            if name in SERVER_CALLS:
                return True
        if isinstance(child, ast.List) and len(child.elts) >= 3 and ast.unparse(child.elts[0]) == "sys.executable":
            words = [e.value for e in child.elts[1:] if isinstance(e, ast.Constant)]
            if len(words) >= 2 and words[0] == "-m" and words[1] in SERVER_COMMANDS and "--tritonserver" not in words:
                return True
    return False


def _names(node: ast.AST) -> set[str]:
    return {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}


@functools.cache
def _server_starters(module) -> frozenset[str]:
    """The top-level functions and classes of a module that start a server, themselves or through one another."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return frozenset()
    nodes = {node.name: node for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    starters = {name for name, node in nodes.items() if _starts_one_itself(node)}
    while grown := {name for name, node in nodes.items() if _names(node) & starters} - starters:
        starters |= grown
    return frozenset(starters)


@functools.cache
def _starts_a_server(function) -> bool:
    """Whether a test or fixture function starts a server, itself or through a function of its own module (helpers
    in other files are not followed: tests/helpers.py starts none)."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    module = inspect.getmodule(function)
    return _starts_one_itself(node) or bool(module and _names(node) & _server_starters(module))


def _server_source(item) -> str | None:
    """What makes this test start a server (the fixture named, or the test itself), or None."""
    for name, definitions in sorted(item._fixtureinfo.name2fixturedefs.items()):
        if any(_starts_a_server(definition.func) for definition in definitions):
            return f"its fixture `{name}`"
    return "the test itself" if _starts_a_server(item.function) else None


_UNMARKED = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        source = _server_source(item) if isinstance(item, pytest.Function) else None
        if source is not None and not item.get_closest_marker("server"):
            item.stash[_UNMARKED] = source


@pytest.hookimpl(tryfirst=True)  # before its fixtures start anything
def pytest_runtest_setup(item):
    if _UNMARKED in item.stash:
        pytest.fail(f"{item.nodeid} starts a tritonserver ({item.stash[_UNMARKED]}) but has no `server` marker: "
                    "add `pytestmark = pytest.mark.server` to its file, or @pytest.mark.server to the test",
                    pytrace=False)
