"""Shared fixtures: tiny models, tokenizers and bundles built inside the test, never downloaded.

Building a model needs torch (training and export); serving one does not. So torch and `model/` are
imported inside the fixtures that build, never at the top of this file.

The serving lane (`make test-serving`) runs the engine, runtime, server and CLI tests in a virtualenv
with the serving dependencies only, as the container has them. There the engine tests run on an
exported bundle instead of the tiny models: `--serving-bundle DIR`, or the shipped bundle when torch
is not installed. A test that needs a model built with torch is marked `needs_torch` (automatically
when it uses one of TORCH_FIXTURES) and is skipped in that lane, with the reason in the report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from service.engine.config import EngineConfig
from service.engine.core import Engine
from service.runtime.bundle import ModelSpec, read_manifest, write_manifest
from service.runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_BUNDLE = ROOT / "models" / "shakespeare-onnx"
SHIPPED_G2P_BUNDLE = ROOT / "models" / "g2p-cmudict-onnx"
HAVE_TORCH = importlib.util.find_spec("torch") is not None

# fixtures that build a model with torch (directly or through another of them)
TORCH_FIXTURES = frozenset({"tiny_model", "tiny_model_dir", "tiny_bundle", "lively_model_dir", "lively_bundle",
                            "llama_bundle", "plain_bundle", "wrong_int8_bundle", "per_tensor_bundle", "seq2seq_model_dir",
                            "lively_seq2seq_bundle", "lively_seq2seq_int8_bundle",
                            "short_g2p_run"})


def pytest_addoption(parser):
    parser.addoption("--serving-bundle", metavar="DIR", default=None,
                     help="run the engine, runtime, server and CLI tests on this exported bundle instead of the "
                          "tiny models built with torch, and skip the tests that need torch (the serving lane; "
                          "without torch installed, the shipped bundle is used)")
    parser.addoption("--avx2-view", action="store_true",
                     help="the session runs under the AVX2-only CPU view (make test-avx2-view): check that "
                          "onnxruntime takes its AVX2 kernels before any test")


def pytest_configure(config):
    """Servers started by the tests (in-process or as child processes, which inherit the environment) keep their
    graph choices in a folder of this session's, never in the user's cache. With --avx2-view, the session
    first makes sure onnxruntime sees the AVX2-only CPU (`make test-avx2-view`), else it stops."""
    if config.getoption("--avx2-view"):
        from tests.avx2_view import SATURATED, u8s8_product

        if u8s8_product() != SATURATED:
            pytest.exit("--avx2-view: onnxruntime did not take the AVX2 kernel (its u8s8 product is exact): the "
                        "CPUID mask is not loaded (LD_PRELOAD tests/avx2_view/mask_cpuid.so) or this CPU cannot "
                        "fault on CPUID", returncode=1)
    if "ATTNSERVE_CACHE_DIR" not in os.environ:
        os.environ["ATTNSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnserve-test-cache-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("ATTNSERVE_CACHE_DIR"), ignore_errors=True))


def serving_bundle(config: pytest.Config) -> Path | None:
    """The bundle the serving lane tests on, or None when the tests build their own models."""
    option = config.getoption("--serving-bundle")
    if option:
        return Path(option).resolve()
    return None if HAVE_TORCH else SHIPPED_BUNDLE


def pytest_report_header(config):
    if config.getoption("--avx2-view"):
        from service.runtime.cpu import cpu_info

        return [f"AVX2-only view of the CPU: {cpu_info().describe()}"]
    bundle = serving_bundle(config)
    if bundle is None:
        return None
    import service

    torch = "installed" if HAVE_TORCH else "not installed"
    return [f"serving lane: engine bundle {bundle} (torch {torch}; tests that need torch are skipped)",
            f"serving lane: attnserve from {Path(service.__file__).parent.parent}"]


def pytest_collection_modifyitems(config, items):
    """Mark the tests that use TORCH_FIXTURES `needs_torch`; in the serving lane, skip every such test."""
    bundle = serving_bundle(config)
    lane = ("this install has the serving dependencies only" if not HAVE_TORCH
            else f"--serving-bundle tests on {bundle} only")
    for item in items:
        if TORCH_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.needs_torch(reason="builds its model with torch"))
        marker = item.get_closest_marker("needs_torch")
        if marker is not None and bundle is not None:
            why = marker.kwargs.get("reason", "needs torch")
            item.add_marker(pytest.mark.skip(reason=f"{why}: {lane}"))


TINY_TEXTS = [
    "Rom.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n",
    "Ham.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "Mac.\nTomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day.\n",
] * 8


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    from model.training.tokenizer import train_bpe

    return Tokenizer(train_bpe(TINY_TEXTS, vocab_size=300, min_frequency=1))


def make_model(seed: int = 0, **overrides):
    """A random GPT (eval mode) of the tiny test shape, `overrides` applied."""
    import torch

    from model.config import GPTConfig
    from model.gpt import GPT

    torch.manual_seed(seed)
    fields = dict(vocab_size=97, n_ctx=64, n_layer=2, n_head=4, d_model=32, dropout=0.0)
    fields.update(overrides)
    return GPT(GPTConfig(**fields)).eval()


@pytest.fixture
def tiny_model():
    return make_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved random model with a context long enough for export verification."""
    from model.checkpoint import save_model_dir

    path = tmp_path_factory.mktemp("model")
    save_model_dir(make_model(vocab_size=tiny_tokenizer.vocab_size, n_ctx=128), tiny_tokenizer, path)
    return path


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model exported with every graph variant."""
    from export.bundle_writer import export_bundle

    path = tmp_path_factory.mktemp("bundle")
    export_bundle(tiny_model_dir, path, name="tiny", optimized=True, int8=True, fp16=True)
    return path


# ---- engine bundles ---------------------------------------------------------------------------------
#
# The engine bundle is the lively bundle below; in the serving lane it is the bundle under test instead.
#
# The model behind the lively bundle is the tiny test model (vocab 300, n_ctx 128, 2 layers,
# d_model 32) with its weight matrices redrawn at a larger scale. At the default initialisation a
# random model's greedy output is one token repeated forever, which an equivalence test cannot tell
# apart from a broken cache; with these weights every continuation depends on the whole context
# (and on position), its greedy output varies from token to token, EOS is rare, and sampling at
# temperature 0.8 has real entropy. So a KV slot mixed up, a position off by one or a prefill chunk
# written to the wrong place changes the tokens.

LIVELY_STD = 0.5  # std of the redrawn weight matrices
LIVELY_SEED = 2


def make_lively(**overrides):
    """The tiny test model (with `overrides`), its weight matrices redrawn ~ N(0, 0.5²)."""
    return redrawn(make_model(**overrides))


def redrawn(model):
    """`model` with its weight matrices (embeddings and projections) redrawn ~ N(0, LIVELY_STD²); biases and
    norms keep their init."""
    import torch

    gen = torch.Generator().manual_seed(LIVELY_SEED)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * LIVELY_STD)
    return model


@pytest.fixture(scope="session")
def lively_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """The tiny test model, with weight matrices ~ N(0, 0.5²): context-dependent, varied output."""
    from model.checkpoint import save_model_dir

    path = tmp_path_factory.mktemp("lively_model")
    save_model_dir(make_lively(vocab_size=tiny_tokenizer.vocab_size, n_ctx=128), tiny_tokenizer, path)
    return path


@pytest.fixture(scope="session")
def lively_bundle(tmp_path_factory, lively_model_dir) -> Path:
    """The lively model exported with the default graphs, `static` (served) and `fp32` (reference), INT8
    (`static-int8`, which `--graph auto` may serve), and each serving graph with its KV cache in float16
    and in int8 (`static-kv16`, `static-kv8`, `static-int8-kv16`, `static-int8-kv8`: served with `kv_dtype`)."""
    from export.bundle_writer import export_bundle

    path = tmp_path_factory.mktemp("engine_bundle")
    export_bundle(lively_model_dir, path, name="tiny", int8=True, kv_dtypes=("float16", "int8"))
    return path


@pytest.fixture(scope="session")
def per_tensor_bundle(tmp_path_factory, tiny_bundle) -> Path:
    """The tiny bundle plus `static-int8-per-tensor`: onnxruntime's dynamic INT8, one activation scale for
    the whole batch, so a row's logits depend on the other rows (not batch-invariant)."""
    import shutil

    from export.bundle_writer import GRAPH_FILES, static_graph_spec
    from export.variants import INT8_PER_TENSOR, quantize

    path = tmp_path_factory.mktemp("per_tensor") / "bundle"
    shutil.copytree(tiny_bundle, path)
    name = "static-int8-per-tensor"
    quantize(path / GRAPH_FILES["static"], path / GRAPH_FILES[name], INT8_PER_TENSOR)
    manifest = read_manifest(path)
    manifest.graphs[name] = static_graph_spec(name, manifest.model.n_layer)
    write_manifest(path, manifest)
    return path


LLAMA = dict(pos_encoding="rotary", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True, n_kv_head=2, d_ff=80,
             layer_norm_eps=1e-6, tie_embeddings=False)  # the Llama-family pieces, Qwen2's Q/K/V biases included


@pytest.fixture(scope="session")
def llama_bundle(tmp_path_factory, tiny_tokenizer) -> Path:
    """A lively Llama-style model (rotary positions, RMSNorm, SwiGLU, 2 KV heads for 4 query heads, untied
    head) exported with the default graphs and INT8."""
    from export.bundle_writer import export_bundle
    from model.checkpoint import save_model_dir

    root = tmp_path_factory.mktemp("llama")
    save_model_dir(make_lively(vocab_size=tiny_tokenizer.vocab_size, n_ctx=128, **LLAMA), tiny_tokenizer, root / "model")
    export_bundle(root / "model", root / "bundle", name="tiny-llama", int8=True)
    return root / "bundle"


# ---- encoder-decoder bundles ---------------------------------------------------------------------------


def make_lively_seq2seq(vocab_size: int, seed: int = 0, **overrides):
    """A tiny encoder-decoder (2 + 2 layers, d_model 32, pre-LN, an output head of its own) with its weight
    matrices redrawn ~ N(0, 0.5²), as the lively decoder's. Random post-LN models with a tied head, the
    paper's and BART's layout, decode one token over and over whatever the source (measured: 1-2 distinct
    tokens in 15); this one writes 4-6, so a mixed-up slot or position changes its output."""
    import torch

    from model.seq2seq import EncoderDecoder
    from model.seq2seq_config import Seq2SeqConfig

    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab_size, n_src_ctx=24, n_tgt_ctx=20, n_encoder_layer=2, n_decoder_layer=2, n_head=4,
                  d_model=32, d_ff=64, norm_placement="pre", tie_embeddings=False, embedding_norm=True, pad_token_id=0,
                  decoder_start_token_id=1, eos_token_id=2)
    return redrawn(EncoderDecoder(Seq2SeqConfig(**{**fields, **overrides})).eval())


@pytest.fixture(scope="session")
def seq2seq_model_dir(tmp_path_factory) -> Path:
    """A lively tiny encoder-decoder with the G2P tokenizer (letters in, phonemes out)."""
    from model.checkpoint import save_model_dir
    from model.training.g2p_data import g2p_tokenizer

    tokenizer = g2p_tokenizer()
    path = tmp_path_factory.mktemp("seq2seq_model")
    save_model_dir(make_lively_seq2seq(tokenizer.vocab_size), tokenizer, path)
    return path


@pytest.fixture(scope="session")
def lively_seq2seq_bundle(tmp_path_factory, seq2seq_model_dir) -> Path:
    from export.seq2seq_bundle import export_seq2seq_bundle

    path = tmp_path_factory.mktemp("seq2seq_bundle")
    export_seq2seq_bundle(seq2seq_model_dir, path, name="tiny-seq2seq")
    return path


@pytest.fixture
def short_g2p_run(tmp_path, monkeypatch) -> tuple[Path, dict]:
    """A G2P model trained for 6 steps (1 + 1 layers, d_model 32) on 400 CMUdict words, split 300 / 50 / 50
    (the split patched for the test): its directory and its training log."""
    from model.training import g2p_data as data
    from model.training import train_g2p

    few = dict(list(data.load_cmudict().items())[:400])
    monkeypatch.setattr(data, "split_words", lambda _: data.Split(dict(list(few.items())[:300]),
                                                                  dict(list(few.items())[300:350]),
                                                                  dict(list(few.items())[350:])))
    out = tmp_path / "g2p"
    assert train_g2p.main(["--out", str(out), "--n-encoder-layer", "1", "--n-decoder-layer", "1", "--d-model", "32",
                           "--d-ff", "64", "--batch-size", "16", "--max-steps", "6", "--eval-interval", "3",
                           "--warmup-steps", "2"]) == 0
    return out, json.loads((out / "training_log.json").read_text())


@pytest.fixture(scope="session")
def lively_seq2seq_int8_bundle(tmp_path_factory, seq2seq_model_dir) -> Path:
    """The lively encoder-decoder with its INT8 pair, graph `static-int8`, beside the fp32 one."""
    from export.seq2seq_bundle import export_seq2seq_bundle

    path = tmp_path_factory.mktemp("seq2seq_int8_bundle")
    export_seq2seq_bundle(seq2seq_model_dir, path, name="tiny-seq2seq", int8=True)
    return path


@pytest.fixture(scope="session")
def seq2seq_int8_bundle(request) -> Path:
    """An encoder-decoder bundle with graphs `static` and `static-int8`: the lively one, or in the serving
    lane the shipped G2P bundle."""
    if serving_bundle(request.config) is None:
        return request.getfixturevalue("lively_seq2seq_int8_bundle")
    if "static-int8" not in read_manifest(SHIPPED_G2P_BUNDLE).graphs:
        pytest.skip(f"{SHIPPED_G2P_BUNDLE} has no 'static-int8' graph")
    return SHIPPED_G2P_BUNDLE


@pytest.fixture(scope="session")
def seq2seq_bundle(request) -> Path:
    """The encoder-decoder bundle the engine and server tests serve: the lively one, or in the serving lane
    the shipped G2P bundle."""
    if serving_bundle(request.config) is None:
        return request.getfixturevalue("lively_seq2seq_bundle")
    read_manifest(SHIPPED_G2P_BUNDLE)
    return SHIPPED_G2P_BUNDLE


@pytest.fixture(scope="session")
def engine_bundle(request) -> Path:
    """The bundle the engine and server tests serve: the lively bundle, or in the serving lane the bundle
    under test. Tests that depend on its shape read it from `engine_model`."""
    bundle = serving_bundle(request.config)
    if bundle is None:
        return request.getfixturevalue("lively_bundle")
    read_manifest(bundle)  # a missing or broken bundle fails here, in one line, not in every test
    return bundle


@pytest.fixture(scope="session")
def engine_model(engine_bundle) -> ModelSpec:
    """The engine bundle's model: vocab_size, n_ctx, name, eos_token_id."""
    return read_manifest(engine_bundle).model


@pytest.fixture(scope="session")
def int8_bundle(request) -> Path:
    """A bundle with the fp32 serving graph `static` and its INT8 counterpart `static-int8`: the tiny
    bundle, or in the serving lane the bundle under test."""
    bundle = serving_bundle(request.config)
    if bundle is None:
        return request.getfixturevalue("tiny_bundle")
    graphs = read_manifest(bundle).graphs
    if not {"static", "static-int8"} <= graphs.keys():
        pytest.skip(f"{bundle} has no 'static' and 'static-int8' graphs to compare")
    return bundle


@pytest.fixture(scope="session")
def plain_bundle(tmp_path_factory, tiny_model_dir) -> Path:
    """The shared tiny model (default initialisation) with the default graphs."""
    from export.bundle_writer import export_bundle

    path = tmp_path_factory.mktemp("plain_bundle")
    export_bundle(tiny_model_dir, path, name="tiny")
    return path


@pytest.fixture(scope="session")
def wrong_int8_bundle(tiny_bundle, lively_bundle, tmp_path_factory) -> Path:
    """The tiny bundle with another model's graph where its INT8 serving graph belongs: a reduced-precision
    graph that parts from its fp32 graph, as a CPU whose integer kernels go wrong would make it."""
    import shutil

    from export.external_data import copy_graph

    dst = tmp_path_factory.mktemp("wrong_int8") / "bundle"
    shutil.copytree(tiny_bundle, dst)
    copy_graph(lively_bundle / "model.static.onnx", dst / "model.static.int8.onnx")  # with its own weights
    return dst


# graph: the fp32 serving graph, whatever the bundle holds, so that every engine of a test (and the test
# servers, tests/fronts/server_harness.py) computes the same logits. On the lively bundle it is the only
# serving graph; on a bundle with INT8 graphs `auto` could serve another one, chosen per CPU.
ENGINE_DEFAULTS = dict(graph="static", max_running=8, max_batch_tokens=256, max_waiting=64, threads=1)


@pytest.fixture
def make_engine(engine_bundle) -> Callable[..., Engine]:
    """make_engine(**config) -> a fresh Engine on the engine bundle (ENGINE_DEFAULTS otherwise)."""

    def make(bundle: Path | None = None, **overrides) -> Engine:
        return Engine(EngineConfig(bundle=bundle or engine_bundle, **{**ENGINE_DEFAULTS, **overrides}))

    return make


@pytest.fixture
def graph_times(monkeypatch) -> Callable[[dict[str, float]], None]:
    """graph_times({"static-int8": 1.0}): `--graph auto` times each graph at that many ms a step at every batch
    size (the others at 10), instead of measuring, so a test decides which graph it picks first."""
    from service.runtime import graph_choice

    def fix(times: dict[str, float]) -> None:
        def time_decode(candidates, batch):
            for c in candidates:
                c.step_ms = dict.fromkeys(sorted({1, batch}), times.get(c.name, 10.0))

        monkeypatch.setattr(graph_choice, "time_decode", time_decode)

    return fix
