"""LoRA adapters in the fused graph, chosen per row (issue 35): the adapter graph a variant's folder holds beside its
own (``model.lora.onnx``, written by scripts/prepare/quantize.py; python_backend/lora.py packs its inputs).

Each projection PEFT targets in these models (q/k/v, o, gate, up, down) keeps its base product ``y = x · W`` as the
variant computes it (fp32, or its 4- or 8-bit ``MatMulNBits`` and what goes with them: int4's residual) and gains the
adapters' delta, in fp32 for every row at once:

    y' = y + ((x · A) ⊙ mask) · B

``A`` [in, width] and ``B`` [width, out] are graph inputs holding, side by side, the adapters of the rows in the step
(each adapter's ``lora_A`` and its ``lora_B`` times its scaling; q, k and v share the fused graph's packed QKV MatMul,
so an adapter's three ``A`` sit side by side and its ``B`` block-diagonally in the packed columns). ``mask`` [rows, 1,
width], one per kind of projection, has ones where the row's own adapter's columns are: a row computes its adapter's
delta and adds exact zeros for the others'. With no adapter in the step every width is 0, and the delta is a zero
add. Widths are symbolic, so one graph takes any mix of adapters and ranks.

A projection is found by the names onnxruntime-genai's builder gives it (``/model/layers.N/attn/qkv_proj/MatMul``)
and what the quantizers name after it (``...MatMul_Q8``, ``...MatMul.nbits``, ...): its input ``x`` is what the group
reads from outside, its output ``y`` what the rest of the graph reads from it. The adapter graph names no weights of
its own: it shares the variant's weights file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper

from python_backend.model_files import ADAPTER_ONNX_FILE, ONNX_FILE
from python_backend.lora import KINDS, BaseShapes, a_input, b_input, mask_input

_PRODUCT = re.compile(r"^/model/layers\.(\d+)/(?:attn|mlp)/(\w+)/MatMul(?:$|[._])")


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


@dataclass
class _Group:
    """The nodes of one projection (the builder's MatMul, or what a quantizer made of it), in graph order."""

    target: Target
    nodes: list


def _groups(model: onnx.ModelProto, shapes: BaseShapes) -> dict[tuple[int, str], _Group]:
    groups: dict[tuple[int, str], _Group] = {}
    for node in model.graph.node:
        match = _PRODUCT.match(node.name)
        if match and match.group(2) in KINDS:
            layer, kind = int(match.group(1)), match.group(2)
            if layer < shapes.num_layers:
                group = groups.setdefault((layer, kind), _Group(Target(layer, kind, *shapes.kind_shape(kind)), []))
                group.nodes.append(node)
    return groups


def _ends(model: onnx.ModelProto, group: _Group, consumers: dict[str, list]) -> tuple[str, str]:
    """The projection's input x (its products' activations: the MatMulNBits', else the MatMul's first input; a GGUF
    grid's matrix may be several MatMulNBits of the same x) and its output y (its last node's, which the rest of the
    graph reads; int4's residual adds after the 4-bit product)."""
    products = [n for n in group.nodes if n.op_type == "MatMulNBits"] or \
        [n for n in group.nodes if n.op_type == "MatMul"]
    activations = {n.input[0] for n in products}
    last = group.nodes[-1]
    inside = {id(node) for node in group.nodes}
    if len(activations) != 1 or (products[0].op_type == "MatMul" and len(products) != 1) or len(last.output) != 1 \
            or not any(id(c) not in inside for c in consumers.get(last.output[0], [])):
        raise ValueError(f"projection {group.nodes[0].name}: not a product followed by what the rest of the graph "
                         f"reads ({[n.op_type for n in group.nodes]})")
    return activations.pop(), last.output[0]


def targets(model: onnx.ModelProto, shapes: BaseShapes) -> list[Target]:
    """The graph's projections that adapters may change, with their (in, out) features from the base's config."""
    return [group.target for group in _groups(model, shapes).values()]


def add_adapter_inputs(model: onnx.ModelProto, shapes: BaseShapes) -> list[Target]:
    """Adds every target's adapter inputs and delta to the graph (in place); returns the targets."""
    graph = model.graph
    groups = _groups(model, shapes)
    if not groups:
        raise ValueError("the graph has no projection named as onnxruntime-genai's builder names them "
                         "(/model/layers.N/attn/qkv_proj/MatMul, ...): adapters cannot be added")
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    last_of = {id(group.nodes[-1]): key for key, group in groups.items()}
    float_type = onnx.TensorProto.FLOAT
    for kind in sorted({kind for _, kind in groups}):
        graph.input.append(helper.make_tensor_value_info(mask_input(kind), float_type, ["batch_size", 1, width(kind)]))
    rebuilt: list[onnx.NodeProto] = []
    for node in list(graph.node):
        rebuilt.append(node)
        key = last_of.get(id(node))
        if key is not None:
            group = groups[key]  # its input read now: an earlier projection's delta may have renamed it
            rebuilt += _delta(graph, group, *_ends(model, group, consumers), consumers)
    del graph.node[:]
    graph.node.extend(rebuilt)
    return [group.target for group in groups.values()]


def write_adapter_graph(folder: Path, shapes: BaseShapes) -> Path:
    """The variant's adapter graph (ADAPTER_ONNX_FILE) beside its own, reading the same weights file."""
    model = onnx.load(str(Path(folder) / ONNX_FILE), load_external_data=False)
    add_adapter_inputs(model, shapes)
    path = Path(folder) / ADAPTER_ONNX_FILE
    onnx.save(model, str(path))
    return path


def _delta(graph: onnx.GraphProto, group: _Group, x: str, y: str,
           consumers: dict[str, list[onnx.NodeProto]]) -> list[onnx.NodeProto]:
    """The nodes adding the adapters' delta to one projection's output; its other readers read the sum instead."""
    target = group.target
    if any(output.name == y for output in graph.output):
        raise ValueError(f"{y} is a graph output: its delta has nowhere to go")
    float_type = onnx.TensorProto.FLOAT
    graph.input.append(helper.make_tensor_value_info(target.a_input, float_type,
                                                     [target.in_features, width(target.kind)]))
    graph.input.append(helper.make_tensor_value_info(target.b_input, float_type,
                                                     [width(target.kind), target.out_features]))
    prefix = f"/model/layers.{target.layer}/lora/{target.kind}"
    inside = {id(node) for node in group.nodes}
    for consumer in consumers.get(y, []):
        if id(consumer) not in inside:
            consumer.input[:] = [f"{prefix}/output" if name == y else name for name in consumer.input]
    return [
        helper.make_node("MatMul", [x, target.a_input], [f"{prefix}/down"], name=f"{prefix}/down"),
        helper.make_node("Mul", [f"{prefix}/down", mask_input(target.kind)], [f"{prefix}/own"], name=f"{prefix}/own"),
        helper.make_node("MatMul", [f"{prefix}/own", target.b_input], [f"{prefix}/delta"], name=f"{prefix}/delta"),
        helper.make_node("Add", [y, f"{prefix}/delta"], [f"{prefix}/output"], name=f"{prefix}/output"),
    ]
