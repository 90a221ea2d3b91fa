"""The ONNX bundle: what `attnserve export` writes and what serving reads, without torch.

    <bundle>/bundle.json       this manifest: config, special ids, I/O specs, opset, weights hash
    <bundle>/tokenizer.json    the tokenizer, copied from the model directory
    <bundle>/tokenizer_config.json, generation_config.json, chat_template.jinja
                               an imported checkpoint's, when it had them (special tokens, chat template, EOS ids)
    <bundle>/model.onnx        the decoder graph (fp32); variants beside it (see `graphs`)

`read_manifest` reads and checks the manifest; `service.runtime.session.GraphRunner` checks the rest
before serving starts (the graph file, its inputs and outputs, the tokenizer). Each problem raises
`BundleError` with a one-line cause.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, model_validator

MANIFEST_FILE = "bundle.json"
# kept beside tokenizer.json from an imported checkpoint, into its model directory and its bundle
TOKENIZER_EXTRAS = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja")
FORMAT = "attnserve-onnx"
FORMAT_VERSION = 1
AUTO_GRAPH = "auto"  # not a graph: asks for the fastest graph that is right on this CPU (graph_choice.py)


class BundleError(Exception):
    """A bundle cannot be served; the message says why in one line."""


class TensorSpec(BaseModel):
    name: str  # graph input/output name
    dtype: str  # numpy dtype name: int64, float32, float16
    shape: list[str | int]  # symbolic dims are names (batch, seq, past_seq, total_seq)


CacheLayout = Literal["concat", "static"]
KvDtype = Literal["float32", "float16", "int8"]  # what a static graph's KV cache holds (docs/engine.md#kv-precision)


WeightPrecision = Literal["float32", "float16", "int8", "int4"]
ModelKind = Literal["decoder", "encoder-decoder"]


class GraphSpec(BaseModel):
    file: str  # ONNX file name inside the bundle
    cache: CacheLayout = "concat"  # concat: past in, past+new out; static: one fixed buffer updated in place
    dtype: Literal["float32", "float16"]  # dtype of the logits, and of the KV cache unless its inputs say otherwise
    weights: WeightPrecision = "float32"  # how the matmul weights are stored; anything but float32 is checked
    description: str  # what this variant is for
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    @property
    def cache_dtype(self) -> str:
        """What the KV cache holds: the dtype of the graph's first past key input (older bundles: `dtype`)."""
        past = next((t for t in self.inputs if t.name.startswith("past_key_values.")), None)
        return past.dtype if past else self.dtype

    @model_validator(mode="before")
    @classmethod
    def _weights_of_older_bundles(cls, data: Any) -> Any:
        """Manifests written before `weights` existed: their INT8 and FP16 graphs say so in the file name."""
        if isinstance(data, dict) and "weights" not in data:
            file = str(data.get("file", ""))
            data = {**data, "weights": "int8" if "int8" in file else "float16" if "fp16" in file else "float32"}
        return data


class ModelSpec(BaseModel):
    name: str  # model name reported to clients
    vocab_size: int
    n_ctx: int  # longest sequence, prompt + generated
    n_layer: int
    n_head: int  # query heads
    d_model: int
    d_head: int
    eos_token_id: int
    bos_token_id: int | None = None
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head (older bundles)
    eos_token_ids: list[int] | None = None  # every id that ends generation, when more than eos_token_id
    architecture: str = "gpt2"  # gpt2 or llama (rotary positions, RMSNorm, SwiGLU), or the encoder-decoder's
    # an encoder-decoder model: n_ctx and n_layer are its decoder's; the encoder reads sources of up to
    # n_src_ctx tokens, and every target starts with decoder_start_token_id
    kind: ModelKind = "decoder"
    n_src_ctx: int | None = None
    n_encoder_layer: int | None = None
    decoder_start_token_id: int | None = None
    pad_token_id: int | None = None

    @model_validator(mode="after")
    def _encoder_decoder_fields(self) -> ModelSpec:
        if self.kind == "encoder-decoder" and None in (self.n_src_ctx, self.n_encoder_layer,
                                                       self.decoder_start_token_id, self.pad_token_id):
            raise ValueError("an encoder-decoder model needs n_src_ctx, n_encoder_layer, decoder_start_token_id "
                             "and pad_token_id")
        return self

    @property
    def encoder_decoder(self) -> bool:
        return self.kind == "encoder-decoder"

    @property
    def kv_heads(self) -> int:
        """Heads of the KV cache: n_kv_head, or n_head."""
        return self.n_kv_head or self.n_head

    @property
    def stop_ids(self) -> list[int]:
        """Every id that ends generation."""
        return self.eos_token_ids or [self.eos_token_id]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Manifest(BaseModel):
    format: Literal["attnserve-onnx"] = FORMAT
    format_version: int = FORMAT_VERSION
    model: ModelSpec
    tokenizer_file: str = "tokenizer.json"
    special_tokens: dict[str, int]  # token string -> id
    tokenizer_sha256: str | None = None  # of tokenizer_file as exported; checked at load (older bundles: None)
    opset: int  # default-domain ONNX opset of every graph
    source_weights_sha256: str  # sha256 of the model.safetensors the graphs were exported from
    default_graph: str  # key into graphs used when no variant is asked for
    graphs: dict[str, GraphSpec]  # variant name -> graph (an encoder-decoder's: its decoder graphs)
    encoder_graph: GraphSpec | None = None  # an encoder-decoder's encoder, run once per source
    # an encoder-decoder's decoder graph that has an encoder of its own (the INT8 pair), by the decoder
    # graph's name; every other decoder graph reads what encoder_graph writes
    encoder_graphs: dict[str, GraphSpec] = {}

    @model_validator(mode="after")
    def _encoder_graph_of_its_kind(self) -> Manifest:
        if (self.encoder_graph is not None) != self.model.encoder_decoder:
            raise ValueError("an encoder-decoder bundle has an encoder_graph, and only it")
        if set(self.encoder_graphs) - set(self.graphs):
            raise ValueError(f"encoder_graphs {sorted(set(self.encoder_graphs) - set(self.graphs))} name no graph")
        return self

    def encoder_for(self, graph: str) -> GraphSpec | None:
        """The encoder graph whose keys and values decoder graph `graph` reads."""
        return self.encoder_graphs.get(graph, self.encoder_graph)

    def preferred_graph(self, cache: CacheLayout) -> str:
        """The default graph if it has this cache layout, else the first graph that has it."""
        if self.graphs.get(self.default_graph) and self.graphs[self.default_graph].cache == cache:
            return self.default_graph
        for name, spec in self.graphs.items():
            if spec.cache == cache:
                return name
        raise BundleError(f"the bundle has no graph with a {cache} KV cache (it has {sorted(self.graphs)}); "
                          f"re-export it with a current 'attnserve export'")


def decoder_io_names(n_layer: int) -> tuple[list[str], list[str]]:
    """The decoder's input and output names, in graph order (optimum / onnxruntime-genai naming)."""
    return _with_cache(["input_ids", "attention_mask", "position_ids"], n_layer)


def static_io_names(n_layer: int) -> tuple[list[str], list[str]]:
    """The static-cache decoder's names (onnxruntime-genai's GroupQueryAttention inputs). A decoder-only graph
    also takes `LOGITS_INDEX` after them (bundles exported before it do not)."""
    return _with_cache(["input_ids", "position_ids", "seqlens_k", "total_sequence_length"], n_layer)


# the positions of each row whose logits a static decoder-only graph computes, int64 [batch, logits_seq]: the
# output is [batch, logits_seq, vocab], and the head (a vocabulary-wide MatMul) runs on those positions alone
LOGITS_INDEX = "logits_index"


def _with_cache(inputs: list[str], n_layer: int) -> tuple[list[str], list[str]]:
    """`inputs` then each layer's past keys and values; the logits then each layer's present ones."""
    inputs, outputs = list(inputs), ["logits"]
    for i in range(n_layer):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def self_kv_names(n_layer: int) -> tuple[list[str], list[str]]:
    """The decoder's self-attention cache, in graph order: past inputs and present outputs."""
    inputs, outputs = static_io_names(n_layer)
    return inputs[4:], outputs[1:]


def cross_kv_names(n_layer: int) -> list[str]:
    """An encoder-decoder's cross-attention keys and values per decoder layer: the encoder graph's
    outputs and the decoder graph's inputs."""
    return [f"cross.{i}.{kind}" for i in range(n_layer) for kind in ("key", "value")]


def seq2seq_decoder_io_names(n_layer: int) -> tuple[list[str], list[str]]:
    """An encoder-decoder's decoder graph: the static decoder's inputs, then the cross-attention keys and
    values and the source mask."""
    inputs, outputs = static_io_names(n_layer)
    return inputs + cross_kv_names(n_layer) + ["encoder_attention_mask"], outputs


def encoder_io_names(n_layer: int) -> tuple[list[str], list[str]]:
    """An encoder-decoder's encoder graph (`n_layer`: the decoder layers it writes keys and values for)."""
    return ["input_ids", "attention_mask"], cross_kv_names(n_layer)


def graph_io_names(cache: CacheLayout, n_layer: int, kind: ModelKind = "decoder",
                   logits_index: bool = True) -> tuple[list[str], list[str]]:
    """A graph's input and output names, in order; `logits_index=False`: a static decoder graph exported
    before `LOGITS_INDEX`, whose logits cover every position of the call."""
    if kind == "encoder-decoder":
        return seq2seq_decoder_io_names(n_layer)
    if cache == "concat":
        return decoder_io_names(n_layer)
    inputs, outputs = static_io_names(n_layer)
    return inputs + [LOGITS_INDEX] * logits_index, outputs


def write_manifest(bundle_dir: Path, manifest: Manifest) -> None:
    (Path(bundle_dir) / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2) + "\n")


def read_manifest(bundle_dir: str | Path) -> Manifest:
    path = Path(bundle_dir) / MANIFEST_FILE
    if not Path(bundle_dir).is_dir():
        raise BundleError(f"bundle directory {bundle_dir} does not exist")
    if not path.is_file():
        raise BundleError(f"{path} is missing: not an attnserve bundle (run 'attnserve export')")
    try:
        return Manifest.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is not valid JSON: {e}") from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BundleError(f"{path} is not a valid manifest: {where}: {first['msg']}") from None
