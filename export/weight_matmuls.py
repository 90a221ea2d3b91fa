"""The MatMuls of a graph that multiply by a weight, rewritten one at a time: what the quantizations share.

    model = rewrite_weight_matmuls(model, lambda node, w: [...nodes that replace node...])

A weight MatMul is one whose second input is a 2-D fp32 initializer. `rewrite` gets the node and that
initializer, adds whatever initializers its nodes read to the graph, and returns the nodes. Afterwards the
weights no node reads any more are dropped, and the graph imports the com.microsoft opset its new nodes
may come from.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import TensorProto, helper

MS_DOMAIN = "com.microsoft"


def rewrite_weight_matmuls(model: onnx.ModelProto,
                           rewrite: Callable[[onnx.NodeProto, onnx.TensorProto], list[onnx.NodeProto]]
                           ) -> onnx.ModelProto:
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    nodes, replaced = [], set()
    for node in graph.node:
        w = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is None or len(w.dims) != 2 or w.data_type != TensorProto.FLOAT:
            nodes.append(node)
            continue
        nodes += rewrite(node, w)
        replaced.add(w.name)
    still_used = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name not in replaced or t.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return model
