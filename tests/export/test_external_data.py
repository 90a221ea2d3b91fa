"""Graph weights as external data: every graph of a bundle keeps its weights in `<graph>.data`, written one
tensor at a time; the bundle loads, serves the same logits as the same graph with its weights inside (the
format of bundles written before), its manifest hashes verify, and the streamed derived graphs equal what
the in-memory quantizers write."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from export.bundle_writer import GRAPH_FILES, export_bundle, sha256_file
from export.external_data import INLINE_BYTES, DataFile, array_of, data_path, load_graph
from export.onnx_export import DecoderWithPast, export_decoder, export_options, sample_inputs
from export.row_quantization import quantize_rows
from export.variants import INT4, INT8, INT8_PER_TENSOR, quantize
from model.checkpoint import load_model_dir
from service.runtime.bundle import BundleError, decoder_io_names, read_manifest
from service.runtime.concat_runner import ConcatRunner
from service.runtime.static_runner import StaticRunner
from tests.conftest import make_model

PROMPTS = [[5, 17, 3, 99, 42], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def test_every_graph_keeps_its_weights_in_its_data_file(tiny_bundle):
    """Every weight matrix (onnxruntime's quantizer keeps a few vectors of scales inside; ours, only what is
    under INLINE_BYTES)."""
    for variant, spec in read_manifest(tiny_bundle).graphs.items():
        graph = load_graph(tiny_bundle / spec.file)
        external = [t for t in graph.graph.initializer if uses_external_data(t)]
        inline = [t for t in graph.graph.initializer if not uses_external_data(t)]
        assert external, variant
        assert all(len(t.dims) < 2 or numpy_helper.to_array(t).nbytes < INLINE_BYTES for t in inline), variant
        data = data_path(tiny_bundle / spec.file)
        for t in external:
            info = ExternalDataInfo(t)
            assert info.location == data.name  # beside the graph, named after it
            assert info.offset + info.length <= data.stat().st_size, (variant, t.name)


def test_a_bundle_with_external_data_serves_the_logits_of_one_with_its_weights_inside(tiny_bundle, tmp_path):
    inline = tmp_path / "inline"
    shutil.copytree(tiny_bundle, inline)
    for variant in ("static", "fp32"):  # as bundles were written before: the weights inside the graph
        path = inline / GRAPH_FILES[variant]
        onnx.save(onnx.load(str(path)), str(path))
        data_path(path).unlink()
    assert not any(uses_external_data(t) for t in onnx.load(str(inline / "model.static.onnx")).graph.initializer)

    def serve(bundle):
        runner = StaticRunner(bundle, "static", provider="cpu")
        runner.attach(runner.cache_shape.buffers(len(PROMPTS)))
        return runner.prefill_batch(0, PROMPTS)

    assert np.array_equal(serve(tiny_bundle), serve(inline))
    ids, mask = np.array([[0, 0, 5, 17, 3]]), np.array([[0, 0, 1, 1, 1]])
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)

    def step(bundle):
        runner = ConcatRunner(bundle, graph="fp32", provider="cpu")
        return runner.step(ids, pos, mask, runner.empty_cache(1))[0]

    assert np.array_equal(step(tiny_bundle), step(inline))


def test_the_manifest_hashes_verify_and_name_every_file_the_graphs_read(tiny_bundle, tiny_model_dir):
    m = read_manifest(tiny_bundle)
    assert m.source_weights_sha256 == sha256_file(tiny_model_dir / "model.safetensors")
    assert m.tokenizer_sha256 == sha256_file(tiny_bundle / m.tokenizer_file)
    StaticRunner(tiny_bundle, provider="cpu")  # checks the tokenizer against its hash
    expected = {"bundle.json", m.tokenizer_file} | {spec.file for spec in m.graphs.values()}
    expected |= {data_path(tiny_bundle / spec.file).name for spec in m.graphs.values()}
    assert {p.name for p in tiny_bundle.iterdir()} == expected


def test_a_graph_whose_data_file_is_missing_fails_at_load_in_one_line(tiny_bundle, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_bundle, broken)
    data_path(broken / GRAPH_FILES["static"]).unlink()
    with pytest.raises(BundleError, match="model.static.onnx cannot be loaded") as e:
        StaticRunner(broken, "static", provider="cpu")
    assert "\n" not in str(e.value)


def test_a_bundle_without_the_standard_fp32_graph_leaves_no_data_file_behind(tiny_model_dir, tmp_path):
    variants = export_bundle(tiny_model_dir, tmp_path, int8=True, keep_fp32=False)
    assert "fp32" not in variants
    assert not (tmp_path / GRAPH_FILES["fp32"]).exists() and not data_path(tmp_path / GRAPH_FILES["fp32"]).exists()


def initializers(model: onnx.ModelProto, graph_dir) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(array_of(t, graph_dir)) for t in model.graph.initializer}


def same_graph(a: onnx.ModelProto, a_dir, b: onnx.ModelProto, b_dir) -> None:
    assert [(n.op_type, list(n.input), list(n.output)) for n in a.graph.node] == \
           [(n.op_type, list(n.input), list(n.output)) for n in b.graph.node]
    want, got = initializers(a, a_dir), initializers(b, b_dir)
    assert set(want) == set(got)
    for name, array in want.items():
        assert array.dtype == got[name].dtype and np.array_equal(array, got[name]), name


def test_the_streamed_int8_graph_is_the_one_quantized_in_memory(tiny_bundle, tmp_path):
    static = tiny_bundle / GRAPH_FILES["static"]
    streamed = load_graph(quantize(static, tmp_path / "int8.onnx", INT8))
    in_memory = quantize_rows(onnx.load(str(static)))
    same_graph(in_memory, tmp_path, streamed, tmp_path)


def test_the_streamed_int4_graph_is_the_one_onnxruntimes_quantizer_writes(tiny_bundle, tmp_path):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    static = tiny_bundle / GRAPH_FILES["static"]
    streamed = load_graph(quantize(static, tmp_path / "int4.onnx", INT4))
    config = DefaultWeightOnlyQuantConfig(block_size=INT4.block_size, is_symmetric=True, bits=INT4.bits,
                                          accuracy_level=INT4.accuracy_level)
    quantizer = MatMulNBitsQuantizer(onnx.load(str(static)), bits=INT4.bits, block_size=INT4.block_size,
                                     is_symmetric=True, accuracy_level=INT4.accuracy_level, algo_config=config)
    quantizer.process()
    same_graph(quantizer.model.model, tmp_path, streamed, tmp_path)
    attrs = [{a.name: helper_value(a) for a in n.attribute} for n in streamed.graph.node if n.op_type == "MatMulNBits"]
    assert attrs == [{a.name: helper_value(a) for a in n.attribute}
                     for n in quantizer.model.model.graph.node if n.op_type == "MatMulNBits"]


def test_the_streamed_per_tensor_int8_graph_computes_what_quantize_dynamic_writes(tiny_bundle, tmp_path):
    """The standard graph's --int8 form, one MatMul at a time, against onnxruntime's quantize_dynamic on the
    whole graph: the same quantized weights under the same names, the same ops, the same logits."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32 = tiny_bundle / GRAPH_FILES["fp32"]
    streamed = load_graph(quantize(fp32, tmp_path / "streamed.onnx", INT8_PER_TENSOR))
    whole = tmp_path / "whole"
    whole.mkdir()
    quantize_dynamic(str(fp32), str(whole / "model.onnx"), op_types_to_quantize=["MatMul"], per_channel=True,
                     weight_type=QuantType.QInt8, reduce_range=True, use_external_data_format=True,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    reference = load_graph(whole / "model.onnx")
    assert sorted((n.op_type, n.name) for n in streamed.graph.node) == \
           sorted((n.op_type, n.name) for n in reference.graph.node)
    want, got = initializers(reference, whole), initializers(streamed, tmp_path)
    assert set(want) == set(got) and all(np.array_equal(want[k], got[k]) for k in want)

    ids, mask = np.array([[0, 0, 5, 17, 3], [1, 2, 3, 4, 5]]), np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": np.clip(mask.cumsum(-1) - 1, 0, None)}
    feed |= {n: np.zeros((2, 4, 0, 8), np.float32) for n in decoder_io_names(2)[0][3:]}

    def logits(path):
        import onnxruntime as ort

        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feed)[0]

    assert np.array_equal(logits(tmp_path / "streamed.onnx"), logits(whole / "model.onnx"))


def helper_value(attribute: onnx.AttributeProto):
    return onnx.helper.get_attribute_value(attribute)


@pytest.mark.parametrize("overrides", [{}, dict(pos_encoding="rotary", norm="rmsnorm", mlp="swiglu", bias=False,
                                                n_kv_head=2)])
def test_the_standard_graph_is_the_one_torch_exports_with_its_weights_inside(tmp_path, overrides):
    model = make_model(vocab_size=300, n_ctx=128, **overrides)
    streamed = load_graph(export_decoder(model, tmp_path / "model.onnx"))
    inline_dir = tmp_path / "inline"
    inline_dir.mkdir()
    with torch.no_grad():
        torch.onnx.export(DecoderWithPast(model), sample_inputs(model), str(inline_dir / "model.onnx"),
                          **export_options(model))
    inline = onnx.load(str(inline_dir / "model.onnx"))
    assert [i.name for i in streamed.graph.input] == [i.name for i in inline.graph.input]
    same_graph(inline, inline_dir, streamed, tmp_path)


def test_a_data_file_keeps_small_tensors_inside_and_aligns_the_others(tmp_path):
    with DataFile(tmp_path / "g.onnx") as data:
        small = data.tensor(np.arange(4, dtype=np.float32), "small")
        big = data.tensor(np.arange(5000, dtype=np.float32).reshape(50, 100), "big")
        odd = data.tensor(np.ones((3, 1000), np.int8), "odd")
        after = data.tensor(np.full(2048, 7, np.int64), "after")
    assert not uses_external_data(small) and numpy_helper.to_array(small).tolist() == [0, 1, 2, 3]
    for t in (big, odd, after):
        assert ExternalDataInfo(t).offset % 4096 == 0
    assert np.array_equal(array_of(big, tmp_path), np.arange(5000, dtype=np.float32).reshape(50, 100))
    assert np.array_equal(array_of(after, tmp_path), np.full(2048, 7, np.int64))


def test_a_loaded_model_equals_its_checkpoint(tiny_model_dir):
    from safetensors.torch import load_file

    model, _ = load_model_dir(tiny_model_dir)
    stored = load_file(str(tiny_model_dir / "model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in stored.items())
    assert state["lm_head.weight"].data_ptr() == state["tok_emb.weight"].data_ptr()  # still tied
