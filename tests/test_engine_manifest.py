"""The manifest beside a TensorRT engine (python_backend/runtime/engine_manifest.py) and the check made with it when
the engine loads: a round trip through JSON, every mismatch with the config or the machine in one message, smaller
limits accepted, a missing or unreadable manifest a clear error; and TensorRTDecoder's load-time errors, which need
neither TensorRT nor a GPU to be seen."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import types

import pytest

from python_backend.runtime.decoder import RuntimeUnavailableError
from python_backend.runtime.engine_manifest import (EngineManifest, EngineMismatchError, OnnxFingerprint,
                                                    ServingLimits, check, load, manifest_path, serving_limits)
from python_backend.runtime.trt_profiles import DecoderLimits, optimization_profiles

ENGINE_LIMITS = DecoderLimits(max_batch_size=32, max_prefill_tokens=1024, max_context_length=2048, num_layers=2,
                              num_kv_heads=3, head_dim=64)
CONFIG = ServingLimits(max_batch_size=32, max_prefill_tokens=1024, max_context_length=2048)
HERE = {"tensorrt_version": "10.5.0", "compute_capability": (9, 0)}
EXPORT_MARK = {"source": "model.gguf", "size": 123, "export_format": 4}


@pytest.fixture
def onnx_file(tmp_path):
    """A stand-in export folder: onnx/model.onnx, its external data and the export's mark file."""
    path = tmp_path / "model" / "onnx" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"the graph")
    (path.parent / "model.onnx.data").write_bytes(b"the weights")
    (tmp_path / "model" / "export_complete.json").write_text(json.dumps(EXPORT_MARK))
    return path


def make_manifest(onnx_file) -> EngineManifest:
    return EngineManifest(tensorrt_version="10.5.0", gpu_name="NVIDIA H200", compute_capability=(9, 0),
                          precision="fp16", limits=ENGINE_LIMITS, vocab_size=49152, cache_dtype="float32",
                          profiles=tuple(optimization_profiles(ENGINE_LIMITS)), workspace_bytes=8 << 30,
                          onnx=OnnxFingerprint.of(onnx_file), built_at="2026-01-02T03:04:05+00:00")


@pytest.fixture
def engine(tmp_path, onnx_file):
    path = tmp_path / "model.plan"
    path.write_bytes(b"not a real engine: the check never deserializes")
    make_manifest(onnx_file).save(path)
    return path


def mismatch_lines(error: pytest.ExceptionInfo) -> list[str]:
    return [line for line in str(error.value).splitlines() if line.startswith("  - ")]


def test_json_round_trip(onnx_file):
    manifest = make_manifest(onnx_file)
    assert EngineManifest.from_json(manifest.to_json()) == manifest


def test_saved_beside_the_engine_with_json_appended(engine, onnx_file):
    assert manifest_path(engine) == engine.parent / "model.plan.json"
    assert load(engine) == make_manifest(onnx_file)


def test_the_json_is_plain_and_each_shape_on_one_line(engine):
    text = manifest_path(engine).read_text()
    raw = json.loads(text)
    assert raw["limits"]["max_batch_size"] == 32 and raw["compute_capability"] == [9, 0]
    assert raw["profiles"][0]["input_ids"] == {"min": [1, 1], "opt": [32, 1], "max": [32, 1024]}
    assert '"max": [32, 1024]' in text


def test_fingerprint_is_the_onnx_file_itself_and_the_export_mark(onnx_file):
    fingerprint = OnnxFingerprint.of(onnx_file)
    assert fingerprint.size == len(b"the graph")
    assert fingerprint.sha256 == hashlib.sha256(b"the graph").hexdigest()
    assert fingerprint.marks == {"export_complete.json": EXPORT_MARK}
    (onnx_file.parent / "model.onnx.data").write_bytes(b"other weights")  # not hashed: hundreds of MB
    assert OnnxFingerprint.of(onnx_file) == fingerprint


def test_the_same_limits_fit(engine):
    assert check(engine, CONFIG, **HERE).limits == ENGINE_LIMITS


def test_smaller_limits_fit(engine):
    check(engine, ServingLimits(max_batch_size=8, max_prefill_tokens=256, max_context_length=512), **HERE)


@pytest.mark.parametrize("config, here, expected", [
    (ServingLimits(64, 1024, 2048), HERE, "config max_batch_size 64 > engine's 32"),
    (ServingLimits(32, 2048, 2048), HERE, "config max_prefill_tokens 2048 > engine's 1024"),
    (ServingLimits(32, 1024, 4096), HERE, "config max_context_length 4096 > engine's 2048"),
    (CONFIG, {**HERE, "tensorrt_version": "10.6.0"},
     "TensorRT 10.6.0 here, but the engine was built with TensorRT 10.5.0"),
    (CONFIG, {**HERE, "compute_capability": (8, 0)},
     "GPU compute capability 8.0 here, but the engine was built on NVIDIA H200 (compute capability 9.0)"),
])
def test_each_mismatch_is_reported_with_the_fix(engine, config, here, expected):
    with pytest.raises(EngineMismatchError) as error:
        check(engine, config, **here)
    [line] = mismatch_lines(error)
    assert line.startswith(f"  - {expected}")
    assert str(engine) in str(error.value) and "make engine" in str(error.value)


def test_every_mismatch_in_one_message(engine):
    with pytest.raises(EngineMismatchError) as error:
        check(engine, ServingLimits(64, 2048, 4096), tensorrt_version="10.6.0", compute_capability=(8, 6))
    assert len(mismatch_lines(error)) == 5
    assert str(error.value).count("make engine") == 1


def test_another_export_does_not_fit(engine, onnx_file):
    check(engine, CONFIG, **HERE, onnx_path=onnx_file)
    onnx_file.write_bytes(b"another graph")
    with pytest.raises(EngineMismatchError, match="is not the export the engine was built from"):
        check(engine, CONFIG, **HERE, onnx_path=onnx_file)


def test_a_new_export_mark_does_not_fit(engine, onnx_file):
    (onnx_file.parent.parent / "export_complete.json").write_text(json.dumps({**EXPORT_MARK, "size": 456}))
    with pytest.raises(EngineMismatchError, match="is not the export"):
        check(engine, CONFIG, **HERE, onnx_path=onnx_file)


def test_a_missing_manifest_is_a_clear_error(engine):
    manifest_path(engine).unlink()
    with pytest.raises(EngineMismatchError, match=r"has no manifest .*model\.plan\.json.*make engine"):
        check(engine, CONFIG, **HERE)


def test_a_missing_engine_is_a_clear_error(tmp_path):
    with pytest.raises(EngineMismatchError, match="no TensorRT engine at .*make engine"):
        load(tmp_path / "model.plan")


@pytest.mark.parametrize("text", ["{", json.dumps({"format": 99}), json.dumps({"format": 1})])
def test_an_unreadable_manifest_is_a_clear_error(engine, text):
    manifest_path(engine).write_text(text)
    with pytest.raises(EngineMismatchError, match="cannot be read.*make engine"):
        load(engine)


def test_serving_limits_of_a_decoders_limits():
    assert serving_limits(ENGINE_LIMITS) == CONFIG


# --- TensorRTDecoder's load-time errors, without TensorRT or a GPU ---


def test_decoder_without_tensorrt_says_what_is_missing(engine, monkeypatch):
    from python_backend.runtime.tensorrt_decoder import TensorRTDecoder

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` fail, installed or not
    with pytest.raises(RuntimeUnavailableError, match="needs the tensorrt Python package"):
        TensorRTDecoder(engine, CONFIG)


def fake_tensorrt(version: str = "10.5.0") -> types.ModuleType:
    """Enough of a tensorrt module for the checks made before deserializing; deserializing fails the test."""
    module = types.ModuleType("tensorrt")
    module.__version__ = version

    def unexpected(*args, **kwargs):
        raise AssertionError("the engine was deserialized before its manifest was checked")

    module.Logger = module.Runtime = unexpected
    return module


def test_decoder_without_a_gpu_says_so(engine, monkeypatch):
    import torch

    from python_backend.runtime.tensorrt_decoder import TensorRTDecoder

    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeUnavailableError, match="needs an NVIDIA GPU"):
        TensorRTDecoder(engine, CONFIG)


def test_decoder_checks_the_manifest_before_deserializing(engine, monkeypatch):
    import torch

    from python_backend.runtime.tensorrt_decoder import TensorRTDecoder

    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(EngineMismatchError, match="config max_batch_size 64 > engine's 32"):
        TensorRTDecoder(engine, dataclasses.replace(ENGINE_LIMITS, max_batch_size=64))


def test_a_mismatch_is_a_runtime_that_cannot_run_here(engine, model_dir, monkeypatch, capsys):
    """As with any runtime that cannot run here, the llm model's load fails saying why, or, with
    allow_cpu_fallback, serves on the CPU."""
    import torch

    from python_backend.runtime.factory import RuntimeSettings, open_decoder
    from scripts.paths import PROJECT_ROOT

    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    settings = RuntimeSettings(runtime="tensorrt", engine_path=str(engine))
    larger = ServingLimits(64, 1024, 2048)
    with pytest.raises(RuntimeUnavailableError, match="config max_batch_size 64 > engine's 32"):
        open_decoder(settings, model_dir, larger, PROJECT_ROOT)
    decoder = open_decoder(dataclasses.replace(settings, allow_cpu_fallback=True), model_dir, larger, PROJECT_ROOT)
    assert type(decoder).__name__ == "OnnxDecoder"
    err = capsys.readouterr().err
    assert "does not fit this server" in err and "allow_cpu_fallback is set: serving on the CPU" in err
