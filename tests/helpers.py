"""Plain helpers that several test files share (fixtures live in tests/conftest.py). Waits take a timeout that only
bounds a hung server or process, never a claim about the machine's speed."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import re
import threading
import time
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from python_backend.engine.loop import generate
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.sequence import Sequence
from python_backend.model_files import PARITY_REPORT_FILE
from python_backend.runtime.decoder import ServingLimits
from scripts.bench.workload import NEVER_WRITTEN
from scripts.clients.llm_client import GenerateClient, triton_inputs
from scripts.launcher.server_metrics import read_metrics
from scripts.paths import MODEL_REPOSITORY
from scripts.prepare.quantize import variant_dir


class _LazyModule(types.ModuleType):
    """A stand-in for a module, which imports it on the first public attribute a test reads. Names with a leading
    underscore are answered as missing without an import: pytest probes every name of a test module as it collects
    it (`_mock_name`, `__wrapped__`), which would import the module at once."""

    def __getattr__(self, attribute: str):
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self.__name__), attribute)


def lazy_module(name: str) -> types.ModuleType:
    """The module `name`, imported when a test first uses it. Every worker collects every file, so a heavy import at
    a file's top (openai 0.8 s, Ray Data and pandas 1.1 s) is paid by the workers that run none of its tests too."""
    return _LazyModule(name)


NO_EOS = NEVER_WRITTEN  # as end_id: generation runs to max_tokens
# The servers the suite starts take at least this long a step (TRITON_LLM_INJECT_FAULT's min_step_ms, set by
# tests/conftest.py; python_backend/runtime/fault_injection.py), so that a count of tokens is also a least time on
# any machine: a request of N tokens is still running N steps' time after it starts, and a bound of N tokens leaves
# a cancel at least that long to arrive. Below this machine's steps on SmolLM2 (about 40 ms at batch 1 on a thread),
# where it changes nothing; a machine many times faster runs the suite's servers as if it were about as fast.
SUITE_MIN_STEP_MS = 20
# A cancelled request stops within a few engine steps (2-5 tokens measured); the bound leaves room for a loaded
# machine where the client lags the engine (a second at SUITE_MIN_STEP_MS on a fast one), and stays far below the
# 1000 tokens such a request would otherwise make.
LEFTOVER_TOKENS = 50
# Five short chat prompts of different lengths and scripts, for the KV caches' batching tests.
KV_TEST_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "用一句话介绍一下长城。",
    "List three colors.",
    "def add(a, b):",
]

# A response_format schema and a tool of the OpenAI API, for structured outputs through the front and in batch lines.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "country": {"type": "string", "maxLength": 24}},
        "required": ["city", "country"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def wait_for(condition, timeout_s: float, interval_s: float = 0.02, message: str = "condition not met in time"
             ) -> float:
    """Seconds until condition() held; fails with message after timeout_s."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{message} (waited {timeout_s} s)"
        time.sleep(interval_s)
    return time.monotonic() - started


# --- a running server ---

def at_once(*calls) -> list:
    """Each call's result, the calls made at once, each on its own thread: requests a server runs as one batch (which
    changes no answer: tests/test_streaming.py), instead of one after another."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
    return [future.result() for future in futures]


@contextlib.contextmanager
def http_stub(handler):
    """A local HTTP server with `handler` (a BaseHTTPRequestHandler class) on a free port, for as long as the block
    runs. Its loop looks for shutdown every 20 ms, so that closing it costs no test half a second."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def metrics(server, strategy: str = "continuous", model: str = "llm") -> dict[str, float]:
    """The llm model's custom metrics under its model and strategy labels (empty if no model reports them)."""
    return read_metrics(f"127.0.0.1:{server.metrics}", model=model, strategy=strategy)


def metric_samples(server) -> list:
    """Every sample on the server's metrics port, histogram buckets and all labels included (prometheus_client's
    Sample: name, labels, value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def decode_steps_above(server, strategy, rows: int) -> float:
    """Decode steps so far that had more than ``rows`` sequences (rows must be a bucket bound of llm_batch_size)."""
    buckets = {float(s.labels["le"]): s.value for s in metric_samples(server) if s.name == "llm_batch_size_bucket"
               and s.labels.get("model") == "llm" and s.labels.get("strategy") == strategy}
    return buckets[float("inf")] - buckets[float(rows)]


def wait_idle(server, strategy: str = "continuous", timeout_s: float = 300) -> dict[str, float]:
    """The metrics once the engine has nothing running or waiting. The engine reports its state after handing out a
    step's tokens, so the token counters are complete by then."""
    def idle():
        values = metrics(server, strategy)
        return values["llm_running_sequences"] + values["llm_waiting_sequences"] == 0

    wait_for(idle, timeout_s, message="the engine did not become idle")
    return metrics(server, strategy)


def assert_ready(server) -> None:
    """Triton says ready, and a small request is served."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http}/v2/health/ready", timeout=10) as response:
        assert response.status == 200
    assert GenerateClient(f"127.0.0.1:{server.http}").complete({"text_input": "Hi", "max_tokens": 2}).output_tokens


@contextlib.contextmanager
def reconfigured_llm(server, **changes):
    """The server's `llm` reloaded with these changes (scripts.launcher.model_control.reload_llm's arguments) for the
    block, then loaded again with the config it had before: the shared servers are left as they were found."""
    import tritonclient.http as httpclient

    from scripts.launcher.model_control import reload_llm

    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http}", network_timeout=300, connection_timeout=300)
    before = client.get_model_config("llm")
    try:
        yield reload_llm(f"127.0.0.1:{server.http}", **changes) if changes else before
    finally:
        client.load_model("llm", config=json.dumps(before))


def long_request() -> dict:
    """A request for the ensemble that runs until cancelled (1000 tokens, EOS never met: at least 20 s at
    SUITE_MIN_STEP_MS)."""
    from scripts.bench.disconnect_storm import LONG_REQUEST

    return dict(LONG_REQUEST)


class BackgroundStream:
    """A gRPC streaming request to the ensemble that runs until cancel(); counts the tokens its client has received
    and notes the final response."""

    def __init__(self, server, request: dict):
        self.tokens, self.final = 0, False
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
        self.client.start_stream(callback=self._on_response)
        self.client.async_stream_infer("ensemble", triton_inputs(grpcclient, {**request, "stream": True}),
                                       enable_empty_final_response=True)

    def _on_response(self, result, error):
        if result is None:
            return
        count = result.as_numpy("num_output_tokens")
        if count is not None:
            self.tokens += int(count.reshape(-1)[0])
        if result.get_response().parameters.get("triton_final_response").bool_param:
            self.final = True

    def cancel(self) -> int:
        """Cancels the request (once; later calls do nothing); returns the tokens its client had received."""
        received = self.tokens
        if self.client is not None:
            self.client.stop_stream(cancel_requests=True)
            self.client.close()
            self.client = None
        return received

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()


def llm_request(prompt_ids: list[int], max_tokens: int, **sampling) -> dict:
    """The inputs of a direct request to the llm model: name -> (value, numpy dtype, Triton dtype)."""
    inputs = {"input_ids": (prompt_ids, np.int32, "INT32"), "max_tokens": (max_tokens, np.int32, "INT32")}
    for name, value in sampling.items():
        dtype, triton_type = {"seed": (np.uint64, "UINT64")}.get(name, (np.float32, "FP32"))
        inputs[name] = (value, dtype, triton_type)
    return inputs


def llm_stream(server, inputs: dict, timeout_s: float = 300) -> tuple[list[int], str | None]:
    """One direct request to the decoupled llm model over a gRPC stream: (all generated ids, error message or
    None)."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    tensors = []
    for name, (value, dtype, triton_type) in inputs.items():
        array = np.array([value if isinstance(value, list) else [value]], dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), triton_type)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    client.async_stream_infer("llm", tensors)
    ids: list[int] = []
    try:
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                return ids, error.message()
            ids += result.as_numpy("output_ids").reshape(-1).tolist()
            if result.as_numpy("finished").reshape(-1)[0]:
                return ids, None
    finally:
        client.stop_stream()


# --- builds ---

# `python -m scripts.prepare.export_onnx` and then `python -m scripts.prepare.quantize` for each variant asked for, in
# one process for every model given (a process each spent ~3 s importing torch again), with the greedy agreement of
# their parity checks on the first 4 load-test prompts instead of all of them: of a tiny random model the whole set
# says no more than 4 prompts do. The rest of the builds and their checks run as they are. A model's build ends with
# a line of its own (BUILT_MARK and [output, exit code] in JSON), so that each failure is told with its own output.
BUILT_MARK = "[export_tiny] "
_BUILD_ON_4_PROMPTS = """import json, sys, traceback
from scripts.prepare import export_onnx, quantize, variant_parity
all_prompts = variant_parity.load_test_prompts
variant_parity.load_test_prompts = lambda: all_prompts()[:4]
mark, builds, export_args, variants = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4:]
for source, output in builds:
    try:
        code = export_onnx.main(["--source", source, "--output", output, *export_args])
        for variant in variants:
            code = code or quantize.main(["--quant", variant, "--source", output])
    except SystemExit as stop:  # a refusal on the command line
        code = stop.code if isinstance(stop.code, int) else 1
    except Exception:
        traceback.print_exc()
        code = 1
    print(mark + json.dumps([output, code]), flush=True)
"""


def export_tinies(builds: list[tuple[Path, Path]], variants: tuple[str, ...] = (),
                  export_args: tuple[str, ...] = ()) -> dict[Path, str | None]:
    """The export of each tiny model (a Hugging Face folder or a GGUF file: source) into its output, run as `make
    model` runs it (with export_args added), and each of these variants built from it beside it
    (`<output>-<variant>`), as `make variants` builds them, all in one process: output -> None when its build passed,
    else the end of its output."""
    import subprocess
    import sys

    from scripts.paths import PROJECT_ROOT

    command = [sys.executable, "-c", _BUILD_ON_4_PROMPTS, BUILT_MARK,
               json.dumps([[str(s), str(o)] for s, o in builds]), json.dumps(list(export_args)), *variants]
    done = subprocess.run(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    results, lines = {}, []
    for line in done.stdout.splitlines(keepends=True):
        if line.startswith(BUILT_MARK):
            output, code = json.loads(line[len(BUILT_MARK):])
            results[Path(output)] = None if code == 0 else "".join(lines)[-3000:]
            lines = []
        else:
            lines.append(line)
    for _, output in builds:  # a build that never ended: the process died in it
        results.setdefault(Path(output), f"the build process died (exit {done.returncode}):\n{''.join(lines)[-3000:]}")
    return results


def export_tiny(source, output, variants: tuple[str, ...] = (), export_args: tuple[str, ...] = ()) -> None:
    """export_tinies of one model, failing with its output when its build fails."""
    error = export_tinies([(source, output)], variants, export_args)[Path(output)]
    assert error is None, error


# --- references ---

# Two logits of a reference's greedy step closer than this: a near tie, where another runtime's rounding may choose the
# runner-up. Random tiny models pass many (the engine tests' one: 8 of its 12 LoRA answers pass one under 0.006
# apart), and its logits moved 3.7e-3 against transformers on CI's machine (tests/tiny_engine_model.py).
NEAR_TIE = 0.01


def departures(answers: list[list[int]], keys: list, reference: dict, runners_up: dict, eos: list[int],
               near_tie: float = NEAR_TIE) -> dict:
    """The answers that leave the reference's (peft_reference's reference.json and runners_up.json: name -> each
    prompt's) other than at a near tie for its runner-up, each key (name, prompt index) -> where and how; and more
    than a third of them (rounded up) leaving it at near ties, under the key "near ties": what is not compared
    after a departure must stay the exception."""
    from scripts.eval.peft_reference import departure

    left = {(name, i): why for answer, (name, i) in zip(answers, keys, strict=True)
            if (why := departure(answer, reference[name][i], runners_up[name][i], eos, near_tie))}
    tied = [key for answer, key in zip(answers, keys) if key not in left and answer != reference[key[0]][key[1]]]
    if len(tied) > -(-len(answers) // 3):
        left["near ties"] = f"{len(tied)} of {len(answers)} answers left the reference at near ties: {tied}"
    return left


def hf_greedy(hf_model, settings, ids: list[int], max_tokens: int, **generate_args) -> list[int]:
    """transformers' greedy generate() from these prompt ids: the new token ids, without EOS."""
    from scripts.eval.peft_reference import greedy_ids

    return greedy_ids(hf_model, ids, max_tokens, settings["eos_token_ids"], **generate_args)


def outputs_alone(decoder, sequences: list[Sequence]) -> list[list[int]]:
    """Each sequence's greedy output ids, run by itself through the engine: what batching must not change."""
    for seq in sequences:
        generate(decoder, [seq])
    return [seq.output_ids for seq in sequences]


class CountingDecoder:
    """A real decoder (either KV layout), recording the shape of the tokens of each model call."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, input_ids, *args, **options):
        self.calls.append(input_ids.shape)
        return self.inner.forward(input_ids, *args, **options)

    def forward_in_place(self, input_ids, attention_mask, cache, **options):
        self.calls.append(input_ids.shape)
        return self.inner.forward_in_place(input_ids, attention_mask, cache, **options)


def fail_choice_after(seq: Sequence, tokens: int, message: str = "the logits are not finite") -> None:
    """Makes seq's next-token choice raise FloatingPointError(message) once it has generated this many tokens."""
    real_choose = seq.chooser.choose

    def choose_then_fail(logits, generated):
        if len(generated) == tokens:
            raise FloatingPointError(message)
        return real_choose(logits, generated)

    seq.chooser.choose = choose_then_fail


def generate_staggered(decoder, prompt_ids: list[list[int]], strategy: str = "continuous") -> list[list[int]]:
    """The engine's greedy output ids for these prompts, run together with max_tokens 8, 14, 20, 26, 8, ... so that
    rows leave the batch while others run (and, continuous, join it)."""
    sequences = [Sequence(prompt_ids=p, params=SamplingParams(max_tokens=8 + 6 * (i % 4), end_ids=(2,)))
                 for i, p in enumerate(prompt_ids)]
    generate(decoder, sequences, strategy=strategy)
    return [s.output_ids for s in sequences]


def config_limits_from_text(model_repository=MODEL_REPOSITORY) -> ServingLimits:
    """The llm config's limits read with a regex, independently of the project's config readers."""
    text = (model_repository / "llm" / "config.pbtxt").read_text()

    def parameter(key):
        return int(re.search(rf'key: "{key}" value: {{ string_value: "(\d+)" }}', text).group(1))

    return ServingLimits(max_batch_size=int(re.search(r"^max_batch_size: (\d+)", text, re.M).group(1)),
                         max_prefill_tokens=parameter("max_prefill_tokens"),
                         max_context_length=parameter("max_context_length"))


def variant_folder(model_dir, variant: str):
    """The folder of a weight variant of the export; the test skips, naming the command that builds it, when it is
    missing (`make test` builds every variant first, so CI never skips)."""
    import pytest

    folder = variant_dir(model_dir, variant)
    if not (folder / PARITY_REPORT_FILE).is_file():
        pytest.skip(f"no {variant} variant at {folder}: `make variants` builds it (make test does)")
    return folder
