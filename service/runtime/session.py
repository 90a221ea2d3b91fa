"""Loading a bundle graph into an onnxruntime session, with one-line errors. numpy only, no torch.

Both runners go through `open_graph`: it reads the manifest, picks the graph, checks the
tokenizer belongs to the model, creates the session and checks the graph's inputs and outputs
against the bundle contract, raising `BundleError` with the cause.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnxruntime as ort

from service.runtime.bundle import (
    BundleError,
    CacheLayout,
    GraphSpec,
    Manifest,
    ModelKind,
    encoder_io_names,
    graph_io_names,
    read_manifest,
    sha256_file,
)
from service.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Provider = Literal["auto", "cpu", "cuda"]
PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def choose_providers(provider: Provider) -> list[str]:
    available = ort.get_available_providers()
    if provider == "cuda" and PROVIDER_NAMES["cuda"] not in available:
        raise BundleError(f"provider 'cuda' was asked for, but this onnxruntime offers only {available} "
                          "(install onnxruntime-gpu on a machine with CUDA)")
    if provider == "cuda" or (provider == "auto" and PROVIDER_NAMES["cuda"] in available):
        return [PROVIDER_NAMES["cuda"], PROVIDER_NAMES["cpu"]]
    return [PROVIDER_NAMES["cpu"]]


def load_tokenizer(bundle_dir: Path, manifest: Manifest) -> Tokenizer:
    path = bundle_dir / manifest.tokenizer_file
    if not path.is_file():
        raise BundleError(f"tokenizer {path} is missing")
    if manifest.tokenizer_sha256 is not None and sha256_file(path) != manifest.tokenizer_sha256:
        raise BundleError(f"tokenizer {path} is not the one the bundle was exported with (its sha256 differs from "
                          "bundle.json's tokenizer_sha256): they do not belong together")
    try:
        tokenizer = Tokenizer.from_file(path, eos_id=manifest.model.eos_token_id)
    except Exception as e:  # tokenizers raises bare Exceptions for unreadable files
        raise BundleError(f"tokenizer {path} cannot be read: {e}") from None
    if tokenizer.vocab_size > manifest.model.vocab_size:
        raise BundleError(f"tokenizer {path} has {tokenizer.vocab_size} tokens but the model's vocabulary "
                          f"is {manifest.model.vocab_size}: they do not belong together")
    for token, token_id in manifest.special_tokens.items():
        if tokenizer.hf.token_to_id(token) != token_id:
            raise BundleError(f"tokenizer {path} maps {token!r} to {tokenizer.hf.token_to_id(token)}, "
                              f"the bundle expects {token_id}: they do not belong together")
    return tokenizer


def create_session(path: Path, provider: Provider, intra_op_threads: int = 0,
                   inter_op_threads: int = 1) -> ort.InferenceSession:
    if not path.is_file():
        raise BundleError(f"graph file {path} is missing")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    try:
        return ort.InferenceSession(str(path), options, providers=choose_providers(provider))
    except BundleError:
        raise
    except Exception as e:
        text = " ".join(str(e).split())
        used, supported = re.search(r"Opset (\d+)", text), re.search(r"till opset (\d+)", text)
        if used and supported:
            raise BundleError(f"{path} uses ONNX opset {used[1]}, but onnxruntime {ort.__version__} supports "
                              f"opsets up to {supported[1]}: re-export with --opset {supported[1]} or lower, "
                              "or upgrade onnxruntime") from None
        raise BundleError(f"{path} cannot be loaded by onnxruntime {ort.__version__}: {text}") from None


def check_io(session: ort.InferenceSession, spec: GraphSpec, n_layer: int, kind: ModelKind = "decoder",
             encoder: bool = False) -> None:
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    want_in, want_out = encoder_io_names(n_layer) if encoder else graph_io_names(spec.cache, n_layer, kind)
    for kind, got, want in (("inputs", inputs, want_in), ("outputs", outputs, want_out)):
        if got != want:
            missing = [n for n in want if n not in got]
            extra = [n for n in got if n not in want]
            detail = f"missing {missing}, unexpected {extra}" if missing or extra else f"order {got}"
            raise BundleError(f"{spec.file} {kind} do not match the bundle contract: {detail}")


@dataclass
class OpenGraph:
    bundle_dir: Path
    manifest: Manifest
    graph_name: str
    spec: GraphSpec
    tokenizer: Tokenizer
    session: ort.InferenceSession


def open_graph(bundle_dir: str | Path, graph: str | None, cache: CacheLayout, provider: Provider = "auto",
               intra_op_threads: int = 0, inter_op_threads: int = 1) -> OpenGraph:
    """Open `graph` (default: the bundle's preferred graph with this cache layout)."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    name = graph or manifest.preferred_graph(cache)
    if name not in manifest.graphs:
        raise BundleError(f"graph {name!r} is not in the bundle; it has {sorted(manifest.graphs)}")
    spec = manifest.graphs[name]
    if spec.cache != cache:
        listing = ", ".join(f"{k} ({v.cache})" for k, v in manifest.graphs.items())
        raise BundleError(f"graph {name!r} has a {spec.cache} KV cache; this runner needs a {cache} one "
                          f"(graphs in the bundle: {listing})")
    tokenizer = load_tokenizer(bundle_dir, manifest)
    session = create_session(bundle_dir / spec.file, provider, intra_op_threads, inter_op_threads)
    check_io(session, spec, manifest.model.n_layer, manifest.model.kind)
    log.info("onnxruntime %s: %s graph %s (%s cache) on %s (intra-op threads %s)", ort.__version__,
             manifest.model.name, name, cache, session.get_providers()[0], intra_op_threads or "default")
    return OpenGraph(bundle_dir, manifest, name, spec, tokenizer, session)
