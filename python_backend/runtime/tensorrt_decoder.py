"""One forward pass of the exported decoder on a TensorRT engine, its KV cache in torch tensors on one GPU.

The engine (scripts/prepare/build_engine.py) has two optimization profiles (python_backend/runtime/trt_profiles.py): 0 tuned
for decode steps, 1 for prefills. An execution context works in one profile at a time, so the decoder keeps one
context per profile, created and bound once. Each call sets the inputs' shapes and addresses, allocates the outputs
as torch tensors of the shapes TensorRT infers, and runs uploads and TensorRT's kernels on the decoder's own torch
CUDA stream, ordered after the caller's current stream (where the KV batch copied the past); reading the logits back
waits for that stream, so the present is complete when the caller uses it. Not the default stream itself: TensorRT
warns that enqueueV3 on it costs extra device-wide synchronizations.

Loading checks the engine's manifest (engine_manifest.py) against the config's limits, this TensorRT and this GPU
before deserializing: a mismatch is one clear error at load, not a failure at some later request.

Needs the tensorrt package and PyTorch with CUDA; without them the constructor raises RuntimeUnavailableError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from python_backend.runtime import engine_manifest
from python_backend.runtime.decoder import CacheShape, RuntimeUnavailableError, TorchTensors
from python_backend.runtime.onnx_decoder import logits_positions

TOKEN_INPUTS = ("input_ids", "attention_mask", "position_ids", "logits_positions")
LOGITS = "logits"
DECODE_PROFILE, PREFILL_PROFILE = 0, 1  # the order of trt_profiles.optimization_profiles
PROFILE_NAMES = ("decode", "prefill")
ADDRESS_ALIGNMENT = 256  # bytes: TensorRT requires it of every input and output address


def import_tensorrt(needed_for: str):
    try:
        import tensorrt
    except ImportError as error:
        raise RuntimeUnavailableError(
            f"{needed_for} needs the tensorrt Python package, not installed here ({error}); NVIDIA's Triton and "
            f"TensorRT containers have it, elsewhere `pip install tensorrt` on a machine with an NVIDIA GPU"
        ) from None
    return tensorrt


def _import_torch_with_cuda(device_id: int):
    try:
        import torch
    except ImportError:
        raise RuntimeUnavailableError("the tensorrt runtime needs PyTorch with CUDA: its KV cache lives in torch "
                                      "tensors on the GPU") from None
    if not torch.cuda.is_available():
        raise RuntimeUnavailableError("the tensorrt runtime needs an NVIDIA GPU, and torch sees none "
                                      "(torch.cuda.is_available() is False: no GPU, no driver or a CPU-only torch)")
    if not 0 <= device_id < torch.cuda.device_count():
        raise RuntimeUnavailableError(f"GPU {device_id} asked for, torch sees {torch.cuda.device_count()} GPU(s)")
    return torch


def tensorrt_to_torch_dtype(trt, torch, dtype):
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}
    if dtype not in table:
        raise RuntimeUnavailableError(f"the engine has a {dtype} input or output, which this runtime does not map")
    return table[dtype]


def _numpy_cache_dtype(torch, dtype) -> np.dtype:
    table = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16)}
    if dtype not in table:
        raise RuntimeUnavailableError(f"the engine's KV cache is {dtype}; this runtime holds float32 or float16")
    return table[dtype]


@dataclass(frozen=True)
class TensorSpec:
    is_input: bool
    dtype: object  # a torch dtype


class TensorRTDecoder:
    """The decoder interface of python_backend/runtime/decoder.py on a TensorRT engine built by `make engine`.

    limits: the config's max_batch_size, max_prefill_tokens and max_context_length (a DecoderLimits, a
    ServingLimits or anything with those attributes); onnx_path, if given, must be the export the engine came from.
    """

    def __init__(self, engine_path: str | os.PathLike, limits, device_id: int = 0,
                 onnx_path: str | os.PathLike | None = None):
        trt = import_tensorrt("the tensorrt runtime")
        torch = _import_torch_with_cuda(device_id)
        capability = tuple(torch.cuda.get_device_capability(device_id))
        self.manifest = engine_manifest.check(engine_path, engine_manifest.serving_limits(limits), trt.__version__,
                                              capability, onnx_path)
        self._trt, self._torch = trt, torch
        self.tensors = TorchTensors(f"cuda:{device_id}")
        self.vocab_size = self.manifest.vocab_size
        with torch.cuda.device(self.tensors.device):
            self._stream = torch.cuda.Stream(self.tensors.device)
            self._engine = self._deserialize(engine_path)
            self._io = self._engine_io()
            self.cache_shape = self._cache_shape()
            self._check_interface(engine_path)
            self._past_names = self.cache_shape.cache_names()
            self._present_names = self.cache_shape.present_names()
            self._contexts = self._create_contexts()
            # An input of zero elements (the past at a prefill) still needs a valid, aligned address.
            self._placeholder = torch.empty(ADDRESS_ALIGNMENT, dtype=torch.uint8, device=self.tensors.device)

    # --- loading ---

    def _deserialize(self, engine_path):
        trt = self._trt
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)  # must outlive the engine
        with open(engine_path, "rb") as source:
            engine = self._runtime.deserialize_cuda_engine(source.read())
        if engine is None:
            raise RuntimeUnavailableError(f"TensorRT could not deserialize {engine_path} (its log above says why); "
                                          f"{engine_manifest.REBUILD_HINT}")
        return engine

    def _engine_io(self) -> dict[str, TensorSpec]:
        trt, engine = self._trt, self._engine
        names = [engine.get_tensor_name(index) for index in range(engine.num_io_tensors)]
        return {name: TensorSpec(is_input=engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT,
                                 dtype=tensorrt_to_torch_dtype(trt, self._torch, engine.get_tensor_dtype(name)))
                for name in names}

    def _cache_shape(self) -> CacheShape:
        limits = self.manifest.limits
        first = self._io.get("past_key_values.0.key")
        if first is None:
            raise RuntimeUnavailableError("the engine has no input past_key_values.0.key: it is not a decoder with "
                                          f"a KV cache; {engine_manifest.REBUILD_HINT}")
        return CacheShape(num_layers=limits.num_layers, num_kv_heads=limits.num_kv_heads, head_dim=limits.head_dim,
                          dtype=_numpy_cache_dtype(self._torch, first.dtype))

    def _check_interface(self, engine_path) -> None:
        expected_inputs = set(TOKEN_INPUTS) | set(self.cache_shape.cache_names())
        expected_outputs = {LOGITS} | set(self.cache_shape.present_names())
        inputs = {name for name, spec in self._io.items() if spec.is_input}
        outputs = set(self._io) - inputs
        problems = _name_differences("inputs", inputs, expected_inputs)
        problems += _name_differences("outputs", outputs, expected_outputs)
        profiles = self._engine.num_optimization_profiles
        if profiles != len(PROFILE_NAMES):
            problems.append(f"{profiles} optimization profile(s), expected {len(PROFILE_NAMES)} (decode, prefill)")
        if problems:
            raise engine_manifest.EngineMismatchError(
                f"the TensorRT engine {engine_path} is not the decoder its manifest describes "
                f"({self.cache_shape.num_layers} layers): " + "; ".join(problems) + f"; {engine_manifest.REBUILD_HINT}")

    def _create_contexts(self) -> list:
        contexts = []
        for profile in (DECODE_PROFILE, PREFILL_PROFILE):
            context = self._engine.create_execution_context()
            if context is None:
                raise RuntimeUnavailableError("TensorRT could not create an execution context (out of GPU memory?)")
            context.set_optimization_profile_async(profile, self._stream.cuda_stream)
            contexts.append(context)
        self._stream.synchronize()
        return contexts

    # --- the decoder interface ---

    scores_prompts = False  # its engine's profiles hold logits_positions to one position (the last)

    def empty_cache(self, batch_size: int) -> list:
        s = self.cache_shape
        return [self.tensors.zeros((batch_size, s.num_kv_heads, 0, s.head_dim), s.dtype) for _ in self._past_names]

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                past: list) -> tuple[np.ndarray, list]:
        """Logits of the last position [batch, 1, vocab] (float32, host) and the present cache (torch, device)."""
        torch = self._torch
        if len(past) != len(self._past_names):
            raise ValueError(f"{len(past)} past tensors given, the engine takes {len(self._past_names)}")
        profile = DECODE_PROFILE if input_ids.shape[1] == 1 else PREFILL_PROFILE
        context = self._contexts[profile]
        with torch.cuda.device(self.tensors.device):
            self._stream.wait_stream(torch.cuda.current_stream(self.tensors.device))
            with torch.cuda.stream(self._stream):
                arrays = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                          "logits_positions": logits_positions(input_ids.shape[1], False)}
                feeds = {name: self.tensors.upload(np.asarray(array, np.int64)) for name, array in arrays.items()}
                feeds.update(zip(self._past_names, past))
                feeds = {name: self._bindable(tensor, self._io[name].dtype) for name, tensor in feeds.items()}
                self._bind_inputs(context, profile, feeds)
                outputs = self._allocate_outputs(context)
                if not context.execute_async_v3(self._stream.cuda_stream):
                    raise RuntimeError("TensorRT's execute_async_v3 failed (its log above says why)")
                logits = outputs[LOGITS].float().cpu().numpy()  # waits for the stream; the feeds live until then
        return logits, [outputs[name] for name in self._present_names]

    def _bindable(self, tensor, dtype):
        """This tensor as TensorRT can read it: on this device, of the engine's type, contiguous and aligned."""
        if tensor.device != self.tensors.device or tensor.dtype != dtype:
            tensor = tensor.to(device=self.tensors.device, dtype=dtype)
        if not tensor.is_contiguous() or tensor.data_ptr() % ADDRESS_ALIGNMENT:
            tensor = tensor.clone(memory_format=self._torch.contiguous_format)  # a fresh, aligned allocation
        return tensor

    def _address(self, tensor) -> int:
        return tensor.data_ptr() if tensor.numel() else self._placeholder.data_ptr()

    def _bind_inputs(self, context, profile: int, feeds: dict) -> None:
        for name, tensor in feeds.items():
            shape = tuple(tensor.shape)
            if not context.set_input_shape(name, shape):
                raise ValueError(self._outside_profile(name, shape, profile))
            context.set_tensor_address(name, self._address(tensor))

    def _outside_profile(self, name: str, shape: tuple, profile: int) -> str:
        low, _, high = self._engine.get_tensor_profile_shape(name, profile)
        limits = self.manifest.limits
        return (f"{name} shape {shape} is outside the TensorRT engine's {PROFILE_NAMES[profile]} profile "
                f"(min {tuple(low)}, max {tuple(high)}); the engine was built for max_batch_size "
                f"{limits.max_batch_size}, max_prefill_tokens {limits.max_prefill_tokens}, max_context_length "
                f"{limits.max_context_length}")

    def _allocate_outputs(self, context) -> dict:
        outputs = {}
        for name in [LOGITS, *self._present_names]:
            shape = tuple(context.get_tensor_shape(name))
            if any(size < 0 for size in shape):
                raise RuntimeError(f"TensorRT could not infer the shape of {name} from the inputs' shapes: {shape}")
            outputs[name] = self._torch.empty(shape, dtype=self._io[name].dtype, device=self.tensors.device)
            context.set_tensor_address(name, self._address(outputs[name]))
        return outputs


def _name_differences(kind: str, actual: set[str], expected: set[str]) -> list[str]:
    problems = []
    if expected - actual:
        problems.append(f"{kind} missing: {', '.join(sorted(expected - actual))}")
    if actual - expected:
        problems.append(f"unexpected {kind}: {', '.join(sorted(actual - expected))}")
    return problems
