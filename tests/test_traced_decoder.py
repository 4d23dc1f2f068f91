"""The export's graph optimizer (scripts/prepare/traced_decoder.py's optimize_graph): onnxscript's, as
torch.onnx.export runs it, without its rule that pairs Slices (SmolLM2's graph the same node for node:
docs/testing.md); and its trace, without torch's fake-tensor cache."""
import collections

import numpy as np
import pytest


def projection_and_halves():
    """y = x @ W.T read through a Transpose of the weight, as torch.onnx.export writes a Linear before optimizing, and
    y's two halves swapped, as rotate_half does (Slices that the full optimizer leaves as they are too)."""
    from onnx import TensorProto, helper, numpy_helper

    weight = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    ints = {name: numpy_helper.from_array(np.array(v, dtype=np.int64), name)
            for name, v in {"zero": [0], "half": [4], "full": [8], "last": [-1]}.items()}
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
         helper.make_node("MatMul", ["x", "Wt"], ["y"]),
         helper.make_node("Slice", ["y", "zero", "half", "last"], ["a"]),
         helper.make_node("Slice", ["y", "half", "full", "last"], ["b"]),
         helper.make_node("Neg", ["b"], ["minus_b"]),
         helper.make_node("Concat", ["minus_b", "a"], ["out"], axis=-1)],
        "halves", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(weight, "W"), *ints.values()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_graph_is_what_the_full_optimizer_makes_of_it_and_its_rules_are_restored(monkeypatch):
    import onnx_ir as ir
    import onnxruntime as ort
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter import onnx_fusions

    from scripts.prepare.traced_decoder import PAIRED_SLICES_RULE, optimize_graph

    proto = projection_and_halves()
    full = ir.from_proto(proto)
    optimizer.optimize_ir(full)
    onnx_fusions.fuse(full)

    default = rewriter._DEFAULT_REWRITE_RULES
    seen = []
    run = optimizer.optimize_ir
    monkeypatch.setattr(optimizer, "optimize_ir", lambda model: (
        seen.append({getattr(rule, "name", None) for rule in rewriter._DEFAULT_REWRITE_RULES}), run(model)))
    ours = ir.from_proto(proto)
    optimize_graph(ours)

    assert PAIRED_SLICES_RULE not in seen[0] and len(seen[0]) > 10, "only the paired Slices' rule is left out"
    assert rewriter._DEFAULT_REWRITE_RULES is default, "onnxscript's own rules are put back"
    nodes = [[(n.op_type, [v.name for v in n.inputs if v is not None]) for n in model.graph] for model in (full, ours)]
    assert nodes[0] == nodes[1]
    weights = {v.name for v in ours.graph.initializers.values()}
    matmul = next(n for n in ours.graph if n.op_type == "MatMul")
    assert matmul.inputs[1].name in weights, "the weight's Transpose is folded: the MatMul reads an initializer"
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    out = [ort.InferenceSession(ir.to_proto(m).SerializeToString()).run(None, {"x": x})[0] for m in (full, ours)]
    assert np.array_equal(out[0], out[1])
    assert collections.Counter(n.op_type for n in ours.graph) == {"MatMul": 1, "Slice": 2, "Neg": 1, "Concat": 1}


def test_the_rules_are_restored_when_optimizing_fails(monkeypatch):
    from onnxscript import optimizer, rewriter

    from scripts.prepare.traced_decoder import optimize_graph

    default = rewriter._DEFAULT_REWRITE_RULES

    def fails(model):
        raise ValueError("the optimizer said no")

    monkeypatch.setattr(optimizer, "optimize_ir", fails)
    with pytest.raises(ValueError, match="said no"):
        optimize_graph(None)
    assert rewriter._DEFAULT_REWRITE_RULES is default


def test_the_trace_runs_without_torchs_fake_tensor_cache_and_puts_it_back(monkeypatch, tmp_path):
    """The cache's hits cost the trace more than they save (traced_decoder.FAKE_TENSOR_CACHE); torch's setting is
    back after the trace, also when it fails."""
    import types

    import torch

    from scripts.prepare import traced_decoder

    seen = []

    def failing_trace(*args, **kwargs):
        seen.append(torch._dynamo.config.fake_tensor_cache_enabled)
        raise RuntimeError("the trace failed")

    monkeypatch.setattr(torch.onnx, "export", failing_trace)
    config = types.SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, hidden_size=8, num_attention_heads=1,
                                   head_dim=8)
    monkeypatch.setattr(torch._dynamo.config, "fake_tensor_cache_enabled", True)  # torch's default, whatever the env
    with pytest.raises(RuntimeError, match="the trace failed"):
        traced_decoder.export_graph(types.SimpleNamespace(config=config), tmp_path / "model.onnx", log=lambda _: None)
    assert seen == [False]
    assert torch._dynamo.config.fake_tensor_cache_enabled is True
