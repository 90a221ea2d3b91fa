"""The long-context rope scalings end to end: a Qwen2 checkpoint with yarn and a Llama one with longrope,
trained (their configs say) on 32 positions and served on 128, built with transformers (random weights, no
hub), imported, exported, verified against PyTorch, and served by the engine while generation crosses the
original context: greedy tokens alone and batched equal transformers'."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

transformers = pytest.importorskip("transformers")

from export.bundle_writer import export_bundle  # noqa: E402
from export.static_cache_graph import export_static_cache_decoder  # noqa: E402
from export.verify import verify, verify_static  # noqa: E402
from model.checkpoint import load_model_dir  # noqa: E402
from model.hf.import_hf import import_hf  # noqa: E402
from service.engine.config import EngineConfig  # noqa: E402
from service.engine.core import Engine  # noqa: E402
from service.runtime.concat_runner import ConcatRunner  # noqa: E402
from tests.engine.harness import drive, greedy, random_prompt  # noqa: E402
from tests.model.hf_models import greedy_hf, greedy_hf_cached, save_random  # noqa: E402

ORIGINAL = 32  # original_max_position_embeddings of both checkpoints
NEW = 24


def build(family: str, tokenizer, tmp_path_factory):
    """(family, the transformers model, the imported model dir, its bundle)."""
    root = tmp_path_factory.mktemp(family)
    hf = save_random(root / "hf", tokenizer, family)
    import_hf(root / "hf", root / "model")
    export_bundle(root / "model", root / "bundle", name=family)
    return family, hf, root / "model", root / "bundle"


@pytest.fixture(scope="module")
def yarn_bundle(tiny_tokenizer, tmp_path_factory):
    return build("qwen2-yarn", tiny_tokenizer, tmp_path_factory)


@pytest.fixture(scope="module")
def longrope_bundle(tiny_tokenizer, tmp_path_factory):
    return build("llama-longrope", tiny_tokenizer, tmp_path_factory)


@pytest.fixture(scope="module")
def phi4_mini_bundle(tiny_tokenizer, tmp_path_factory):
    return build("phi4-mini-longrope", tiny_tokenizer, tmp_path_factory)


def serve(bundle, requests) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Each request's greedy tokens served in one batch, and alone."""
    config = dict(bundle=bundle, graph="static", max_running=4, max_batch_tokens=64)
    batched = drive(Engine(EngineConfig(**config)), requests)
    alone = {r.request_id: drive(Engine(EngineConfig(**config)), [r]).tokens(r.request_id) for r in requests}
    return {r.request_id: batched.tokens(r.request_id) for r in requests}, alone


@pytest.mark.parametrize("built", ["yarn_bundle", "longrope_bundle"])
def test_the_graphs_match_pytorch(request, built):
    _, _, model_dir, bundle = request.getfixturevalue(built)
    model, _ = load_model_dir(model_dir)
    assert model.config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert verify_static(model, bundle, "static").passed
    assert verify(model, ConcatRunner(bundle, graph="fp32", provider="cpu")).passed
    graph = onnx.load(str(bundle / "model.static.onnx"))
    tables = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer if t.name in ("rope_cos", "rope_sin")}
    cos, sin = model.rotary(torch.arange(128)[None])  # (1, 1, 128, 16): both halves of each pair alike
    np.testing.assert_array_equal(tables["rope_cos"], cos[0, 0, :, :8].numpy())  # the model's angles, bit for bit
    np.testing.assert_array_equal(tables["rope_sin"], sin[0, 0, :, :8].numpy())
    assert not [n for n in graph.graph.node if n.op_type == "RotaryEmbedding"]  # one table: rotated in attention


@pytest.mark.parametrize("built", ["yarn_bundle", "longrope_bundle"])
def test_rotated_before_the_attention_op_the_graph_matches_pytorch_too(request, built, tmp_path):
    """The other placement (RotaryEmbedding ops at position_ids) reads the same tables, attention factor in."""
    _, _, model_dir, bundle = request.getfixturevalue(built)
    model, _ = load_model_dir(model_dir)
    copy = shutil.copytree(bundle, tmp_path / "bundle")
    export_static_cache_decoder(model, copy / "model.static.onnx", rotary_in_attention=False)
    graph = onnx.load(str(copy / "model.static.onnx"), load_external_data=False)
    assert len([n for n in graph.graph.node if n.op_type == "RotaryEmbedding"]) == 4  # q and k of 2 layers
    assert verify_static(model, copy, "static").passed


def test_partial_rotary_with_longrope_matches_pytorch(phi4_mini_bundle):
    """Phi-4-mini's layout: longrope's factors cover the 12 rotated dimensions of each 16-wide head, whose
    6-wide tables GroupQueryAttention cannot take (a multiple of 8), so RotaryEmbedding ops rotate them."""
    _, _, model_dir, bundle = phi4_mini_bundle
    model, _ = load_model_dir(model_dir)
    assert (model.config.rotary_dim, model.config.rope_scaling["rope_type"]) == (12, "longrope")
    assert verify_static(model, bundle, "static").passed
    assert verify(model, ConcatRunner(bundle, graph="fp32", provider="cpu")).passed
    graph = onnx.load(str(bundle / "model.static.onnx"), load_external_data=False)
    assert len([n for n in graph.graph.node if n.op_type == "RotaryEmbedding"]) == 4


def test_yarn_greedy_tokens_alone_and_batched_equal_transformers(yarn_bundle):
    _, hf, _, bundle = yarn_bundle
    rng = np.random.default_rng(5)
    requests = [greedy(f"r{n}", random_prompt(rng, n), NEW, ignore_eos=True) for n in (5, 17, 30, 40)]
    batched, alone = serve(bundle, requests)
    for r in requests:  # within, crossing and past the original 32 positions
        want = greedy_hf(hf, r.prompt_token_ids, NEW)
        assert batched[r.request_id] == want and alone[r.request_id] == want, r.request_id


@pytest.mark.parametrize("built", ["longrope_bundle", "phi4_mini_bundle"])
def test_longrope_greedy_tokens_alone_and_batched_equal_transformers(request, built):
    """Positions below the original context are rotated with the short factors, the rest with the long. A
    sequence within it is transformers' with or without its cache; one that crosses it is transformers'
    cached generation (which keeps the keys it rotated short, where its uncached forward of the whole
    sequence rotates every key long). A prompt already past it is transformers' fed the prompt's first 32
    tokens in one call and the rest in the next, not its single call, which rotates them long too."""
    _, hf, _, bundle = request.getfixturevalue(built)
    rng = np.random.default_rng(7)
    # (prompt, new tokens): "within" ends exactly at the original context, its last call 32 positions long
    cases = {"within": (5, ORIGINAL - 4), "past": (40, NEW), "crossing": (17, NEW)}
    prompts = {rid: random_prompt(rng, n) for rid, (n, _) in cases.items()}
    batched, alone = serve(bundle, [greedy(rid, prompts[rid], new, ignore_eos=True) for rid, (_, new) in cases.items()])
    want = {"within": greedy_hf(hf, prompts["within"], cases["within"][1]),
            "crossing": greedy_hf_cached(hf, prompts["crossing"], NEW),
            "past": greedy_hf_cached(hf, prompts["past"], NEW, first_call=ORIGINAL)}
    assert want["within"] == greedy_hf_cached(hf, prompts["within"], cases["within"][1])
    for rid in cases:
        assert batched[rid] == want[rid] and alone[rid] == want[rid], rid
    # the cases where the served tokens are not those of transformers' forward of the whole sequence
    assert want["crossing"] != greedy_hf(hf, prompts["crossing"], NEW)
    assert want["past"] != greedy_hf(hf, prompts["past"], NEW)
