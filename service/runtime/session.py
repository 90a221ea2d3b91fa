"""Loading a bundle graph into an onnxruntime session, with one-line errors. numpy only, no torch.

Both runners subclass `GraphRunner`: it reads the manifest, picks the graph, checks the
tokenizer belongs to the model, creates the session and checks the graph's inputs and outputs
against the bundle contract, raising `BundleError` with the cause.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import ClassVar, Literal

import onnxruntime as ort

from service.runtime.bundle import (
    LOGITS_INDEX,
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
                   inter_op_threads: int = 1, spin: bool = True) -> ort.InferenceSession:
    """`path`'s session. `spin`: its idle threads spin a while before they sleep (onnxruntime's default, which
    saves a wake-up between operators); off where other sessions of the process run on the same cores."""
    if not path.is_file():
        raise BundleError(f"graph file {path} is missing")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
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
    if encoder:
        want_in, want_out = encoder_io_names(n_layer)
    else:  # a static decoder graph from before LOGITS_INDEX is served as it was: every position's logits
        want_in, want_out = graph_io_names(spec.cache, n_layer, kind, logits_index=LOGITS_INDEX in inputs)
    for kind, got, want in (("inputs", inputs, want_in), ("outputs", outputs, want_out)):
        if got != want:
            missing = [n for n in want if n not in got]
            extra = [n for n in got if n not in want]
            detail = f"missing {missing}, unexpected {extra}" if missing or extra else f"order {got}"
            raise BundleError(f"{spec.file} {kind} do not match the bundle contract: {detail}")


class GraphRunner:
    """A bundle graph opened for running: its manifest, tokenizer and onnxruntime session. A runner
    subclasses it and names the KV cache layout its graph has (`CACHE`)."""

    CACHE: ClassVar[CacheLayout]

    def __init__(self, bundle_dir: str | Path, graph: str | None = None, provider: Provider = "auto",
                 intra_op_threads: int = 0, inter_op_threads: int = 1, spin: bool = True):
        """Open `graph` (default: the bundle's preferred graph with this runner's cache layout); `spin` as
        `create_session`'s."""
        self.bundle_dir = Path(bundle_dir)
        self.manifest = read_manifest(self.bundle_dir)
        self.graph_name = name = graph or self.manifest.preferred_graph(self.CACHE)
        graphs = self.manifest.graphs
        if name not in graphs:
            raise BundleError(f"graph {name!r} is not in the bundle; it has {sorted(graphs)}")
        self.spec = graphs[name]
        if self.spec.cache != self.CACHE:
            listing = ", ".join(f"{k} ({v.cache})" for k, v in graphs.items())
            raise BundleError(f"graph {name!r} has a {self.spec.cache} KV cache; this runner needs a {self.CACHE} "
                              f"one (graphs in the bundle: {listing})")
        self.tokenizer = load_tokenizer(self.bundle_dir, self.manifest)
        self.session = create_session(self.bundle_dir / self.spec.file, provider, intra_op_threads,
                                      inter_op_threads, spin)
        m = self.manifest.model
        check_io(self.session, self.spec, m.n_layer, m.kind)
        log.info("onnxruntime %s: %s graph %s (%s cache) on %s (intra-op threads %s)", ort.__version__, m.name,
                 name, self.CACHE, self.session.get_providers()[0], intra_op_threads or "default")
