"""What a benchmark ran on, and where its results go.

`describe()` is the machine as JSON: the CPU as `service.runtime.cpu` sees it (model, cores, and the flags
that select onnxruntime's kernels), the Python, onnxruntime and numpy versions, the OS.
`machine_line()` is the same in one line, for each benchmark's BENCHMARKS.md section. `shown()` is a command
line or a setting with its absolute paths made relative to the repo, as a section prints it.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.runtime.cpu import CpuInfo, cpu_info

ROOT = Path(__file__).resolve().parents[1]
BENCH_DOC = ROOT / "docs" / "BENCHMARKS.md"
RESULTS_DIR = ROOT / "docs" / "bench"


def describe() -> dict:
    return {**cpu_info().as_dict(), "python": platform.python_version(), "onnxruntime": ort.__version__,
            "numpy": np.__version__, "os": platform.platform()}


def machine_line(m: dict) -> str:
    """E.g. 'AMD EPYC, 2 cores, avx2 (no avx512f, ...); Python 3.11.7, onnxruntime 1.32.0, numpy 2.4.6'."""
    cpu = CpuInfo(m["cpu"], m["cores"], tuple(m["cpu_flags"])).describe()
    return f"{cpu}; Python {m['python']}, onnxruntime {m['onnxruntime']}, numpy {m['numpy']}"


def publish(name: str, result: dict, markdown: str, out: Path = RESULTS_DIR,
            docs: tuple[Path, ...] = (BENCH_DOC,)) -> None:
    """Write `<out>/<name>.json` and, for the standard results folder, the `name` section of
    BENCHMARKS.md (and of any other of `docs`). Plots go next to the JSON (each benchmark draws its own)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    if out.resolve() == RESULTS_DIR:
        for doc in docs:
            write_section(name, markdown, doc)


def shown(text: str) -> str:
    """`text` (a command line, a setting) as a BENCHMARKS.md section prints it: each absolute path in it (a
    word starting with "/", or the value of `--flag=/...`) relative to the repo if inside it, else by its name
    alone, so that no section names the machine's folders."""
    return " ".join(_shown_word(word) for word in text.split(" "))


def _shown_word(word: str) -> str:
    flag, eq, value = word.partition("=") if word.startswith("-") else ("", "", word)
    if not value.startswith("/"):
        return word
    path = Path(value)
    for candidate in (path, path.resolve()):
        if candidate.is_relative_to(ROOT):
            return flag + eq + (candidate.relative_to(ROOT).as_posix() or ".")
    return flag + eq + (path.name or value)


def write_section(name: str, markdown: str, doc: Path = BENCH_DOC) -> None:
    """Replace the block between `<!-- bench:name -->` and `<!-- /bench:name -->` in `doc`."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
