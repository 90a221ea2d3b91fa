"""Blockwise weights (`com.microsoft.MatMulNBits`), one weight at a time.

Each MatMul whose second input is a 2-D fp32 initializer W (K, N) becomes

    MatMulNBits(x, W_q, scales)    K, N, bits, block_size, accuracy_level

with W_q the weight in `bits`-bit symmetric blocks of `block_size` along K (uint8, (N, K / block_size,
block_size · bits / 8)) and one fp32 scale per block (N, K / block_size): what onnxruntime's
`MatMulNBitsQuantizer` writes (its default format, QOperator), from the same packing kernels
(`quantize_matmul_4bits`, `quantize_matmul_8bits`). That quantizer holds the whole graph and every weight
at once; here each weight is read from the source's data file (memory-mapped), packed and written to the
new graph's before the next (`export/external_data.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from export.external_data import DataFile, array_of
from export.weight_matmuls import MS_DOMAIN, rewrite_weight_matmuls


def pack_blocks(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed uint8 (N, K blocks, block bytes), fp32 scales (N, K blocks)) of fp32 weight `w` (K, N), symmetric."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    rows, cols = w.shape
    k_blocks = -(-rows // block_size)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if k_blocks * block_size != rows:
        w = np.pad(w, ((0, k_blocks * block_size - rows), (0, 0)))
    packed = np.zeros((cols, k_blocks, block_size * bits // 8), dtype=np.uint8)
    scales = np.zeros((cols, k_blocks), dtype=np.float32)
    zero_points = np.zeros((cols, -(-k_blocks * bits // 8)), dtype=np.uint8)  # unused: symmetric
    kernel = {4: quantize_matmul_4bits, 8: quantize_matmul_8bits}[bits]
    kernel(packed, w, scales, zero_points, block_size, cols, rows, True)
    return packed, scales


def quantize_blocks(model: onnx.ModelProto, graph_dir: Path, data: DataFile, bits: int, block_size: int,
                    accuracy_level: int) -> onnx.ModelProto:
    """`model` with every MatMul on a 2-D fp32 initializer as MatMulNBits; weights read from `graph_dir`,
    the packed ones written to `data`."""
    level = {"accuracy_level": accuracy_level} if accuracy_level else {}

    def rewrite(node: onnx.NodeProto, w: onnx.TensorProto) -> list[onnx.NodeProto]:
        packed, scales = pack_blocks(array_of(w, graph_dir), bits, block_size)
        q, s = data.tensor(packed, f"{w.name}_Q{bits}"), data.tensor(scales, f"{w.name}_scales")
        model.graph.initializer.extend([q, s])
        return [helper.make_node("MatMulNBits", [node.input[0], q.name, s.name], list(node.output),
                                 name=f"{node.name}_Q{bits}" if node.name else "", domain=MS_DOMAIN,
                                 K=int(w.dims[0]), N=int(w.dims[1]), bits=bits, block_size=block_size, **level)]

    return rewrite_weight_matmuls(model, rewrite)

