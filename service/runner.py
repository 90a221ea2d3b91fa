"""The ONNX Runtime session: feeds in, logits and the new KV cache out. numpy only, no torch.

`OnnxRunner.step(input_ids, position_ids, attention_mask, cache) -> (logits, cache)` runs one
prefill or decode step of the bundle's decoder graph. The cache is a list of 2·n_layer arrays
[batch, n_head, past_seq, d_head] in graph order (layer 0 key, layer 0 value, layer 1 key, ...).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Literal

import numpy as np
import onnxruntime as ort

from model.tokenizer import Tokenizer
from service.bundle import BundleError, GraphSpec, Manifest, decoder_io_names, read_manifest

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


class OnnxRunner:
    def __init__(self, bundle_dir: str | Path, graph: str | None = None, provider: Provider = "auto",
                 intra_op_threads: int = 0, inter_op_threads: int = 1):
        self.bundle_dir = Path(bundle_dir)
        self.manifest = read_manifest(self.bundle_dir)
        name = graph or self.manifest.default_graph
        if name not in self.manifest.graphs:
            raise BundleError(f"graph {name!r} is not in the bundle; it has {sorted(self.manifest.graphs)}")
        self.graph_name = name
        self.spec: GraphSpec = self.manifest.graphs[name]
        self.tokenizer = load_tokenizer(self.bundle_dir, self.manifest)
        self.session = self._create_session(provider, intra_op_threads, inter_op_threads)
        self._check_io()
        self.cache_dtype = np.dtype(self.spec.dtype)
        m = self.manifest.model
        log.info("onnxruntime %s: %s graph %s on %s (intra-op threads %s)", ort.__version__, m.name, name,
                 self.session.get_providers()[0], intra_op_threads or "default")

    def _create_session(self, provider: Provider, intra: int, inter: int) -> ort.InferenceSession:
        path = self.bundle_dir / self.spec.file
        if not path.is_file():
            raise BundleError(f"graph file {path} is missing")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = intra
        options.inter_op_num_threads = inter
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

    def _check_io(self) -> None:
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        want_in, want_out = decoder_io_names(self.manifest.model.n_layer)
        for kind, got, want in (("inputs", inputs, want_in), ("outputs", outputs, want_out)):
            if got != want:
                missing = [n for n in want if n not in got]
                extra = [n for n in got if n not in want]
                detail = f"missing {missing}, unexpected {extra}" if missing or extra else f"order {got}"
                raise BundleError(f"{self.spec.file} {kind} do not match the bundle contract: {detail}")

    @property
    def n_layer(self) -> int:
        return self.manifest.model.n_layer

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        m = self.manifest.model
        return [np.zeros((batch, m.n_head, 0, m.d_head), dtype=self.cache_dtype) for _ in range(2 * m.n_layer)]

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One forward pass. attention_mask covers past + new positions; returns logits [B, T, V]."""
        feeds = {"input_ids": input_ids.astype(np.int64, copy=False),
                 "attention_mask": attention_mask.astype(np.int64, copy=False),
                 "position_ids": position_ids.astype(np.int64, copy=False)}
        for i in range(self.n_layer):
            feeds[f"past_key_values.{i}.key"] = cache[2 * i]
            feeds[f"past_key_values.{i}.value"] = cache[2 * i + 1]
        logits, *present = self.session.run(None, feeds)
        return logits, present
