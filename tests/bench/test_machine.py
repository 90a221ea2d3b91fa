"""What every benchmark records about the machine, and where it writes."""

from __future__ import annotations

import json

import pytest

from bench import machine
from service.runtime.cpu import cpu_info


def test_the_line_names_the_cpu_its_kernel_flags_and_the_versions():
    m = {"cpu": "AMD EPYC", "cores": 2, "cpu_flags": ["avx2"], "python": "3.11.7", "onnxruntime": "1.32.0",
         "numpy": "2.4.6", "os": "Linux"}
    assert machine.machine_line(m) == ("AMD EPYC, 2 cores, avx2 (no avx512f, avx512_vnni, avx_vnni, amx_tile); "
                                       "Python 3.11.7, onnxruntime 1.32.0, numpy 2.4.6")


def test_describe_is_the_cpu_as_the_server_sees_it():
    assert machine.describe().items() >= cpu_info().as_dict().items()


def test_results_elsewhere_leave_benchmarks_md_alone(tmp_path, monkeypatch):
    def refuse(*args):
        pytest.fail("publish() outside docs/bench wrote BENCHMARKS.md")

    monkeypatch.setattr(machine, "write_section", refuse)
    machine.publish("x", {"machine": machine.describe()}, "## x\n", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "x.json").read_text())["machine"] == machine.describe()


def test_sections_print_paths_relative_to_the_repo_or_by_name():
    cmd = (f"attnserve bench compare --work {machine.ROOT / 'runs' / 'compare'} --out=/tmp/pytest-7/results "
           f"--bundle {machine.ROOT} --sizes gpt2-124m (stream settings at their defaults)")
    assert machine.shown(cmd) == ("attnserve bench compare --work runs/compare --out=results --bundle . "
                                  "--sizes gpt2-124m (stream settings at their defaults)")
