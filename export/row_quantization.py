"""INT8 matmuls whose activations are quantized one row (one token) at a time.

onnxruntime's dynamic quantization (`DynamicQuantizeMatMul`) gives the whole activation tensor one
scale, so every row of a batch rounds by the largest value of any row: a request's logits change
with what else is in the batch. Here each MatMul with a constant weight becomes

    m   = max(|x| over the row)                              one scale per token, [..., 1]
    x_q = QuantizeLinear(x / m, 1/127, 128)                  u8, 1...255, zero point 128 (rounds half to even)
    y   = MatMulIntegerToFloat(x_q, W_q, m, w_scale/127, 128)   exact integer products, then y · m · w_scale/127

with W_q per-column symmetric in 7 bits (-64...64), so a u8 × s8 pair sum fits 16 bits
(255 · 64 · 2 = 32640) and no kernel saturates it (docs/onnx.md). Everything a row's output depends
on is that row's: its scale, its integer dot products (exact, in any order and on any CPU), and
elementwise float operations. A row's logits are therefore the same bits alone and in any batch.

Five ops per MatMul: at batch 1 each costs a few microseconds of dispatch whatever its size, so the 1/127
is folded into the quantizer's scale and the weight scales rather than spent on a Mul. An all-zero row
gives x / 0 = NaN, which QuantizeLinear turns into some integer; its output is then scaled by m = 0, so
the row's product is 0, as it should be.

Given the graph's directory and a data file, the weights are read from the source's data file one at a time
(memory-mapped) and the quantized ones written to the new graph's (`export/external_data.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.external_data import DataFile, array_of
from export.weight_matmuls import MS_DOMAIN, rewrite_weight_matmuls

WEIGHT_MAX = 64  # 7-bit weights: u8 x s8 pair sums fit 16 bits on AVX2 without VNNI
ACTIVATION_MAX = 127  # a row's largest |value| maps to 127 steps from the zero point 128
ZERO_POINT = 128


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [K, N] in -64...64, fp32 scale [N]): symmetric, one scale per output column."""
    scale = np.abs(w).max(axis=0) / WEIGHT_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale), -WEIGHT_MAX, WEIGHT_MAX).astype(np.int8), scale


def quantize_rows(model: onnx.ModelProto, graph_dir: Path | None = None, data: DataFile | None = None
                  ) -> onnx.ModelProto:
    """`model` with every MatMul whose second input is a 2-D fp32 initializer rewritten as above. Weights in
    a data file are read from `graph_dir`; the quantized ones go to `data` (None: inside the graph)."""
    make = data.tensor if data else numpy_helper.from_array
    shared = {"rowq_step": np.array(1 / ACTIVATION_MAX, np.float32),
              "rowq_zero_point": np.array(ZERO_POINT, np.uint8)}
    model = rewrite_weight_matmuls(model, lambda node, w: _row_quantized_matmul(
        node, model.graph, array_of(w, graph_dir or Path(".")), make))
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in shared.items())
    return model


def _row_quantized_matmul(node: onnx.NodeProto, graph: onnx.GraphProto, w: np.ndarray, make) -> list[onnx.NodeProto]:
    x, y, p = node.input[0], node.output[0], f"rowq_{node.name or node.output[0]}"
    w_q, w_scale = quantize_weight(w)
    w_scale = (w_scale / ACTIVATION_MAX).astype(np.float32)  # the activations' 1/127, folded in
    graph.initializer.extend([make(w_q, f"{p}_w"), make(w_scale, f"{p}_ws")])

    def op(kind: str, inputs: list[str], out: str, **attrs) -> onnx.NodeProto:
        return helper.make_node(kind, inputs, [out], name=f"{p}_{out.rsplit('_', 1)[-1]}", **attrs)

    return [
        op("Abs", [x], f"{p}_abs"),
        op("ReduceMax", [f"{p}_abs"], f"{p}_max", axes=[-1], keepdims=1),
        op("Div", [x, f"{p}_max"], f"{p}_unit"),  # -1 ... 1
        op("QuantizeLinear", [f"{p}_unit", "rowq_step", "rowq_zero_point"], f"{p}_q"),  # 1 ... 255
        helper.make_node("MatMulIntegerToFloat", [f"{p}_q", f"{p}_w", f"{p}_max", f"{p}_ws", "rowq_zero_point"],
                         [y], name=f"{p}_matmul", domain=MS_DOMAIN),
    ]
