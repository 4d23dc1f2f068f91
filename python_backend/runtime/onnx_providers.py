"""onnxruntime's execution providers for each runtime, and the check that the one asked for is the one running.

onnxruntime falls back to the CPU without a word when a provider cannot load (no onnxruntime-gpu, no CUDA, no
TensorRT libraries): a model asking for a GPU would then serve from the CPU at a fraction of the speed. So the
session's providers are checked after it is made, and a missing one is a RuntimeUnavailableError that names it.

Provider options follow onnxruntime's documentation for the CUDA and TensorRT execution providers:
``user_compute_stream`` puts onnxruntime's kernels on torch's current stream, so that the cache's copies
(torch) and the forward pass (onnxruntime) are ordered without synchronising; the TensorRT provider gets FP16, an
engine cache and a timing cache on disk, and explicit optimization profiles (python_backend/runtime/trt_profiles.py)
in trtexec's ``name:AxBxC`` format, one entry per input and profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from python_backend.runtime.decoder import RuntimeUnavailableError
from python_backend.runtime.trt_profiles import DecoderLimits, optimization_profiles

CPU, CUDA, TENSORRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"
GPU_PACKAGE_HINT = ("install onnxruntime-gpu (built for this machine's CUDA and, for the TensorRT provider, TensorRT) "
                    "instead of onnxruntime, or run in NVIDIA's Triton container with it")


@dataclass(frozen=True)
class TensorrtProviderSettings:
    limits: DecoderLimits
    fp16: bool = True
    cache_dir: Path = Path("build/tensorrt-ep-cache")
    workspace_bytes: int = 4 << 30


def profile_shape_options(limits: DecoderLimits) -> dict[str, str]:
    """trt_profile_{min,opt,max}_shapes: every input of every profile, ``name:AxBxC`` joined by commas (an input
    named again starts the next profile)."""
    profiles = optimization_profiles(limits)
    options = {}
    for bound in ("min", "opt", "max"):
        entries = [f"{name}:{'x'.join(str(d) for d in getattr(shape_range, bound))}"
                   for profile in profiles for name, shape_range in profile.items()]
        options[f"trt_profile_{bound}_shapes"] = ",".join(entries)
    return options


def cuda_options(device_id: int, stream: int | None) -> dict[str, str]:
    options = {"device_id": str(device_id)}
    if stream is not None:
        options["user_compute_stream"] = str(stream)
    return options


def tensorrt_options(device_id: int, stream: int | None, settings: TensorrtProviderSettings) -> dict[str, str]:
    cache = str(settings.cache_dir)
    return {
        **cuda_options(device_id, stream),
        "trt_fp16_enable": str(settings.fp16),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": cache,
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": cache,
        "trt_max_workspace_size": str(settings.workspace_bytes),
        **profile_shape_options(settings.limits),
    }


def providers(runtime: str, device_id: int = 0, stream: int | None = None,
              tensorrt: TensorrtProviderSettings | None = None) -> list:
    """The providers list for ``ort.InferenceSession``, most preferred first. Nodes a GPU provider cannot run go
    to the next one (onnxruntime's graph partitioning); a provider that is missing altogether fails the check."""
    if runtime == "onnxruntime":
        return [CPU]
    if runtime == "onnxruntime-cuda":
        return [(CUDA, cuda_options(device_id, stream)), CPU]
    if runtime == "onnxruntime-tensorrt":
        if tensorrt is None:
            raise ValueError("the onnxruntime-tensorrt runtime needs its TensorrtProviderSettings")
        return [(TENSORRT, tensorrt_options(device_id, stream, tensorrt)), (CUDA, cuda_options(device_id, stream)), CPU]
    raise ValueError(f"not an onnxruntime runtime: {runtime!r}")


def require_available(runtime: str, available: list[str]) -> None:
    """Before making a session: is the provider this runtime needs in this onnxruntime build at all?"""
    wanted = {"onnxruntime-cuda": CUDA, "onnxruntime-tensorrt": TENSORRT}.get(runtime)
    if wanted and wanted not in available:
        raise RuntimeUnavailableError(
            f"runtime {runtime!r} needs onnxruntime's {wanted}, which this onnxruntime does not have "
            f"(it has {', '.join(available)}): {GPU_PACKAGE_HINT}")


def require_running(runtime: str, session_providers: list[str]) -> None:
    """After making a session: did the provider really load? (onnxruntime drops one that fails to load, e.g. when
    libcudnn or libnvinfer is missing, and only logs it.)"""
    wanted = {"onnxruntime-cuda": CUDA, "onnxruntime-tensorrt": TENSORRT}.get(runtime)
    if wanted and wanted not in session_providers:
        raise RuntimeUnavailableError(
            f"runtime {runtime!r}: onnxruntime has {wanted} but could not load it (the session runs on "
            f"{', '.join(session_providers)}); its log above says which library is missing: {GPU_PACKAGE_HINT}")
