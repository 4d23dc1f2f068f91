"""One forward pass of an ONNX causal decoder with a KV cache, on onnxruntime.

The graph's interface (what ``scripts/export_onnx.py`` writes, and what Hugging Face's ONNX exports use):
inputs ``input_ids``, ``attention_mask``, ``position_ids`` (int64) and ``past_key_values.{i}.key/.value``
([batch, kv_heads, past, head_dim]); outputs ``logits`` and ``present.{i}.key/.value``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

_PAST_KEY = re.compile(r"past_key_values\.(\d+)\.key")


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize


_ORT_TO_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class OnnxDecoder:
    def __init__(self, model_path: str | os.PathLike, intra_op_threads: int = 0):
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads  # 0: onnxruntime picks (one per core)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        layers = sorted(int(m.group(1)) for name in inputs if (m := _PAST_KEY.fullmatch(name)))
        first = inputs["past_key_values.0.key"]
        self.cache_shape = CacheShape(
            num_layers=len(layers),
            num_kv_heads=int(first.shape[1]),
            head_dim=int(first.shape[3]),
            dtype=np.dtype(_ORT_TO_NUMPY[first.type]),
        )
        self.vocab_size = _vocab_size(self.session)
        self._past_names = [f"past_key_values.{i}.{kind}" for i in layers for kind in ("key", "value")]
        self._output_names = ["logits"] + [f"present.{i}.{kind}" for i in layers for kind in ("key", "value")]

    def empty_cache(self, batch_size: int) -> list[np.ndarray]:
        s = self.cache_shape
        return [np.zeros((batch_size, s.num_kv_heads, 0, s.head_dim), s.dtype) for _ in self._past_names]

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: list[np.ndarray],
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Returns logits [batch, seq, vocab] and the new cache (past + this step) as a flat key/value list."""
        feed = {
            "input_ids": input_ids.astype(np.int64, copy=False),
            "attention_mask": attention_mask.astype(np.int64, copy=False),
            "position_ids": position_ids.astype(np.int64, copy=False),
        }
        feed.update(zip(self._past_names, past))
        logits, *present = self.session.run(self._output_names, feed)
        return logits, present


def _vocab_size(session: ort.InferenceSession) -> int:
    """The logits' last dimension: fixed in the graphs we know; else found by one forward pass of one token."""
    size = session.get_outputs()[0].shape[-1]
    if isinstance(size, int):
        return size
    feed = {"input_ids": np.zeros((1, 1), np.int64), "attention_mask": np.ones((1, 1), np.int64),
            "position_ids": np.zeros((1, 1), np.int64)}
    for spec in session.get_inputs():
        if spec.name not in feed:  # a past key/value: [batch 1, kv_heads, past 0, head_dim]
            feed[spec.name] = np.zeros((1, spec.shape[1], 0, spec.shape[3]), _ORT_TO_NUMPY[spec.type])
    return int(session.run(["logits"], feed)[0].shape[-1])
