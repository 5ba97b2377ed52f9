"""GPTQ (pipeline/targets/onnxruntime/gptq.py) on small matrices, and integer codes placed in a graph as MatMulNBits
(quantize.place_linears) run by ONNX Runtime against the float product of the dequantized weights."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from pipeline.prequantized import QuantizedLinear
from pipeline.targets.onnxruntime.gptq import grid, quantize
from pipeline.targets.onnxruntime.quantize import place_linears


def correlated_inputs(columns: int, rows: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs whose columns are mixed and unevenly scaled, as a layer's are, and their Hessian 2/n x^T x."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, columns)) @ rng.normal(size=(columns, columns)) * rng.uniform(0.1, 3, size=columns)
    return x, 2 / rows * x.T @ x


def round_to_nearest(weight: np.ndarray, group_size: int, sym: bool = False) -> np.ndarray:
    """The dequantized round-to-nearest weights on the grid GPTQ's first group step would pick."""
    w = torch.tensor(weight, dtype=torch.float32)
    out = torch.empty_like(w)
    for start in range(0, w.shape[1], group_size):
        group = w[:, start : start + group_size]
        scale, zero = grid(group, 4, sym)
        codes = torch.clamp(torch.round(group / scale[:, None]) + zero[:, None], 0, 15)
        out[:, start : start + group_size] = scale[:, None] * (codes - zero[:, None])
    return out.numpy()


def output_error(approx: np.ndarray, weight: np.ndarray, hessian: np.ndarray) -> float:
    """The layer's squared output error over the calibration inputs, the quantity GPTQ minimises."""
    delta = approx - weight
    return float(np.trace(delta @ hessian @ delta.T))


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_lowers_the_output_error_below_round_to_nearest(sym, desc_act):
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(48, 256)).astype(np.float32)
    _, hessian = correlated_inputs(256)
    linear = quantize(weight, hessian, bits=4, group_size=64, sym=sym, desc_act=desc_act)
    gptq_error = output_error(linear.dequantize(), weight, hessian)
    rtn_error = output_error(round_to_nearest(weight, 64, sym), weight, hessian)
    assert gptq_error < 0.8 * rtn_error, (gptq_error, rtn_error)
    assert linear.codes.dtype == np.uint8 and linear.codes.max() <= 15
    if sym:
        assert (linear.zeros == 8).all()
    if desc_act:  # each group holds group_size rows, the most active first
        assert np.bincount(linear.g_idx).tolist() == [64] * 4
        assert linear.g_idx[np.argmax(np.diag(hessian))] == 0
    else:
        assert linear.g_idx is None


def test_with_uncorrelated_inputs_gptq_is_round_to_nearest():
    """A diagonal Hessian carries no error from one input row to another, so every code is the nearest one."""
    rng = np.random.default_rng(2)
    weight = rng.normal(size=(32, 128)).astype(np.float32)
    hessian = np.diag(rng.uniform(0.5, 2.0, size=128))
    linear = quantize(weight, hessian, bits=4, group_size=32)
    np.testing.assert_array_equal(linear.dequantize(), round_to_nearest(weight, 32))


def test_onnxruntime_gptq_equals_round_to_nearest():
    """Why gptq.py exists: ONNX Runtime 1.32's own `gptq` gives round-to-nearest on the same grid (its error feedback
    reads the zero half of a triangular matrix). If this starts failing, ONNX Runtime fixed it: reconsider using it."""
    from onnxruntime.quantization.neural_compressor.weight_only import gptq as onnxruntime_gptq

    rng = np.random.default_rng(3)
    weight = rng.normal(size=(32, 128)).astype(np.float32)
    _, hessian = correlated_inputs(128)
    theirs = onnxruntime_gptq(weight.T.astype(np.float64).copy(), hessian.copy(), num_bits=4, group_size=32).T
    np.testing.assert_allclose(theirs, round_to_nearest(weight, 32), atol=1e-6)
    ours = quantize(weight, hessian, bits=4, group_size=32).dequantize()
    assert output_error(ours, weight, hessian) < 0.8 * output_error(theirs, weight, hessian)


def one_matmul_graph(columns: int, rows: int, weight: np.ndarray) -> onnx.ModelProto:
    """y = x @ W^T with W [rows, columns] a constant, the node named as the fused graph names a linear's."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, columns])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, rows])
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="/model/layers.0/mlp/down_proj/MatMul")
    graph = helper.make_graph([node], "g", [x], [y], [numpy_helper.from_array(weight.T.copy(), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize(
    "bits, group_size, sym, desc_act, columns",
    [
        (4, 32, False, False, 96),
        (4, 64, True, False, 128),
        (4, 32, False, True, 96),  # act-order: the input is gathered into group order first
        (8, 32, False, False, 64),
        (4, -1, False, False, 80),  # per channel over 80 rows: blocks of 16 sharing one scale
        (4, 64, False, False, 96),  # a last group of 32 rows
    ],
)
def test_placed_codes_compute_the_dequantized_product(bits, group_size, sym, desc_act, columns):
    rng = np.random.default_rng(4)
    rows = 24
    size = columns if group_size == -1 else group_size
    groups = -(-columns // size)
    g_idx = None
    if desc_act:
        g_idx = (np.arange(columns) // size)[rng.permutation(columns)].astype(np.int32)
    linear = QuantizedLinear(
        codes=rng.integers(0, 2**bits, size=(rows, columns), dtype=np.uint8),
        scales=rng.uniform(0.01, 0.1, size=(rows, groups)).astype(np.float16),
        zeros=np.full((rows, groups), 2 ** (bits - 1), np.uint8)
        if sym
        else rng.integers(0, 2**bits, size=(rows, groups), dtype=np.uint8),
        g_idx=g_idx,
        bits=bits,
        group_size=group_size,
    )
    model = one_matmul_graph(columns, rows, np.zeros((rows, columns), np.float32))
    assert place_linears(model, {"model.layers.0.mlp.down_proj": linear}, accuracy_level=None) == [
        "/model/layers.0/mlp/down_proj/MatMul"
    ]
    assert [n.op_type for n in model.graph.node] == ["Gather"] * desc_act + ["MatMulNBits"]
    assert not any(i.name == "w" for i in model.graph.initializer)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.normal(size=(3, columns)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ linear.dequantize().T, rtol=1e-4, atol=1e-4)
