"""The ``runtime`` parameter of the llm model: which decoder runs the exported model, and on what.

- ``onnxruntime``: the CPU execution provider, the cache in numpy (the default); with ``io_binding: true`` the
  device path instead (torch CPU tensors through IO binding), which the tests use to cover the GPU code on a CPU;
- ``onnxruntime-cuda``: the CUDA execution provider, the cache in torch CUDA tensors;
- ``onnxruntime-tensorrt``: the TensorRT execution provider (FP16 unless ``precision: fp32``, engine and timing
  cache on disk, optimization profiles from the config's limits), the cache in torch CUDA tensors;
- ``tensorrt``: a serialized TensorRT engine built by ``make engine`` (scripts/prepare/build_engine.py), run with
  ``execute_async_v3`` on torch's CUDA stream.

A runtime that cannot run here fails the model's load with a RuntimeUnavailableError naming what is missing; only
``allow_cpu_fallback: true`` turns that into a warning and the CPU runtime.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from python_backend.config_values import flag
from python_backend.runtime.decoder import RuntimeUnavailableError, ServingLimits, TorchTensors
from python_backend.runtime.engine_manifest import ENGINE_FILE
from python_backend.runtime.trt_profiles import DecoderLimits

RUNTIMES = ("onnxruntime", "onnxruntime-cuda", "onnxruntime-tensorrt", "tensorrt")
GPU_RUNTIMES = RUNTIMES[1:]
TRT_EP_PRECISIONS = ("fp16", "fp32")

@dataclass(frozen=True)
class RuntimeSettings:
    runtime: str = "onnxruntime"
    io_binding: bool = False
    device_id: int = 0
    precision: str = "fp16"
    engine_path: str = ""
    trt_cache_dir: str = "build/tensorrt-ep-cache"
    allow_cpu_fallback: bool = False
    intra_op_threads: int = 0
    adapters: bool = False  # LoRA: the variant's adapter graph (python_backend/serving/llm_adapters.py turns it on)

    def __post_init__(self):
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, not {self.runtime!r}")
        if self.precision not in TRT_EP_PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(TRT_EP_PRECISIONS)}, not {self.precision!r} "
                             "(a TensorRT engine's precision is chosen when it is built: make engine PRECISION=...)")

    @classmethod
    def from_parameters(cls, params: dict[str, str], device_id: int = 0) -> "RuntimeSettings":
        """From the llm model's config.pbtxt parameters (absent ones keep their defaults)."""
        defaults = cls()
        return cls(
            runtime=params.get("runtime") or defaults.runtime,
            io_binding=flag(params.get("io_binding", ""), "io_binding"),
            device_id=device_id,
            precision=params.get("precision") or defaults.precision,
            engine_path=params.get("engine_path", ""),
            trt_cache_dir=params.get("trt_cache_dir") or defaults.trt_cache_dir,
            allow_cpu_fallback=flag(params.get("allow_cpu_fallback", ""), "allow_cpu_fallback"),
            intra_op_threads=int(params.get("intra_op_threads") or 0),
        )

    @property
    def uses_gpu(self) -> bool:
        return self.runtime in GPU_RUNTIMES


def open_decoder(settings: RuntimeSettings, model_dir: Path, limits: ServingLimits, project_root: Path):
    """The decoder for these settings; raises RuntimeUnavailableError when it cannot run here, unless the
    settings allow the CPU fallback."""
    try:
        return _open(settings, model_dir, limits, project_root)
    except RuntimeUnavailableError as error:
        if not (settings.allow_cpu_fallback and settings.uses_gpu):
            raise
        print(f"[llm] {error}; allow_cpu_fallback is set: serving on the CPU with onnxruntime", file=sys.stderr,
              flush=True)
        return _open(replace(settings, runtime="onnxruntime"), model_dir, limits, project_root)


def _open(settings: RuntimeSettings, model_dir: Path, limits: ServingLimits, project_root: Path):
    from python_backend.model_files import ONNX_FILE

    onnx_path = model_dir / ONNX_FILE
    from python_backend.runtime.onnx_slot_decoder import is_fused_graph

    if onnx_path.is_file() and is_fused_graph(onnx_path):
        if settings.adapters:
            onnx_path = _adapter_graph(model_dir)
        return _fused(settings, onnx_path, limits, project_root)
    if settings.adapters:
        raise ValueError(f"LoRA adapters need a variant's folder (the fused graph and its adapter graph: `make "
                         f"variants`); {model_dir} is the export's own graph")
    if settings.runtime == "onnxruntime":
        from python_backend.runtime.onnx_decoder import OnnxDecoder
        from python_backend.runtime.onnx_device_decoder import OnnxDeviceDecoder

        if settings.io_binding:
            return OnnxDeviceDecoder.on_cpu(onnx_path, settings.intra_op_threads)
        return OnnxDecoder(onnx_path, settings.intra_op_threads)
    tensors = cuda_tensors(settings.runtime, settings.device_id)  # every GPU runtime keeps its cache there
    if settings.runtime == "tensorrt":
        from python_backend.runtime.tensorrt_decoder import TensorRTDecoder

        engine = Path(settings.engine_path) if settings.engine_path else model_dir / ENGINE_FILE
        return TensorRTDecoder(_under(project_root, engine), limits, settings.device_id, onnx_path=onnx_path)
    return _onnxruntime_on_gpu(settings, onnx_path, tensors, limits, project_root)


def _fused(settings: RuntimeSettings, onnx_path: Path, limits: ServingLimits, project_root: Path):
    """A fused graph (a QUANT variant's folder: GroupQueryAttention writing its slot cache in place): on the CPU, or
    through IO binding with the cache in torch tensors (io_binding on the CPU; onnxruntime-cuda on a GPU). TensorRT
    parses neither GroupQueryAttention nor MatMulNBits, so the TensorRT runtimes serve the export itself."""
    from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder, OnnxSlotDeviceDecoder

    if settings.runtime in ("tensorrt", "onnxruntime-tensorrt"):
        raise RuntimeUnavailableError(
            f"{onnx_path} is a fused graph (a QUANT variant's folder: onnxruntime's GroupQueryAttention and "
            f"MatMulNBits, which TensorRT does not parse); {settings.runtime!r} serves the export itself: "
            "MODEL_DIR=build/model, which make gives a TensorRT RUNTIME (docs/gpu.md)")
    if settings.runtime == "onnxruntime":
        if settings.io_binding:
            return OnnxSlotDeviceDecoder.on_cpu(onnx_path, settings.intra_op_threads)
        return OnnxSlotDecoder(onnx_path, settings.intra_op_threads)
    tensors = cuda_tensors(settings.runtime, settings.device_id)  # onnxruntime-cuda
    return OnnxSlotDeviceDecoder(_gpu_session(settings, onnx_path, tensors, limits, project_root), tensors)


def open_draft_decoder(settings: RuntimeSettings, draft_dir: Path, limits: ServingLimits, project_root: Path):
    """Speculative decoding's draft model (python_backend/engine/speculative.py): a variant's fused graph, on the
    served model's runtime and device, without adapters."""
    from python_backend.model_files import ONNX_FILE
    from python_backend.runtime.onnx_slot_decoder import is_fused_graph

    onnx_path = draft_dir / ONNX_FILE
    if not (onnx_path.is_file() and is_fused_graph(onnx_path)):
        raise ValueError(f"a draft model is a QUANT variant's folder (a fused graph): {draft_dir} is not")
    return _fused(replace(settings, adapters=False), onnx_path, limits, project_root)


def _adapter_graph(model_dir: Path) -> Path:
    from python_backend.model_files import ADAPTER_ONNX_FILE

    path = model_dir / ADAPTER_ONNX_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapters need {path}, the variant's adapter graph: build the variant again (`make "
                         "variants`; variants built before adapters existed lack it)")
    return path


def cpu_decoder(onnx_path: Path, intra_op_threads: int = 0):
    """The CPU decoder for an ONNX file, whichever graph it is (the tools' way in: parity, benchmarks)."""
    from python_backend.runtime.onnx_decoder import OnnxDecoder
    from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder, is_fused_graph

    if is_fused_graph(onnx_path):
        return OnnxSlotDecoder(onnx_path, intra_op_threads)
    return OnnxDecoder(onnx_path, intra_op_threads)


def cuda_tensors(runtime: str, device_id: int) -> TorchTensors:
    try:
        import torch
    except ImportError as error:
        raise RuntimeUnavailableError(f"runtime {runtime!r} keeps the KV cache in torch CUDA tensors, and torch is "
                                      f"not installed ({error})") from error
    if not torch.cuda.is_available():
        raise RuntimeUnavailableError(
            f"runtime {runtime!r} keeps the KV cache in torch CUDA tensors, but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})")
    if device_id >= torch.cuda.device_count():
        raise RuntimeUnavailableError(f"runtime {runtime!r}: no CUDA device {device_id} "
                                      f"(torch sees {torch.cuda.device_count()})")
    return TorchTensors(f"cuda:{device_id}")


def _onnxruntime_on_gpu(settings, onnx_path: Path, tensors: TorchTensors, limits: ServingLimits, project_root):
    from python_backend.runtime.onnx_device_decoder import OnnxDeviceDecoder

    return OnnxDeviceDecoder(_gpu_session(settings, onnx_path, tensors, limits, project_root), tensors)


def _gpu_session(settings, onnx_path: Path, tensors: TorchTensors, limits: ServingLimits, project_root):
    """An onnxruntime session on the settings' GPU provider, on torch's current CUDA stream."""
    import onnxruntime as ort

    from python_backend.runtime import onnx_providers
    from python_backend.runtime.onnx_decoder import session_options

    onnx_providers.require_available(settings.runtime, ort.get_available_providers())
    stream = tensors.torch.cuda.current_stream(tensors.device).cuda_stream
    trt = None
    if settings.runtime == "onnxruntime-tensorrt":
        cache_dir = _under(project_root, Path(settings.trt_cache_dir))
        cache_dir.mkdir(parents=True, exist_ok=True)
        trt = onnx_providers.TensorrtProviderSettings(
            limits=decoder_limits(onnx_path, limits), fp16=settings.precision == "fp16", cache_dir=cache_dir)
    providers = onnx_providers.providers(settings.runtime, settings.device_id, stream, trt)
    session = ort.InferenceSession(str(onnx_path), session_options(settings.intra_op_threads), providers=providers)
    onnx_providers.require_running(settings.runtime, session.get_providers())
    return session


def decoder_limits(onnx_path: Path, limits: ServingLimits) -> DecoderLimits:
    """The config's limits with the cache's dimensions, read from the graph's inputs (not its weights)."""
    from python_backend.runtime.onnx_decoder import file_cache_shape

    shape = file_cache_shape(onnx_path)
    return DecoderLimits(max_batch_size=limits.max_batch_size, max_prefill_tokens=limits.max_prefill_tokens,
                         max_context_length=limits.max_context_length, num_layers=shape.num_layers,
                         num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)


def _under(root: Path, path: Path) -> Path:
    return path if path.is_absolute() else root / path
