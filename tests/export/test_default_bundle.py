"""The bundle that ships beside the default checkpoint: current, complete, and equal to PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest

from export.bundle_writer import sha256_file
from export.verify import verify
from model.checkpoint import load_model_dir
from service.bundle import read_manifest
from service.concat_runner import OnnxRunner

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "shakespeare"
BUNDLE_DIR = ROOT / "models" / "shakespeare-onnx"


def test_bundle_was_exported_from_the_shipped_weights():
    manifest = read_manifest(BUNDLE_DIR)
    assert manifest.source_weights_sha256 == sha256_file(MODEL_DIR / "model.safetensors"), (
        "the bundle is stale: re-run 'make bundle'")
    assert (BUNDLE_DIR / "tokenizer.json").read_bytes() == (MODEL_DIR / "tokenizer.json").read_bytes()
    for spec in manifest.graphs.values():
        assert (BUNDLE_DIR / spec.file).is_file()


@pytest.mark.slow
def test_default_graph_verifies_against_pytorch():
    model, _ = load_model_dir(MODEL_DIR)
    report = verify(model, OnnxRunner(BUNDLE_DIR, provider="cpu"))
    assert report.passed, report.format()
