"""A deep model's graph from the trace of its first two layers: torch.onnx.export's time grows with the layers it
traces (SmolLM2: about 3.4 s a layer on top of 6 s, 2-core machine), while a decoder's layers are the same operations
on weights of their own. The second layer's nodes, as the trace wrote them, are copied for each layer after it, with
that layer's weights and KV cache inputs and outputs; the final norm then reads the last copy. scripts/prepare/
export_onnx.py checks the result's parity against transformers as it checks a full trace's.

Taken only where every layer is the same kind (``replication_refusal``), and only when the traced graph has the shape
this relies on (``replicate``): the second layer reads from the first only the residual stream, and is read from
outside only by the final norm and through its cache outputs. Anything else raises ``NotReplicable``, and the export
traces every layer instead."""

from __future__ import annotations

import ast
import re

import onnx_ir as ir

TRACED_LAYERS = 2
_LAYER_SCOPE = re.compile(r"(?:^|\.)layers\.(\d+)$")


class NotReplicable(ValueError):
    """The traced graph is not two layers that a copy of the second can extend."""


def replication_refusal(config) -> str | None:
    """Why this model's layers cannot all be copies of one traced layer (None: they can): too few to gain from it,
    or layers of more than one kind, as any per-layer list of its config says (``layer_types``' sliding-window and
    full attention, Llama 4's ``no_rope_layers``, ...). Dense and expert MLPs mixed show in the weights instead
    (check_uniform)."""
    layers = config.num_hidden_layers
    if layers <= TRACED_LAYERS:
        return f"{layers} layers: all are traced"
    for key, value in sorted(config.to_dict().items()):
        if isinstance(value, list) and len(value) == layers and len({repr(v) for v in value}) > 1:
            return f"layers of more than one kind ({key}: {', '.join(sorted({str(v) for v in value}))})"
    return None


def layer_parameters(state: dict, layer: int) -> dict[str, tuple]:
    """Layer ``layer``'s parameters in a state dict: the name's tail after ``layers.N.`` -> shape."""
    pattern = re.compile(rf"(?:^|\.)layers\.{layer}\.(.+)$")
    return {match.group(1): tuple(tensor.shape) for name, tensor in state.items() if (match := pattern.search(name))}


def check_uniform(state: dict, layers: int) -> None:
    """Every layer has the second's parameters, of the same shapes (a model that mixes kinds of layers does not)."""
    second = layer_parameters(state, 1)
    for layer in range(TRACED_LAYERS, layers):
        if layer_parameters(state, layer) != second:
            raise NotReplicable(f"layer {layer}'s parameters are not layer 1's")


def _layer_of(node: ir.Node) -> int | None:
    for scope in ast.literal_eval(node.metadata_props.get("pkg.torch.onnx.name_scopes", "[]")):
        if match := _LAYER_SCOPE.search(scope):
            return int(match.group(1))
    return None


def _sources(graph: ir.Graph, layer: int) -> set[ir.Value]:
    """The values that hold layer ``layer``'s own data: its weights and its past KV inputs."""
    cache = {f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"}
    weights = re.compile(rf"(?:^|\.)layers\.{layer}\.")
    return ({v for v in graph.inputs if v.name in cache}
            | {v for name, v in graph.initializers.items() if weights.search(name)})


def _depends_on(value: ir.Value, sources: set[ir.Value], memo: dict) -> bool:
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in memo:
            if memo[v]:
                memo[value] = True
                return True
            continue
        if v in sources:
            memo[value] = True
            return True
        # a shape is not the data: the sizes of every layer's cache are the same
        if v in seen or v.producer() is None or v.producer().op_type in ("Shape", "Size"):
            continue
        seen.add(v)
        stack.extend(i for i in v.producer().inputs if i is not None)
    memo[value] = False
    return False


def _second_layer(graph: ir.Graph) -> list[ir.Node]:
    """The nodes the second layer's copies repeat: those in its scope, and the scope-less pass-throughs of its past
    KV inputs (the cache's reads, which torch.export puts outside any module)."""
    past = {"past_key_values.1.key", "past_key_values.1.value"}
    nodes = []
    for node in graph:
        layer = _layer_of(node)
        reads_past = any(v is not None and v.name in past for v in node.inputs)
        if layer == 1 or (layer is None and reads_past and node.op_type == "Identity"):
            nodes.append(node)
        elif layer is not None and layer > 1:
            raise NotReplicable(f"a node of layer {layer} in a trace of {TRACED_LAYERS} layers")
    return nodes


def replicate(model: ir.Model, state: dict, layers: int) -> None:
    """Extends ``model``, torch.onnx.export's graph of a model's first two layers, to ``layers`` layers in place:
    layer i's nodes are the second layer's, on state's ``layers.i.`` weights (state: the traced module's state dict
    with every layer), past_key_values.i.* and present.i.*."""
    graph = model.graph
    check_uniform(state, layers)
    second = _second_layer(graph)
    members = set(second)
    for node in second:
        if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
            raise NotReplicable(f"{node.op_type} {node.name} holds a subgraph")
    first_sources, second_sources, memo = _sources(graph, 0), _sources(graph, 1), {}
    layer_inputs = {v for v in second_sources if v.is_graph_input()}
    residual_in = set()
    for node in second:
        for v in node.inputs:
            if v is None or v in layer_inputs or v.is_initializer() or v.producer() in members:
                continue
            if _depends_on(v, first_sources, memo):
                residual_in.add(v)
    if len(residual_in) != 1:
        raise NotReplicable(f"layer 1 reads {len(residual_in)} values computed from layer 0 (the residual stream: 1)")
    (residual_in,) = residual_in
    present = {"present.1.key", "present.1.value"}
    residual_out = set()
    for node in second:
        for v in node.outputs:
            if v.is_graph_output() and v.name not in present:
                raise NotReplicable(f"layer 1 writes the graph output {v.name}")
            outside = {use.node for use in v.uses()} - members
            if any(_layer_of(n) == 0 for n in outside):
                raise NotReplicable("layer 0 reads a value of layer 1")
            if outside:
                residual_out.add(v)
    if len(residual_out) != 1:
        raise NotReplicable(f"{len(residual_out)} values of layer 1 are read after it (the residual stream: 1)")
    (residual_out,) = residual_out
    weights = {v.name: v for v in second_sources if v.is_initializer()}
    for layer in range(TRACED_LAYERS, layers):
        if missing := [name for name in weights if _layer_name(name, layer) not in state]:
            raise NotReplicable(f"no weight {_layer_name(missing[0], layer)} for layer {layer}")
    tail_readers = [(use.node, use.idx) for use in residual_out.uses() if use.node not in members]

    previous_out = residual_out
    for layer in range(TRACED_LAYERS, layers):
        mapping: dict[ir.Value, ir.Value] = {residual_in: previous_out}
        for v in sorted(layer_inputs, key=lambda v: v.name):
            copy = ir.Value(name=v.name.replace(".1.", f".{layer}."), shape=_copied(v.shape), type=v.type)
            graph.inputs.append(copy)
            mapping[v] = copy
        for name, v in weights.items():
            new_name = _layer_name(name, layer)
            tensor = state[new_name].detach().numpy()
            copy = ir.Value(name=new_name, shape=ir.Shape(tensor.shape), type=v.type,
                            const_value=ir.Tensor(tensor, name=new_name))
            graph.register_initializer(copy)
            mapping[v] = copy
        for node in second:
            outputs = [ir.Value(name=_renamed(v.name, layer, present), shape=_copied(v.shape), type=v.type)
                       for v in node.outputs]
            copy = ir.Node(node.domain, node.op_type, [None if v is None else mapping.get(v, v) for v in node.inputs],
                           attributes=list(node.attributes.values()), overload=node.overload, outputs=outputs,
                           version=node.version, name=f"{node.name}__layer{layer}",
                           metadata_props={key: value.replace("layers.1", f"layers.{layer}")
                                           for key, value in node.metadata_props.items()})
            graph.append(copy)
            mapping.update(zip(node.outputs, outputs))
            for old, new in zip(node.outputs, outputs):
                if old.name in present:
                    graph.outputs.append(new)
        previous_out = mapping[residual_out]
    for node, index in tail_readers:
        node.replace_input_with(index, previous_out)
    _order_cache(graph, layers)
    graph.sort()


def _layer_name(name: str, layer: int) -> str:
    """Layer 1's weight name as layer ``layer``'s."""
    return re.sub(r"((?:^|\.)layers\.)1\.", rf"\g<1>{layer}.", name, count=1)


def _copied(shape: ir.Shape | None) -> ir.Shape | None:
    return None if shape is None else shape.copy()


def _renamed(name: str, layer: int, present: set[str]) -> str:
    return name.replace(".1.", f".{layer}.") if name in present else f"{name}__layer{layer}"


def _order_cache(graph: ir.Graph, layers: int) -> None:
    """The graph's inputs and outputs in the order a full trace gives them: past_key_values.0.key, .0.value, .1.key,
    ... after the other inputs, present.N.* likewise after the logits."""
    def ordered(values, prefix):
        rank = {f"{prefix}.{i}.{kind}": 2 * i + k for i in range(layers) for k, kind in enumerate(("key", "value"))}
        others = [v for v in values if v.name not in rank]
        return others + sorted((v for v in values if v.name in rank), key=lambda v: rank[v.name])

    for values, prefix in ((graph.inputs, "past_key_values"), (graph.outputs, "present")):
        new = ordered(list(values), prefix)
        values.clear()
        values.extend(new)
