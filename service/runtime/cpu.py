"""What this CPU is, in the terms that decide how onnxruntime's kernels compute.

onnxruntime picks its matmul kernels at run time from the instruction set. Integer matmuls differ
in more than speed: u8s8 products on AVX2 without VNNI go through VPMADDUBSW, whose 16-bit pair
sums saturate, so a dynamically quantised graph can give other logits there than on a CPU with
VNNI or AMX. Logs, the start-up self-check and every benchmark name the CPU with these flags.

The flags are /proc/cpuinfo's, less those this process cannot use as CPUID answers it (numpy's run-time
dispatch reads CPUID: `process_flags`). The two differ only where CPUID is masked for a process, as the test
suite's AVX2-only view does (tests/avx2_view/): onnxruntime then takes the kernels of the masked CPU, and what
is said of the CPU must follow.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# the flags that select onnxruntime's x86 matmul kernels, as /proc/cpuinfo spells them
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")
# those numpy's run-time CPU features name (what CPUID answers this process)
NUMPY_FEATURES = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512_vnni": "AVX512VNNI"}


@dataclass(frozen=True)
class CpuInfo:
    model: str  # model name, e.g. "AMD EPYC" or "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    cores: int  # logical CPUs this process may run on
    flags: tuple[str, ...]  # those of KERNEL_FLAGS the CPU has, in that order

    @property
    def has_int8_dot(self) -> bool:
        """Whether u8s8 integer dot products are exact here (VNNI or AMX), not saturating."""
        return any(f in self.flags for f in ("avx512_vnni", "avx_vnni", "amx_tile"))

    def describe(self) -> str:
        """One line: model, cores and flags, e.g. 'AMD EPYC, 2 cores, avx2 (no avx512f, ...)'."""
        missing = [f for f in KERNEL_FLAGS if f not in self.flags]
        flags = ", ".join(self.flags) or "none of " + "/".join(KERNEL_FLAGS)
        absent = f" (no {', '.join(missing)})" if missing and self.flags else ""
        return f"{self.model}, {self.cores} cores, {flags}{absent}"

    def as_dict(self) -> dict:
        return {"cpu": self.model, "cores": self.cores, "cpu_flags": list(self.flags)}


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo text."""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    return (model[1].strip() if model else platform.processor() or platform.machine(),
            set(flags[1].split()) if flags else set())


@cache
def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    try:
        model, flags = parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        model, flags = platform.processor() or platform.machine(), set()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return CpuInfo(model, cores, tuple(f for f in KERNEL_FLAGS if f in process_flags(flags)))


def process_flags(listed: set[str], usable: dict[str, bool] | None = None) -> set[str]:
    """Of the flags /proc/cpuinfo lists, those this process can use: `usable` maps numpy's feature names to
    what CPUID answered it (default: numpy's own). A listed flag numpy finds missing is dropped; if any is,
    CPUID is masked for this process, and the flags numpy cannot tell (AVX-VNNI, AMX) are dropped too."""
    if usable is None:
        from numpy._core._multiarray_umath import __cpu_features__ as usable
    hidden = {f for f, name in NUMPY_FEATURES.items() if f in listed and usable.get(name) is False}
    if not hidden:
        return listed
    return {f for f in listed - hidden if f in NUMPY_FEATURES or f not in KERNEL_FLAGS}
