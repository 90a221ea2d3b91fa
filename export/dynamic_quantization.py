"""onnxruntime's dynamic INT8 quantization (`quantize_dynamic`: one activation scale per tensor), one MatMul at
a time.

`quantize_dynamic` loads the whole graph with its weights, runs shape inference over a copy and keeps the
fp32 and the quantized weights side by side: about 3.5× the fp32 weights at Qwen2.5-0.5B's shape. Here
each MatMul whose second input is a 2-D fp32 initializer is cut out as a graph of its own (its input, its
weight, its output, under the same names), quantized by `quantize_dynamic` itself, and the ops it becomes
(DynamicQuantizeLinear, MatMulInteger, Cast, the two Muls) are put back in its place, their weights written
to the new graph's data file (`export/external_data.py`). The names are those `quantize_dynamic` gives in the
whole graph, so an activation that feeds several MatMuls is quantized once, as there; the tests check that
the result computes what `quantize_dynamic` writes for the whole graph.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.external_data import DataFile, array_of


def quantize_matmuls_dynamic(model: onnx.ModelProto, graph_dir: Path, data: DataFile, weight_type: str,
                             reduce_range: bool) -> onnx.ModelProto:
    """`model` with every MatMul on a 2-D fp32 initializer quantized as `quantize_dynamic(op_types_to_quantize=
    ["MatMul"], per_channel=True)` quantizes it; weights read from `graph_dir`, the quantized ones written to
    `data`."""
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    nodes, made, replaced = [], set(), set()
    with tempfile.TemporaryDirectory(prefix="attnserve-quantize.") as tmp:
        for node in graph.node:
            w = weights.get(node.input[1]) if node.op_type == "MatMul" else None
            if w is None or len(w.dims) != 2 or w.data_type != TensorProto.FLOAT:
                nodes.append(node)
                continue
            quantized = _quantized_alone(node, array_of(w, graph_dir), Path(tmp), weight_type, reduce_range)
            for new in quantized.graph.node:
                if new.name not in made:  # an activation already quantized for an earlier MatMul
                    made.add(new.name)
                    nodes.append(new)
            graph.initializer.extend(data.tensor(numpy_helper.to_array(t), t.name)
                                     for t in quantized.graph.initializer)
            replaced.add(w.name)
    still_used = {name for node in nodes for name in node.input}
    kept = {}
    for t in graph.initializer:  # the same name from two MatMuls (a shared zero point) is kept once
        if (t.name not in replaced or t.name in still_used) and t.name not in kept:
            kept[t.name] = t
    del graph.initializer[:]
    graph.initializer.extend(kept.values())
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _quantized_alone(node: onnx.NodeProto, w: np.ndarray, tmp: Path, weight_type: str,
                     reduce_range: bool) -> onnx.ModelProto:
    """MatMul `node` with weight `w`, as a graph of its own, through `quantize_dynamic`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    x, y = node.input[0], node.output[0]
    alone = helper.make_model(
        helper.make_graph([node], "matmul", [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.ascontiguousarray(w), node.input[1])]),
        opset_imports=[helper.make_opsetid("", 17)])
    src, dst = tmp / "matmul.onnx", tmp / "matmul.int8.onnx"
    onnx.save(alone, str(src))
    quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul"], per_channel=True,
                     weight_type=QuantType.QInt8 if weight_type == "s8" else QuantType.QUInt8,
                     reduce_range=reduce_range, extra_options={"DefaultTensorType": TensorProto.FLOAT})
    return onnx.load(str(dst))
