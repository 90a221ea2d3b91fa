"""Llama-family import parity: random LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM / Qwen3ForCausalLM /
SmolLM3ForCausalLM / Phi3ForCausalLM / Gemma2ForCausalLM / Gemma3ForCausalLM (with and without sliding windows) built
with transformers, saved locally, imported, and compared logit for logit and token for token."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model_dir  # noqa: E402
from model.generate import generate  # noqa: E402
from model.hf.import_hf import import_hf, main  # noqa: E402
from model.hf.llama import windows  # noqa: E402
from tests.model.hf_models import FAMILIES, greedy_hf, greedy_hf_cached, save_random  # noqa: E402


@pytest.mark.parametrize("family", list(FAMILIES))
def test_imported_llama_family_matches_transformers(tiny_tokenizer, tmp_path, family):
    hf = save_random(tmp_path / "hf", tiny_tokenizer, family, shard=family == "llama")
    if family == "llama":
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # sharded
    import_hf(tmp_path / "hf", tmp_path / "ours")
    ours, tok = load_model_dir(tmp_path / "ours")
    c = ours.config
    assert (c.n_layer, c.n_head, c.kv_heads, c.d_model, c.ff_width, c.n_ctx) == (
        hf.config.num_hidden_layers, 4, hf.config.num_key_value_heads, 64, 96, 128)
    gemma = family.startswith("gemma")
    assert (c.pos_encoding, c.norm, c.mlp, c.qkv_bias) == ("rotary", "rmsnorm", "geglu" if gemma else "swiglu",
                                                           family.startswith("qwen2"))
    window = getattr(hf.config, "sliding_window", None)
    hf_layers = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * c.n_layer  # Mistral: every layer
    want_windows = [window if window and kind == "sliding_attention" else None for kind in hf_layers]
    assert [c.window(i) for i in range(c.n_layer)] == want_windows
    assert (c.post_norms, c.scale_embeddings, c.attn_softcap, c.final_softcap) == {
        "gemma2": (True, True, 8.0, 12.0), "gemma3": (True, True, None, None)}.get(family, (False, False, None, None))
    assert (c.d_head, c.qk_norm, c.rotary_dim, c.no_rotary_layers) == {
        "qwen3": (32, True, 32, None), "smollm3": (16, False, 16, [1]), "phi3": (16, False, 12, None),
        "qwen3-window": (32, True, 32, None), "smollm3-window": (16, False, 16, [1]),
        "phi3-window": (16, False, 12, None), "phi4-mini-longrope": (16, False, 12, None),
        "gemma3": (32, True, 32, None)}.get(family, (16, False, 16, None))
    if family == "gemma3":  # global layers: rope_theta, linearly scaled; sliding layers: their own base, unscaled
        assert (c.rope_theta, c.rope_scaling["factor"], c.rope_local_theta, c.rope_local_scaling) == (
            1_000_000.0, 2.0, 10_000.0, None)
        assert [c.rope_of(i)[0] for i in range(3)] == [10_000.0, 10_000.0, 1_000_000.0]

    # 40 tokens: past the sliding windows of 8
    ids = torch.tensor([tok.encode("Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to "
                                   "day, to the last syllable of recorded time")])
    assert ids.shape[1] > 16
    if "longrope" in family:  # transformers rotates every position of a call past 32 with the long factors
        ids = ids[:, :32]
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert (got - expected).abs().max().item() <= 1e-4
    prompt = ids[0, :6].tolist()
    # 38 positions cross longrope's switch at 32: from there a cached generation keeps the keys it rotated with
    # the short factors, as transformers' cached generation does, where a forward of the whole sequence would not
    reference = greedy_hf_cached if "longrope" in family else greedy_hf
    assert generate(ours, [prompt], 32, temperature=0.0)[0] == reference(hf, prompt, 32)


@pytest.mark.parametrize("kind,hf,want", [
    # Phi-3-mini-4k: every layer sees 2047 keys, itself included
    ("phi3", dict(sliding_window=2047, max_position_embeddings=4096), (2047, None)),
    ("phi3", dict(sliding_window=131072, max_position_embeddings=131072), (None, None)),
    # Qwen3 as Qwen2: nothing without use_sliding_window, else the layers from max_window_layers on
    ("qwen3", dict(sliding_window=4096, max_window_layers=1, max_position_embeddings=40960), (None, None)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=4096, max_window_layers=2, max_position_embeddings=40960),
     (4096, ["full_attention", "full_attention", "sliding_attention", "sliding_attention"])),
    # SmolLM3: by default its blocks without rotary positions (every 4th), layer_types when written out
    ("smollm3", dict(use_sliding_window=True, sliding_window=2048, max_position_embeddings=65536),
     (2048, ["full_attention"] * 3 + ["sliding_attention"])),
    ("smollm3", dict(use_sliding_window=True, sliding_window=2048, max_position_embeddings=65536,
                     layer_types=["sliding_attention"] + ["full_attention"] * 3),
     (2048, ["sliding_attention"] + ["full_attention"] * 3)),
    ("smollm3", dict(sliding_window=2048, max_position_embeddings=65536), (None, None)),
])
def test_the_window_rules_of_qwen3_smollm3_and_phi3(kind, hf, want):
    assert windows({"num_hidden_layers": 4, **hf}, kind) == want


def test_every_eos_id_of_the_generation_config_is_kept(tiny_tokenizer, tmp_path):
    save_random(tmp_path / "hf", tiny_tokenizer, "llama")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5, 7]}))
    import_hf(tmp_path / "hf", tmp_path / "ours")
    ours, _ = load_model_dir(tmp_path / "ours")
    assert (ours.config.eos_token_id, ours.config.eos_token_ids) == (0, [0, 5, 7])
    assert json.loads((tmp_path / "ours" / "generation_config.json").read_text())["eos_token_id"] == [0, 5, 7]


@pytest.mark.parametrize("family,change,message", [
    # transformers' masks would window the second block, its flash attention would not (use_sliding_window off)
    ("smollm3", dict(layer_types=["full_attention", "sliding_attention"], sliding_window=32),
     "layer_types names sliding_attention layers but use_sliding_window is off"),
    ("smollm3", dict(no_rope_layers=[1, 0, 1]), "no_rope_layers has 3 entries for 2 layers"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("phi3", dict(partial_rotary_factor=0.5625, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
     "even rotated width, got 9"),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
     "rope_scaling type 'dynamic' is not supported"),
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention is not supported"),
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
])
def test_an_option_of_the_newer_families_the_decoder_lacks_is_refused(tiny_tokenizer, tmp_path, capsys, family,
                                                                      change, message):
    save_random(tmp_path / "hf", tiny_tokenizer, family)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("change,message", [
    (dict(architectures=["GPTNeoXForCausalLM"]), "architecture GPTNeoXForCausalLM is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_activation="gelu"),
     "hidden_activation 'gelu' is not supported"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", use_bidirectional_attention=True),
     "use_bidirectional_attention is not supported"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
     "rope_scaling type 'dynamic' is not supported: dynamic NTK recomputes every position's frequencies"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_an_unsupported_checkpoint_is_refused_in_one_line(tiny_tokenizer, tmp_path, capsys, change, message):
    save_random(tmp_path / "hf", tiny_tokenizer, "llama")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()  # what saving the checkpoint printed
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
