"""LoRA adapters in the fused graph, chosen per row (issue 35's graph step; not yet built into the variants or
served: python_backend/runtime/lora.py packs the inputs, docs/architecture.md#lora says what is left).

Each projection PEFT targets in these models (q/k/v, o, gate, up, down) keeps its base product ``y = x · W`` (fp32,
or the variant's 4- or 8-bit ``MatMulNBits``: this runs before quantization, whose quantizers take only MatMuls with
constant weights) and gains the adapters' delta, for every row at once:

    y' = y + ((x · A) ⊙ mask) · B

``A`` [in, width] and ``B`` [width, out] are graph inputs holding, side by side, the adapters of the rows in the step
(each adapter's ``lora_A`` and its ``lora_B`` times its scaling; q, k and v share the fused graph's packed QKV MatMul,
so an adapter's three ``A`` sit side by side and its ``B`` block-diagonally in the packed columns). ``mask`` [rows, 1,
width], one per kind of projection, has ones where the row's own adapter's columns are: a row computes its adapter's
delta and adds exact zeros for the others'. With no adapter in the step every width is 0, and the delta is a zero
add. Widths are symbolic, so one graph takes any mix of adapters and ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import onnx
from onnx import helper

from python_backend.runtime.lora import KINDS, a_input, b_input, mask_input

_PRODUCT = re.compile(r"^/model/layers\.(\d+)/(?:attn|mlp)/(\w+)/MatMul$")


@dataclass(frozen=True)
class Target:
    """One projection of one layer that adapters may change."""

    layer: int
    kind: str  # a key of KINDS
    in_features: int
    out_features: int

    @property
    def a_input(self) -> str:
        return a_input(self.layer, self.kind)

    @property
    def b_input(self) -> str:
        return b_input(self.layer, self.kind)


def width(kind: str) -> str:
    return f"lora_width_{kind}"


def targets(model: onnx.ModelProto) -> list[Target]:
    """The graph's projections that adapters may change: MatMuls named as the builder names them, with a constant
    weight (read before quantization)."""
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    found = []
    for node in model.graph.node:
        match = _PRODUCT.match(node.name) if node.op_type == "MatMul" else None
        if match and match.group(2) in KINDS and node.input[1] in shapes:
            rows, columns = shapes[node.input[1]]
            found.append(Target(int(match.group(1)), match.group(2), rows, columns))
    return found


def add_adapter_inputs(model: onnx.ModelProto) -> list[Target]:
    """Adds every target's adapter inputs and delta to the graph (in place); returns the targets."""
    graph = model.graph
    found = {(t.layer, t.kind): t for t in targets(model)}
    if not found:
        raise ValueError("the graph has no projection named as onnxruntime-genai's builder names them "
                         "(/model/layers.N/attn/qkv_proj/MatMul, ...): adapters cannot be added")
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    float_type = onnx.TensorProto.FLOAT
    for kind in sorted({t.kind for t in found.values()}):
        graph.input.append(helper.make_tensor_value_info(mask_input(kind), float_type, ["batch_size", 1, width(kind)]))
    rebuilt: list[onnx.NodeProto] = []
    for node in list(graph.node):
        rebuilt.append(node)
        match = _PRODUCT.match(node.name) if node.op_type == "MatMul" else None
        target = found.get((int(match.group(1)), match.group(2))) if match else None
        if target is not None:
            rebuilt += _delta(graph, node, target, consumers)
    del graph.node[:]
    graph.node.extend(rebuilt)
    return list(found.values())


def _delta(graph: onnx.GraphProto, product: onnx.NodeProto, target: Target,
           consumers: dict[str, list[onnx.NodeProto]]) -> list[onnx.NodeProto]:
    """The nodes adding the adapters' delta to one base product; its consumers read the sum instead."""
    x, y = product.input[0], product.output[0]
    if any(output.name == y for output in graph.output):
        raise ValueError(f"{y} is a graph output: its delta has nowhere to go")
    float_type = onnx.TensorProto.FLOAT
    graph.input.append(helper.make_tensor_value_info(target.a_input, float_type,
                                                     [target.in_features, width(target.kind)]))
    graph.input.append(helper.make_tensor_value_info(target.b_input, float_type,
                                                     [width(target.kind), target.out_features]))
    prefix = f"{product.name}/lora"
    for consumer in consumers.get(y, []):
        consumer.input[:] = [f"{prefix}/output" if name == y else name for name in consumer.input]
    return [
        helper.make_node("MatMul", [x, target.a_input], [f"{prefix}/down"], name=f"{prefix}/down"),
        helper.make_node("Mul", [f"{prefix}/down", mask_input(target.kind)], [f"{prefix}/own"], name=f"{prefix}/own"),
        helper.make_node("MatMul", [f"{prefix}/own", target.b_input], [f"{prefix}/delta"], name=f"{prefix}/delta"),
        helper.make_node("Add", [y, f"{prefix}/delta"], [f"{prefix}/output"], name=f"{prefix}/output"),
    ]
