"""One forward pass of an ONNX causal decoder with a KV cache, on onnxruntime, the cache in host memory.

The graph's interface (what ``scripts/prepare/export_onnx.py`` writes, and what Hugging Face's ONNX exports use):
inputs ``input_ids``, ``attention_mask``, ``position_ids`` (int64) and ``past_key_values.{i}.key/.value``
([batch, kv_heads, past, head_dim]); outputs ``logits`` and ``present.{i}.key/.value``.
The device path (the cache in torch tensors, bound to onnxruntime's IO binding) is onnx_device_decoder.py.
"""

from __future__ import annotations

import os
import re

import numpy as np
import onnxruntime as ort

from python_backend.runtime.decoder import CacheShape, HostTensors

_PAST_KEY = re.compile(r"past_key_values\.(\d+)\.key")

ORT_TO_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


# Threads a session takes when its caller (the llm config's `intra_op_threads`) names none:
# $TRITON_LLM_INTRA_OP_THREADS, else 0 (onnxruntime's choice, one per core). Processes that share the cores, such as
# servers beside each other on one host or the test suite's parallel workers and their servers, lower it so that they
# do not oversubscribe the cores: onnxruntime's threads spin while they wait, and on taken cores that is lost work.
INTRA_OP_THREADS_ENV = "TRITON_LLM_INTRA_OP_THREADS"


def threads_from_environment(environ=os.environ) -> int:
    value = environ.get(INTRA_OP_THREADS_ENV, "").strip() or "0"
    if not value.isdigit():
        raise ValueError(f"{INTRA_OP_THREADS_ENV} must be a whole number of threads (0: one per core), not {value!r}")
    return int(value)


DEFAULT_INTRA_OP_THREADS = threads_from_environment()

# Sessions made after share_thread_pool() run on the process's one onnxruntime thread pool instead of pools of their
# own: two sessions that take turns (speculative decoding's draft and served model) would otherwise each keep its
# threads spinning while the other computes, and fight for the cores (the speculative probe: no gain at all, x0.96).
_shared_pool = False


def share_thread_pool(intra_op_threads: int = 0) -> None:
    """Makes this process's sessions from now on share one thread pool of this many threads (0: the
    environment's, else one per core). onnxruntime reads the sizes when it makes its environment, at the first
    session: call this before any."""
    global _shared_pool
    from onnxruntime.capi import _pybind_state  # the pool's sizes have no public setter in onnxruntime's Python API

    _pybind_state.set_global_thread_pool_sizes(intra_op_threads or DEFAULT_INTRA_OP_THREADS, 1)
    _shared_pool = True


def cpu_session(model_path: str | os.PathLike, intra_op_threads: int = 0) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_path), session_options(intra_op_threads), providers=["CPUExecutionProvider"])


def session_options(intra_op_threads: int = 0) -> ort.SessionOptions:
    options = ort.SessionOptions()
    if _shared_pool:
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = intra_op_threads or DEFAULT_INTRA_OP_THREADS
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def graph_cache_shape(session: ort.InferenceSession) -> CacheShape:
    inputs = {i.name: i for i in session.get_inputs()}
    layers = sorted(int(m.group(1)) for name in inputs if (m := _PAST_KEY.fullmatch(name)))
    if layers != list(range(len(layers))) or not layers:
        raise ValueError(f"the graph's past_key_values inputs are not layers 0..n-1: {layers}")
    first = inputs["past_key_values.0.key"]
    return CacheShape(num_layers=len(layers), num_kv_heads=int(first.shape[1]), head_dim=int(first.shape[3]),
                      dtype=np.dtype(ORT_TO_NUMPY[first.type]))


def file_cache_shape(model_path: str | os.PathLike) -> CacheShape:
    """The cache's shape from the ONNX file's declared inputs, without loading its weights or making a session."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    keys = [i for i in graph.input if _PAST_KEY.fullmatch(i.name)]
    if not keys:
        raise ValueError(f"{model_path} has no past_key_values.N.key inputs: not a decoder with a KV cache")
    tensor_type = keys[0].type.tensor_type
    dims = tensor_type.shape.dim
    return CacheShape(num_layers=len(keys), num_kv_heads=dims[1].dim_value, head_dim=dims[3].dim_value,
                      dtype=onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))


LOGITS_POSITIONS = "logits_positions"  # the export's input: which new positions go through the LM head


def logits_positions(new: int, all_positions: bool) -> np.ndarray:
    """The export's logits_positions: the last new position (rows are left-padded, so it is every row's last), or
    every new position to score a prompt."""
    return np.arange(new, dtype=np.int64) if all_positions else np.array([new - 1], np.int64)


def takes_logits_positions(session: ort.InferenceSession) -> bool:
    """Whether the graph takes logits_positions (an export older than that input has the last position only)."""
    return any(i.name == LOGITS_POSITIONS for i in session.get_inputs())


def graph_vocab_size(session: ort.InferenceSession) -> int:
    """The logits' last dimension: fixed in the graphs we know; else found by one forward pass of one token."""
    size = session.get_outputs()[0].shape[-1]
    if isinstance(size, int):
        return size
    feed = {"input_ids": np.zeros((1, 1), np.int64), "attention_mask": np.ones((1, 1), np.int64),
            "position_ids": np.zeros((1, 1), np.int64)}
    if takes_logits_positions(session):
        feed[LOGITS_POSITIONS] = logits_positions(1, False)
    for spec in session.get_inputs():
        if spec.name not in feed:  # a past key/value: [batch 1, kv_heads, past 0, head_dim]
            feed[spec.name] = np.zeros((1, spec.shape[1], 0, spec.shape[3]), ORT_TO_NUMPY[spec.type])
    return int(session.run(["logits"], feed)[0].shape[-1])


class OnnxDecoder:
    """onnxruntime's CPU provider with plain ``run``: numpy in, numpy out (the default CPU path)."""

    tensors = HostTensors()

    def __init__(self, model_path: str | os.PathLike, intra_op_threads: int = 0,
                 session: ort.InferenceSession | None = None):
        self.session = session or cpu_session(model_path, intra_op_threads)
        self.cache_shape = graph_cache_shape(self.session)
        self.vocab_size = graph_vocab_size(self.session)
        self._past_names = self.cache_shape.cache_names()
        self._output_names = ["logits"] + self.cache_shape.present_names()
        self.scores_prompts = takes_logits_positions(self.session)

    def empty_cache(self, batch_size: int) -> list[np.ndarray]:
        s = self.cache_shape
        return [np.zeros((batch_size, s.num_kv_heads, 0, s.head_dim), s.dtype) for _ in self._past_names]

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: list[np.ndarray],
        all_positions: bool = False,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Returns the last position's logits [batch, 1, vocab] (with all_positions every position's, [batch, new,
        vocab]) and the new cache (past + this step)."""
        feed = {
            "input_ids": input_ids.astype(np.int64, copy=False),
            "attention_mask": attention_mask.astype(np.int64, copy=False),
            "position_ids": position_ids.astype(np.int64, copy=False),
        }
        if self.scores_prompts:
            feed[LOGITS_POSITIONS] = logits_positions(input_ids.shape[1], all_positions)
        elif all_positions:
            raise ValueError("this export computes the last position's logits only: export it again (make model) "
                             "to score prompts")
        feed.update(zip(self._past_names, past))
        logits, *present = self.session.run(self._output_names, feed)
        return (logits if all_positions else logits[:, -1:, :]), present
