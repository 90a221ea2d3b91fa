"""This machine's memory, as the server plans from it: the limit it runs under, what the process holds, and
address space that costs nothing until it is written.

    limit = memory_limit()            # MemoryLimit(bytes, source): the container's cgroup limit, else physical memory
    resident_bytes()                  # this process's resident set now
    budget_bytes("0.65", limit)       # a fraction of the limit, or a size: "12GiB", "800MB", "4294967296"
    array = lazy_zeros(dims, dtype)   # zeros in reserved address space; pages are taken when written
    release_pages(array, lo, hi)      # give the pages wholly inside bytes [lo, hi) of `array` back (they read as 0)
    return_freed_memory()             # malloc_trim: what an unloaded model freed leaves the resident set

The KV cache reserves every slot's whole context as address space (`lazy_zeros`, an anonymous mapping with
MAP_NORESERVE: no commit charge) and the kernel maps a page when a position in it is first written, so
resident memory follows the tokens written; `release_pages` (madvise MADV_DONTNEED) returns a freed
sequence's pages. Transparent huge pages are refused on these mappings: one touched position would
otherwise take 2 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11's mmap does not name it
CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: str  # where it was read: the container's cgroup limit, or physical memory


def memory_limit() -> MemoryLimit:
    """The memory this process may use: its cgroup's limit (a container's `--memory`) where one is set below
    physical memory, else physical memory."""
    physical = _meminfo_bytes("MemTotal")
    for path in _cgroup_limit_files():
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < physical:
            return MemoryLimit(int(text), f"the cgroup limit ({path})")
    return MemoryLimit(physical, "physical memory")


def _cgroup_limit_files() -> list[Path]:
    """cgroup v2's memory.max of this process's group (and of the namespace root, as a container sees it), then
    cgroup v1's limit."""
    files = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                files.append(CGROUP_ROOT / line[3:].strip().lstrip("/") / "memory.max")
    except OSError:
        pass
    return files + [CGROUP_ROOT / "memory.max", CGROUP_ROOT / "memory" / "memory.limit_in_bytes"]


def _meminfo_bytes(field: str) -> int:
    for line in MEMINFO.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{MEMINFO} has no {field}")


def resident_bytes() -> int:
    """This process's resident set size now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def budget_bytes(value: str | float, limit: MemoryLimit) -> int:
    """`value` as bytes: a fraction of `limit` (0 < f <= 1), or a size with an optional unit (KiB, MiB, GiB,
    TiB are powers of 2; K/KB, M/MB, G/GB, T/TB powers of 10)."""
    text = str(value).strip()
    fraction = _fraction(text)
    if fraction is not None:
        return int(fraction * limit.bytes)
    return parse_size(text)


def _fraction(text: str) -> float | None:
    try:
        f = float(text)
    except ValueError:
        return None
    if f > 1:
        return None  # a plain number above 1 is a size in bytes
    if not 0 < f <= 1 or not math.isfinite(f):
        raise ValueError(f"{text!r}: a fraction of memory must be in (0, 1]")
    return f


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS:
        raise ValueError(f"{text!r} is neither a fraction of memory in (0, 1] nor a size such as 12GiB or 800MB")
    size = int(float(m.group(1)) * UNITS[unit])
    if size < 1:
        raise ValueError(f"{text!r}: a size must be at least one byte")
    return size


def check_budget(value: str | float) -> str:
    """`value` if it reads as a budget (a fraction or a size), else ValueError saying what is allowed."""
    budget_bytes(value, MemoryLimit(1, "check"))
    return str(value).strip()


def lazy_zeros(dims: tuple[int, ...], dtype: str | np.dtype) -> np.ndarray:
    """A zeroed array in address space reserved without commit: a page takes memory when first written."""
    nbytes = max(math.prod(dims) * np.dtype(dtype).itemsize, 1)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(area, dtype=dtype, count=math.prod(dims)).reshape(dims)


def release_pages(array: np.ndarray, lo: int, hi: int) -> int:
    """Give back the pages wholly inside bytes [lo, hi) of `array` (from `lazy_zeros`); they read as zeros
    after. Returns the bytes released. Pages shared with bytes outside the range are kept."""
    area = array.base
    while area is not None and not isinstance(area, mmap.mmap):
        area = getattr(area, "base", None) if not isinstance(area, memoryview) else area.obj
    if area is None:
        return 0  # an ordinary array (tests, probes): nothing to give back
    start = -(-lo // PAGE) * PAGE
    end = hi // PAGE * PAGE
    if end <= start:
        return 0
    area.madvise(mmap.MADV_DONTNEED, start, end - start)
    return end - start


def return_freed_memory() -> None:
    """Ask the C allocator to give the memory freed since (an unloaded model's weights and arenas) back to the
    system, so that the resident size falls with it; a no-op where the allocator has no such call."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
