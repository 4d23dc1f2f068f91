"""What every decoder runtime shares: the cache's shape, the tensors its cache lives in, and the errors of a runtime
that cannot run here.

A decoder (python_backend/runtime/onnx_decoder.py, onnx_device_decoder.py, tensorrt_decoder.py) has
``cache_shape``, ``vocab_size``, ``tensors`` (a HostTensors or TorchTensors: where its KV cache lives) and

- ``empty_cache(batch_size)``: the past of a prefill, one [batch, kv_heads, 0, head_dim] tensor per layer key/value;
- ``forward(input_ids, attention_mask, position_ids, past)``: the three int64 numpy arrays [batch, new] (the mask
  [batch, past + new]) and the past in its own tensors; returns the last position's logits as a float32 numpy array
  [batch, 1, vocab] and the present (past + new) in its own tensors. A runtime whose ``scores_prompts`` is true
  also takes ``all_positions=True`` and returns every new position's logits [batch, new, vocab] (a prompt scored).

Token ids, masks and positions are small and cross to the device at every step; the cache never leaves its device;
only the last position's logits come back to the host, where sampling runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class RuntimeUnavailableError(RuntimeError):
    """The runtime a model asks for cannot run here (a package, a provider or a GPU is missing)."""


@dataclass(frozen=True)
class ServingLimits:
    """The `llm` model config's limits that a runtime must serve: an engine's profiles cover them, a decoder's
    buffers are sized by them."""

    max_batch_size: int
    max_prefill_tokens: int
    max_context_length: int


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    def cache_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kind}" for i in range(self.num_layers) for kind in ("key", "value")]

    def present_names(self) -> list[str]:
        return [f"present.{i}.{kind}" for i in range(self.num_layers) for kind in ("key", "value")]


class HostTensors:
    """The cache as numpy arrays in host memory (the CPU path with onnxruntime's plain ``run``)."""

    device = "cpu"
    host = True

    def zeros(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    def rows(self, index: np.ndarray) -> np.ndarray:
        return index

    def clone(self, array: np.ndarray) -> np.ndarray:
        return array.copy()


class TorchTensors:
    """The cache as torch tensors on one device (``cpu`` or ``cuda:N``): the device path, which the CPU tests run
    with CPU tensors. Indexing and slicing a torch tensor work as on numpy, so the KV batch's code is shared."""

    host = False

    def __init__(self, device: str = "cpu"):
        import torch

        self.torch = torch
        self.device = torch.device(device)

    def zeros(self, shape, dtype):
        if not isinstance(dtype, self.torch.dtype):
            dtype = torch_dtype(dtype)
        return self.torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    def rows(self, index: np.ndarray):
        return self.torch.as_tensor(index, dtype=self.torch.int64, device=self.device)

    def clone(self, tensor):
        return tensor.clone()

    def upload(self, array: np.ndarray):
        """A host array as a contiguous tensor on this device."""
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device)


def torch_dtype(dtype):
    import torch

    return {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
            np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}[np.dtype(dtype)]
