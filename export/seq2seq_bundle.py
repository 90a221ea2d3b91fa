"""An encoder-decoder model directory -> a bundle: the encoder graph, the decoder graph, the manifest.

    <bundle>/model.encoder.onnx               run once per source: the cross-attention keys and values
    <bundle>/model.decoder.static.onnx        run every step: self-attention cache in place, cross state read
    <bundle>/model.encoder.int8.onnx          with --int8: the pair with INT8 MatMuls (graph "static-int8"),
    <bundle>/model.decoder.static.int8.onnx   activations quantized per row, so batch-invariant
    <bundle>/bundle.json                      kind "encoder-decoder", n_src_ctx, decoder_start_token_id, ...

`attnserve export` writes it when the model directory's config says `"kind": "encoder-decoder"`
(`seq2seq_graphs.py` builds the graphs; `row_quantization.py` quantizes them). The manifest lists the
decoder graphs under `graphs` and their encoders under `encoder_graphs`, by the same name.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from export.bundle_writer import copy_tokenizer, special_tokens, stamp_metadata, static_graph_spec, weights_hash
from export.row_quantization import quantize_rows
from export.seq2seq_graphs import export_seq2seq
from model.checkpoint import load_seq2seq_dir
from model.seq2seq import EncoderDecoder
from service.runtime.bundle import (
    GraphSpec,
    Manifest,
    ModelSpec,
    TensorSpec,
    WeightPrecision,
    cross_kv_names,
    sha256_file,
    write_manifest,
)

ENCODER_FILE = "model.encoder.onnx"
DECODER_FILE = "model.decoder.static.onnx"
INT8_FILES = ("model.encoder.int8.onnx", "model.decoder.static.int8.onnx")
INT8_GRAPH = "static-int8"
OPSET = 17


def encoder_spec(n_layer: int, file: str = ENCODER_FILE, weights: WeightPrecision = "float32") -> GraphSpec:
    inputs = [TensorSpec(name="input_ids", dtype="int64", shape=["batch", "src_seq"]),
              TensorSpec(name="attention_mask", dtype="int64", shape=["batch", "src_seq"])]
    outputs = [TensorSpec(name=n, dtype="float32", shape=["batch", "heads", "src_seq", "d_head"])
               for n in cross_kv_names(n_layer)]
    return GraphSpec(file=file, cache="static", dtype="float32", weights=weights,
                     description="the encoder: a batch of sources -> every decoder layer's cross-attention keys "
                                 "and values", inputs=inputs, outputs=outputs)


def decoder_spec(n_layer: int, file: str = DECODER_FILE, weights: WeightPrecision = "float32") -> GraphSpec:
    """The static serving graph's inputs and outputs, with the cross state after its cache."""
    spec = static_graph_spec("static", n_layer, logits_index=False)
    spec.inputs += [TensorSpec(name=n, dtype="float32", shape=["batch", "heads", "max_src", "d_head"])
                    for n in cross_kv_names(n_layer)]
    spec.inputs.append(TensorSpec(name="encoder_attention_mask", dtype="int64", shape=["batch", "max_src"]))
    what = "" if weights == "float32" else ", INT8 MatMuls with activations quantized per row (batch-invariant)"
    return spec.model_copy(update={"file": file, "weights": weights, "description": (
        "the decoder: GroupQueryAttention over a fixed self-attention buffer updated in place, then "
        f"cross-attention over the source's keys and values{what}")})


def make_manifest(model: EncoderDecoder, special: dict[str, int], name: str, weights_sha: str, int8: bool = False
                  ) -> Manifest:
    c = model.config
    spec = ModelSpec(name=name, vocab_size=c.vocab_size, n_ctx=c.n_tgt_ctx, n_layer=c.n_decoder_layer,
                     n_head=c.n_head, d_model=c.d_model, d_head=c.d_head, eos_token_id=c.eos_token_id,
                     bos_token_id=c.bos_token_id, architecture=c.architecture, kind="encoder-decoder",
                     n_src_ctx=c.n_src_ctx, n_encoder_layer=c.n_encoder_layer,
                     decoder_start_token_id=c.decoder_start_token_id, pad_token_id=c.pad_token_id)
    L = c.n_decoder_layer
    graphs, encoders = {"static": decoder_spec(L)}, {}
    if int8:
        graphs[INT8_GRAPH] = decoder_spec(L, INT8_FILES[1], "int8")
        encoders[INT8_GRAPH] = encoder_spec(L, INT8_FILES[0], "int8")
    return Manifest(model=spec, special_tokens=special, opset=OPSET, source_weights_sha256=weights_sha,
                    default_graph="static", graphs=graphs, encoder_graph=encoder_spec(L), encoder_graphs=encoders)


def export_seq2seq_bundle(model_dir: Path, out: Path, name: str | None = None, int8: bool = False) -> list[str]:
    """Write the bundle (with `int8`, the INT8 pair too); returns the graph files written."""
    model, tokenizer = load_seq2seq_dir(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    export_seq2seq(model, out / ENCODER_FILE, out / DECODER_FILE)
    files = [ENCODER_FILE, DECODER_FILE]
    if int8:
        for fp32, quantized in zip(files, INT8_FILES, strict=True):
            onnx.save(quantize_rows(onnx.load(str(out / fp32))), str(out / quantized))
        files += INT8_FILES
    manifest = make_manifest(model, special_tokens(tokenizer), name or model_dir.resolve().name,
                             weights_hash(model_dir), int8)
    for file in files:
        stamp_metadata(out / file, manifest)
    copy_tokenizer(model_dir, out)
    manifest.tokenizer_sha256 = sha256_file(out / manifest.tokenizer_file)
    write_manifest(out, manifest)
    return files
