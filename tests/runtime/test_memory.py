"""The memory facts the server plans from: the limit it runs under, budgets as fractions or sizes, and address
space whose pages are taken on write and given back."""

from __future__ import annotations

import pytest

from service.runtime import memory
from service.runtime.memory import MemoryLimit, budget_bytes, lazy_zeros, release_pages, resident_bytes

MiB = 2**20


def test_a_cgroup_limit_below_physical_memory_is_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory, "_cgroup_limit_files", lambda: [tmp_path / "memory.max"])
    physical = memory.memory_limit()
    assert physical.source == "physical memory" and physical.bytes > 0
    (tmp_path / "memory.max").write_text("max\n")  # no limit set
    assert memory.memory_limit() == physical
    (tmp_path / "memory.max").write_text(f"{6 * 2**30}\n")  # docker run --memory 6g
    limit = memory.memory_limit()
    assert limit.bytes == 6 * 2**30 and "cgroup" in limit.source
    (tmp_path / "memory.max").write_text(f"{physical.bytes * 2}\n")  # above the machine: the machine is the limit
    assert memory.memory_limit() == physical


def test_a_budget_is_a_fraction_of_the_limit_or_a_size():
    limit = MemoryLimit(8 * 2**30, "test")
    assert budget_bytes("0.5", limit) == 4 * 2**30
    assert budget_bytes(1, limit) == limit.bytes
    assert budget_bytes("12GiB", limit) == 12 * 2**30
    assert budget_bytes("800MB", limit) == 800 * 10**6
    assert budget_bytes("1.5 GiB", limit) == 3 * 2**29
    assert budget_bytes("4096", limit) == 4096
    for bad, message in (("0", "fraction"), ("-0.5", "fraction"), ("2 parsecs", "size such as")):
        with pytest.raises(ValueError, match=message):
            budget_bytes(bad, limit)


def test_pages_are_taken_on_write_and_given_back():
    array = lazy_zeros((64, MiB // 4), "float32")  # 64 MiB of address space
    before = resident_bytes()
    assert (array[::7] == 0).all() and resident_bytes() - before < 8 * MiB  # reading takes no memory
    array[:] = 1.0
    written = resident_bytes()
    assert written - before >= 60 * MiB
    assert release_pages(array, 0, array.nbytes) == array.nbytes
    assert written - resident_bytes() >= 60 * MiB
    assert (array == 0).all()  # released pages read as zeros
    array[3] = 2.0  # and can be written again
    assert release_pages(array, 3 * MiB + 1, 4 * MiB) == MiB - memory.PAGE  # only whole pages inside the range
    assert array[3, 0] == 2.0 and (array[3, memory.PAGE // 4:] == 0).all()
