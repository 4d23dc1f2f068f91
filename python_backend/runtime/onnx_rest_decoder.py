"""Prompts' rests after a cached prefix, many rows in one call: the rest graph beside a fused graph (issue 34).

onnxruntime's CPU ``GroupQueryAttention`` takes more than one new token after a past for one row only. The rest
graph (scripts/prepare/rest_graph.py: ``model.rests.onnx`` beside ``model.onnx``, ``model.lora.rests.onnx`` beside
the adapter graph) writes that attention out in plain operators over any rows, each with its own past length, and
returns the new keys and values instead of writing them: ``SlotKVCache.prefill_rests`` puts them in the slots.

Its weights are the variant's file, read through one shared read-only map and given to the session as its
initializers with prepacking off, so that the second session copies no weights: what it adds is the map's pages,
which the system shares with the file cache and may drop, and about 120 MB of session (fp32, measured in
docs/performance.md). Without prepacking its matrix products are a little slower than the main session's (a 16-row
rest: 620-640 ms against 550 ms prepacked, fp32); the rest graph runs only for prefills after a cache hit.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from python_backend.runtime.decoder import CacheShape

PAST_LENGTHS_INPUT = "past_lengths"
REST_SUFFIX = ".rests.onnx"  # model.onnx -> model.rests.onnx, model.lora.onnx -> model.lora.rests.onnx


def rest_graph_path(graph_path: str | os.PathLike) -> Path:
    path = Path(graph_path)
    return path.with_name(path.name[: -len(".onnx")] + REST_SUFFIX)


def rest_output(cache_name: str) -> str:
    """The rest graph's output for a cache input: past_key_values.3.key -> rest.3.key."""
    return "rest." + cache_name[len("past_key_values."):]


def _shared_weights(model_path: Path) -> tuple[dict[str, ort.OrtValue], list[np.memmap]]:
    """The graph's external initializers as OrtValues over read-only maps of their files (no copy)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    graph = onnx.load(str(model_path), load_external_data=False).graph
    maps: dict[str, np.memmap] = {}
    values = {}
    for initializer in graph.initializer:
        if initializer.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = ExternalDataInfo(initializer)
        if info.location not in maps:
            maps[info.location] = np.memmap(model_path.parent / info.location, dtype=np.uint8, mode="r")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(initializer.data_type)
        raw = maps[info.location][info.offset: info.offset + info.length]
        values[initializer.name] = ort.OrtValue.ortvalue_from_numpy(raw.view(dtype).reshape(tuple(initializer.dims)))
    return values, list(maps.values())


class RestDecoder:
    """``forward(input_ids, attention_mask, past_lengths, cache, extra)``: rows' rests (right-padded [rows, new],
    the mask's ones over each row's tokens) after pasts of ``past_lengths`` tokens held in ``cache`` (the rows'
    slots, read only). Returns each row's last-position logits [rows, vocab] and, per cache array in order, the
    new keys or values [rows, kv_heads, new, head_dim]."""

    def __init__(self, rest_path: str | os.PathLike, cache_shape: CacheShape, intra_op_threads: int = 0):
        from python_backend.runtime.onnx_decoder import session_options

        path = Path(rest_path)
        options = session_options(intra_op_threads)
        options.add_session_config_entry("session.disable_prepacking", "1")
        self._weights, self._maps = _shared_weights(path)  # kept alive: the session reads them
        for name, value in self._weights.items():
            options.add_initializer(name, value)
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._cache_names = cache_shape.cache_names()
        self._outputs = ["logits"] + [rest_output(name) for name in self._cache_names]
        self._has_position_switch = any(i.name == "logits_all_positions" for i in self.session.get_inputs())

    @classmethod
    def beside(cls, graph_path: str | os.PathLike, cache_shape: CacheShape,
               intra_op_threads: int = 0) -> "RestDecoder | None":
        """The rest graph next to a fused graph, or None where the variant has none (built before it, or an
        attention the rest graph cannot write out): rests are then prefilled one row at a time."""
        path = rest_graph_path(graph_path)
        return cls(path, cache_shape, intra_op_threads) if path.is_file() else None

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, past_lengths: np.ndarray,
                cache: list[np.ndarray], extra: dict[str, np.ndarray] | None = None
                ) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {"input_ids": np.ascontiguousarray(input_ids, np.int64),
                 "attention_mask": np.ascontiguousarray(attention_mask, np.int64),
                 PAST_LENGTHS_INPUT: np.ascontiguousarray(past_lengths, np.int64)}
        if self._has_position_switch:
            feeds["logits_all_positions"] = np.zeros(1, np.int64)
        feeds.update(zip(self._cache_names, cache))
        feeds.update(extra or {})
        logits, *new = self.session.run(self._outputs, feeds)
        return logits[:, -1], new
