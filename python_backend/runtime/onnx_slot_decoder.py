"""A fused decoder graph whose attention writes the KV cache in place, on onnxruntime's CPU provider.

The graph is onnxruntime-genai's model builder's (scripts/prepare/fused_graph.py): ``GroupQueryAttention`` with
rotary embedding inside, fused norms, one packed QKV MatMul. Its interface: inputs ``input_ids`` [rows, new] and
``attention_mask`` [rows, total] (int64), ``past_key_values.{i}.key/.value``; outputs ``logits`` [rows, 1, vocab]
(each row's last position: the project's build gathers it before the LM head; with its input
``logits_all_positions`` set to 1, or from a graph without that gather, [rows, new, vocab]) and
``present.{i}.key/.value``; ``query_seqlens`` [rows] (int32, graphs built since format 9): how many of each row's
new tokens are real; no ``position_ids`` (a row's past is its mask's sum minus that count).

Bound to one buffer for both the past and the present, ``GroupQueryAttention`` appends each row's new keys and
values at that row's own length, where the mask says it ends, instead of copying the cache into a longer present:
the cache is preallocated, one slot per row, and never copied by a step (python_backend/engine/kv_slots.py owns
the slots). What onnxruntime's CPU kernel takes (onnxruntime 1.32, docs/architecture.md): any rows, each with its
own past (none for a first prompt) and its own count of new tokens, right-padded to the longest; a decode step is
one new token per row. A graph built before ``query_seqlens`` takes several new tokens after a past for one row
only (``batches_rests`` is False: it refuses several such rows in one call, and the engine computes them one a call).
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort

from python_backend.runtime.decoder import CacheShape, HostTensors, TorchTensors
from python_backend.lora import graph_targets
from python_backend.runtime.onnx_decoder import cpu_session, graph_cache_shape

FUSED_ATTENTION_OP = "GroupQueryAttention"
ALL_POSITIONS_INPUT = "logits_all_positions"  # scripts/prepare/fused_graph.py
QUERY_LENGTHS_INPUT = "query_seqlens"  # scripts/prepare/fused_graph.py


def query_lengths(input_ids: np.ndarray, attention_mask: np.ndarray, given: np.ndarray | None) -> np.ndarray:
    """Each row's count of real new tokens: given, else all of them up to the row's length (a first prompt's
    right padding ends where its mask does)."""
    if given is not None:
        return np.asarray(given, np.int32)
    return np.minimum(input_ids.shape[1], attention_mask.sum(axis=1)).astype(np.int32)


def is_fused_graph(model_path: str | os.PathLike) -> bool:
    """Whether the ONNX file is a fused in-place graph (read from its nodes, without loading its weights)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    inputs = {i.name for i in graph.input}
    return "position_ids" not in inputs and any(n.op_type == FUSED_ATTENTION_OP for n in graph.node)


class OnnxSlotDecoder:
    """``forward_in_place(input_ids, attention_mask, cache)``: ``cache`` holds one contiguous array per layer key and
    value, [rows, kv_heads, max_len, head_dim] (views of the slots' buffers), bound as past and present at once.
    Returns the logits of each row's last position [rows, 1, vocab], or with ``all_positions`` of every new
    position [rows, new, vocab] (scoring a prompt). ``new_counts`` [rows]: how many of each row's new tokens are
    real (rows right-padded, each after its own past: the prefix cache's rests); default: every new token up to
    the row's mask."""

    kv_layout = "slots"
    tensors = HostTensors()

    def __init__(self, model_path: str | os.PathLike, intra_op_threads: int = 0,
                 session: ort.InferenceSession | None = None):
        self.session = session or cpu_session(model_path, intra_op_threads)
        self.cache_shape: CacheShape = graph_cache_shape(self.session)
        logits = next(o for o in self.session.get_outputs() if o.name == "logits")
        self.vocab_size = int(logits.shape[-1])
        self._past_names = self.cache_shape.cache_names()
        self._present_names = self.cache_shape.present_names()
        self._bound = None
        inputs = {i.name for i in self.session.get_inputs()}
        self.has_position_switch = ALL_POSITIONS_INPUT in inputs
        self.batches_rests = QUERY_LENGTHS_INPUT in inputs
        self.gathers_last = logits.shape[1] == 1 and not self.has_position_switch
        # LoRA: the projections whose adapter inputs the graph has (a variant's adapter graph), else empty
        self.lora_targets = graph_targets((i.name, i.shape) for i in self.session.get_inputs())

    @property
    def scores_prompts(self) -> bool:
        """Whether forward_in_place can give every position's logits (a graph built before the switch cannot)."""
        return not self.gathers_last

    def forward_in_place(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                         cache: list[np.ndarray], all_positions: bool = False,
                         extra: dict[str, np.ndarray] | None = None,
                         new_counts: np.ndarray | None = None) -> np.ndarray:
        """extra: more of the graph's inputs by name (a LoRA graph's adapter inputs: python_backend/lora.py)."""
        self._check_positions(all_positions)
        binding = self._cache_binding(cache)
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=np.int64))
        for name, array in self._counts_input(input_ids, attention_mask, new_counts):
            binding.bind_cpu_input(name, array)
        for name, array in (extra or {}).items():
            if self._bound[3].get(name) is not array:  # adapters' matrices stay the same arrays from step to step
                binding.bind_cpu_input(name, np.ascontiguousarray(array))
                self._bound[3][name] = array
        if self.has_position_switch:
            binding.bind_cpu_input(ALL_POSITIONS_INPUT, np.array([int(all_positions)], np.int64))
        binding.bind_output("logits")
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[-1].numpy()

    def _counts_input(self, input_ids, attention_mask, new_counts) -> list[tuple[str, np.ndarray]]:
        """The graph's query_seqlens input (none for a graph built without it, which takes no padded rest)."""
        if self.batches_rests:
            return [(QUERY_LENGTHS_INPUT, query_lengths(input_ids, attention_mask, new_counts))]
        if new_counts is not None and input_ids.shape[0] > 1 and attention_mask.shape[1] > input_ids.shape[1]:
            raise ValueError("this fused graph takes no right-padded rows after a past: build the variant again "
                             "(make model QUANT=...)")
        return []

    def _check_positions(self, all_positions: bool) -> None:
        if all_positions and not self.scores_prompts:
            raise ValueError("this fused graph computes each row's last logits only: build the variant again "
                             "(make model QUANT=...) to score prompts")

    def _cache_binding(self, cache: list[np.ndarray]) -> ort.IOBinding:
        """A binding with these cache views bound as past and present; the last one is kept, as consecutive decode
        steps bind the same views (binding 60 tensors at every step cost about 0.5 ms of an 8 ms step)."""
        key = tuple((array.ctypes.data, array.shape) for array in cache)
        if self._bound is not None and self._bound[0] == key:
            return self._bound[1]
        binding = self.session.io_binding()
        for past, present, array in zip(self._past_names, self._present_names, cache):
            if not array.flags.c_contiguous:
                raise ValueError(f"{past} must be contiguous to be written in place")
            value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the array's memory: no copy
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        self._bound = (key, binding, cache, {})  # the arrays stay referenced while bound; then the extra inputs
        return binding


class OnnxSlotDeviceDecoder(OnnxSlotDecoder):
    """The fused graph with its slot cache in torch tensors on one device, bound by address through IO binding: the
    past and the present of each layer are the same tensor, as on the host. Token ids and the mask cross to the
    device at each call; the logits come back through DLPack and cross to the host. With CPU tensors and the CPU
    provider this is the same code a GPU runs (onnxruntime's CUDA provider has GroupQueryAttention with a shared
    past/present buffer, which is how onnxruntime-genai runs it), which is how the CPU tests cover it."""

    def __init__(self, session: ort.InferenceSession, tensors: TorchTensors):
        super().__init__(None, session=session)
        self.tensors = tensors
        self._device_type = tensors.device.type
        self._device_id = tensors.device.index or 0
        self._cache_dtype = np.dtype(self.cache_shape.dtype)

    @classmethod
    def on_cpu(cls, model_path: str | os.PathLike, intra_op_threads: int = 0) -> "OnnxSlotDeviceDecoder":
        return cls(cpu_session(model_path, intra_op_threads), TorchTensors("cpu"))

    def forward_in_place(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: list,
                         all_positions: bool = False, extra: dict[str, np.ndarray] | None = None,
                         new_counts: np.ndarray | None = None) -> np.ndarray:
        self._check_positions(all_positions)
        binding = self._cache_binding(cache)
        small = [("input_ids", np.asarray(input_ids, np.int64)),
                 ("attention_mask", np.asarray(attention_mask, np.int64)),
                 *self._counts_input(input_ids, attention_mask, new_counts)]
        if self.has_position_switch:
            small.append((ALL_POSITIONS_INPUT, np.array([int(all_positions)], np.int64)))
        small += [(name, np.asarray(array)) for name, array in (extra or {}).items()]
        uploaded = [(name, self.tensors.upload(array), array.dtype) for name, array in small]
        for name, tensor, dtype in uploaded:  # (referenced until the run ends)
            self._bind(binding.bind_input, name, tensor, dtype)
        binding.bind_output("logits", self._device_type, self._device_id)
        binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        logits = self.tensors.torch.from_dlpack(binding.get_outputs()[-1])
        return logits.float().cpu().numpy()

    def _cache_binding(self, cache: list) -> ort.IOBinding:
        key = tuple((tensor.data_ptr(), tuple(tensor.shape)) for tensor in cache)
        if self._bound is not None and self._bound[0] == key:
            return self._bound[1]
        binding = self.session.io_binding()
        for past, present, tensor in zip(self._past_names, self._present_names, cache):
            self._bind(binding.bind_input, past, tensor, self._cache_dtype)
            self._bind(binding.bind_output, present, tensor, self._cache_dtype)
        self._bound = (key, binding, cache)
        return binding

    def _bind(self, bind, name: str, tensor, dtype) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous to be bound by address")
        bind(name, self._device_type, self._device_id, dtype, list(tensor.shape), tensor.data_ptr())
