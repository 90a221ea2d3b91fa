"""Derived graphs: optimised (onnxruntime's transformer fusions), INT8 (per-row or per-tensor activations), INT4
(blockwise `MatMulNBits`), FP16.

Each takes the fp32 decoder written by `onnx_export` and writes a graph with the same inputs and
outputs, so the runner serves any of them unchanged, its weights in `<graph>.data` beside it
(`export/external_data.py`). The quantized graphs are written one weight at a time; onnxruntime's
transformer optimiser and the FP16 conversion hold the whole graph.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import onnx

from export.external_data import DataFile, copy_initializers, data_path, load_graph
from service.runtime.bundle import WeightPrecision


def optimize(src: Path, dst: Path, n_head: int, d_model: int) -> Path:
    """onnxruntime's transformer optimiser for GPT-2 graphs (LayerNorm, GELU, SkipLayerNorm fusions).

    Only provider-independent fusions are applied offline (opt_level 1 plus the fusion passes), so
    the graph still runs on CPU and CUDA; the session adds its own at load time.
    """
    from onnxruntime.transformers.optimizer import optimize_model

    opt = optimize_model(str(src), model_type="gpt2", num_heads=n_head, hidden_size=d_model, opt_level=0)
    opt.save_model_to_file(str(dst), use_external_data_format=True)
    return dst


@dataclass(frozen=True)
class Quantization:
    """One way to store the MatMul weights in fewer bits (the candidates of docs/onnx.md)."""

    name: str  # as the benchmark and docs/onnx.md call it
    weights: WeightPrecision  # what the manifest records
    # dynamic: onnxruntime's quantize_dynamic, one activation scale per tensor; rowwise: one per row
    # (export/row_quantization.py); blockwise: MatMulNBits
    method: Literal["dynamic", "rowwise", "blockwise"]
    weight_type: Literal["s8", "u8"] = "s8"  # dynamic only
    reduce_range: bool = False  # dynamic only: 7-bit weights, so AVX2's 16-bit pair sums cannot saturate
    bits: int = 8  # blockwise only
    block_size: int = 32  # blockwise only: weights sharing one scale along the input dimension
    accuracy_level: int = 0  # blockwise only: 0/1 fp32 compute, 4 int8 compute (onnxruntime's MatMulNBits)


QUANTIZATIONS = {q.name: q for q in (
    Quantization("u8s8", "int8", "dynamic"),
    Quantization("u8u8", "int8", "dynamic", weight_type="u8"),
    Quantization("u8s8-reduce-range", "int8", "dynamic", reduce_range=True),
    Quantization("rowwise-u8s8", "int8", "rowwise", reduce_range=True),
    Quantization("nbits8-fp32", "int8", "blockwise", bits=8, accuracy_level=1),
    Quantization("nbits8-int8", "int8", "blockwise", bits=8, accuracy_level=4),
    Quantization("nbits4-fp32", "int4", "blockwise", bits=4, accuracy_level=1),
    Quantization("nbits4-int8", "int4", "blockwise", bits=4, accuracy_level=4),
)}
BLOCK_SIZES = (16, 32, 64, 128)  # what `attnserve bench quantization` sweeps for the 4-bit candidates


def quantization(name: str) -> Quantization:
    """A candidate by name: one of QUANTIZATIONS, or a blockwise one with another block size, `<name>-b<size>`
    (`nbits4-int8-b64`)."""
    if name in QUANTIZATIONS:
        return QUANTIZATIONS[name]
    m = re.fullmatch(r"(.+)-b(\d+)", name)
    if not m or m[1] not in QUANTIZATIONS or QUANTIZATIONS[m[1]].method != "blockwise":
        raise ValueError(f"unknown quantization {name!r}: one of {sorted(QUANTIZATIONS)}, or a blockwise one "
                         f"with '-b<block size>'")
    block_size = int(m[2])
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"{name!r}: MatMulNBits takes block sizes that are powers of 2 from 16")
    return replace(QUANTIZATIONS[m[1]], name=name, block_size=block_size)


# what --int8 writes: 7-bit weights (no CPU saturates their u8 x s8 pair sums; VNNI and AMX keep their fast
# kernels) and one activation scale per row, so a row's logits do not depend on the other rows of its batch
# (export/row_quantization.py; the measurements are in docs/onnx.md)
INT8 = QUANTIZATIONS["rowwise-u8s8"]
# what --int8-per-tensor writes (and --int8 wrote before it): onnxruntime's quantize_dynamic, one activation
# scale for the whole batch; its logits differ with the batch, and by a few percent of the largest logit
# between kernels. Kept for comparison, and for the standard int8 graph, which must stay in standard ops
INT8_PER_TENSOR = QUANTIZATIONS["u8s8-reduce-range"]
# what --int4 writes: 4-bit symmetric blockwise weights, int8 activations (accuracy level 4). Its integer
# products (0..15 times -127..127, summed in pairs and fours) fit 16 bits on AVX2 and never saturate on any
# kernel; docs/onnx.md has the argument and the block-size measurements
INT4 = quantization("nbits4-int8-b32")


def quantize(src: Path, dst: Path, q: Quantization = INT8) -> Path:
    """Write `src` with its MatMul weights stored as `q` says; activations, logits and cache stay fp32."""
    src, dst = Path(src), Path(dst)
    model = load_graph(src)
    with DataFile(dst) as data:
        if q.method == "rowwise":
            from export.row_quantization import quantize_rows

            quantize_rows(model, src.parent, data)
        elif q.method == "dynamic":
            from export.dynamic_quantization import quantize_matmuls_dynamic

            quantize_matmuls_dynamic(model, src.parent, data, q.weight_type, q.reduce_range)
        else:
            from export.block_quantization import quantize_blocks

            quantize_blocks(model, src.parent, data, q.bits, q.block_size, q.accuracy_level)
        copy_initializers(model, src.parent, data)  # what stays fp32 (embeddings, norms, biases, rotary tables)
    onnx.save(model, str(dst))
    return dst


def convert_fp16(src: Path, dst: Path) -> Path:
    """FP16 weights, activations, logits and KV cache, for the CUDA execution provider."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=False)
    data_path(dst).unlink(missing_ok=True)  # onnx appends to a data file that is there
    onnx.save(model, str(dst), save_as_external_data=True, location=data_path(dst).name)
    return dst


def node_count(path: Path) -> int:
    return len(onnx.load(str(path), load_external_data=False).graph.node)
