import ast
import functools
import inspect
import json
import os
import signal
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from python_backend.model_files import MODEL_DIR_ENV, ONNX_FILE, SETTINGS_FILE
from python_backend.runtime.fault_injection import FAULT_ENV
from python_backend.serving.periodic import Periodic
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.triton_server import all_models, running_server
from scripts.paths import MODEL_REPOSITORY, default_model_dir
from scripts.launcher.processes import last_crash, process_with_argument, zombie_children_of
from tests.helpers import KV_TEST_PROMPTS, SUITE_MIN_STEP_MS, variant_folder
from tests.tiny_engine_model import tiny_engine_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    """`make test` runs the suite on parallel workers (pytest-xdist), which share the machine's cores: each worker's
    in-process onnxruntime sessions and torch, and the servers it starts, take its share of them rather than one
    thread per core each, which oversubscribes the cores (the fast suite on 2 cores and 2 workers: 82 s with a thread
    per core, 64 s with one; six server files: 131 s and 215 s of CPU with the servers' thread per core, 117 s and
    162 s with one). The servers and other processes a worker starts (exports, references in other venvs) inherit
    the share: $TRITON_LLM_INTRA_OP_THREADS for onnxruntime, $OMP_NUM_THREADS for torch and numpy (four files with
    exports and references: 144 s with a thread per core, 131 s with one)."""
    # the servers it starts inherit it (tests/helpers.py's SUITE_MIN_STEP_MS says why)
    os.environ.setdefault(FAULT_ENV, f"min_step_ms={SUITE_MIN_STEP_MS}")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1:
        import torch

        from python_backend.runtime import onnx_decoder

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        onnx_decoder.DEFAULT_INTRA_OP_THREADS = threads
        os.environ[onnx_decoder.INTRA_OP_THREADS_ENV] = os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = default_model_dir()
    if not (path / ONNX_FILE).is_file():
        pytest.fail(f"no exported model at {path}: run `make model` (make test does it)")
    return path


@pytest.fixture(scope="session")
def tiny_dir(model_dir) -> Path:
    """The export of the engine tests' tiny model (tests/tiny_engine_model.py says why), its fp32 and fast variants
    beside it in build/tiny; built here where missing or out of date."""
    return tiny_engine_model(model_dir)


@pytest.fixture(scope="session")
def tiny_decoder(tiny_dir):
    """The tiny model's export graph (its padded KV cache), as `decoder` is the real export's."""
    from python_backend.runtime.onnx_decoder import OnnxDecoder

    return OnnxDecoder(tiny_dir / ONNX_FILE)


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
def kv_prompts(tokenizer) -> list[list[int]]:
    """KV_TEST_PROMPTS as chat prompts' token ids, for the KV caches' batching tests."""
    return [tokenizer.encode(p, apply_chat_template=True) for p in KV_TEST_PROMPTS]


@pytest.fixture(scope="session")
def hf_model(settings):
    """The same model in transformers (the folder the export wrote or read), for reference outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(settings["hf_dir"], dtype=torch.float32).eval()


class ServerPool:
    """Real tritonservers shared by the whole session, one for each configuration (model folder, repository,
    environment): a configuration's server starts when a test first asks for it and stops at the session's end, so
    each weight variant's server starts once however many files use it. They run with explicit model control, so a
    test may reload `llm` with other settings (`reconfigured_llm` in tests/helpers.py puts the config back)."""

    WATCH_INTERVAL_S = 5.0
    LOOKS = 3  # a zombie found at this many looks in a row is a dead stub: Triton reaps a stub it stops within seconds

    def __init__(self, tmp_path_factory):
        self._tmp_path_factory = tmp_path_factory
        self._running: list = []  # the running_server context managers, to leave at the end
        self._servers: dict[tuple, object] = {}
        self._logs: dict[object, Path] = {}  # Ports -> server.log
        self._pids: dict[object, int] = {}  # Ports -> tritonserver's pid
        self._sightings: dict[object, dict[int, int]] = {}  # Ports -> its zombie children -> looks in a row
        self.deaths: dict[object, str] = {}  # Ports -> why the watch stopped that server
        self._watch = Periodic("dead-stub-watch", self.WATCH_INTERVAL_S, self.watch)
        self._watch.start()

    def get(self, model_folder: Path, model_repository: Path = MODEL_REPOSITORY, env: dict[str, str] | None = None):
        """The Ports of the server with this configuration, started on first use."""
        env = {MODEL_DIR_ENV: str(model_folder), **(env or {})}
        key = (str(model_repository), tuple(sorted(env.items())))
        if key not in self._servers:
            log = self._tmp_path_factory.mktemp(f"triton-{Path(model_folder).name}") / "server.log"
            print(f"\nserver log: {log}")
            running = running_server(model_repository, log_path=log, explicit_models=all_models(model_repository),
                                     env=env)
            ports = running.__enter__()
            self._logs[ports], self._pids[ports] = log, process_with_argument(f"--http-port={ports.http}")
            self._running.append(running)
            self._servers[key] = ports
        return self._servers[key]

    def pid(self, ports) -> int | None:
        """The pid of the tritonserver on these ports."""
        return self._pids[ports]

    def log(self, ports) -> Path:
        """The log of the tritonserver on these ports."""
        return self._logs[ports]

    def _zombies(self) -> list[tuple[dict, object, dict[int, str]]]:
        """(env, Ports, its zombie children) of each server the watch has not stopped, from one read of /proc."""
        running = [(dict(env), ports) for (_, env), ports in list(self._servers.items())
                   if ports not in self.deaths and self._pids[ports] is not None]
        if not running:
            return []
        zombies = zombie_children_of(self._pids[ports] for _, ports in running)
        return [(env, ports, zombies.get(self._pids[ports], {})) for env, ports in running]

    def watch(self) -> None:
        """Stops a shared server whose stub has died, so that the test waiting on it fails within seconds instead of
        waiting out its client's timeout (600 s): Triton never answers the requests a dead stub held, and stopping
        the server closes their connections. The reason is kept for every later test's check_alive."""
        for env, ports, zombies in self._zombies():
            before = self._sightings.get(ports, {})
            self._sightings[ports] = {pid: before.get(pid, 0) + 1 for pid in zombies}
            if any(looks >= self.LOOKS for looks in self._sightings[ports].values()):
                self.deaths[ports] = self._death(env, ports, zombies)
                # SIGKILL: after SIGTERM a server with a dead stub said "Exiting immediately" and lived on for minutes
                os.kill(self._pids[ports], signal.SIGKILL)

    def check_alive(self) -> None:
        """Fails the asking test at once when a Python stub of a shared server died (a crash leaves it a zombie that
        the server never reaps): Triton keeps the dead model READY and never answers the requests sent to it, so the
        test would wait out its clients' timeouts. The server's log has the stub's last Python stacks
        (faulthandler)."""
        for reason in self.deaths.values():
            pytest.fail(reason, pytrace=False)
        for env, ports, dead in self._zombies():
            if dead:
                pytest.fail(self._death(env, ports, dead), pytrace=False)

    def _death(self, env, ports, dead: dict[int, str]) -> str:
        log = self._logs[ports]
        return (f"a Python stub of the shared server for {env[MODEL_DIR_ENV]} died ({dead}; Triton would never "
                f"answer its requests): its log, {log}, says\n"
                f"{last_crash(log.read_text(errors='replace')) or '(no crash report)'}")

    def close(self) -> None:
        """Stops every server at once: each takes seconds to shut its models down."""
        self._watch.stop()
        with ThreadPoolExecutor(max(1, len(self._running))) as pool:
            list(pool.map(lambda running: running.__exit__(None, None, None), self._running))


@pytest.fixture(scope="session")
def servers(tmp_path_factory, pytestconfig):
    pool = ServerPool(tmp_path_factory)
    pytestconfig.stash[SERVER_POOL] = pool
    yield pool
    pool.close()


SERVER_POOL = pytest.StashKey[ServerPool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed after the watch stopped a shared server says why (its own error is only a lost
    connection)."""
    report = (yield).get_result()
    pool = item.config.stash.get(SERVER_POOL, None)
    if report.failed and pool is not None and pool.deaths:
        report.sections.append(("shared servers stopped (a stub died)", "\n\n".join(pool.deaths.values())))


@pytest.fixture(autouse=True)
def _shared_servers_alive(request):
    if "servers" in request.fixturenames:
        request.getfixturevalue("servers").check_alive()


@pytest.fixture(scope="session")
def server(servers, model_dir):
    """A real tritonserver with the project's model repository serving fp32 as `make serve QUANT=fp32` does (the fp32
    variant: the export's weights on the fused graph and its slot cache), on free loopback ports."""
    return servers.get(variant_folder(model_dir, "fp32"))


@pytest.fixture(scope="session")
def service(server, model_dir, tmp_path_factory):
    """The OpenAI-compatible service as `make serve` runs it, on a free port, in front of the shared fp32 server;
    yields the port."""
    log_path = tmp_path_factory.mktemp("openai") / "service.log"
    with running_openai_api(f"127.0.0.1:{server.grpc}", model_dir, log_path) as url:
        yield int(url.rsplit(":", 1)[1])
    print(f"service log: {log_path}")


@pytest.fixture(scope="session")
def client(service):
    """The official `openai` client of the shared service (no retries: a test sees each error)."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{service}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model(settings) -> str:
    """The served model's name."""
    return settings["model_name"]


@pytest.fixture(scope="session")
def variant_server(servers, model_dir):
    """variant_server("int4"): the shared tritonserver serving that weight variant (skips when it is not built)."""
    return lambda variant: servers.get(variant_folder(model_dir, variant))


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
def _module_tree(module) -> ast.Module | None:
    try:
        return ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return None


@functools.cache
def _definitions(module) -> dict[int, ast.AST]:
    """The module's function definitions (nested ones too) by the line their code object starts at: the first
    decorator's, or the def's. Looked up there, a function's source is parsed once with its module's."""
    tree = _module_tree(module)
    if tree is None:
        return {}
    return {min([node.lineno] + [d.lineno for d in node.decorator_list]): node for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


@functools.cache
def _server_starters(module) -> frozenset[str]:
    """The top-level functions and classes of a module that start a server, themselves or through one another."""
    tree = _module_tree(module)
    if tree is None:
        return frozenset()
    nodes = {node.name: node for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    starters = {name for name, node in nodes.items() if _starts_one_itself(node)}
    names = {name: _names(node) for name, node in nodes.items()}
    while grown := {name for name in nodes if names[name] & starters} - starters:
        starters |= grown
    return frozenset(starters)


@functools.cache
def _starts_a_server(function) -> bool:
    """Whether a test or fixture function starts a server, itself or through a function of its own module (helpers
    in other files are not followed: tests/helpers.py starts none)."""
    module = inspect.getmodule(function)
    code = getattr(function, "__code__", None)
    node = _definitions(module).get(code.co_firstlineno) if module and code else None
    if node is None:
        try:
            node = ast.parse(textwrap.dedent(inspect.getsource(function)))
        except (OSError, TypeError, SyntaxError):
            return False
    return _starts_one_itself(node) or bool(module and _names(node) & _server_starters(module))


def _server_source(item) -> str | None:
    """What makes this test start a server (the fixture named, or the test itself), or None."""
    for name, definitions in sorted(item._fixtureinfo.name2fixturedefs.items()):
        # The last definition is the one the test gets (a file's own overrides conftest's), and those it asks for
        # by its own name.
        active = definitions[-1:]
        while len(active) < len(definitions) and name in inspect.signature(active[0].func).parameters:
            active = definitions[-len(active) - 1:]
        if any(_starts_a_server(definition.func) for definition in active):
            return f"its fixture `{name}`"
    return "the test itself" if _starts_a_server(item.function) else None


# The files that take longest, longest first (their summed --durations in a `make test` on the 2-core machine, in
# seconds, and in the fast suite: docs/testing.md). `make test` hands whole files to whichever worker is free, in
# collection order (`--dist loadfile --no-loadscope-reorder`): a long file that came last would run alone at the end.
# xdist's own order (most tests first) put the tiny models, the quick sweep and Ray last; the fast suite's long files
# listed too keep its workers within a few seconds of each other. The other files follow in name order.
LONGEST_FIRST = [
    "test_guided_engine.py",  # 21, fast suite 33: the fast suite's longest by far (its other files: 12 s or less)
    "test_architectures.py",  # 100 (its seven architectures built in one process, then served one after another)
    "test_loadtests.py",  # 72
    "test_tiny_model.py",  # 67
    "test_ray_batch.py",  # 64
    "test_recovery.py",  # 59
    "test_gguf_types.py",  # 55, fast suite 7
    "test_lora.py",  # 51, fast suite 15
    "test_prefix_cache_server.py",  # 49
    "test_batch_api.py",  # 48
    "test_quantized_variants.py",  # 40, fast suite 7
    "test_strategies.py",  # 39
    "test_lm_eval.py",  # 38
    "test_server.py",  # 37
    "test_client_libraries.py",  # 36
    "test_fault_isolation.py",  # 33
    "test_structured_server.py",  # 30
    "test_limits.py",  # 30
    "test_streaming.py",  # 28
    "test_runtime_server.py",  # 21
    "test_run_batch.py",  # 18, fast suite 6
    "test_fast_variant.py",  # 16
]


def longest_first(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


def pytest_collection_modifyitems(items):
    longest_first(items)


@pytest.hookimpl(tryfirst=True)  # before its fixtures start anything
def pytest_runtest_setup(item):
    """The `server` marker's check, on the tests that run without it (reading a test's sources is the costly part:
    checked here, a worker reads only the files it runs, and a marked test needs no look)."""
    if item.get_closest_marker("server") or not isinstance(item, pytest.Function):
        return
    source = _server_source(item)
    if source is not None:
        pytest.fail(f"{item.nodeid} starts a tritonserver ({source}) but has no `server` marker: "
                    "add `pytestmark = pytest.mark.server` to its file, or @pytest.mark.server to the test",
                    pytrace=False)
