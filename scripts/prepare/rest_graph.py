"""The fused graph's twin for prompts' rests after a cached prefix, many rows at once (issue 34).

onnxruntime's CPU ``GroupQueryAttention`` takes more than one new token after a past for one row only, so after a
prefix-cache hit each prompt's rest was prefilled alone. This graph is the variant's own (``model.onnx``, or the
adapter graph ``model.lora.onnx``) with each ``GroupQueryAttention`` written out in plain ONNX operators that take
any number of rows, each with its own past length and its own number of new tokens (right-padded):

- rotary embedding of the new queries and keys at positions ``past_lengths[row] + j`` (the same cos/sin caches and
  the same half-split rotation as the kernel's ``rotary_interleaved = 0``);
- each query attends to its row's past (the slot cache, read, sliced to the longest past of the call and masked
  beyond the row's own) and causally to the new keys; the query heads that share a KV head are stacked, as in the
  export's grouped attention, so the past is read once per KV head;
- the new keys (rotated) and values are outputs, ``rest.{i}.key/.value`` [rows, kv_heads, new, head_dim]: the
  engine writes each row's into its slot after its past (python_backend/engine/kv_slots.py). The past is only read.

Its inputs are the variant's with ``attention_mask`` meaning the new tokens only ([rows, new], ones over each row's
rest: the LM head's gather then picks each row's last real position) and ``past_lengths`` [rows] int64 added; the
weights are the variant's file, named, not copied. Built beside the variant by scripts/prepare/quantize.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from python_backend.runtime.onnx_rest_decoder import PAST_LENGTHS_INPUT as PAST_LENGTHS, rest_graph_path, rest_output

ATTENTION_OP = "GroupQueryAttention"


def rest_key_output(layer: int) -> str:
    return rest_output(f"past_key_values.{layer}.key")


def rest_value_output(layer: int) -> str:
    return rest_output(f"past_key_values.{layer}.value")


def unsupported(model: onnx.ModelProto) -> str | None:
    """Why this graph's attention cannot be written out here (None: it can)."""
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and any(a.name == "accuracy_level" and a.i == 4 for a in node.attribute):
            # int8 activations (the fast variant): the written-out attention's last-bit differences from the
            # kernel's change their rounding, and a rest's tokens with them (measured: logits 0.8 apart)
            return "int8 arithmetic in the matrices (accuracy_level 4)"
        if node.op_type != ATTENTION_OP:
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attributes.get("local_window_size", -1) not in (-1, 0):
            return "a sliding window"
        if attributes.get("softcap", 0.0):
            return "attention soft-capping"
        if not attributes.get("do_rotary", 0) or attributes.get("rotary_interleaved", 0):
            return "rotary embedding outside the attention or interleaved"
        if any(node.input[i] for i in (1, 2)) or len(node.input) > 9 and any(node.input[9:]):
            return "unpacked query, key and value, or extra attention inputs"
    return None


class _Writer:
    def __init__(self, graph: onnx.GraphProto, prefix: str):
        self.graph, self.prefix, self.nodes = graph, prefix, []

    def const(self, name: str, value) -> str:
        full = f"{self.prefix}/const/{name}"
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), full))
        return full

    def node(self, op: str, inputs: list[str], name: str, outputs: list[str] | None = None, **attributes) -> str:
        outputs = outputs or [f"{self.prefix}/{name}"]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{self.prefix}/{name}", **attributes))
        return outputs[0]

    def split(self, x: str, sizes: str, name: str, parts: list[str], axis: int) -> list[str]:
        outputs = [f"{self.prefix}/{name}_{part}" for part in parts]
        self.node("Split", [x, sizes], name, outputs=outputs, axis=axis)
        return outputs


def _shared(w: _Writer) -> dict[str, str]:
    """What every layer's attention reads: positions [rows, new], the past's length used, the masks."""
    i64 = np.int64
    past = w.node("Unsqueeze", [PAST_LENGTHS, w.const("axis_1", np.array([1], i64))], "past_2d")  # [rows, 1]
    ids_shape = w.node("Shape", ["input_ids"], "ids_shape")
    new = w.node("Gather", [ids_shape, w.const("one", np.array(1, i64))], "new")  # scalar
    steps = w.node("Range", [w.const("zero", np.array(0, i64)), new, w.const("step", np.array(1, i64))], "steps")
    positions = w.node("Add", [past, w.node("Unsqueeze", [steps, w.const("axis_0", np.array([0], i64))],
                                            "steps_2d")], "positions")  # [rows, new]
    longest = w.node("ReduceMax", [past], "longest", keepdims=0)  # scalar: the past read from the cache
    longest_1d = w.node("Reshape", [longest, w.const("shape_1", np.array([1], i64))], "longest_1d")
    past_range = w.node("Range", [w.const("zero_again", np.array(0, i64)), longest, w.const("step_again",
                                                                                        np.array(1, i64))], "past_range")
    # [rows, 1, 1, longest]: 0 where a past position is the row's, -inf past its own length
    beyond = w.node("GreaterOrEqual", [w.node("Unsqueeze", [past_range, w.const("axis_0b", np.array([0], i64))],
                                              "past_range_2d"), past], "beyond")
    blocked = w.const("blocked", np.array(-np.inf, np.float32))
    zero_f = w.const("zero_f", np.array(0.0, np.float32))
    past_mask = w.node("Where", [beyond, blocked, zero_f], "past_mask_2d")
    past_mask = w.node("Unsqueeze", [past_mask, w.const("axes_123", np.array([1, 2, 3], i64))], "past_mask")
    # [1, 1, 1, new, new] causal among the new tokens (broadcast over the stacked query heads)
    later = w.node("Greater", [w.node("Unsqueeze", [steps, w.const("axis_0c", np.array([0], i64))], "keys_2d"),
                               w.node("Unsqueeze", [steps, w.const("axis_1c", np.array([1], i64))], "queries_2d")],
                   "later")
    causal = w.node("Where", [later, blocked, zero_f], "causal")  # [new, new]
    split_sizes = w.node("Concat", [longest_1d, w.node("Reshape", [new, w.const("shape_1b", np.array([1], i64))],
                                                        "new_1d")], "split_sizes", axis=0)  # [longest, new]
    return {"positions": positions, "longest_1d": longest_1d, "past_mask": past_mask, "causal": causal,
            "split_sizes": split_sizes}


def _attention(w: _Writer, node: onnx.NodeProto, layer: int, shared: dict[str, str],
               heads: int, kv_heads: int, head_dim: int, scale: float) -> None:
    i64 = np.int64
    packed, past_key, past_value, cos_cache, sin_cache = (node.input[0], node.input[3], node.input[4],
                                                          node.input[7], node.input[8])
    groups = heads // kv_heads
    sizes = w.const("sizes", np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], i64))
    q, k, v = w.split(packed, sizes, "packed", ["q", "k", "v"], axis=2)
    half = head_dim // 2
    cos = w.node("Unsqueeze", [w.node("Gather", [cos_cache, shared["positions"]], "cos"),
                               w.const("axis_2", np.array([2], i64))], "cos_4d")  # [rows, new, 1, half]
    sin = w.node("Unsqueeze", [w.node("Gather", [sin_cache, shared["positions"]], "sin"),
                               w.const("axis_2b", np.array([2], i64))], "sin_4d")

    def rotate(x: str, count: int, name: str) -> str:  # [rows, new, count * head_dim] -> [rows, new, count, dim]
        x = w.node("Reshape", [x, w.const(f"{name}_heads", np.array([0, 0, count, head_dim], i64))],
                   f"{name}_heads")
        first, second = w.split(x, w.const(f"{name}_halves", np.array([half, half], i64)), f"{name}_half",
                                ["1", "2"], axis=3)
        return w.node("Concat", [
            w.node("Sub", [w.node("Mul", [first, cos], f"{name}_1c"), w.node("Mul", [second, sin], f"{name}_2s")],
                   f"{name}_r1"),
            w.node("Add", [w.node("Mul", [second, cos], f"{name}_2c"), w.node("Mul", [first, sin], f"{name}_1s")],
                   f"{name}_r2")], f"{name}_rotated", axis=3)

    q = rotate(q, heads, "q")  # [rows, new, heads, dim]
    k = rotate(k, kv_heads, "k")
    # Stacked query heads: [rows, kv_heads, groups, new, dim] (query head h uses KV head h // groups)
    q = w.node("Transpose", [w.node("Reshape", [q, w.const("q_groups", np.array([0, 0, kv_heads, groups, head_dim],
                                                                              i64))], "q_grouped")],
               "q_stacked", perm=[0, 2, 3, 1, 4])
    new_key = w.node("Transpose", [k], "new_key", outputs=[rest_key_output(layer)], perm=[0, 2, 1, 3])
    v = w.node("Reshape", [v, w.const("v_heads", np.array([0, 0, kv_heads, head_dim], i64))], "v_heads")
    new_value = w.node("Transpose", [v], "new_value", outputs=[rest_value_output(layer)], perm=[0, 2, 1, 3])
    starts, axes = w.const("slice_starts", np.array([0], i64)), w.const("slice_axes", np.array([2], i64))
    old_key = w.node("Unsqueeze", [w.node("Slice", [past_key, starts, shared["longest_1d"], axes], "old_key_3d"),
                                   w.const("axis_2c", np.array([2], i64))], "old_key")  # [rows, kv, 1, longest, dim]
    old_value = w.node("Unsqueeze", [w.node("Slice", [past_value, starts, shared["longest_1d"], axes],
                                            "old_value_3d"), w.const("axis_2d", np.array([2], i64))], "old_value")
    new_key_5d = w.node("Unsqueeze", [new_key, w.const("axis_2e", np.array([2], i64))], "new_key_5d")
    new_value_5d = w.node("Unsqueeze", [new_value, w.const("axis_2f", np.array([2], i64))], "new_value_5d")
    scaled = w.node("Mul", [q, w.const("scale", np.array(scale, np.float32))], "q_scaled")
    perm = [0, 1, 2, 4, 3]
    old_scores = w.node("Add", [w.node("MatMul", [scaled, w.node("Transpose", [old_key], "old_key_t", perm=perm)],
                                       "old_scores_raw"), shared["past_mask"]], "old_scores")
    new_scores = w.node("Add", [w.node("MatMul", [scaled, w.node("Transpose", [new_key_5d], "new_key_t", perm=perm)],
                                       "new_scores_raw"), shared["causal"]], "new_scores")
    probabilities = w.node("Softmax", [w.node("Concat", [old_scores, new_scores], "scores", axis=4)],
                           "probabilities", axis=4)
    old_p, new_p = w.split(probabilities, shared["split_sizes"], "p", ["old", "new"], axis=4)
    context = w.node("Add", [w.node("MatMul", [old_p, old_value], "old_context"),
                             w.node("MatMul", [new_p, new_value_5d], "new_context")], "context")
    context = w.node("Transpose", [context], "context_t", perm=[0, 3, 1, 2, 4])  # [rows, new, kv, groups, dim]
    w.node("Reshape", [context, w.const("out_shape", np.array([0, 0, heads * head_dim], i64))], "output",
           outputs=[node.output[0]])


def build(model: onnx.ModelProto) -> onnx.ModelProto:
    """The rest graph of a fused graph (a copy; the weights stay where the original's name them)."""
    why = unsupported(model)
    if why:
        raise ValueError(f"the rest graph writes out GroupQueryAttention without {why}")
    rest = onnx.ModelProto()
    rest.CopyFrom(model)
    graph = rest.graph
    cache = {i.name: i for i in graph.input if i.name.startswith("past_key_values.")}
    head_dim = cache["past_key_values.0.key"].type.tensor_type.shape.dim[3].dim_value
    kv_heads = cache["past_key_values.0.key"].type.tensor_type.shape.dim[1].dim_value
    graph.input.append(helper.make_tensor_value_info(PAST_LENGTHS, TensorProto.INT64, ["batch_size"]))
    shared_writer = _Writer(graph, "/rests")
    shared = _shared(shared_writer)
    nodes, layer = list(shared_writer.nodes), 0
    for node in graph.node:
        if node.op_type != ATTENTION_OP:
            nodes.append(node)
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        heads = attributes["num_heads"]
        writer = _Writer(graph, f"/rests/layers.{layer}")
        _attention(writer, node, layer, shared, heads, kv_heads, head_dim,
                   attributes.get("scale") or head_dim ** -0.5)
        nodes += writer.nodes
        layer += 1
    del graph.node[:]
    graph.node.extend(nodes)
    outputs = [o for o in graph.output if not o.name.startswith("present.")]
    del graph.output[:]
    graph.output.extend(outputs)
    for i in range(layer):
        for name in (rest_key_output(i), rest_value_output(i)):
            graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                              ["batch_size", kv_heads, "sequence_length", head_dim]))
    _drop_unused(graph)
    return rest


def _drop_unused(graph: onnx.GraphProto) -> None:
    """Removes the nodes nothing reads any more (the kernel's mask reformatting)."""
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    initializers = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(initializers)


def write(graph_path: str | Path) -> Path | None:
    """Writes the rest graph beside ``graph_path`` (sharing its weights file); None when its attention cannot be
    written out (the engine then prefills rests one row at a time)."""
    model = onnx.load(str(graph_path), load_external_data=False)
    if unsupported(model):
        return None
    target = rest_graph_path(graph_path)
    onnx.save(build(model), str(target))
    return target
