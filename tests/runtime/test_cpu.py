"""What the server and the benchmarks say about the CPU: model, cores, and the flags that pick kernels."""

from __future__ import annotations

from service.runtime.cpu import KERNEL_FLAGS, CpuInfo, cpu_info, parse_cpuinfo, process_flags

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
"""


def test_an_avx2_only_cpu_is_described_with_what_it_lacks():
    model, flags = parse_cpuinfo(EPYC)
    info = CpuInfo(model, 2, tuple(f for f in KERNEL_FLAGS if f in flags))
    assert info.flags == ("avx2",) and not info.has_int8_dot
    assert info.describe() == "AMD EPYC, 2 cores, avx2 (no avx512f, avx512_vnni, avx_vnni, amx_tile)"
    assert info.as_dict() == {"cpu": "AMD EPYC", "cores": 2, "cpu_flags": ["avx2"]}


def test_vnni_or_amx_makes_integer_dot_products_exact():
    assert CpuInfo("x", 2, ("avx2", "avx512f", "avx512_vnni")).has_int8_dot
    assert CpuInfo("x", 2, ("avx2", "avx_vnni")).has_int8_dot
    assert CpuInfo("x", 2, ("avx2", "avx512f", "avx512_vnni", "amx_tile")).describe() == (
        "x, 2 cores, avx2, avx512f, avx512_vnni, amx_tile (no avx_vnni)")


def test_this_machine_is_read_from_proc_cpuinfo(tmp_path):
    info = cpu_info()
    assert info.model and info.cores >= 1 and set(info.flags) <= set(KERNEL_FLAGS)
    missing = tmp_path / "cpuinfo"
    assert cpu_info(missing).flags == ()  # no /proc/cpuinfo: no flags claimed


def test_flags_the_process_cannot_use_are_not_claimed():
    """CPUID masked for the process (tests/avx2_view/): what /proc/cpuinfo lists beyond it is not claimed."""
    listed = {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "fma"}
    everything = {"AVX2": True, "AVX512F": True, "AVX512VNNI": True}
    assert process_flags(listed, everything) == listed
    masked = {"AVX2": True, "AVX512F": False, "AVX512VNNI": False}
    assert process_flags(listed, masked) == {"avx2", "fma"}  # AVX-VNNI cannot be told apart: dropped with them
    client = {"avx2", "avx_vnni"}  # AVX-VNNI without AVX-512 (a client CPU): nothing hidden, all kept
    assert process_flags(client, masked) == client
