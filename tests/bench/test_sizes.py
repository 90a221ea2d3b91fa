"""The benchmark sizes at tiny shapes: one model directory, its Hugging Face export and its bundle hold the
same weights, random models decode varied text, and a prepared size is reused, not rebuilt."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import bench.sizes as sizes  # noqa: E402
from bench.sizes import Prepared, liveliness, prepare  # noqa: E402
from model.checkpoint import load_model_dir  # noqa: E402
from service.runtime.bundle import read_manifest  # noqa: E402
from service.runtime.static_runner import StaticRunner  # noqa: E402

TINY_QK_GAIN = 2.5  # a few narrow layers need sharper attention than the real sizes to decode varied tokens
TINY = {  # the random sizes at a shape that builds and exports in seconds
    "gpt2-124m": dict(vocab_size=1024, n_ctx=128, n_layer=3, n_head=4, d_model=64),
    "smollm2-135m": dict(vocab_size=1024, n_ctx=128, n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=96),
}
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("sizes")


@pytest.fixture(scope="module", params=list(TINY))
def prepared(request, work) -> Prepared:
    return prepare(request.param, work, shape=TINY[request.param], qk_gain=TINY_QK_GAIN)


def test_a_prepared_size_describes_its_model(prepared):
    config = json.loads((prepared.model_dir / "config.json").read_text())
    assert (prepared.vocab_size, prepared.n_ctx) == (config["vocab_size"], config["n_ctx"]) == (1024, 128)
    assert prepared.arch == ("llama" if prepared.size == "smollm2-135m" else "gpt")
    ours, tok = load_model_dir(prepared.model_dir)
    assert prepared.parameters == ours.num_parameters()
    assert tok.vocab_size == prepared.vocab_size
    graphs = set(read_manifest(prepared.bundle).graphs)
    assert graphs >= ({"static", "static-int8", "static-int8-per-tensor"}
                      | ({"static-int4"} if sizes.int4_supported() else set()))


def test_transformers_loads_the_hf_directory_with_our_logits(prepared):
    ours, tok = load_model_dir(prepared.model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(prepared.hf_dir).eval()
    assert type(hf).__name__ == ("LlamaForCausalLM" if prepared.arch == "llama" else "GPT2LMHeadModel")
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(prepared.hf_dir)
    assert hf_tok(TEXT).input_ids == tok.encode(TEXT)
    assert len(hf_tok) == prepared.vocab_size
    config = json.loads((prepared.hf_dir / "config.json").read_text())
    if prepared.arch == "gpt":
        assert config["n_ctx"] == prepared.n_ctx  # llama.cpp's converter reads it
    ids = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        want = ours(ids)
        assert (hf(ids).logits - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("graph", ["static", "static-int8", "static-int8-per-tensor", "static-int4"])
def test_the_bundle_runs_and_agrees_with_pytorch(prepared, graph):
    if graph not in read_manifest(prepared.bundle).graphs:
        pytest.skip(f"export_bundle writes no {graph} graph")
    ours, _ = load_model_dir(prepared.model_dir)
    runner = StaticRunner(prepared.bundle, graph, provider="cpu")
    runner.attach(runner.cache_shape.buffers(1))
    prompt = np.random.default_rng(0).integers(0, prepared.vocab_size, 16).tolist()
    got = runner.prefill_batch(0, [prompt])[0]
    with torch.no_grad():
        want = ours(torch.tensor([prompt]))[0, -1].numpy()
    if graph == "static":
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    else:  # fewer bits move the logits, not their shape; 4-bit blocks move this sharp-attention model's far
        assert np.corrcoef(got, want)[0, 1] > (0.5 if graph == "static-int4" else 0.9)


def test_random_weights_decode_varied_tokens_with_clear_margins(prepared):
    stamp = json.loads((prepared.model_dir.parent / "prepared.json").read_text())
    lively = stamp["liveliness"]
    assert lively["new_tokens"] == 112  # 128 positions, 16 of them the prompt
    assert min(lively["distinct"]) >= sizes.MIN_DISTINCT
    assert lively["mean_margin"] > 0.5


def test_a_prepared_size_is_reused_until_its_shape_changes(prepared, work):
    weights = prepared.model_dir / "model.safetensors"
    built = weights.stat().st_mtime_ns
    again = prepare(prepared.size, work, shape=TINY[prepared.size], qk_gain=TINY_QK_GAIN)
    assert again == prepared and weights.stat().st_mtime_ns == built
    other = prepare(prepared.size, work / "other", shape={**TINY[prepared.size], "layer_norm_eps": 1e-6},
                    qk_gain=TINY_QK_GAIN)
    assert json.loads((other.model_dir / "config.json").read_text())["layer_norm_eps"] == 1e-6


def test_a_collapsing_initialisation_is_refused(work, monkeypatch):
    import torch

    from model.gpt import GPT

    def one_token(config, init):  # no token embedding, so through the tied head every logit is 0: id 0 forever
        model = GPT(config).eval()
        with torch.no_grad():
            model.tok_emb.weight.zero_()
        return model

    monkeypatch.setattr(sizes, "random_model", one_token)
    with pytest.raises(RuntimeError, match="collapses under greedy decoding"):
        prepare("gpt2-124m", work / "collapsing", shape=TINY["gpt2-124m"], qk_gain=TINY_QK_GAIN)


def test_liveliness_counts_distinct_tokens_per_row():
    from model.config import GPTConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_ctx=64, n_layer=1, n_head=2, d_model=16)).eval()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: argmax picks id 0 every step
    lively = liveliness(model, rows=3, new_tokens=20)
    assert lively.distinct == [1, 1, 1] and lively.new_tokens == 20 and lively.mean_margin == 0.0


def test_a_small_vocabulary_is_the_shipped_bpe_truncated():
    tok = sizes.bpe_tokenizer(300)
    assert tok.vocab_size == 300 and tok.eos_id == 0
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert max(tok.encode(TEXT)) < 300


@pytest.mark.corpus
@pytest.mark.slow
def test_a_large_vocabulary_is_a_trained_bpe_padded_with_reserved_tokens(tmp_path):
    tok = sizes.bpe_tokenizer(49152)
    assert tok.vocab_size == 49152 and tok.eos_id == 0
    reserved = tok.hf.id_to_token(49151)
    assert reserved == "<reserved_49151>"
    assert tok.encode(TEXT + reserved)[-1] == 49151 and tok.decode(tok.encode(TEXT + reserved)) == TEXT + reserved
    tok.save(tmp_path / "tokenizer.json")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert len(hf_tok) == 49152 and hf_tok(TEXT).input_ids == tok.encode(TEXT)


@pytest.mark.slow
def test_the_shipped_size_is_the_shipped_model(work):
    p = prepare("shipped", work, int4=False)
    assert p.model_dir == sizes.SHIPPED_MODEL and p.arch == "llama"
    ours, tok = load_model_dir(p.model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(p.hf_dir).eval()
    ids = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-4
    assert {"static", "static-int8"} <= set(read_manifest(p.bundle).graphs)
