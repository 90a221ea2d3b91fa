"""ONNX export: the bundle's contract, verification against PyTorch, and the derived graphs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch

from export.bundle_writer import GRAPH_FILES, export_bundle, sha256_file
from export.variants import node_count
from export.verify import verify, verify_static
from model.checkpoint import load_model_dir
from service.runtime.bundle import LOGITS_INDEX, decoder_io_names, read_manifest, static_io_names
from service.runtime.concat_runner import ConcatRunner
from service.runtime.self_check import MIN_AGREEMENT, logits_at_every_position, probe_sequences
from service.runtime.static_runner import StaticRunner


def test_manifest_describes_the_model_and_the_graphs(tiny_bundle, tiny_model_dir):
    m = read_manifest(tiny_bundle)
    model, tok = load_model_dir(tiny_model_dir)
    assert (m.model.vocab_size, m.model.n_ctx, m.model.n_layer, m.model.n_head, m.model.d_head) == (
        model.config.vocab_size, 128, 2, 4, 8)
    assert m.model.eos_token_id == tok.eos_id and m.special_tokens == {"<|endoftext|>": tok.eos_id}
    assert m.source_weights_sha256 == sha256_file(tiny_model_dir / "model.safetensors")
    assert set(m.graphs) == {"static", "static-int8", "fp32", "optimized", "int8", "fp16"}
    assert m.default_graph == "static" and m.graphs["static"].cache == "static"
    assert {g.cache for g in m.graphs.values()} == {"static", "concat"}
    assert (tiny_bundle / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert m.opset == 17


@pytest.mark.parametrize("variant", ["fp32", "optimized", "int8", "fp16"])
def test_graph_io_names_shapes_and_metadata(tiny_bundle, variant):
    graph = onnx.load(str(tiny_bundle / GRAPH_FILES[variant]))
    inputs, outputs = decoder_io_names(2)
    assert [i.name for i in graph.graph.input] == inputs
    assert [o.name for o in graph.graph.output] == outputs
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    assert dims["input_ids"] == ["batch", "seq"] and dims["attention_mask"] == ["batch", "total_seq"]
    assert dims["past_key_values.1.value"] == ["batch", 4, "past_seq", 8]
    props = {p.key: p.value for p in graph.metadata_props}
    assert json.loads(props["attnserve.model"])["name"] == "tiny"
    assert {o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")} == {17}


@pytest.mark.parametrize("variant", ["static", "static-int8"])
def test_static_graph_io_names_shapes_and_metadata(tiny_bundle, variant):
    graph = onnx.load(str(tiny_bundle / GRAPH_FILES[variant]))
    inputs, outputs = static_io_names(2)
    assert [i.name for i in graph.graph.input] == [*inputs, LOGITS_INDEX]
    assert [o.name for o in graph.graph.output] == outputs
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    assert dims["seqlens_k"] == ["batch"] and dims["total_sequence_length"] == []
    assert dims[LOGITS_INDEX] == ["batch", "logits_seq"]
    assert [d.dim_param or d.dim_value for d in graph.graph.output[0].type.tensor_type.shape.dim][:2] == [
        "batch", "logits_seq"]
    assert dims["past_key_values.1.value"] == ["batch", 4, "max_seq", 8]
    assert "GroupQueryAttention" in {n.op_type for n in graph.graph.node}
    assert "Concat" not in {n.op_type for n in graph.graph.node}  # the cache is never copied
    props = {p.key: p.value for p in graph.metadata_props}
    assert json.loads(props["attnserve.model"])["name"] == "tiny"


def test_static_graph_verifies_against_pytorch(tiny_bundle, tiny_model_dir):
    model, _ = load_model_dir(tiny_model_dir)
    report = verify_static(model, tiny_bundle)
    assert report.passed, report.format()
    assert [c.name for c in report.checks] == ["prefill", "chunked", "decode", "greedy"]


@pytest.mark.parametrize("overrides", [dict(bias=False), dict(activation="gelu"), dict(pos_encoding="sinusoidal")])
def test_static_graph_covers_every_architecture_option(tiny_tokenizer, tmp_path, overrides):
    from model.checkpoint import save_model_dir
    from tests.conftest import make_model

    save_model_dir(make_model(vocab_size=tiny_tokenizer.vocab_size, n_ctx=128, **overrides), tiny_tokenizer, tmp_path / "m")
    export_bundle(tmp_path / "m", tmp_path / "b")
    model, _ = load_model_dir(tmp_path / "m")
    report = verify_static(model, tmp_path / "b")
    assert report.passed, report.format()


def test_static_verification_catches_a_wrong_graph(tiny_bundle, tiny_model_dir):
    model, _ = load_model_dir(tiny_model_dir)
    with torch.no_grad():
        model.blocks[1].attn.out_proj.bias[0] += 0.1  # (a uniform shift would vanish in the next LayerNorm)
    assert not verify_static(model, tiny_bundle).passed


def test_no_fp32_needs_another_standard_graph(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="keeps a standard graph"):
        export_bundle(tiny_model_dir, tmp_path, keep_fp32=False)


@pytest.mark.parametrize("variant", ["fp32", "optimized"])
def test_verification_against_pytorch_passes(tiny_bundle, tiny_model_dir, variant):
    model, _ = load_model_dir(tiny_model_dir)
    report = verify(model, ConcatRunner(tiny_bundle, graph=variant, provider="cpu"))
    assert report.passed, report.format()
    assert [c.name for c in report.checks] == ["checker", "prefill", "decode", "greedy"]
    assert all(c.max_abs_diff <= 1e-4 for c in report.checks)


def test_verification_catches_a_wrong_graph(tiny_bundle, tiny_model_dir):
    model, _ = load_model_dir(tiny_model_dir)
    with torch.no_grad():
        model.ln_f.bias += 0.01  # PyTorch now differs from the exported graph
    report = verify(model, ConcatRunner(tiny_bundle, graph="fp32", provider="cpu"))
    assert not report.passed and "FAILED" in report.format()


def test_optimized_graph_has_fewer_nodes(tiny_bundle):
    assert node_count(tiny_bundle / GRAPH_FILES["optimized"]) < node_count(tiny_bundle / GRAPH_FILES["fp32"])


def test_fp16_graph_stays_close(tiny_bundle):
    ref = ConcatRunner(tiny_bundle, graph="fp32", provider="cpu")
    other = ConcatRunner(tiny_bundle, graph="fp16", provider="cpu")
    ids = np.array([[5, 9, 17, 33, 2, 8]])
    mask, pos = np.ones_like(ids), np.arange(6)[None]
    want, _ = ref.step(ids, pos, mask, ref.empty_cache(1))
    got, cache = other.step(ids, pos, mask, other.empty_cache(1))
    assert got.dtype == np.float16 and cache[0].dtype == np.float16
    err = np.abs(got.astype(np.float32) - want).max()
    assert 0 < err <= 0.01 * np.abs(want).max()  # close, and not the fp32 graph under another name


@pytest.mark.parametrize("variant", ["static-int8", "int8"])
def test_int8_graphs_follow_fp32_on_the_top1_token(tiny_bundle, variant):
    """Judged as the start-up self-check judges it: the most likely token at every position of
    text the fp32 graph wrote, by the same rule on every CPU (not logit tolerances, which differ)."""
    ref = StaticRunner(tiny_bundle, "static", provider="cpu")
    seqs = probe_sequences(ref, rows=8)
    want = logits_at_every_position(ref, seqs)
    if variant == "static-int8":
        got = logits_at_every_position(StaticRunner(tiny_bundle, variant, provider="cpu"), seqs)
    else:
        runner = ConcatRunner(tiny_bundle, graph=variant, provider="cpu")
        pos = np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape)
        got, _ = runner.step(seqs, pos, np.ones_like(seqs), runner.empty_cache(len(seqs)))
    assert read_manifest(tiny_bundle).graphs[variant].weights == "int8"
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= MIN_AGREEMENT["int8"]
    assert np.abs(got - want).max() > 0  # not the fp32 graph under another name


def test_export_cli_verifies_and_exits_zero(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "export", str(tiny_model_dir), "-o", str(tmp_path), "--verify"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "PASSED" in out.stdout and "max|Δlogits|" in out.stdout


def test_imported_gpt2_exports_and_verifies(tiny_tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    from model.hf.import_hf import import_hf

    cfg = transformers.GPT2Config(vocab_size=tiny_tokenizer.vocab_size, n_positions=160, n_embd=32, n_layer=2,
                                  n_head=2, eos_token_id=tiny_tokenizer.eos_id)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    tiny_tokenizer.save(tmp_path / "hf" / "tokenizer.json")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    export_bundle(tmp_path / "ours", tmp_path / "bundle", optimized=True, int8=True)
    model, _ = load_model_dir(tmp_path / "ours")
    for variant in ("fp32", "optimized"):
        report = verify(model, ConcatRunner(tmp_path / "bundle", graph=variant, provider="cpu"))
        assert report.passed, report.format()
    report = verify_static(model, tmp_path / "bundle")
    assert report.passed, report.format()


@pytest.mark.parametrize("variant", ["static-int8", "int8"])
def test_int8_weights_are_7_bit_so_no_cpu_can_saturate_their_products(tiny_bundle, variant):
    """u8 activations times |w| <= 64, in pairs, stay below 2^15: AVX2's VPMADDUBSW computes the same
    exact sums as VNNI and AMX (docs/onnx.md)."""
    from onnx import numpy_helper

    graph = onnx.load(str(tiny_bundle / GRAPH_FILES[variant])).graph
    int8 = [numpy_helper.to_array(t) for t in graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert len(int8) >= 2 * 4 + 1  # the attention and MLP matrices of both layers, and the output head
    assert max(int(np.abs(w.astype(np.int32)).max()) for w in int8) <= 64
    assert 255 * 64 * 2 < 2**15
