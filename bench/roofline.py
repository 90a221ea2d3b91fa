"""The memory-bandwidth bound on a batch-1 decode step: bytes a graph reads per token, and the tokens/s they allow.

    bytes = weight_bytes_per_token(bundle / "model.static.int4.onnx")
    bound = bound_tokens_per_s(bytes, read_bandwidth())   # bench.commands.bandwidth: GB/s of this machine

A decode step at batch 1 reads every weight it multiplies by once, so no step can be faster than those
bytes over the machine's read bandwidth. What is counted: every initializer of the graph (and of its
subgraphs), at its stored size (a 4-bit matrix as its packed bytes plus its block scales; an 8-bit one
with its scales and zero points), except the tables a step only looks rows up in: the data of a
`Gather` (token and position embeddings) and the cos/sin caches of `GroupQueryAttention` and
`RotaryEmbedding`. A tied output head counts once, as the logits MatMul's own (transposed) copy, which
the step reads whole; the embedding it was copied from is only gathered. The KV cache is not counted
(it grows with the context; at batch 1 and short contexts it is small beside the weights), nor are
activations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

# (op type, input index) of the inputs whose rows a step looks up rather than reads whole
LOOKED_UP = {("Gather", 0), ("GroupQueryAttention", 7), ("GroupQueryAttention", 8),
             ("RotaryEmbedding", 2), ("RotaryEmbedding", 3)}


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                yield from _graphs(sub)


def tensor_bytes(t: onnx.TensorProto) -> int:
    """Stored size of an initializer, from its shape and type (so external data need not be loaded)."""
    count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (count + 1) // 2
    return count * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def weight_bytes_per_token(onnx_path: str | Path) -> int:
    """Bytes of initializers a batch-1 decode step of the graph at `onnx_path` reads (see the module docstring)."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    sizes: dict[str, int] = {}
    read_whole: set[str] = set()
    for graph in _graphs(model.graph):
        sizes.update((t.name, tensor_bytes(t)) for t in graph.initializer)
        for node in graph.node:
            read_whole.update(name for i, name in enumerate(node.input) if (node.op_type, i) not in LOOKED_UP)
        read_whole.update(o.name for o in graph.output)  # an initializer returned as an output is read whole
    return sum(size for name, size in sizes.items() if name in read_whole)


def graph_weight_bytes_per_token(bundle: Path, graph: str) -> int:
    """`weight_bytes_per_token` of graph `graph` of the bundle at `bundle`."""
    from service.runtime.bundle import read_manifest

    return weight_bytes_per_token(Path(bundle) / read_manifest(bundle).graphs[graph].file)


def bound_tokens_per_s(bytes_per_token: int, gb_per_s: float) -> float:
    """The most tokens/s a batch-1 decode can reach reading `bytes_per_token` at `gb_per_s` (10⁹ bytes/s)."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes per token must be positive, got {bytes_per_token}")
    return gb_per_s * 1e9 / bytes_per_token
