"""bench.roofline: the bytes a batch-1 decode step reads, and the tokens/s the read bandwidth allows for them."""

from __future__ import annotations

import onnx
import pytest

from bench.commands.quantization import expand_block_sizes
from bench.roofline import bound_tokens_per_s, tensor_bytes, weight_bytes_per_token
from export.bundle_writer import GRAPH_FILES


def test_every_initializer_counts_but_the_looked_up_embeddings(tiny_bundle):
    path = tiny_bundle / GRAPH_FILES["static"]
    graph = onnx.load(str(path)).graph
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather"}
    sizes = {t.name: tensor_bytes(t) for t in graph.initializer}
    assert {"tok_emb.weight", "pos_emb.weight"} <= gathered  # the tiny GPT: token and position tables
    assert weight_bytes_per_token(path) == sum(sizes.values()) - sum(sizes[name] for name in gathered)
    # the tied output head is read whole, as the logits MatMul's transposed copy: as many bytes as the table
    assert any(n.op_type == "MatMul" and sizes.get(n.input[1]) == sizes["tok_emb.weight"] for n in graph.node)


def test_fewer_bits_read_fewer_bytes(tiny_bundle, tmp_path):
    from export.variants import INT4, quantize

    fp32 = weight_bytes_per_token(tiny_bundle / GRAPH_FILES["static"])
    int8 = weight_bytes_per_token(tiny_bundle / GRAPH_FILES["static-int8"])
    int4 = weight_bytes_per_token(quantize(tiny_bundle / GRAPH_FILES["static"], tmp_path / "int4.onnx", INT4))
    assert int4 < int8 < fp32
    assert int8 < 0.4 * fp32 and int4 < 0.7 * int8  # norms, biases and scales stay fp32 in the tiny model


def test_the_bound_is_bandwidth_over_bytes():
    assert bound_tokens_per_s(250_000_000, 20.0) == pytest.approx(80.0)
    with pytest.raises(ValueError):
        bound_tokens_per_s(0, 20.0)


def test_the_quantization_bench_sweeps_block_sizes_of_4_bit_candidates_only():
    names = ["u8s8-reduce-range", "nbits8-int8", "nbits4-int8", "nbits4-fp32-b128"]
    assert expand_block_sizes(names, [16, 64]) == [
        "u8s8-reduce-range", "nbits8-int8", "nbits4-int8-b16", "nbits4-int8-b64", "nbits4-fp32-b128"]
    assert expand_block_sizes(names, []) == names
