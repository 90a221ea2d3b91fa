"""Exporting an encoder-decoder: the encoder and decoder graphs match PyTorch in every configuration, the
manifest says what the bundle is, and the runners refuse what they cannot serve."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from export.cli import main
from export.seq2seq_bundle import export_seq2seq_bundle
from export.verify_seq2seq import verify_int8_pair, verify_seq2seq
from model.checkpoint import save_model_dir
from model.training.g2p_data import g2p_tokenizer
from service.runtime.bundle import BundleError, read_manifest
from service.runtime.graph_choice import open_serving_graph
from service.runtime.seq2seq_runner import Seq2SeqRunner
from service.runtime.static_runner import StaticRunner
from tests.conftest import make_lively_seq2seq

pytestmark = pytest.mark.needs_torch("builds models in PyTorch")

CONFIGS = {
    "paper": dict(norm_placement="post", tie_embeddings=True, embedding_norm=False),  # sinusoidal, shared, ReLU, √d
    "pre-ln learned separate": dict(pos_encoding="learned", share_embeddings=False, activation="gelu"),
    "bart-like": dict(norm_placement="post", tie_embeddings=True, pos_encoding="learned", position_offset=2,
                      final_logits_bias=True, scale_embedding=False, activation="gelu_tanh"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_configuration_exports_and_verifies(tmp_path, name):
    tokenizer = g2p_tokenizer()
    model = make_lively_seq2seq(tokenizer.vocab_size, **CONFIGS[name])
    if model.config.final_logits_bias:
        import torch

        with torch.no_grad():
            model.logits_bias.normal_()
    save_model_dir(model, tokenizer, tmp_path / "model")
    files = export_seq2seq_bundle(tmp_path / "model", tmp_path / "bundle", name="s2s")
    assert files == ["model.encoder.onnx", "model.decoder.static.onnx"]
    report = verify_seq2seq(model, tmp_path / "bundle", tol=1e-4)
    assert report.passed, report.format()
    m = read_manifest(tmp_path / "bundle")
    assert (m.model.kind, m.model.n_src_ctx, m.model.n_ctx, m.model.n_layer, m.model.n_encoder_layer) == (
        "encoder-decoder", 24, 20, 2, 2)
    assert m.model.decoder_start_token_id == 1 and m.encoder_graph.file == "model.encoder.onnx"


def test_the_export_cli_writes_and_verifies(seq2seq_model_dir, tmp_path, capsys):
    assert main([str(seq2seq_model_dir), "-o", str(tmp_path / "b"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "model.encoder.onnx" in out
    assert main([str(seq2seq_model_dir), "-o", str(tmp_path / "c"), "--int8", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "model.encoder.int8.onnx" in out and "model.decoder.static.int8.onnx" in out
    assert "verify static-int8" in out and "FAIL" not in out and out.count("PASSED") == 2
    assert main([str(seq2seq_model_dir), "-o", str(tmp_path / "d"), "--int4"]) == 2
    assert "encoder-decoder" in capsys.readouterr().err


def test_the_int8_pair_agrees_with_fp32_and_is_batch_invariant(lively_seq2seq_int8_bundle):
    m = read_manifest(lively_seq2seq_int8_bundle)
    assert m.graphs["static-int8"].weights == m.encoder_for("static-int8").weights == "int8"
    assert m.encoder_for("static").file == "model.encoder.onnx" and m.encoder_for("static").weights == "float32"
    report = verify_int8_pair(lively_seq2seq_int8_bundle)
    assert report.passed, report.format()
    runner = Seq2SeqRunner(lively_seq2seq_int8_bundle, "static-int8", provider="cpu")
    assert runner.encoder._model_path.endswith("model.encoder.int8.onnx")
    assert {node.op_type for node in onnx.load(str(lively_seq2seq_int8_bundle / "model.encoder.int8.onnx")).graph.node
            } >= {"MatMulIntegerToFloat", "Attention"}


def test_an_int8_pair_that_parts_from_fp32_is_not_served(lively_seq2seq_int8_bundle, tmp_path, caplog, graph_times):
    """Another model's INT8 pair where this bundle's belongs, as a CPU whose integer kernels went wrong would
    make it: named, start-up refuses it; under auto, where it is the first pick, the fp32 pair is served."""
    import shutil

    other = tmp_path / "other"
    save_model_dir(make_lively_seq2seq(g2p_tokenizer().vocab_size, d_ff=96), g2p_tokenizer(), other / "model")
    export_seq2seq_bundle(other / "model", other / "bundle", int8=True)
    bundle = tmp_path / "b"
    shutil.copytree(lively_seq2seq_int8_bundle, bundle)
    for file in ("model.encoder.int8.onnx", "model.decoder.static.int8.onnx"):
        shutil.copyfile(other / "bundle" / file, bundle / file)
    with pytest.raises(BundleError, match="static-int8.*agrees with the fp32 graph"):
        open_serving_graph(bundle, "static-int8", threads=1)
    graph_times({"static-int8": 1.0})
    with caplog.at_level("WARNING"):
        assert open_serving_graph(bundle, "auto", threads=1).graph_name == "static"
    assert "not serving static-int8" in caplog.text


def test_new_graphs_use_the_fused_attention_operators(lively_seq2seq_bundle):
    encoder = {n.op_type for n in onnx.load(str(lively_seq2seq_bundle / "model.encoder.onnx")).graph.node}
    decoder = {n.op_type for n in onnx.load(str(lively_seq2seq_bundle / "model.decoder.static.onnx")).graph.node}
    assert "Attention" in encoder and {"GroupQueryAttention", "MultiHeadAttention"} <= decoder
    assert not {"Softmax", "Transpose"} & decoder  # no attention left in plain ops
    assert "SkipLayerNormalization" in encoder & decoder


def test_a_runner_for_the_other_kind_is_refused(lively_seq2seq_bundle, lively_bundle):
    with pytest.raises(BundleError, match="encoder-decoder"):
        StaticRunner(lively_seq2seq_bundle, provider="cpu")
    with pytest.raises(BundleError, match="decoder-only"):
        Seq2SeqRunner(lively_bundle, provider="cpu")


def test_a_manifest_of_mixed_kinds_is_refused(lively_seq2seq_bundle, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(lively_seq2seq_bundle, bundle)
    manifest = json.loads((bundle / "bundle.json").read_text())
    manifest["model"]["kind"] = "decoder"
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="encoder_graph"):
        read_manifest(bundle)


def test_a_shorter_source_slot_masks_the_rest(lively_seq2seq_bundle):
    """Slots sized below the model's longest source still serve the sources that fit, with the same logits."""
    full = Seq2SeqRunner(lively_seq2seq_bundle, provider="cpu")
    short = Seq2SeqRunner(lively_seq2seq_bundle, provider="cpu", max_source=8)
    src = [[5, 9, 11, 30], [6, 7, 8, 9, 10, 11, 12, 13]]
    with full.scratch_cache(2, 4), short.scratch_cache(2, 4):
        np.testing.assert_allclose(short.prefill_batch(0, src), full.prefill_batch(0, src), atol=1e-5)
        with pytest.raises(ValueError, match="exceeds the 8"):
            short.encode(0, [[5] * 9])
