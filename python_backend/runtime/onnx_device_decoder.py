"""The decoder on onnxruntime with the KV cache in torch tensors on one device, through onnxruntime's IO binding.

The past is bound by address (no copy); onnxruntime allocates the present and the logits on the same device from
its own arena, and they come back as torch tensors through DLPack (no copy either). Token ids, the mask and the
positions cross to the device at each step; only the last position's logits cross back. With CPU tensors and the
CPU provider this is the same code the GPU runs, which is how ``make test`` covers it token-exactly; with CUDA
tensors it runs on the CUDA or TensorRT execution provider (python_backend/runtime/onnx_providers.py).
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort

from python_backend.runtime.decoder import TorchTensors
from python_backend.runtime.onnx_decoder import (LOGITS_POSITIONS, graph_cache_shape, graph_vocab_size,
                                                 logits_positions, takes_logits_positions)


class OnnxDeviceDecoder:
    def __init__(self, session: ort.InferenceSession, tensors: TorchTensors):
        self.session = session
        self.tensors = tensors
        self.cache_shape = graph_cache_shape(session)
        self.vocab_size = graph_vocab_size(session)
        self._past_names = self.cache_shape.cache_names()
        self._output_names = ["logits"] + self.cache_shape.present_names()
        device = tensors.device
        self._device_type = device.type
        self._device_id = device.index or 0
        self._cache_dtype = np.dtype(self.cache_shape.dtype)
        self.scores_prompts = takes_logits_positions(session)

    @classmethod
    def on_cpu(cls, model_path: str | os.PathLike, intra_op_threads: int = 0) -> "OnnxDeviceDecoder":
        from python_backend.runtime.onnx_decoder import cpu_session

        return cls(cpu_session(model_path, intra_op_threads), TorchTensors("cpu"))

    def empty_cache(self, batch_size: int):
        s = self.cache_shape
        return [self.tensors.zeros((batch_size, s.num_kv_heads, 0, s.head_dim), s.dtype) for _ in self._past_names]

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: list,
                all_positions: bool = False):
        """Returns the last position's logits [batch, 1, vocab] (with all_positions every position's, [batch, new,
        vocab]; numpy, host) and the present (device tensors)."""
        binding = self.session.io_binding()
        small = [(name, self.tensors.upload(array.astype(np.int64, copy=False)))
                 for name, array in (("input_ids", input_ids), ("attention_mask", attention_mask),
                                     ("position_ids", position_ids))]
        if self.scores_prompts:
            small.append((LOGITS_POSITIONS, self.tensors.upload(logits_positions(input_ids.shape[1], all_positions))))
        for name, tensor in small:
            self._bind_input(binding, name, tensor, np.int64)
        for name, tensor in zip(self._past_names, past):
            self._bind_input(binding, name, tensor, self._cache_dtype)
        for name in self._output_names:
            binding.bind_output(name, self._device_type, self._device_id)
        binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        logits, *present = (self.tensors.torch.from_dlpack(value) for value in binding.get_outputs())
        return (logits if all_positions else logits[:, -1:, :]).float().cpu().numpy(), present

    def _bind_input(self, binding, name: str, tensor, dtype) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous to be bound by address")
        binding.bind_input(name, self._device_type, self._device_id, dtype, list(tensor.shape), tensor.data_ptr())
