"""The test suite's AVX2-only view of the CPU (mask_cpuid.c, loaded with LD_PRELOAD by `make test-avx2-view`),
and how a process tells which view it has: onnxruntime's u8s8 integer matmul saturates only on AVX2 without
VNNI, so its product says which kernel it took."""

from __future__ import annotations

import shutil
from pathlib import Path

from service.runtime.cpu import parse_cpuinfo

K = 64
SATURATED = 32 * 32767  # 255 x 127 pairs summed in 16 bits, saturating at 32767 each: AVX2's VPMADDUBSW
EXACT = K * 255 * 127  # VNNI, AMX, or any exact integer kernel
WIDER = ("avx512f", "avx_vnni", "amx_tile")  # what the view hides: each brings other integer kernels


def where_avx2_kernels_run(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """Where this machine runs onnxruntime's AVX2 kernels, as `make test-avx2-view` decides it: "native" on an
    AVX2-only CPU, "view" where the lane can mask CPUID (the CPU faults on it and a C compiler builds the mask),
    else "qemu" (an emulated Haswell, 30-100x slower)."""
    _, flags = parse_cpuinfo(cpuinfo.read_text())
    if not flags & set(WIDER):
        return "native"
    return "view" if "cpuid_fault" in flags and shutil.which("cc") else "qemu"


def u8s8_product() -> int:
    """255 x 127 summed over K terms by onnxruntime's MatMulInteger on this process's CPU view."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "saturation",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, K])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
        [numpy_helper.from_array(np.full((K, 1), 127, np.int8), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return int(session.run(None, {"a": np.full((1, K), 255, np.uint8)})[0].item())
