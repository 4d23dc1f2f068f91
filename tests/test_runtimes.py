"""The llm model's runtimes without a server: the device code path (torch tensors through onnxruntime's IO binding)
is token-exact with the host path on the export and on the fused graph's slot cache (prefix caching on), and a
runtime that cannot run here says what is missing: on the engine tests' tiny model (tests/tiny_engine_model.py)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from python_backend.engine.kv_batch import KVBatch
from python_backend.engine.batch_sampling import choose_next
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.model_files import ONNX_FILE
from python_backend.runtime import onnx_providers
from python_backend.runtime.decoder import RuntimeUnavailableError, ServingLimits
from python_backend.runtime.factory import (GPU_RUNTIMES, RuntimeSettings, cpu_decoder, decoder_limits,
                                            open_decoder)
from python_backend.runtime.onnx_decoder import file_cache_shape
from python_backend.runtime.onnx_device_decoder import OnnxDeviceDecoder
from python_backend.runtime.trt_profiles import optimization_profiles
from scripts.paths import PROJECT_ROOT
from scripts.prepare.quantize import variant_dir
from tests.helpers import generate_staggered, variant_folder

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "用一句话介绍一下长城。",
           "List three colors.", "def add(a, b):", "Count from one to ten."]
LIMITS = ServingLimits(max_batch_size=32, max_prefill_tokens=1024, max_context_length=2048)


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    return tiny_decoder


@pytest.fixture(scope="module")
def device_decoder(tiny_dir):
    return OnnxDeviceDecoder.on_cpu(tiny_dir / ONNX_FILE)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p, apply_chat_template=True) for p in PROMPTS]


def test_the_device_path_generates_the_same_tokens_as_the_host_path(decoder, device_decoder, prompts):
    # Different max_tokens make rows leave the batch (select) while others run and join it (extend): continuous
    # batching runs every operation of the cache that the other strategies do.
    host = generate_staggered(decoder, prompts, "continuous")
    assert all(host)
    assert generate_staggered(device_decoder, prompts, "continuous") == host


def test_the_device_path_keeps_its_cache_in_torch_tensors_and_matches_logits(decoder, device_decoder, prompts):
    host_batch, host_logits, _ = KVBatch.prefill(decoder, prompts[:3])
    batch, logits, _ = KVBatch.prefill(device_decoder, prompts[:3])
    assert all(isinstance(t, torch.Tensor) for t in batch.past)
    assert isinstance(logits, np.ndarray) and logits.shape == (3, decoder.vocab_size)
    np.testing.assert_array_equal(logits, host_logits)
    joining, _, _ = KVBatch.prefill(device_decoder, prompts[3:5])
    host_joining, _, _ = KVBatch.prefill(decoder, prompts[3:5])
    batch.extend(joining)
    host_batch.extend(host_joining)
    batch.select([4, 0, 2])
    host_batch.select([4, 0, 2])
    tokens = np.array([11, 12, 13])
    np.testing.assert_array_equal(batch.step(device_decoder, tokens), host_batch.step(decoder, tokens))
    assert batch.cache_bytes() == host_batch.cache_bytes() > 0
    for device_t, host_t in zip(batch.past, host_batch.past):
        assert device_t.is_contiguous()
        np.testing.assert_array_equal(device_t.numpy(), host_t)


def test_choose_next_reads_host_logits_from_either_path(device_decoder, prompts):
    sequences = [Sequence(prompt_ids=p, params=SamplingParams(max_tokens=4, end_ids=(2,))) for p in prompts[:2]]
    _, logits, _ = KVBatch.prefill(device_decoder, [s.prompt_ids for s in sequences])
    tokens, failed = choose_next(sequences, logits)
    assert not failed and list(tokens) == [int(np.argmax(row)) for row in logits]


def test_sessions_take_the_environments_thread_count_where_the_config_names_none(monkeypatch):
    from python_backend.runtime import onnx_decoder

    assert [onnx_decoder.threads_from_environment(environ) for environ in (
        {}, {"TRITON_LLM_INTRA_OP_THREADS": ""}, {"TRITON_LLM_INTRA_OP_THREADS": " 3 "})] == [0, 0, 3]
    with pytest.raises(ValueError, match="TRITON_LLM_INTRA_OP_THREADS must be a whole number of threads.*'two'"):
        onnx_decoder.threads_from_environment({"TRITON_LLM_INTRA_OP_THREADS": "two"})
    monkeypatch.setattr(onnx_decoder, "DEFAULT_INTRA_OP_THREADS", 3)
    assert onnx_decoder.session_options(0).intra_op_num_threads == 3  # the config's 0
    assert onnx_decoder.session_options(2).intra_op_num_threads == 2  # the config's own count wins


def test_the_factory_opens_the_cpu_runtimes(tiny_dir):
    plain = open_decoder(RuntimeSettings(), tiny_dir, LIMITS, PROJECT_ROOT)
    bound = open_decoder(RuntimeSettings(io_binding=True), tiny_dir, LIMITS, PROJECT_ROOT)
    assert type(plain).__name__ == "OnnxDecoder" and type(bound).__name__ == "OnnxDeviceDecoder"


def test_a_fused_folder_opens_a_slot_decoder_on_each_path_and_tensorrt_refuses_it(tiny_dir):
    fused = variant_dir(tiny_dir, "fast")
    host = open_decoder(RuntimeSettings(), fused, LIMITS, PROJECT_ROOT)
    bound = open_decoder(RuntimeSettings(io_binding=True), fused, LIMITS, PROJECT_ROOT)
    assert (type(host).__name__, type(bound).__name__) == ("OnnxSlotDecoder", "OnnxSlotDeviceDecoder")
    assert host.kv_layout == bound.kv_layout == "slots"
    for runtime in ("tensorrt", "onnxruntime-tensorrt"):
        with pytest.raises(RuntimeUnavailableError, match=rf"fused graph .*TensorRT does not parse.*'{runtime}' serves "
                                                          "the export itself"):
            open_decoder(RuntimeSettings(runtime=runtime), fused, LIMITS, PROJECT_ROOT)
    if not torch.cuda.is_available():  # onnxruntime-cuda takes the fused graph: here it lacks only the GPU
        with pytest.raises(RuntimeUnavailableError, match=r"runtime 'onnxruntime-cuda' .*torch sees no CUDA device"):
            open_decoder(RuntimeSettings(runtime="onnxruntime-cuda"), fused, LIMITS, PROJECT_ROOT)


def test_the_slot_cache_on_the_device_path_gives_the_host_paths_tokens_with_prefix_caching(tiny_dir, prompts):
    """The fused graph through IO binding with its slots (and the prefix cache's blocks) in torch tensors, as
    onnxruntime-cuda runs it, here on CPU tensors: two rounds of prompts behind one shared prefix (the second round
    served from the cache), rows of different lengths leaving and joining; every token the host path's."""
    from python_backend.engine.core import EngineCore
    from python_backend.runtime.onnx_slot_decoder import OnnxSlotDeviceDecoder

    path = variant_folder(tiny_dir, "fp32") / ONNX_FILE
    prompts = prompts[:4]
    shared = [token for p in prompts for token in p][:48]
    config = SchedulerConfig(max_batch_size=8, kv_layout="slots", max_context_length=512, kv_budget_tokens=65536,
                             enable_kv_cache_reuse=True)

    def two_rounds(decoder):
        core = EngineCore(decoder, config)
        answers = []
        for _ in range(2):
            batch = [Sequence(prompt_ids=shared + p, params=SamplingParams(max_tokens=3 + 2 * i, end_ids=()))
                     for i, p in enumerate(prompts)]
            for seq in batch:
                core.add(seq)
            while core.step().progressed:
                pass
            answers.append([seq.output_ids for seq in batch])
        return answers, core

    host, host_core = two_rounds(cpu_decoder(path))
    device, device_core = two_rounds(OnnxSlotDeviceDecoder.on_cpu(path))
    assert device == host and all(host[0]) and host[0] == host[1]
    assert device_core.prefix.hit_tokens == host_core.prefix.hit_tokens >= len(prompts) * 48
    assert all(isinstance(buffer, torch.Tensor) for buffer in device_core.cache._buffers)


@pytest.mark.parametrize("runtime", GPU_RUNTIMES)
def test_a_gpu_runtime_without_a_gpu_fails_saying_what_is_missing(tiny_dir, runtime):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(RuntimeUnavailableError, match=rf"runtime '{runtime}' .*torch sees no CUDA device"):
        open_decoder(RuntimeSettings(runtime=runtime), tiny_dir, LIMITS, PROJECT_ROOT)


def test_allow_cpu_fallback_serves_on_the_cpu_and_says_why(tiny_dir, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    decoder = open_decoder(RuntimeSettings(runtime="onnxruntime-cuda", allow_cpu_fallback=True), tiny_dir, LIMITS,
                           PROJECT_ROOT)
    assert type(decoder).__name__ == "OnnxDecoder"
    assert "allow_cpu_fallback is set: serving on the CPU" in capsys.readouterr().err


def test_a_missing_or_unloaded_provider_is_named():
    with pytest.raises(RuntimeUnavailableError, match="needs onnxruntime's CUDAExecutionProvider.*onnxruntime-gpu"):
        onnx_providers.require_available("onnxruntime-cuda", ["CPUExecutionProvider"])
    with pytest.raises(RuntimeUnavailableError, match="TensorrtExecutionProvider but could not load it"):
        onnx_providers.require_running("onnxruntime-tensorrt", ["CUDAExecutionProvider", "CPUExecutionProvider"])
    onnx_providers.require_available("onnxruntime", ort.get_available_providers())
    onnx_providers.require_running("onnxruntime-cuda", ["CUDAExecutionProvider", "CPUExecutionProvider"])


@pytest.mark.parametrize("parameters, message", [
    ({"runtime": "cuda"}, "runtime must be one of onnxruntime, onnxruntime-cuda"),
    ({"precision": "int8"}, "precision must be one of fp16, fp32"),
    ({"io_binding": "maybe"}, "io_binding must be true or false"),
    ({"allow_cpu_fallback": "sure"}, "allow_cpu_fallback must be true or false"),
])
def test_bad_runtime_parameters_are_refused_clearly(parameters, message):
    with pytest.raises(ValueError, match=message):
        RuntimeSettings.from_parameters(parameters)


def test_runtime_parameters_are_read_from_the_config_values():
    settings = RuntimeSettings.from_parameters({"runtime": "onnxruntime-tensorrt", "precision": "fp32",
                                                "io_binding": "false", "allow_cpu_fallback": "true",
                                                "engine_path": "", "trt_cache_dir": "", "intra_op_threads": "2"},
                                               device_id=3)
    assert settings == RuntimeSettings(runtime="onnxruntime-tensorrt", precision="fp32", allow_cpu_fallback=True,
                                       device_id=3, intra_op_threads=2)
    assert settings.uses_gpu and not RuntimeSettings().uses_gpu


def _parse_profiles(option: str) -> list[dict[str, tuple[int, ...]]]:
    profiles: list[dict] = [{}]
    for entry in option.split(","):
        name, dims = entry.split(":")
        if name in profiles[-1]:
            profiles.append({})
        profiles[-1][name] = tuple(int(d) for d in dims.split("x"))
    return profiles


def test_the_tensorrt_provider_gets_both_profiles_for_every_input(tiny_dir):
    limits = decoder_limits(tiny_dir / ONNX_FILE, LIMITS)
    options = onnx_providers.tensorrt_options(0, 1234, onnx_providers.TensorrtProviderSettings(limits=limits))
    assert options["user_compute_stream"] == "1234" and options["trt_fp16_enable"] == "True"
    expected = optimization_profiles(limits)
    session_inputs = {i.name for i in ort.InferenceSession(str(tiny_dir / ONNX_FILE)).get_inputs()}
    for bound in ("min", "opt", "max"):
        parsed = _parse_profiles(options[f"trt_profile_{bound}_shapes"])
        assert len(parsed) == len(expected) == 2
        for profile, ranges in zip(parsed, expected):
            assert set(profile) == set(ranges) == session_inputs
            assert all(profile[name] == getattr(ranges[name], bound) for name in profile)


def test_decoder_limits_read_the_cache_dims_from_the_graph_without_its_weights(tiny_dir, decoder):
    limits = decoder_limits(tiny_dir / ONNX_FILE, LIMITS)
    shape = decoder.cache_shape
    assert (limits.num_layers, limits.num_kv_heads, limits.head_dim) == (shape.num_layers, shape.num_kv_heads,
                                                                         shape.head_dim)
    assert limits.max_batch_size == 32 and limits.max_context_length == 2048
    assert file_cache_shape(tiny_dir / ONNX_FILE) == shape  # the file's declared inputs, as the session sees them


class AlwaysToken:
    """A runtime that disagrees: the decoder it wraps, except that its logits always favour one token."""

    def __init__(self, decoder, token: int):
        self.decoder, self.token = decoder, token

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def forward(self, *inputs):
        logits, present = self.decoder.forward(*inputs)
        logits = logits.copy()
        logits[..., self.token] = logits.max() + 1
        return logits, present


def test_the_runtime_benchmark_compares_runtimes_on_the_same_tokens(decoder, tiny_dir, monkeypatch, capsys):
    from scripts.bench import runtime_benchmark

    # Short requests (the comparison is under test, not the workload); the session's decoder for onnxruntime, and
    # for "onnxruntime-cuda" a stand-in that gives other tokens than the CPU runtimes.
    workload = runtime_benchmark.workload
    monkeypatch.setattr(runtime_benchmark, "workload",
                        lambda n: [{**request, "max_tokens": 6} for request in workload(n)])
    opened, real_open = [], runtime_benchmark.open_decoder

    def open_decoder(settings, *args):
        opened.append(settings)
        if settings.runtime == "onnxruntime-cuda":
            return AlwaysToken(decoder, token=42)
        return decoder if settings == RuntimeSettings() else real_open(settings, *args)

    monkeypatch.setattr(runtime_benchmark, "open_decoder", open_decoder)
    runtimes = "onnxruntime,onnxruntime+io_binding,onnxruntime-cuda"
    assert runtime_benchmark.main(["--model-dir", str(tiny_dir), "--runtimes", runtimes, "--requests", "2",
                                   "--repeats", "1"]) == 0
    assert [(s.runtime, s.io_binding) for s in opened] == [("onnxruntime", False), ("onnxruntime", True),
                                                          ("onnxruntime-cuda", False)]
    rows = {row.split(" | ")[0].removeprefix("| "): row for row in capsys.readouterr().out.splitlines()
            if row.startswith("| onnxruntime")}
    assert list(rows) == runtimes.split(",")
    assert "x1.00" in rows["onnxruntime"]
    assert rows["onnxruntime+io_binding"].endswith("| True |"), "the device path gives the host path's tokens"
    assert rows["onnxruntime-cuda"].endswith("| False |"), "a runtime that gives other tokens is reported"


def test_the_sampling_benchmark_runs_every_row_to_max_tokens_greedy_and_really_sampled(tiny_dir, capsys):
    from scripts.bench import sampling_benchmark

    fp32 = variant_folder(tiny_dir, "fp32")
    prompts, decoder = [[1, 2, 3, 4], [5, 6, 7]], cpu_decoder(fp32 / ONNX_FILE)
    greedy, _ = sampling_benchmark.run(decoder, prompts, 6, sampled=False)
    sampled, _ = sampling_benchmark.run(decoder, prompts, 6, sampled=True)
    assert [len(ids) for ids in greedy + sampled] == [6] * 4
    assert sampled != greedy, "the sampled rows are sampled"
    assert sampling_benchmark.main(["--model-dir", str(fp32), "--requests", "2", "--max-tokens", "4",
                                    "--repeats", "1"]) == 0
    assert "2 rows x 4 tokens" in capsys.readouterr().out
