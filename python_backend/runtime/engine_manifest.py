"""The manifest written beside a TensorRT engine (``model.plan`` -> ``model.plan.json``), and the check made with it
when the engine loads.

A serialized engine runs only on the TensorRT version that built it, on GPUs of the compute capability it was built
for, and only for input shapes inside its optimization profiles (python_backend/runtime/trt_profiles.py). TensorRT
itself reports a wrong version or GPU as a terse deserialization failure, and a shape outside the profiles only when
a request brings it. The manifest records what the engine was built with and for, so that loading can say at once,
in one message, everything that does not fit and how to fix it (rebuild with ``make engine``).

The ONNX file's fingerprint is its size and the sha256 of the ``.onnx`` file itself (the graph, a few MB), not of
its external weights (hundreds of MB); the export's mark file (scripts/prepare/build_marks.py), recorded beside it, changes
whenever the export or variant is made again from other inputs.

Plain code with unit tests (tests/test_engine_manifest.py): nothing here needs TensorRT or a GPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from python_backend.runtime.decoder import RuntimeUnavailableError, ServingLimits
from python_backend.runtime.trt_profiles import DecoderLimits, ShapeRange

MANIFEST_FORMAT = 1
ENGINE_FILE = "tensorrt/model.plan"  # inside an exported model folder, beside onnx/model.onnx
REBUILD_HINT = "rebuild the engine with `make engine` (python -m scripts.prepare.build_engine)"
# The mark files an export or a weights variant writes last (scripts/prepare/build_marks.py), read from the model folder.
MODEL_MARKS = ("export_complete.json", "quantize_complete.json")

Profile = dict[str, ShapeRange]
_INT_LIST = re.compile(r"\[[\d,\s]*\]")


class EngineMismatchError(RuntimeUnavailableError):
    """The engine cannot serve this configuration on this machine (or has no readable manifest)."""


LIMIT_NAMES = tuple(field.name for field in dataclasses.fields(ServingLimits))


@dataclass(frozen=True)
class OnnxFingerprint:
    path: str  # as given at build time: informative only, a model folder may be mounted elsewhere
    size: int
    sha256: str
    marks: dict[str, dict]  # mark file name -> its content, for those present in the model folder

    @classmethod
    def of(cls, onnx_path: str | os.PathLike) -> "OnnxFingerprint":
        path = Path(onnx_path)
        digest = hashlib.sha256()
        with path.open("rb") as source:
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
        model_dir = path.parent.parent  # <model dir>/onnx/model.onnx
        marks = {name: json.loads((model_dir / name).read_text()) for name in MODEL_MARKS
                 if (model_dir / name).is_file()}
        return cls(path=str(path), size=path.stat().st_size, sha256=digest.hexdigest(), marks=marks)

    def same_model(self, other: "OnnxFingerprint") -> bool:
        return (self.size, self.sha256, self.marks) == (other.size, other.sha256, other.marks)


@dataclass(frozen=True)
class EngineManifest:
    tensorrt_version: str
    gpu_name: str
    compute_capability: tuple[int, int]
    precision: str  # fp16, bf16, fp32 or strongly-typed (the ONNX's own types and Q/DQ nodes)
    limits: DecoderLimits
    vocab_size: int
    cache_dtype: str  # numpy's name of the KV cache's element type, e.g. float32
    profiles: tuple[Profile, ...]  # in the engine's profile order: decode, prefill
    workspace_bytes: int
    onnx: OnnxFingerprint
    built_at: str  # ISO 8601, UTC
    format: int = MANIFEST_FORMAT

    def to_json(self) -> str:
        text = json.dumps(dataclasses.asdict(self), indent=2)
        return _INT_LIST.sub(lambda match: json.dumps(json.loads(match.group())), text)  # a shape on one line

    @classmethod
    def from_json(cls, text: str) -> "EngineManifest":
        raw = json.loads(text)
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {raw.get('format')!r}, this code reads format {MANIFEST_FORMAT}")
        raw["compute_capability"] = tuple(raw["compute_capability"])
        raw["limits"] = DecoderLimits(**raw["limits"])
        raw["profiles"] = tuple({name: _range_from_json(shapes) for name, shapes in profile.items()}
                                for profile in raw["profiles"])
        raw["onnx"] = OnnxFingerprint(**raw["onnx"])
        return cls(**raw)

    def save(self, engine_path: str | os.PathLike) -> Path:
        path = manifest_path(engine_path)
        path.write_text(self.to_json() + "\n")
        return path


def _range_from_json(raw: dict) -> ShapeRange:
    return ShapeRange(min=tuple(raw["min"]), opt=tuple(raw["opt"]), max=tuple(raw["max"]))


def manifest_path(engine_path: str | os.PathLike) -> Path:
    return Path(f"{engine_path}.json")


def load(engine_path: str | os.PathLike) -> EngineManifest:
    """The manifest beside this engine; a missing engine, a missing or unreadable manifest are clear errors."""
    engine, path = Path(engine_path), manifest_path(engine_path)
    if not engine.is_file():
        raise EngineMismatchError(f"no TensorRT engine at {engine}: build it with `make engine` "
                                  f"(python -m scripts.prepare.build_engine)")
    if not path.is_file():
        raise EngineMismatchError(f"the TensorRT engine {engine} has no manifest {path} (the build writes it "
                                  f"last, so the build may have stopped half-way); {REBUILD_HINT}")
    try:
        return EngineManifest.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as error:
        raise EngineMismatchError(f"the TensorRT engine's manifest {path} cannot be read ({error}); "
                                  f"{REBUILD_HINT}") from error


def mismatches(manifest: EngineManifest, wanted: ServingLimits, tensorrt_version: str,
               compute_capability: tuple[int, int], onnx_path: str | os.PathLike | None = None) -> list[str]:
    """Every way this engine does not fit: the config's limits beyond the engine's (smaller ones are fine), another
    TensorRT version, another GPU generation, and (if onnx_path is given) another export than it was built from."""
    problems = []
    for name in LIMIT_NAMES:
        asked, built = getattr(wanted, name), getattr(manifest.limits, name)
        if asked > built:
            problems.append(f"config {name} {asked} > engine's {built}")
    if tensorrt_version != manifest.tensorrt_version:
        problems.append(f"TensorRT {tensorrt_version} here, but the engine was built with TensorRT "
                        f"{manifest.tensorrt_version} (an engine runs only on the version that built it)")
    if tuple(compute_capability) != tuple(manifest.compute_capability):
        problems.append(f"GPU compute capability {_capability(compute_capability)} here, but the engine was built "
                        f"on {manifest.gpu_name} (compute capability {_capability(manifest.compute_capability)})")
    if onnx_path is not None and Path(onnx_path).is_file():
        if not OnnxFingerprint.of(onnx_path).same_model(manifest.onnx):
            problems.append(f"{onnx_path} is not the export the engine was built from ({manifest.onnx.path}, "
                            f"{manifest.onnx.size} bytes, sha256 {manifest.onnx.sha256[:12]}...)")
    return problems


def check(engine_path: str | os.PathLike, wanted: ServingLimits, tensorrt_version: str,
          compute_capability: tuple[int, int], onnx_path: str | os.PathLike | None = None) -> EngineManifest:
    """The engine's manifest if the engine fits; else EngineMismatchError listing every mismatch."""
    manifest = load(engine_path)
    problems = mismatches(manifest, wanted, tensorrt_version, compute_capability, onnx_path)
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise EngineMismatchError(f"the TensorRT engine {engine_path} does not fit this server:\n{listed}\n"
                                  f"Fix: {REBUILD_HINT}, on this machine, from this config.")
    return manifest


def serving_limits(limits) -> ServingLimits:
    """The three config limits of a DecoderLimits, a ServingLimits or anything with those attributes."""
    return ServingLimits(**{name: int(getattr(limits, name)) for name in LIMIT_NAMES})


def _capability(capability) -> str:
    return ".".join(str(part) for part in capability)
