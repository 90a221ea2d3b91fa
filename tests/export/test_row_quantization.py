"""INT8 with one activation scale per row (`export/row_quantization.py`, what `--int8` writes): its arithmetic
is the documented one, and a row's output is the same bits alone and in any batch."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.row_quantization import ACTIVATION_MAX, WEIGHT_MAX, quantize_rows, quantize_weight

K, N = 96, 80


def matmul_graph(w: np.ndarray, bias: np.ndarray | None = None) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm" if bias is not None else "y"], name="mm")]
    inits = [numpy_helper.from_array(w, "w")]
    if bias is not None:
        nodes.append(helper.make_node("Add", ["mm", "b"], ["y"]))
        inits.append(numpy_helper.from_array(bias, "b"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def session(model: onnx.ModelProto, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
    w[:, 3] = 0  # an all-zero output column
    return w, rng.standard_normal(N).astype(np.float32)


def rows(batch: int, seq: int = 1, seed: int = 1) -> np.ndarray:
    """Rows of very different magnitudes, one of them all zeros: per-tensor scales would round them alike."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq, K)).astype(np.float32) * np.geomspace(1e-3, 1e3, batch)[:, None, None]
    x[0, 0] = 0
    return x.astype(np.float32)


def test_weights_are_7_bit_per_column_and_zero_columns_stay_finite(weights):
    q, scale = quantize_weight(weights[0])
    assert q.dtype == np.int8 and np.abs(q).max() == WEIGHT_MAX and scale.shape == (N,)
    assert (q[:, 3] == 0).all() and np.isfinite(scale).all()
    np.testing.assert_allclose(q * scale, weights[0], atol=scale.max() / 2 + 1e-7)


def test_the_graph_computes_the_documented_integer_arithmetic(weights):
    w, bias = weights
    model = quantize_rows(matmul_graph(w, bias))
    assert not any(n.op_type == "MatMul" for n in model.graph.node)
    assert sum(n.op_type == "MatMulIntegerToFloat" for n in model.graph.node) == 1
    assert "w" not in {t.name for t in model.graph.initializer}  # the fp32 weight is gone
    x = rows(6, 3)
    got = session(model).run(None, {"x": x})[0]
    q, w_scale = quantize_weight(w)
    m = np.abs(x).max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # the zero row: 0 / 0, scaled by m = 0 in the end
        x_q = np.nan_to_num(np.rint(x / m / np.float32(1 / ACTIVATION_MAX))).astype(np.int64)  # half to even
    assert np.abs(x_q).max() <= ACTIVATION_MAX
    want = (x_q @ q.astype(np.int64)).astype(np.float32) * (w_scale / ACTIVATION_MAX) * m + bias
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.isfinite(got).all() and np.array_equal(got[0, 0], bias)  # the zero row: exactly the bias
    np.testing.assert_allclose(got, x @ w + bias, atol=0.02 * np.abs(x @ w).max(-1, keepdims=True).max())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_output_is_the_same_bits_alone_and_in_any_batch(weights, threads):
    run = session(quantize_rows(matmul_graph(weights[0])), threads)
    x = rows(32)
    alone = np.concatenate([run.run(None, {"x": x[i:i + 1]})[0] for i in range(32)])
    for batch in (2, 5, 32):
        together = np.concatenate([run.run(None, {"x": x[i:i + batch]})[0] for i in range(0, 32 - batch + 1, batch)])
        np.testing.assert_array_equal(together, alone[:len(together)])
    as_one_prompt = run.run(None, {"x": x.reshape(1, 32, K)})[0].reshape(32, 1, N)
    np.testing.assert_array_equal(as_one_prompt, alone)
