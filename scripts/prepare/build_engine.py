"""Builds a TensorRT engine of the exported decoder, for the `llm` model's limits, and writes its manifest beside it.

    python -m scripts.prepare.build_engine --model-dir build/model     # -> build/model/tensorrt/model.plan (+ .json)
    make engine PRECISION=fp32

It builds on the first visible GPU (CUDA_VISIBLE_DEVICES=N picks another).

Run it on the machine (GPU model, TensorRT version) that will serve: an engine runs only there. The optimization
profiles (decode- and prefill-tuned) come from model_repository/llm/config.pbtxt's max_batch_size,
max_prefill_tokens and max_context_length (python_backend/runtime/trt_profiles.py), the layer, head and vocabulary
sizes from the ONNX graph's inputs and outputs. The manifest (python_backend/runtime/engine_manifest.py) records
them, with the TensorRT version and the GPU, so that loading can refuse an engine that does not fit.

Precisions (--precision):
  fp16 (default)  fp16 kernels where TensorRT finds them faster; inputs, outputs and the KV cache keep the export's
                  fp32 types.
  bf16            the same with bfloat16: Ampere GPUs (compute capability 8.0) and newer.
  fp32            fp32 only, TF32 off: the closest to the CPU decoder; the slowest.
INT8 weight-only and FP8 engines need an ONNX graph with Q/DQ (QuantizeLinear/DequantizeLinear) nodes, e.g. from
NVIDIA TensorRT Model Optimizer, built with --strongly-typed: the network then takes every type from the graph and
no precision flag is set. This project cannot produce such a graph here (Model Optimizer's calibration needs a GPU),
and scripts/prepare/quantize.py's int4/int8 variants use onnxruntime-only operators (MatMulNBits) that TensorRT does not
parse: build from the fp32 export.

The timing cache (--timing-cache) keeps the kernel timings across builds, which makes a rebuild much faster.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from python_backend.model_files import ONNX_FILE
from python_backend.runtime.decoder import CacheShape, RuntimeUnavailableError, ServingLimits
from python_backend.runtime.engine_manifest import (
    ENGINE_FILE,
    LIMIT_NAMES,
    EngineManifest,
    OnnxFingerprint,
    Profile,
    manifest_path,
)
from python_backend.runtime.tensorrt_decoder import LOGITS, TOKEN_INPUTS, import_tensorrt
from python_backend.runtime.trt_profiles import DecoderLimits, optimization_profiles
from scripts.launcher.model_config import llm_config, parameter
from scripts.paths import BUILD_DIR, MODEL_REPOSITORY

PRECISIONS = ("fp16", "bf16", "fp32")
STRONGLY_TYPED = "strongly-typed"
DEFAULT_TIMING_CACHE = BUILD_DIR / "tensorrt-timing.cache"
DEFAULT_WORKSPACE_GB = 8.0
_PAST_KEY = re.compile(r"past_key_values\.(\d+)\.key")


class BuildError(RuntimeError):
    """The engine cannot be built: the message says why and what to do."""


def log(message: str) -> None:
    print(f"build_engine: {message}", file=sys.stderr, flush=True)


# --- plain parts: no TensorRT needed ---


@dataclass(frozen=True)
class GraphDims:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    cache_dtype: str  # numpy's name, e.g. float32


def read_graph_dims(onnx_path: str | os.PathLike) -> GraphDims:
    """Layer, head and vocabulary sizes from the graph's inputs and outputs (its weights are not loaded)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    initializers = {tensor.name for tensor in model.graph.initializer}
    inputs = {value.name: value for value in model.graph.input if value.name not in initializers}
    outputs = {value.name: value for value in model.graph.output}
    num_layers = sum(1 for name in inputs if _PAST_KEY.fullmatch(name))
    _check_interface(onnx_path, set(inputs), set(outputs), num_layers)
    _check_standard_operators(onnx_path, model.graph)
    _, heads, _, head_dim = _fixed_dims(inputs["past_key_values.0.key"])
    vocab = _fixed_dims(outputs[LOGITS])[-1]
    if heads is None or head_dim is None or vocab is None:
        raise BuildError(f"{onnx_path}: the KV heads, head size and vocabulary must be fixed sizes in the graph")
    elem_type = inputs["past_key_values.0.key"].type.tensor_type.elem_type
    return GraphDims(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim, vocab_size=vocab,
                     cache_dtype=onnx.helper.tensor_dtype_to_np_dtype(elem_type).name)


def _fixed_dims(value) -> list[int | None]:
    return [dim.dim_value if dim.HasField("dim_value") else None for dim in value.type.tensor_type.shape.dim]


def _check_interface(onnx_path, inputs: set[str], outputs: set[str], num_layers: int) -> None:
    if num_layers == 0:
        raise BuildError(f"{onnx_path} has no past_key_values.N.key inputs: not a decoder with a KV cache")
    names = CacheShape(num_layers, num_kv_heads=0, head_dim=0, dtype=None)  # only its tensor names are used
    expected_inputs, expected_outputs = set(TOKEN_INPUTS) | set(names.cache_names()), {LOGITS, *names.present_names()}
    if inputs != expected_inputs or outputs != expected_outputs:
        differences = sorted(inputs ^ expected_inputs) + sorted(outputs ^ expected_outputs)
        raise BuildError(f"{onnx_path} is not the decoder interface of python_backend/runtime/onnx_decoder.py "
                         f"(missing or unexpected: {', '.join(differences)})")


def _check_standard_operators(onnx_path, graph) -> None:
    """TensorRT parses the standard ONNX operators, not onnxruntime's own (the int4/int8 variants' MatMulNBits)."""
    foreign = sorted({f"{node.domain}.{node.op_type}" for node in graph.node if node.domain not in ("", "ai.onnx")})
    if foreign:
        raise BuildError(f"{onnx_path} uses operators TensorRT cannot parse ({', '.join(foreign)}): build the "
                         f"engine from the fp32 export (--model-dir build/model, as `make engine` does)")


def config_limits(model_repository: str | os.PathLike) -> ServingLimits:
    """max_batch_size, max_prefill_tokens and max_context_length of the `llm` model's config.pbtxt."""
    path = Path(model_repository) / "llm" / "config.pbtxt"
    if not path.is_file():
        raise BuildError(f"no model config at {path}: --model-repository names the folder that holds llm/")
    config = llm_config(model_repository)

    def number(key: str) -> int:
        text = parameter(config, key)
        if not text.isdigit():
            raise BuildError(f"{path}: parameter {key} is {text!r}, not a number")
        return int(text)

    return ServingLimits(max_batch_size=int(config.max_batch_size), max_prefill_tokens=number("max_prefill_tokens"),
                         max_context_length=number("max_context_length"))


def decoder_limits(serving: ServingLimits, dims: GraphDims) -> DecoderLimits:
    try:
        return DecoderLimits(max_batch_size=serving.max_batch_size, max_prefill_tokens=serving.max_prefill_tokens,
                             max_context_length=serving.max_context_length, num_layers=dims.num_layers,
                             num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim)
    except ValueError as error:
        raise BuildError(f"invalid limits: {error}") from None


@dataclass(frozen=True)
class BuildPlan:
    """Everything the TensorRT build does, decided before TensorRT is called."""

    onnx_path: Path
    engine_path: Path
    timing_cache_path: Path | None
    precision: str
    workspace_bytes: int
    dims: GraphDims
    limits: DecoderLimits
    profiles: tuple[Profile, ...]
    network_flags: tuple[str, ...]  # names of trt.NetworkDefinitionCreationFlag members to set
    builder_flags: tuple[str, ...]  # names of trt.BuilderFlag members to set
    cleared_builder_flags: tuple[str, ...]  # ... and to clear


def precision_flags(precision: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(network flags, builder flags to set, builder flags to clear) for a precision."""
    if precision == STRONGLY_TYPED:
        return ("STRONGLY_TYPED",), (), ()
    if precision == "fp32":
        return (), (), ("TF32",)  # TensorRT allows TF32 by default: 10-bit mantissas in matrix products
    if precision in ("fp16", "bf16"):
        return (), (precision.upper(),), ()
    raise BuildError(f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)} or {STRONGLY_TYPED}")


def make_plan(model_dir: str | os.PathLike, output: str | os.PathLike | None = None, precision: str = "fp16",
              workspace_gb: float = DEFAULT_WORKSPACE_GB,
              timing_cache: str | os.PathLike | None = DEFAULT_TIMING_CACHE,
              model_repository: str | os.PathLike = MODEL_REPOSITORY,
              limits: ServingLimits | None = None) -> BuildPlan:
    """The build of <model_dir>'s ONNX graph; limits, if given, replace the config's (a smaller test engine)."""
    onnx_path = Path(model_dir) / ONNX_FILE
    if not onnx_path.is_file():
        raise BuildError(f"no exported model at {onnx_path}: run `make model` first")
    dims = read_graph_dims(onnx_path)
    decoder = decoder_limits(limits or config_limits(model_repository), dims)
    network_flags, builder_flags, cleared = precision_flags(precision)
    return BuildPlan(onnx_path=onnx_path, engine_path=Path(output) if output else Path(model_dir) / ENGINE_FILE,
                     timing_cache_path=Path(timing_cache) if timing_cache else None, precision=precision,
                     workspace_bytes=int(workspace_gb * (1 << 30)), dims=dims, limits=decoder,
                     profiles=tuple(optimization_profiles(decoder)), network_flags=network_flags,
                     builder_flags=builder_flags, cleared_builder_flags=cleared)


def precision_problem(precision: str, compute_capability: tuple[int, int]) -> str | None:
    if precision == "bf16" and tuple(compute_capability) < (8, 0):
        return (f"bf16 needs an Ampere or newer GPU (compute capability 8.0+), this one is "
                f"{'.'.join(map(str, compute_capability))}: use --precision fp16")
    return None


def make_manifest(plan: BuildPlan, tensorrt_version: str, gpu_name: str, compute_capability: tuple[int, int],
                  built_at: datetime | None = None) -> EngineManifest:
    return EngineManifest(
        tensorrt_version=tensorrt_version, gpu_name=gpu_name, compute_capability=tuple(compute_capability),
        precision=plan.precision, limits=plan.limits, vocab_size=plan.dims.vocab_size,
        cache_dtype=plan.dims.cache_dtype, profiles=plan.profiles, workspace_bytes=plan.workspace_bytes,
        onnx=OnnxFingerprint.of(plan.onnx_path),
        built_at=(built_at or datetime.now(timezone.utc)).isoformat(timespec="seconds"))


def gpu_identity() -> tuple[str, tuple[int, int]]:
    """The name and compute capability of the GPU TensorRT builds on (CUDA's device 0: the first of
    CUDA_VISIBLE_DEVICES), from torch if it has CUDA, else from nvidia-smi."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))
    except ImportError:
        pass
    first_visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"  # an index or a UUID
    query = ["nvidia-smi", f"--id={first_visible}", "--query-gpu=name,compute_cap", "--format=csv,noheader"]
    try:
        name, capability = subprocess.run(query, capture_output=True, text=True, check=True).stdout.rsplit(",", 1)
        major, minor = capability.strip().split(".")
        return name.strip(), (int(major), int(minor))
    except (OSError, subprocess.CalledProcessError, ValueError):
        raise BuildError("no NVIDIA GPU found (neither torch with CUDA nor nvidia-smi sees one): a TensorRT engine "
                         "is built on the GPU that will run it") from None


def write_engine(engine_path: Path, serialized, manifest: EngineManifest) -> None:
    """The engine, then its manifest: a manifest beside an engine means the engine is complete and is the one it
    describes. A write that fails leaves the previous engine and manifest as they were."""
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    partial = engine_path.with_name(engine_path.name + ".partial")
    try:
        with partial.open("wb") as target:
            target.write(serialized)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    manifest_path(engine_path).unlink(missing_ok=True)
    os.replace(partial, engine_path)
    manifest.save(engine_path)


# --- the TensorRT calls ---


def build_serialized_engine(trt, plan: BuildPlan):
    """The serialized engine (a buffer) of this plan; the timing cache is read before and written after."""
    logger = trt.Logger(trt.Logger.WARNING)
    try:
        builder = trt.Builder(logger)
    except (RuntimeError, TypeError) as error:  # no usable GPU or driver
        raise BuildError(f"TensorRT cannot start a builder ({error}): is an NVIDIA GPU and its driver here?") from None
    network = builder.create_network(_flag_bits(trt.NetworkDefinitionCreationFlag, plan.network_flags))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(plan.onnx_path)):  # reads the external weights beside the file
        errors = "; ".join(str(parser.get_error(index)) for index in range(parser.num_errors))
        raise BuildError(f"TensorRT cannot parse {plan.onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_bytes)
    for name in plan.builder_flags:
        config.set_flag(getattr(trt.BuilderFlag, name))
    for name in plan.cleared_builder_flags:
        config.clear_flag(getattr(trt.BuilderFlag, name))
    for shapes in plan.profiles:
        profile = builder.create_optimization_profile()
        for name, shape_range in shapes.items():
            profile.set_shape(name, shape_range.min, shape_range.opt, shape_range.max)
        config.add_optimization_profile(profile)
    _use_timing_cache(config, plan.timing_cache_path)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError("TensorRT could not build the engine (its log above says why)")
    _save_timing_cache(config, plan.timing_cache_path)
    return serialized


def _flag_bits(flags, names: tuple[str, ...]) -> int:
    bits = 0
    for name in names:
        bits |= 1 << int(getattr(flags, name))
    return bits


def _use_timing_cache(config, path: Path | None) -> None:
    if path is None:
        return
    cache = config.create_timing_cache(path.read_bytes() if path.is_file() else b"")
    if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
        log(f"the timing cache {path} does not fit this TensorRT or GPU; starting a fresh one")
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _save_timing_cache(config, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as target:
        target.write(config.get_timing_cache().serialize())


# --- the whole build ---


def build_engine(model_dir: str | os.PathLike, output: str | os.PathLike | None = None, precision: str = "fp16",
                 workspace_gb: float = DEFAULT_WORKSPACE_GB,
                 timing_cache: str | os.PathLike | None = DEFAULT_TIMING_CACHE,
                 model_repository: str | os.PathLike = MODEL_REPOSITORY,
                 limits: ServingLimits | None = None) -> EngineManifest:
    """Builds and writes the engine and its manifest; returns the manifest."""
    trt = import_tensorrt("building a TensorRT engine")
    gpu_name, capability = gpu_identity()
    plan = make_plan(model_dir, output, precision, workspace_gb, timing_cache, model_repository, limits)
    if problem := precision_problem(plan.precision, capability):
        raise BuildError(problem)
    log(f"building {plan.engine_path} ({plan.precision}) on {gpu_name} with TensorRT {trt.__version__}: "
        f"{_describe(plan.limits)}")
    started = time.monotonic()
    serialized = build_serialized_engine(trt, plan)
    manifest = make_manifest(plan, trt.__version__, gpu_name, capability)
    write_engine(plan.engine_path, serialized, manifest)
    log(f"done in {time.monotonic() - started:.0f} s: {plan.engine_path} and {manifest_path(plan.engine_path)}")
    return manifest


def _describe(limits: DecoderLimits) -> str:
    return (f"max_batch_size {limits.max_batch_size}, max_prefill_tokens {limits.max_prefill_tokens}, "
            f"max_context_length {limits.max_context_length}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.prepare.build_engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True, help="an exported model folder (make model)")
    parser.add_argument("--output", type=Path, help=f"the engine file (default: <model-dir>/{ENGINE_FILE}); its "
                                                    "manifest goes beside it, with .json appended")
    parser.add_argument("--precision", choices=PRECISIONS, help="fp16 (default), bf16 (Ampere+) or fp32")
    parser.add_argument("--strongly-typed", action="store_true",
                        help="take every type from the ONNX graph (Q/DQ-annotated INT8 or FP8 graphs); no --precision")
    parser.add_argument("--workspace-gb", type=float, default=DEFAULT_WORKSPACE_GB,
                        help="the builder's scratch memory limit, GiB (default %(default)s)")
    parser.add_argument("--timing-cache", type=Path, default=DEFAULT_TIMING_CACHE,
                        help="read before and written after the build (default: build/tensorrt-timing.cache)")
    parser.add_argument("--no-timing-cache", action="store_true", help="neither read nor write a timing cache")
    parser.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY,
                        help="where llm/config.pbtxt, whose limits the engine covers, is (default: model_repository)")
    for name in LIMIT_NAMES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="default: the llm config's")
    args = parser.parse_args(argv)
    if args.strongly_typed and args.precision:
        parser.error("--strongly-typed takes every type from the ONNX graph: drop --precision")
    args.precision = STRONGLY_TYPED if args.strongly_typed else (args.precision or "fp16")
    return args


def chosen_limits(args: argparse.Namespace) -> ServingLimits | None:
    """The config's limits with the ones given on the command line replaced; None if none was given."""
    given = {name: getattr(args, name) for name in LIMIT_NAMES if getattr(args, name) is not None}
    return replace(config_limits(args.model_repository), **given) if given else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        limits = chosen_limits(args)
        build_engine(args.model_dir, args.output, args.precision, args.workspace_gb,
                     None if args.no_timing_cache else args.timing_cache, args.model_repository, limits)
    except (BuildError, RuntimeUnavailableError) as error:
        log(str(error))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
