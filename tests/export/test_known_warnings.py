"""`attnserve export` prints warnings only when they matter: the known harmless ones are silenced while
it runs, every other one shows."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from export.known_warnings import QUANTIZER_PREPROCESS_HINT, known_warnings_silenced

ROOT = Path(__file__).resolve().parents[2]


def test_a_successful_export_prints_nothing_on_stderr(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "export", str(tiny_model_dir), "-o", str(tmp_path), "--int8",
                          "--verify"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and "PASSED" in out.stdout


def line_of(path: Path, statement: str) -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip() == statement)


def test_only_the_known_warnings_are_silenced(caplog):
    gpt = ROOT / "model" / "gpt.py"
    known = line_of(gpt, "if total > self.config.n_ctx:")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with known_warnings_silenced():
            warnings.warn_explicit("Converting a tensor to a Python boolean", torch.jit.TracerWarning, str(gpt), known)
            # the statement after it is not known: a warning there shows
            warnings.warn_explicit("Converting a tensor to a Python boolean", torch.jit.TracerWarning, str(gpt),
                                   known + 1)
            warnings.warn("another kind of warning", UserWarning, stacklevel=1)
            logging.warning(QUANTIZER_PREPROCESS_HINT + ". Refer to example: ...")
            logging.warning("a warning that matters")
        logging.warning(QUANTIZER_PREPROCESS_HINT + ", outside the export")
    assert [(w.category, w.lineno) for w in shown if w.category is torch.jit.TracerWarning] == \
        [(torch.jit.TracerWarning, known + 1)]
    assert any(w.category is UserWarning and str(w.message) == "another kind of warning" for w in shown)
    assert [r.getMessage() for r in caplog.records] == [
        "a warning that matters", QUANTIZER_PREPROCESS_HINT + ", outside the export"]
