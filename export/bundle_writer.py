"""Assemble a bundle directory from a model directory: graphs, tokenizer, manifest, metadata.

Each graph keeps its weights in `<graph file>.data` beside it (`export/external_data.py`): the model's
weights are held once, as PyTorch loaded them, while the two fp32 graphs are written, and are let go before
the derived graphs are made from the written ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx

from export.external_data import DataFile, copy_initializers, data_path, load_graph
from export.kv_precision import CALIBRATION_TOKENS, kv_scales, with_kv_cache
from export.onnx_export import DEFAULT_OPSET, export_decoder
from export.static_cache_graph import export_static_cache_decoder
from export.variants import INT4, INT8, INT8_PER_TENSOR, Quantization, convert_fp16, optimize, quantize
from model.checkpoint import TOKENIZER_FILE, WEIGHTS_FILE, load_model_dir
from model.config import GPTConfig
from service.runtime.bundle import (
    LOGITS_INDEX,
    TOKENIZER_EXTRAS,
    GraphSpec,
    KvDtype,
    Manifest,
    ModelSpec,
    TensorSpec,
    WeightPrecision,
    decoder_io_names,
    sha256_file,
    static_io_names,
    write_manifest,
)
from service.runtime.tokenizer import Tokenizer

GRAPH_FILES = {"static": "model.static.onnx", "static-int8": "model.static.int8.onnx",
               "static-int8-per-tensor": "model.static.int8-per-tensor.onnx", "static-int4": "model.static.int4.onnx",
               "fp32": "model.onnx", "optimized": "model.opt.onnx",
               "int8": "model.int8.onnx", "fp16": "model.fp16.onnx"}
STATIC_VARIANTS = ("static", "static-int8", "static-int8-per-tensor", "static-int4")
# --kv-dtype: each serving graph again, with its KV cache in fewer bytes (export/kv_precision.py)
KV_SUFFIXES: dict[KvDtype, str] = {"float16": "kv16", "int8": "kv8"}
KV_TWINS: dict[str, tuple[str, KvDtype]] = {f"{v}-{suffix}": (v, kv) for v in STATIC_VARIANTS
                                            for kv, suffix in KV_SUFFIXES.items()}  # twin: (its graph, its cache)
GRAPH_FILES.update({twin: GRAPH_FILES[v].replace(".onnx", f".{KV_SUFFIXES[kv]}.onnx")
                    for twin, (v, kv) in KV_TWINS.items()})
# weight precision of each variant; the others are float32
WEIGHTS: dict[str, WeightPrecision] = {"static-int8": INT8.weights, "static-int8-per-tensor": INT8_PER_TENSOR.weights,
                                       "static-int4": INT4.weights, "int8": INT8_PER_TENSOR.weights, "fp16": "float16"}
DESCRIPTIONS = {
    "static": "the serving graph: fp32, GroupQueryAttention over a fixed KV buffer updated in place",
    "static-int8": "the serving graph with INT8 MatMuls, activations quantized per row (batch-invariant) and 7-bit "
                   "weights (no saturation on any CPU), for CPU",
    "static-int8-per-tensor": "the serving graph with onnxruntime's dynamic INT8 MatMuls, one activation scale per "
                              "batch (not batch-invariant; for comparison), for CPU",
    "static-int4": f"the serving graph with 4-bit MatMulNBits weights (block {INT4.block_size}, int8 activations: "
                   "exact integer products on every CPU), for CPU: the fewest bytes read per token",
    "fp32": "the exported decoder, fp32",
    "optimized": "fp32 with onnxruntime's transformer fusions",
    "int8": "dynamic INT8 MatMuls in standard ops, one activation scale per batch (7-bit weights: no saturation on "
            "any CPU), for CPU",
    "fp16": "fp16 throughout, for the CUDA execution provider (untested on a GPU here)",
}
KV_DESCRIPTIONS = {"float16": "; its KV cache in float16 (half the memory; the attention runs in float16)",
                   "int8": "; its KV cache in int8 with fixed per-channel scales (a quarter of the memory)"}
DESCRIPTIONS.update({twin: DESCRIPTIONS[v] + KV_DESCRIPTIONS[kv] for twin, (v, kv) in KV_TWINS.items()})


def kv_variant(variant: str, kv_dtype: KvDtype) -> str:
    """The name of serving graph `variant` with its KV cache in `kv_dtype`: static-kv16, static-int8-kv8, ..."""
    return variant if kv_dtype == "float32" else f"{variant}-{KV_SUFFIXES[kv_dtype]}"



def static_graph_spec(variant: str, n_layer: int, logits_index: bool = True) -> GraphSpec:
    """A static serving graph's contract; `logits_index=False`: an encoder-decoder's decoder, whose logits cover
    every position of the call."""
    in_names, out_names = static_io_names(n_layer)
    kv = ["batch", "kv_heads", "max_seq", "d_head"]
    inputs = [TensorSpec(name="input_ids", dtype="int64", shape=["batch", "seq"]),
              TensorSpec(name="position_ids", dtype="int64", shape=["batch", "seq"]),
              TensorSpec(name="seqlens_k", dtype="int32", shape=["batch"]),
              TensorSpec(name="total_sequence_length", dtype="int32", shape=[])]
    graph, cache = KV_TWINS.get(variant, (variant, "float32"))
    inputs += [TensorSpec(name=n, dtype=cache, shape=kv) for n in in_names[4:]]
    if logits_index:
        inputs.append(TensorSpec(name=LOGITS_INDEX, dtype="int64", shape=["batch", "logits_seq"]))
    outputs = [TensorSpec(name="logits", dtype="float32", shape=["batch", "logits_seq" if logits_index else "seq",
                                                                   "vocab"])]
    outputs += [TensorSpec(name=n, dtype=cache, shape=kv) for n in out_names[1:]]
    return GraphSpec(file=GRAPH_FILES[variant], cache="static", dtype="float32",
                     weights=WEIGHTS.get(graph, "float32"), description=DESCRIPTIONS[variant],
                     inputs=inputs, outputs=outputs)


def graph_spec(variant: str, n_layer: int) -> GraphSpec:
    if variant in STATIC_VARIANTS or variant in KV_TWINS:
        return static_graph_spec(variant, n_layer)
    dtype = "float16" if variant == "fp16" else "float32"
    in_names, out_names = decoder_io_names(n_layer)
    kv_in = ["batch", "kv_heads", "past_seq", "d_head"]
    kv_out = ["batch", "kv_heads", "total_seq", "d_head"]
    inputs = [TensorSpec(name="input_ids", dtype="int64", shape=["batch", "seq"]),
              TensorSpec(name="attention_mask", dtype="int64", shape=["batch", "total_seq"]),
              TensorSpec(name="position_ids", dtype="int64", shape=["batch", "seq"])]
    inputs += [TensorSpec(name=n, dtype=dtype, shape=kv_in) for n in in_names[3:]]
    outputs = [TensorSpec(name="logits", dtype=dtype, shape=["batch", "seq", "vocab"])]
    outputs += [TensorSpec(name=n, dtype=dtype, shape=kv_out) for n in out_names[1:]]
    return GraphSpec(file=GRAPH_FILES[variant], dtype=dtype, weights=WEIGHTS.get(variant, "float32"),
                     description=DESCRIPTIONS[variant], inputs=inputs, outputs=outputs)


def make_manifest(config: GPTConfig, tokenizer_special: dict[str, int], name: str, opset: int, weights_sha: str,
                  variants: list[str], default: str) -> Manifest:
    c = config
    spec = ModelSpec(name=name, vocab_size=c.vocab_size, n_ctx=c.n_ctx, n_layer=c.n_layer, n_head=c.n_head,
                     d_model=c.d_model, d_head=c.d_head, eos_token_id=c.eos_token_id, bos_token_id=c.bos_token_id,
                     n_kv_head=c.n_kv_head, eos_token_ids=c.eos_token_ids,
                     architecture="llama" if c.pos_encoding == "rotary" else "gpt2")
    return Manifest(model=spec, special_tokens=tokenizer_special, opset=opset, source_weights_sha256=weights_sha,
                    default_graph=default, graphs={v: graph_spec(v, c.n_layer) for v in variants})


def stamp_metadata(path: Path, manifest: Manifest) -> None:
    """Copy the essentials into the ONNX file's metadata_props, so a lone .onnx still says what it is (its
    weights, in its data file, are not read)."""
    model = load_graph(path)
    props = {"attnserve.model": manifest.model.model_dump_json(),
             "attnserve.special_tokens": json.dumps(manifest.special_tokens),
             "attnserve.source_weights_sha256": manifest.source_weights_sha256}
    del model.metadata_props[:]
    for k, v in props.items():
        model.metadata_props.add(key=k, value=v)
    onnx.save(model, str(path))


def special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    added = tokenizer.hf.get_added_tokens_decoder()
    return {tok.content: idx for idx, tok in added.items() if tok.special}


def copy_tokenizer(model_dir: Path, bundle_dir: Path) -> None:
    """tokenizer.json, and beside it what an imported checkpoint brought: tokenizer_config.json (special
    tokens, the chat template), chat_template.jinja and generation_config.json."""
    shutil.copyfile(model_dir / TOKENIZER_FILE, bundle_dir / TOKENIZER_FILE)
    for name in TOKENIZER_EXTRAS:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, bundle_dir / name)


def weights_hash(model_dir: Path) -> str:
    return sha256_file(model_dir / WEIGHTS_FILE)


def write_kv_twins(config: GPTConfig, tokenizer: Tokenizer, out: Path, graphs: list[str],
                   kv_dtypes: tuple[KvDtype, ...]) -> list[str]:
    """Each serving graph of `graphs` (written in `out`) again with its KV cache in each of `kv_dtypes`, with its
    weights copied into its own data file one tensor at a time; an int8 cache's scales come from what the fp32
    serving graph writes for text it samples itself."""
    written, scales = [], None
    for kv in dict.fromkeys(k for k in kv_dtypes if k != "float32"):
        if kv == "int8" and scales is None:
            c = config
            start = c.bos_token_id if c.bos_token_id is not None else c.eos_token_id
            scales = kv_scales(out / GRAPH_FILES["static"], c.n_layer, min(c.n_ctx, CALIBRATION_TOKENS), start,
                               min(tokenizer.vocab_size, c.vocab_size))
        for v in graphs:
            twin = kv_variant(v, kv)
            model = with_kv_cache(load_graph(out / GRAPH_FILES[v]), kv, scales, graph_dir=out)
            with DataFile(out / GRAPH_FILES[twin]) as data:
                copy_initializers(model, out, data)
            onnx.save(model, str(out / GRAPH_FILES[twin]))
            onnx.checker.check_model(str(out / GRAPH_FILES[twin]))
            written.append(twin)
    return written


def export_bundle(model_dir: Path, out: Path, *, name: str | None = None, opset: int = DEFAULT_OPSET,
                  optimized: bool = False, int8: bool = False, int8_per_tensor: bool = False,
                  int4: Quantization | None = None, fp16: bool = False, keep_fp32: bool = True, default: str = "static",
                  kv_dtypes: tuple[KvDtype, ...] = ()) -> list[str]:
    """Write the bundle; returns the graph variants written. `int4`: the 4-bit graph's quantization (`INT4`, or
    another block size), None for none. `kv_dtypes`: each serving graph again with its KV cache in each of these types
    (`kv_variant`)."""
    if not keep_fp32 and not (optimized or int8 or fp16):
        raise ValueError("leaving out the fp32 graph needs --optimize, --int8 or --fp16: "
                         "a bundle keeps a standard graph")
    model, tokenizer = load_model_dir(model_dir)
    config = model.config
    out.mkdir(parents=True, exist_ok=True)
    static = export_static_cache_decoder(model, out / GRAPH_FILES["static"])
    fp32 = export_decoder(model, out / GRAPH_FILES["fp32"], opset)
    del model  # the derived graphs are made from the written ones
    variants = ["static", "fp32"]
    if int8:
        quantize(static, out / GRAPH_FILES["static-int8"], INT8)
        variants.append("static-int8")
    if int8_per_tensor:
        quantize(static, out / GRAPH_FILES["static-int8-per-tensor"], INT8_PER_TENSOR)
        variants.append("static-int8-per-tensor")
    if int4:
        quantize(static, out / GRAPH_FILES["static-int4"], int4)
        variants.append("static-int4")
    variants += write_kv_twins(config, tokenizer, out, [v for v in variants if v in STATIC_VARIANTS], kv_dtypes)
    if optimized:
        optimize(fp32, out / GRAPH_FILES["optimized"], config.n_head, config.d_model)
        variants.append("optimized")
    if int8:
        quantize(fp32, out / GRAPH_FILES["int8"], INT8_PER_TENSOR)  # the standard graph keeps standard ops
        variants.append("int8")
    if fp16:
        convert_fp16(fp32, out / GRAPH_FILES["fp16"])
        variants.append("fp16")
    if not keep_fp32:
        fp32.unlink()
        data_path(fp32).unlink()
        variants.remove("fp32")
    if default not in variants:
        raise ValueError(f"default graph {default!r} was not written; the bundle has {variants}")
    manifest = make_manifest(config, special_tokens(tokenizer), name or model_dir.resolve().name, opset,
                             weights_hash(model_dir), variants, default)
    if int4 and int4.block_size != INT4.block_size:  # the descriptions name the default's
        for spec in manifest.graphs.values():
            spec.description = spec.description.replace(f"block {INT4.block_size},", f"block {int4.block_size},")
    for v in variants:
        stamp_metadata(out / GRAPH_FILES[v], manifest)
    copy_tokenizer(model_dir, out)
    manifest.tokenizer_sha256 = sha256_file(out / manifest.tokenizer_file)
    write_manifest(out, manifest)
    return variants
