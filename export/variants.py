"""Derived graphs: optimised (onnxruntime's transformer fusions), INT8 (dynamic quantisation), FP16.

Each takes the fp32 decoder written by `onnx_export` and writes a graph with the same inputs and
outputs, so the runner serves any of them unchanged.
"""

from __future__ import annotations

from pathlib import Path

import onnx


def optimize(src: Path, dst: Path, n_head: int, d_model: int) -> Path:
    """onnxruntime's transformer optimiser for GPT-2 graphs (LayerNorm, GELU, SkipLayerNorm fusions).

    Only provider-independent fusions are applied offline (opt_level 1 plus the fusion passes), so
    the graph still runs on CPU and CUDA; the session adds its own at load time.
    """
    from onnxruntime.transformers.optimizer import optimize_model

    opt = optimize_model(str(src), model_type="gpt2", num_heads=n_head, hidden_size=d_model, opt_level=0)
    opt.save_model_to_file(str(dst))
    return dst


def quantize_int8(src: Path, dst: Path) -> Path:
    """Dynamic INT8 quantisation of the MatMul weights, for CPU (activations stay fp32)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # contrib ops (GroupQueryAttention) defeat shape inference; their outputs are float
    quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8,
                     per_channel=True, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return dst


def convert_fp16(src: Path, dst: Path) -> Path:
    """FP16 weights, activations, logits and KV cache, for the CUDA execution provider."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=False)
    onnx.save(model, str(dst))
    return dst


def node_count(path: Path) -> int:
    return len(onnx.load(str(path), load_external_data=False).graph.node)
