"""What a benchmark ran on, and where its results go."""

from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
BENCH_DOC = ROOT / "docs" / "BENCHMARKS.md"
RESULTS_DIR = ROOT / "docs" / "bench"


def describe() -> dict:
    cpu = platform.processor() or "unknown CPU"
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"model name\s*:\s*(.+)", text)[1].strip()
    except (OSError, TypeError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": ort.__version__, "numpy": np.__version__, "os": platform.platform()}


def machine_line(m: dict) -> str:
    return (f"{m['cpu']}, {m['cores']} cores; Python {m['python']}, onnxruntime {m['onnxruntime']}, "
            f"numpy {m['numpy']}")


def publish(name: str, result: dict, markdown: str, out: Path = RESULTS_DIR) -> None:
    """Write `<out>/<name>.json` and, for the standard results folder, the `name` section of
    BENCHMARKS.md. Plots go next to the JSON (each benchmark draws its own)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    if out == RESULTS_DIR:
        write_section(name, markdown)


def write_section(name: str, markdown: str, doc: Path = BENCH_DOC) -> None:
    """Replace the block between `<!-- bench:name -->` and `<!-- /bench:name -->` in BENCHMARKS.md."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
