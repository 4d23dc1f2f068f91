"""Block quantization (scripts/prepare/block_quantization.py) and the graph rewrite (scripts/prepare/quantize.py), run by onnxruntime's
own MatMulNBits kernels on small graphs: on weights that came from GGUF grids the quantized product is the fp32
product; on other weights the residual still helps."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from scripts.prepare.block_quantization import block_sum_matrix, quantize
from scripts.prepare.quantize import Recipe, quantize_on_grid

K, N, BLOCK = 96, 40, 32


def q4_1_weights(rng) -> tuple[np.ndarray, np.ndarray]:
    """[K, N] weights as GGUF's Q4_1 stores them: w = d·q + m per block of 32 along K, d and m fp16, every block
    using codes 0 and 15 (the quantizer maps a block's min and max there). Returns (weights, codes [N, K])."""
    codes = rng.integers(0, 16, (N, K // BLOCK, BLOCK))
    codes[..., 0], codes[..., 1] = 0, 15
    d = rng.uniform(0.001, 0.05, (N, K // BLOCK, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.4, 0.1, (N, K // BLOCK, 1)).astype(np.float16).astype(np.float32)
    weights = (d * codes + m).astype(np.float32)
    return weights.reshape(N, K).T.copy(), codes.reshape(N, K)


def one_matmul_model(weight: np.ndarray) -> onnx.ModelProto:
    k, n = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "one_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", n])],
        [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def rewritten(weight: np.ndarray, recipe: Recipe) -> onnx.ModelProto:
    model = one_matmul_model(weight)
    quantize_on_grid(model, recipe, head=None)
    return model


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_q4_1_weights_get_back_their_own_codes_and_scales(rng):
    weights, codes = q4_1_weights(rng)
    matrix = quantize(weights, bits=4)
    assert np.array_equal(matrix.codes().reshape(N, K), codes)
    assert matrix.residual_spread(weights) < 1e-6
    exact = matrix.dequantize() + np.repeat(matrix.residual, BLOCK, axis=0)
    assert np.abs(exact - weights).max() < 1e-6


def test_int4_with_residual_is_the_fp32_product_on_q4_1_weights(rng):
    weights, _ = q4_1_weights(rng)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    expected = x @ weights
    exact = run(rewritten(weights, Recipe("int4", bits=4)), x)
    without_residual = run(rewritten(weights, Recipe("int4", bits=4, residual=False)), x)
    assert np.abs(exact - expected).max() < 1e-5 * np.abs(expected).max()
    assert np.abs(without_residual - expected).max() > 100 * np.abs(exact - expected).max()


def test_symmetric_int8_is_exact_on_q8_0_weights(rng):
    scales = rng.uniform(0.001, 0.02, (N, K // BLOCK, 1)).astype(np.float16).astype(np.float32)
    codes = rng.integers(-127, 128, (N, K // BLOCK, BLOCK))
    codes[..., 0] = 127  # Q8_0's scale is max|w| / 127
    weights = (scales * codes).astype(np.float32).reshape(N, K).T.copy()
    matrix = quantize(weights, bits=8, symmetric=True)
    assert matrix.zero_points is None
    assert np.abs(matrix.dequantize() - weights).max() < 1e-6 * np.abs(weights).max()
    x = rng.standard_normal((1, 2, K)).astype(np.float32)
    head = Recipe("t", bits=8, symmetric=True, residual=False)
    assert np.abs(run(rewritten(weights, head), x) - x @ weights).max() < 1e-5 * np.abs(x @ weights).max()


def test_the_residual_reduces_the_error_on_plain_fp32_weights(rng):
    weights = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    x = rng.standard_normal((4, 1, K)).astype(np.float32)
    expected = x @ weights
    with_residual = run(rewritten(weights, Recipe("int4", bits=4)), x)
    without = run(rewritten(weights, Recipe("int4", bits=4, residual=False)), x)
    assert 0 < np.abs(with_residual - expected).mean() < np.abs(without - expected).mean()


def test_onnxruntime_own_quantizer_widens_the_range_to_zero_and_misses_the_grid():
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    block = (np.arange(BLOCK, dtype=np.float32)[:, None] % 16) * 0.1 + 1.0  # min 1.0, step 0.1, all positive
    _, ort_scales, _ = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=BLOCK, bits=4)) \
        .qbits_block_quant(block)
    assert ort_scales[0, 0] == pytest.approx(2.5 / 15)  # (max - 0) / 15
    assert quantize(block, bits=4).scales[0, 0] == pytest.approx(0.1)  # (max - min) / 15: the grid's own step


def test_block_sums_and_shared_sums_for_matmuls_reading_the_same_input(rng):
    assert np.array_equal(np.arange(64.0) @ block_sum_matrix(64, 32), [np.arange(32.0).sum(), np.arange(32, 64.0).sum()])
    weights, _ = q4_1_weights(rng)
    model = one_matmul_model(weights)
    second = helper.make_node("MatMul", ["x", "w2"], ["y2"], name="proj2")
    model.graph.node.append(second)
    model.graph.initializer.append(numpy_helper.from_array(weights[:, ::-1].copy(), "w2"))
    model.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["batch", "seq", N]))
    stats = quantize_on_grid(model, Recipe("int4", bits=4), head=None)
    assert stats["matmuls_quantized"] == 2 and stats["max_residual_spread"] < 1e-6
    assert sum(n.name.endswith(".block_sums") for n in model.graph.node) == 1


def test_unsupported_shapes_and_bits_are_refused():
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        quantize(np.zeros((40, 8), np.float32), bits=4)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize(np.zeros((32, 8), np.float32), bits=3)
