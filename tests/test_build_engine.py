"""scripts/prepare/build_engine.py: the limits and graph sizes of the real config and export, the builder settings of each
precision, the manifest of a build, and the script's one-line failure without TensorRT; the tests marked gpu build
small engines from the real export and hold TensorRTDecoder's logits and greedy tokens to the CPU decoder's."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from python_backend.model_files import ONNX_FILE
from python_backend.runtime.decoder import ServingLimits
from python_backend.runtime.engine_manifest import EngineManifest, EngineMismatchError, load
from scripts.prepare import build_engine
from scripts.prepare.build_engine import (BuildError, GraphDims, config_limits, make_manifest, make_plan, precision_flags,
                                  precision_problem, read_graph_dims, write_engine)
from scripts.paths import MODEL_REPOSITORY, PROJECT_ROOT
from tests.helpers import config_limits_from_text


@pytest.fixture(scope="module")
def hf_config(model_dir) -> dict:
    return json.loads((model_dir / "hf" / "config.json").read_text())


def test_graph_sizes_of_the_real_export(model_dir, hf_config):
    assert read_graph_dims(model_dir / ONNX_FILE) == GraphDims(
        num_layers=hf_config["num_hidden_layers"], num_kv_heads=hf_config["num_key_value_heads"],
        head_dim=hf_config["head_dim"], vocab_size=hf_config["vocab_size"], cache_dtype="float32")


def test_graph_sizes_are_read_without_the_weights(model_dir, monkeypatch):
    import onnx

    calls = []
    real_load = onnx.load
    monkeypatch.setattr(onnx, "load", lambda *args, **kwargs: calls.append(kwargs) or real_load(*args, **kwargs))
    read_graph_dims(model_dir / ONNX_FILE)
    assert calls == [{"load_external_data": False}]


DECODER_INPUTS = ["input_ids", "attention_mask", "position_ids", "logits_positions", "past_key_values.0.key",
                  "past_key_values.0.value"]
DECODER_OUTPUTS = ["logits", "present.0.key", "present.0.value"]


def save_graph(path, inputs: list[str], outputs: list[str], domain: str = ""):
    """An ONNX graph with these inputs and outputs, each a [1, 3, 1, 64] float tensor, made by Identity nodes of
    this operator domain (what the nodes compute does not matter)."""
    import onnx
    from onnx import TensorProto, helper

    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 3, 1, 64]) for name in inputs + outputs]
    nodes = [helper.make_node("Identity", [inputs[0]], [name], domain=domain) for name in outputs]
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", values[:len(inputs)], values[len(inputs):])), str(path))
    return path


def test_a_graph_that_is_not_the_decoder_is_refused(tmp_path):
    with pytest.raises(BuildError, match="not a decoder"):
        read_graph_dims(save_graph(tmp_path / "model.onnx", ["x"], ["y"]))


def test_a_graph_with_another_interface_is_refused(tmp_path):
    inputs = [name for name in DECODER_INPUTS if name != "position_ids"]
    with pytest.raises(BuildError, match="missing or unexpected: position_ids, hidden_states"):
        read_graph_dims(save_graph(tmp_path / "model.onnx", inputs, DECODER_OUTPUTS + ["hidden_states"]))


def test_the_decoder_interface_is_accepted(tmp_path):
    dims = read_graph_dims(save_graph(tmp_path / "model.onnx", DECODER_INPUTS, DECODER_OUTPUTS))
    assert dims == GraphDims(num_layers=1, num_kv_heads=3, head_dim=64, vocab_size=64, cache_dtype="float32")


def test_onnxruntime_only_operators_are_refused(tmp_path):
    """scripts/prepare/quantize.py's int4 and int8 variants compute with com.microsoft.MatMulNBits."""
    path = save_graph(tmp_path / "model.onnx", DECODER_INPUTS, DECODER_OUTPUTS, domain="com.microsoft")
    with pytest.raises(BuildError, match=r"cannot parse \(com\.microsoft\.Identity\).*fp32 export"):
        read_graph_dims(path)


def test_limits_come_from_the_llm_config():
    assert config_limits(MODEL_REPOSITORY) == config_limits_from_text()


def test_plan_of_the_real_export(model_dir, hf_config, decoder):
    plan = make_plan(model_dir, timing_cache=None)
    config = config_limits_from_text()
    assert (plan.limits.max_batch_size, plan.limits.max_prefill_tokens, plan.limits.max_context_length) == (
        config.max_batch_size, config.max_prefill_tokens, config.max_context_length)
    assert (plan.limits.num_layers, plan.limits.num_kv_heads, plan.limits.head_dim) == (
        hf_config["num_hidden_layers"], hf_config["num_key_value_heads"], hf_config["head_dim"])
    # Two profiles (decode, prefill), each with a range for every input of the real export that holds the graph's
    # fixed sizes and reaches the config's limits.
    graph_inputs = {i.name: i.shape for i in decoder.session.get_inputs()}
    assert len(plan.profiles) == 2
    for profile in plan.profiles:
        assert set(profile) == set(graph_inputs)
        for name, shapes in profile.items():
            for axis, size in enumerate(graph_inputs[name]):
                if isinstance(size, int):
                    assert shapes.min[axis] == shapes.opt[axis] == shapes.max[axis] == size, (name, axis)
        assert profile["input_ids"].max == profile["position_ids"].max == (config.max_batch_size,
                                                                             config.max_prefill_tokens)
        assert profile["attention_mask"].max == (config.max_batch_size, config.max_context_length)
        assert profile["past_key_values.0.key"].max == (config.max_batch_size, hf_config["num_key_value_heads"],
                                                        config.max_context_length - 1, hf_config["head_dim"])
        assert all(lo == 1 for name in ("input_ids", "attention_mask") for lo in profile[name].min)
        assert profile["past_key_values.0.value"].min[2] == 0  # a prefill has no past
    assert plan.onnx_path == model_dir / ONNX_FILE
    assert plan.engine_path == model_dir / "tensorrt" / "model.plan"
    assert plan.workspace_bytes == 8 << 30 and plan.timing_cache_path is None
    assert (plan.precision, plan.builder_flags, plan.network_flags) == ("fp16", ("FP16",), ())


def test_limits_given_replace_the_configs(model_dir):
    plan = make_plan(model_dir, limits=ServingLimits(max_batch_size=4, max_prefill_tokens=64, max_context_length=128))
    for profile in plan.profiles:
        assert profile["input_ids"].max == (4, 64)
        assert profile["attention_mask"].max == (4, 128)


def test_limits_on_the_command_line_replace_the_configs():
    config = config_limits_from_text()
    args = build_engine.parse_args(["--model-dir", "build/model", "--max-batch-size", "4"])
    assert build_engine.chosen_limits(args) == ServingLimits(4, config.max_prefill_tokens, config.max_context_length)
    assert build_engine.chosen_limits(build_engine.parse_args(["--model-dir", "build/model"])) is None


@pytest.mark.parametrize("precision, network_flags, builder_flags, cleared", [
    ("fp16", (), ("FP16",), ()),
    ("bf16", (), ("BF16",), ()),
    ("fp32", (), (), ("TF32",)),
    ("strongly-typed", ("STRONGLY_TYPED",), (), ()),
])
def test_builder_settings_of_each_precision(precision, network_flags, builder_flags, cleared):
    assert precision_flags(precision) == (network_flags, builder_flags, cleared)


def test_an_unknown_precision_is_refused():
    with pytest.raises(BuildError, match="unknown precision 'int8'"):
        precision_flags("int8")


def test_bf16_needs_ampere_or_newer():
    assert "8.0" in precision_problem("bf16", (7, 5))
    assert precision_problem("bf16", (8, 0)) is None
    assert precision_problem("fp16", (7, 5)) is None


def test_strongly_typed_takes_no_precision():
    with pytest.raises(SystemExit):
        build_engine.parse_args(["--model-dir", "build/model", "--strongly-typed", "--precision", "fp16"])
    assert build_engine.parse_args(["--model-dir", "m", "--strongly-typed"]).precision == "strongly-typed"
    assert build_engine.parse_args(["--model-dir", "m"]).precision == "fp16"


def test_manifest_of_a_build(model_dir):
    plan = make_plan(model_dir, precision="bf16", workspace_gb=2, limits=ServingLimits(4, 64, 128))
    manifest = make_manifest(plan, tensorrt_version="10.5.0", gpu_name="NVIDIA H200", compute_capability=(9, 0))
    onnx_bytes = (model_dir / ONNX_FILE).read_bytes()
    assert (manifest.tensorrt_version, manifest.gpu_name, manifest.compute_capability) == ("10.5.0", "NVIDIA H200",
                                                                                          (9, 0))
    assert (manifest.precision, manifest.workspace_bytes, manifest.limits) == ("bf16", 2 << 30, plan.limits)
    assert (manifest.vocab_size, manifest.cache_dtype, manifest.profiles) == (49152, "float32", plan.profiles)
    assert manifest.onnx.size == len(onnx_bytes)
    assert manifest.onnx.sha256 == hashlib.sha256(onnx_bytes).hexdigest()
    assert manifest.onnx.marks["export_complete.json"] == json.loads((model_dir / "export_complete.json").read_text())
    assert EngineManifest.from_json(manifest.to_json()) == manifest


@pytest.fixture
def small_plan(model_dir, tmp_path):
    return make_plan(model_dir, output=tmp_path / "tensorrt" / "model.plan", limits=ServingLimits(4, 64, 128))


def test_the_engine_and_its_manifest_replace_a_previous_build(small_plan):
    manifest = make_manifest(small_plan, "10.5.0", "NVIDIA H200", (9, 0))
    write_engine(small_plan.engine_path, b"previous engine", replace(manifest, tensorrt_version="10.4.0"))
    write_engine(small_plan.engine_path, b"engine bytes", manifest)
    assert small_plan.engine_path.read_bytes() == b"engine bytes"
    assert load(small_plan.engine_path) == manifest
    assert sorted(path.name for path in small_plan.engine_path.parent.iterdir()) == ["model.plan", "model.plan.json"]


def test_a_failed_engine_write_keeps_the_previous_build(small_plan):
    previous = make_manifest(small_plan, "10.5.0", "NVIDIA H200", (9, 0))
    write_engine(small_plan.engine_path, b"previous engine", previous)
    with pytest.raises(TypeError):
        write_engine(small_plan.engine_path, "not bytes", previous)
    assert small_plan.engine_path.read_bytes() == b"previous engine" and load(small_plan.engine_path) == previous
    assert not small_plan.engine_path.with_name("model.plan.partial").exists()


def test_a_new_engine_never_sits_beside_the_previous_manifest(small_plan, monkeypatch):
    previous = make_manifest(small_plan, "10.5.0", "NVIDIA H200", (9, 0))
    write_engine(small_plan.engine_path, b"previous engine", previous)

    def disk_full(self, engine_path):
        raise OSError("no space left on device")

    monkeypatch.setattr(EngineManifest, "save", disk_full)
    with pytest.raises(OSError):
        write_engine(small_plan.engine_path, b"new engine", replace(previous, tensorrt_version="10.6.0"))
    assert small_plan.engine_path.read_bytes() == b"new engine"
    with pytest.raises(EngineMismatchError, match="has no manifest"):
        load(small_plan.engine_path)


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.prepare.build_engine", *args], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_without_tensorrt_the_script_says_so_in_one_line(model_dir, tmp_path):
    try:
        import tensorrt  # noqa: F401

        pytest.skip("tensorrt is installed here: its absence cannot be seen")
    except ImportError:
        pass
    result = run_script("--model-dir", str(model_dir), "--output", str(tmp_path / "model.plan"),
                        "--timing-cache", str(tmp_path / "timing.cache"))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "needs the tensorrt Python package" in line
    assert list(tmp_path.iterdir()) == []


def test_help_tells_the_precisions():
    result = run_script("--help")
    assert result.returncode == 0
    for words in ("fp16 (default)", "bf16", "Ampere", "fp32", "INT8", "FP8", "Q/DQ", "Model Optimizer",
                  "--strongly-typed", "cannot produce"):
        assert words in result.stdout, words


# --- on a GPU with TensorRT: a real engine from the real export ---

SMALL = ServingLimits(max_batch_size=4, max_prefill_tokens=64, max_context_length=128)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors.", "def add(a, b):"]
DECODE_STEPS = 4


@pytest.fixture(scope="session")
def gpu():
    pytest.importorskip("tensorrt", reason="needs the tensorrt Python package (NVIDIA's TensorRT/Triton containers)")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: torch.cuda.is_available() is False")


@pytest.fixture(scope="module")
def small_engine(gpu, model_dir, tmp_path_factory):
    """precision -> the path of a small engine built from the real export (each built once, on first use)."""
    folder = tmp_path_factory.mktemp("engines")
    built = {}

    def build(precision: str):
        if precision not in built:
            path = folder / f"{precision}.plan"
            build_engine.build_engine(model_dir, path, precision, workspace_gb=4, timing_cache=folder / "timing.cache",
                                      limits=SMALL)
            built[precision] = path
        return built[precision]

    return build


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(prompt, apply_chat_template=True) for prompt in PROMPTS]


def tensorrt_decoder(path, model_dir):
    from python_backend.runtime.tensorrt_decoder import TensorRTDecoder

    return TensorRTDecoder(path, SMALL, onnx_path=model_dir / ONNX_FILE)


def run_steps(decoder, prompts, tokens=None):
    """Last-position logits [batch, vocab] of a left-padded prefill and DECODE_STEPS decode steps, feeding `tokens`
    (one array per step) or else each step's argmax; returns (logits per call, tokens fed)."""
    longest = max(len(prompt) for prompt in prompts)
    ids, mask = np.zeros((len(prompts), longest), np.int64), np.zeros((len(prompts), longest), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):], mask[row, longest - len(prompt):] = prompt, 1
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    logits, past = decoder.forward(ids, mask, positions, decoder.empty_cache(len(prompts)))
    all_logits, fed, next_positions = [logits[:, -1]], [], mask.sum(axis=1)
    for step in range(DECODE_STEPS):
        chosen = tokens[step] if tokens is not None else all_logits[-1].argmax(axis=1)
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        logits, past = decoder.forward(chosen[:, None], mask, next_positions[:, None], past)
        all_logits.append(logits[:, -1])
        fed.append(chosen)
        next_positions = next_positions + 1
    return all_logits, fed


@pytest.fixture(scope="module")
def cpu_reference(decoder, prompt_ids):
    return run_steps(decoder, prompt_ids)


@pytest.mark.gpu
def test_the_build_writes_its_manifest(gpu, small_engine, model_dir):
    import tensorrt
    import torch

    manifest = load(small_engine("fp32"))
    assert (manifest.tensorrt_version, manifest.compute_capability) == (
        tensorrt.__version__, tuple(torch.cuda.get_device_capability(0)))
    assert (manifest.limits.max_batch_size, manifest.limits.max_prefill_tokens,
            manifest.limits.max_context_length) == (4, 64, 128)
    assert manifest.precision == "fp32"


@pytest.mark.gpu
def test_the_engine_has_the_exports_cache_and_vocabulary(gpu, small_engine, model_dir, decoder):
    trt_decoder = tensorrt_decoder(small_engine("fp32"), model_dir)
    assert trt_decoder.vocab_size == decoder.vocab_size
    shape, expected = trt_decoder.cache_shape, decoder.cache_shape
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype) == (
        expected.num_layers, expected.num_kv_heads, expected.head_dim, expected.dtype)
    empty = trt_decoder.empty_cache(3)
    assert len(empty) == 2 * shape.num_layers
    assert tuple(empty[0].shape) == (3, shape.num_kv_heads, 0, shape.head_dim) and empty[0].is_cuda


@pytest.mark.gpu
def test_fp32_engine_logits_match_the_cpu_decoder(gpu, small_engine, model_dir, prompt_ids, cpu_reference):
    expected, tokens = cpu_reference
    actual, _ = run_steps(tensorrt_decoder(small_engine("fp32"), model_dir), prompt_ids, tokens)
    for step, (got, want) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3, err_msg=f"call {step} (0: prefill)")


@pytest.mark.gpu
def test_fp16_engine_picks_the_same_tokens_on_most_rows(gpu, small_engine, model_dir, prompt_ids, cpu_reference):
    expected, tokens = cpu_reference
    actual, _ = run_steps(tensorrt_decoder(small_engine("fp16"), model_dir), prompt_ids, tokens)
    assert all(np.isfinite(got).all() for got in actual)
    same = [np.mean(got.argmax(axis=1) == want.argmax(axis=1)) for got, want in zip(actual, expected)]
    assert np.mean(same) >= 0.85, same


@pytest.mark.gpu
def test_fp32_engine_greedy_generation_equals_the_cpu_decoders(gpu, small_engine, model_dir, decoder, prompt_ids,
                                                              settings):
    from python_backend.engine.loop import generate
    from python_backend.engine.sampling import SamplingParams
    from python_backend.engine.sequence import Sequence

    def greedy(runtime):
        sequences = [Sequence(prompt_ids=ids, params=SamplingParams(max_tokens=12,
                                                                    end_ids=tuple(settings["eos_token_ids"])))
                     for ids in prompt_ids]
        generate(runtime, sequences)
        return [sequence.output_ids for sequence in sequences]

    expected = greedy(decoder)
    assert all(expected)
    assert greedy(tensorrt_decoder(small_engine("fp32"), model_dir)) == expected


@pytest.mark.gpu
def test_a_config_beyond_the_engine_is_refused_at_load(gpu, small_engine):
    from python_backend.runtime.tensorrt_decoder import TensorRTDecoder

    with pytest.raises(EngineMismatchError, match="config max_batch_size 8 > engine's 4"):
        TensorRTDecoder(small_engine("fp32"), ServingLimits(8, 64, 128))


@pytest.mark.gpu
def test_a_batch_beyond_the_profiles_is_a_clear_error(gpu, small_engine, model_dir):
    trt_decoder = tensorrt_decoder(small_engine("fp32"), model_dir)
    ids = np.ones((5, 2), np.int64)
    with pytest.raises(ValueError, match="outside the TensorRT engine's prefill profile"):
        trt_decoder.forward(ids, np.ones((5, 2), np.int64), np.tile(np.arange(2), (5, 1)), trt_decoder.empty_cache(5))
