"""The serving runner: torch-free, one step function, and one-line errors for broken bundles."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from service.runtime.bundle import BundleError
from service.runtime.concat_runner import ConcatRunner

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def graph_file(bundle, variant: str):
    """Where export writes the graph `variant` in `bundle` (export, and so torch, imported only here)."""
    from export.bundle_writer import GRAPH_FILES

    return bundle / GRAPH_FILES[variant]


def test_serving_path_never_imports_torch(tiny_bundle):
    code = f"""
import sys, numpy as np
from service.runtime.concat_runner import ConcatRunner
r = ConcatRunner({str(tiny_bundle)!r}, provider="cpu")
logits, cache = r.step(np.array([[1, 2, 3]]), np.array([[0, 1, 2]]), np.ones((1, 3), dtype=np.int64), r.empty_cache(1))
assert logits.shape == (1, 3, r.manifest.model.vocab_size), logits.shape
assert "torch" not in sys.modules, "torch was imported"
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_prefill_then_decode_equals_one_prefill(tiny_bundle):
    r = ConcatRunner(tiny_bundle, graph="fp32", provider="cpu")
    ids = np.array([[4, 8, 15, 16, 23, 42]])
    full, _ = r.step(ids, np.arange(6)[None], np.ones((1, 6), dtype=np.int64), r.empty_cache(1))
    logits, cache = r.step(ids[:, :4], np.arange(4)[None], np.ones((1, 4), dtype=np.int64), r.empty_cache(1))
    steps = [logits]
    for t in (4, 5):
        logits, cache = r.step(ids[:, t:t + 1], np.array([[t]]), np.ones((1, t + 1), dtype=np.int64), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
    assert cache[0].shape == (1, 4, 6, 8)


def test_cpu_is_chosen_and_reported(tiny_bundle, caplog):
    caplog.set_level("INFO", logger="service.runtime.session")
    r = ConcatRunner(tiny_bundle, provider="auto")
    assert r.session.get_providers()[0] in ("CPUExecutionProvider", "CUDAExecutionProvider")
    assert "on CPUExecutionProvider" in caplog.text or "on CUDAExecutionProvider" in caplog.text


def test_cuda_asked_for_but_missing_is_a_clear_error(tiny_bundle):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(BundleError, match="onnxruntime-gpu"):
        ConcatRunner(tiny_bundle, provider="cuda")


@pytest.fixture
def broken(tiny_bundle, tmp_path):
    """A private copy of the bundle for a test to damage."""
    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, dst)
    return dst


def test_missing_bundle_directory(tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        ConcatRunner(tmp_path / "nowhere")


def test_missing_manifest(broken):
    (broken / "bundle.json").unlink()
    with pytest.raises(BundleError, match="bundle.json is missing"):
        ConcatRunner(broken)


@pytest.mark.parametrize("content,match", [("{not json", "not valid JSON"),
                                           ('{"format": "attnserve-onnx"}', "not a valid manifest: model")])
def test_corrupt_manifest(broken, content, match):
    (broken / "bundle.json").write_text(content)
    with pytest.raises(BundleError, match=match):
        ConcatRunner(broken)


def test_missing_graph_file(broken):
    graph_file(broken, "fp32").unlink()
    with pytest.raises(BundleError, match="model.onnx is missing"):
        ConcatRunner(broken, graph="fp32")


def test_truncated_graph_file(broken):
    path = graph_file(broken, "fp32")
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(BundleError, match="cannot be loaded"):
        ConcatRunner(broken, graph="fp32")


def test_unknown_graph_variant(broken):
    with pytest.raises(BundleError, match="'int4' is not in the bundle"):
        ConcatRunner(broken, graph="int4")


def test_unsupported_opset(broken):
    path = graph_file(broken, "fp32")
    import onnx

    model = onnx.load(str(path))
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = 99
    onnx.save(model, str(path))
    with pytest.raises(BundleError, match="uses ONNX opset 99, but onnxruntime .* supports opsets up to"):
        ConcatRunner(broken, graph="fp32")


def test_graph_io_that_does_not_match_the_contract(broken):
    path = graph_file(broken, "fp32")
    import onnx

    model = onnx.load(str(path))
    old = model.graph.input[2].name
    model.graph.input[2].name = "positions"
    for node in model.graph.node:
        node.input[:] = ["positions" if n == old else n for n in node.input]
    onnx.save(model, str(path))
    with pytest.raises(BundleError, match=r"inputs do not match .*missing \['position_ids'\], unexpected \['positions'\]"):
        ConcatRunner(broken, graph="fp32")


def test_tokenizer_larger_than_the_model_vocabulary(broken):
    from model.training.tokenizer import train_bpe
    from service.runtime.tokenizer import Tokenizer
    from tests.conftest import TINY_TEXTS

    Tokenizer(train_bpe(TINY_TEXTS * 3, vocab_size=400, min_frequency=1)).save(broken / "tokenizer.json")
    manifest = json.loads((broken / "bundle.json").read_text())
    assert manifest["model"]["vocab_size"] < 400
    with pytest.raises(BundleError, match="do not belong together"):
        ConcatRunner(broken)


def test_tokenizer_with_different_special_ids(broken):
    manifest = json.loads((broken / "bundle.json").read_text())
    manifest["special_tokens"] = {"<|endoftext|>": 5}
    (broken / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="maps '<\\|endoftext\\|>' to 0, the bundle expects 5"):
        ConcatRunner(broken)
