"""The bundle that ships beside the default checkpoint: current, complete, and equal to PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest

from export.bundle_writer import sha256_file
from export.verify import verify, verify_static
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
def test_default_graph_is_the_static_cache_serving_graph():
    manifest = read_manifest(BUNDLE_DIR)
    assert manifest.default_graph == "static" and manifest.graphs["static"].cache == "static"
    assert any(g.cache == "concat" for g in manifest.graphs.values()), "the bundle keeps a standard graph"


@pytest.mark.slow
def test_default_graph_verifies_against_pytorch():
    model, _ = load_model_dir(MODEL_DIR)
    report = verify_static(model, BUNDLE_DIR)
    assert report.passed, report.format()


@pytest.mark.slow
def test_standard_graph_stays_close_to_pytorch():
    model, _ = load_model_dir(MODEL_DIR)
    report = verify(model, OnnxRunner(BUNDLE_DIR, provider="cpu"), tol=0.5)  # INT8 weights
    assert all(c.passed for c in report.checks if c.name != "greedy"), report.format()
