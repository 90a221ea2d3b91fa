"""Llama-family models end to end: built with transformers (random weights, no hub), imported, exported
(static-cache graph with grouped-query attention and rotary positions, and the standard graph), verified
against PyTorch, and served by the engine: greedy tokens alone and batched equal transformers'. The
windowed families (Mistral, Qwen2 on some layers, Gemma 2 on every other one) have windows of 8 positions,
which the prompts and their continuations cross."""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from export.bundle_writer import export_bundle  # noqa: E402
from export.verify import verify, verify_static  # noqa: E402
from model.checkpoint import load_model_dir  # noqa: E402
from model.hf.import_hf import import_hf  # noqa: E402
from service.engine.config import EngineConfig  # noqa: E402
from service.engine.core import Engine  # noqa: E402
from service.runtime.bundle import read_manifest  # noqa: E402
from service.runtime.concat_runner import ConcatRunner  # noqa: E402
from service.runtime.self_check import check  # noqa: E402
from service.runtime.static_runner import StaticRunner  # noqa: E402
from tests.engine.harness import drive, greedy, random_prompt  # noqa: E402
from tests.model.hf_models import greedy_hf, save_random  # noqa: E402

FAMILIES = ["llama", "llama3-rope", "qwen2", "mistral", "mistral-window", "qwen2-window", "gemma2"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_bundle(request, tiny_tokenizer, tmp_path_factory):
    """(family, the transformers model, the imported model dir, its bundle)."""
    root = tmp_path_factory.mktemp(request.param)
    hf = save_random(root / "hf", tiny_tokenizer, request.param)
    import_hf(root / "hf", root / "model")
    export_bundle(root / "model", root / "bundle", name=request.param, int8=True)
    return request.param, hf, root / "model", root / "bundle"


def test_the_graphs_match_pytorch_and_the_cache_holds_only_kv_heads(family_bundle):
    family, hf, model_dir, bundle = family_bundle
    model, _ = load_model_dir(model_dir)
    assert verify_static(model, bundle, "static").passed
    assert verify(model, ConcatRunner(bundle, graph="fp32", provider="cpu")).passed
    assert (bundle / "generation_config.json").is_file()  # kept from the checkpoint, beside the tokenizer
    m = read_manifest(bundle).model
    assert (m.architecture, m.n_head, m.kv_heads) == ("llama", 4, hf.config.num_key_value_heads)
    engine = Engine(EngineConfig(bundle=bundle, graph="static", max_running=4, max_batch_tokens=64))
    assert engine.kv.shape.n_head == hf.config.num_key_value_heads  # not the 4 query heads
    layers = hf.config.num_hidden_layers
    # K,V x layers x heads x ctx x d_head x 4 bytes: a windowed layer keeps the whole context too
    assert engine.kv.shape.bytes_per_slot == 2 * layers * m.kv_heads * 128 * 16 * 4
    assert [b.shape for b in engine.kv.buffers] == [(4, m.kv_heads, 128, 16)] * 2 * layers


def test_every_graph_is_batch_invariant(family_bundle):
    """The start-up self-check's probe: rows alone and in a batch of other lengths get the same bits. (Its
    INT8 agreement bar is not asserted here: these random-weight models have near-ties a real model has not.)"""
    _, _, _, bundle = family_bundle
    assert check(StaticRunner(bundle, "static", provider="cpu")).invariance.identical
    assert check(StaticRunner(bundle, "static-int8", provider="cpu"), allow_low_agreement=True).invariance.identical


def test_served_greedy_tokens_alone_and_batched_equal_transformers(family_bundle):
    family, hf, _, bundle = family_bundle
    rng = np.random.default_rng(3)
    requests = [greedy(f"r{i}", random_prompt(rng, n), 20, ignore_eos=True) for i, n in enumerate((5, 17, 1, 30))]
    config = dict(bundle=bundle, graph="static", max_running=4, max_batch_tokens=64)
    batched = drive(Engine(EngineConfig(**config)), requests)
    for r in requests:
        want = greedy_hf(hf, r.prompt_token_ids, 20)
        assert batched.tokens(r.request_id) == want, (family, r.request_id)
        assert drive(Engine(EngineConfig(**config)), [r]).tokens(r.request_id) == want


def test_twelve_requests_at_once_equal_transformers(family_bundle):
    """More requests than fit one step's token budget: chunked prefills beside decodes, rows of every length
    on both sides of the window."""
    family, hf, _, bundle = family_bundle
    rng = np.random.default_rng(12)
    lengths = (1, 3, 7, 8, 9, 12, 16, 23, 30, 41, 5, 60)
    requests = [greedy(f"r{i}", random_prompt(rng, n), 16, ignore_eos=True) for i, n in enumerate(lengths)]
    run = drive(Engine(EngineConfig(bundle=bundle, graph="static", max_running=12, max_batch_tokens=48)), requests)
    for r in requests:
        assert run.tokens(r.request_id) == greedy_hf(hf, r.prompt_token_ids, 16), (family, r.request_id)
