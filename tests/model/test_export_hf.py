"""Export to a Hugging Face directory (GPT-2, Llama, Mistral, Qwen2, Gemma 2 or 3): transformers loads it offline
and computes our logits, and import-hf gives back the same weights."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model_dir, save_model_dir  # noqa: E402
from model.generate import generate  # noqa: E402
from model.hf.export_hf import architecture, export_hf, main  # noqa: E402
from model.hf.import_hf import import_hf  # noqa: E402
from tests.conftest import LLAMA, ROOT, make_lively, make_model  # noqa: E402
from tests.model.hf_models import greedy_hf, save_random  # noqa: E402


def test_transformers_loads_the_export_and_matches_our_logits(tiny_model_dir, tmp_path):
    out = export_hf(tiny_model_dir, tmp_path / "hf")
    ours, tok = load_model_dir(tiny_model_dir)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    text = "Tomorrow, and tomorrow, and tomorrow"
    assert hf_tok(text).input_ids == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eos_id
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-4
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                         do_sample=False, pad_token_id=tok.eos_id)
    assert greedy.shape[1] == ids.shape[1] + 16


def test_export_then_import_gives_back_the_same_weights(tiny_model_dir, tmp_path):
    import_hf(export_hf(tiny_model_dir, tmp_path / "hf"), tmp_path / "back")
    a, _ = load_model_dir(tiny_model_dir)
    b, _ = load_model_dir(tmp_path / "back")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_models_gpt2_cannot_express_are_refused(tiny_tokenizer, tmp_path, capsys):
    model = make_model(vocab_size=tiny_tokenizer.vocab_size, pos_encoding="sinusoidal")
    save_model_dir(model, tiny_tokenizer, tmp_path / "sin")
    assert main([str(tmp_path / "sin"), "-o", str(tmp_path / "hf")]) == 2
    assert "learned positions" in capsys.readouterr().err
    cfg = json.loads((tmp_path / "sin" / "config.json").read_text())
    assert cfg["pos_encoding"] == "sinusoidal"


# ---- Llama-style models -> LlamaForCausalLM ------------------------------------------------------------

SHIPPED_MODEL = ROOT / "models" / "shakespeare"
LLAMA_STYLE = {**LLAMA, "qkv_bias": False, "rope_theta": 5000.0, "eos_token_ids": [0, 3], "bos_token_id": 0}


def llama_model_dir(tokenizer, out, **overrides):
    """A lively Llama-style model: 2 KV heads for 4 query heads, untied head unless overridden."""
    model = make_lively(vocab_size=tokenizer.vocab_size, n_ctx=128, **{**LLAMA_STYLE, **overrides})
    return save_model_dir(model, tokenizer, out)


@pytest.mark.parametrize("tied", [False, True])
def test_a_llama_style_model_exports_as_llama_with_our_logits(tiny_tokenizer, tmp_path, tied):
    src = llama_model_dir(tiny_tokenizer, tmp_path / "ours", tie_embeddings=tied)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out = export_hf(src, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_key_value_heads"], cfg["tie_word_embeddings"], cfg["rope_theta"]) == (2, tied, 5000.0)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 3]

    ours, tok = load_model_dir(src)
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.config.num_key_value_heads == 2 and hf.config.rms_norm_eps == ours.config.layer_norm_eps
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    text = "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace"
    assert hf_tok(text).input_ids == tok.encode(text)
    assert hf_tok.apply_chat_template([{"role": "user", "content": "Ham."}], tokenize=False) == "Ham."
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-4
    prompt = ids[0, :6].tolist()
    assert generate(ours, [prompt], 24, temperature=0.0)[0] == greedy_hf(hf, prompt, 24)


def test_a_llama_style_export_imports_back_to_the_same_weights(tiny_tokenizer, tmp_path):
    src = llama_model_dir(tiny_tokenizer, tmp_path / "ours")
    import_hf(export_hf(src, tmp_path / "hf"), tmp_path / "back")
    a, _ = load_model_dir(src)
    b, _ = load_model_dir(tmp_path / "back")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert b.config == a.config


def test_the_shipped_model_exports_as_llama_with_its_logits(tmp_path):
    out = export_hf(SHIPPED_MODEL, tmp_path / "hf")
    ours, tok = load_model_dir(SHIPPED_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    assert transformers.PreTrainedTokenizerFast.from_pretrained(out)(text).input_ids == tok.encode(text)
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("overrides,message", [
    (dict(pos_encoding="learned"), "closest is Llama, which needs rotary positions"),
    (dict(bias=True), "closest is Llama, which needs no biases"),
    (dict(norm="layernorm", bias=True), "closest is Llama, which needs RMSNorm, no biases"),
    (dict(n_layer=2, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
     "as close is Qwen2, which needs biases on the query/key/value projection alone"),
    # a windowed Qwen3 (or SmolLM3, Phi-3) is not written as one without its window
    (dict(n_layer=2, qk_norm=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
     "closest is Llama, which needs no sliding window"),
    (dict(rotary_fraction=0.75, sliding_window=8), "closest is Llama, which needs no sliding window"),
    (dict(attn_softcap=30.0), "closest is Llama, which needs pre-norm blocks with unscaled embeddings and no soft"),
    (dict(mlp="geglu", post_norms=True, scale_embeddings=True, attn_scale=0.3),
     "closest is Gemma 2, which needs an attention scale of 1 / sqrt(an integer)"),
])
def test_a_model_no_family_expresses_is_refused(tiny_tokenizer, tmp_path, capsys, overrides, message):
    model = make_model(vocab_size=tiny_tokenizer.vocab_size, **{**LLAMA_STYLE, **overrides})
    with pytest.raises(ValueError, match="none of Llama, Mistral, Qwen2, Gemma 2, Gemma 3, GPT-2"):
        architecture(model.config)
    save_model_dir(model, tiny_tokenizer, tmp_path / "odd")
    assert main([str(tmp_path / "odd"), "-o", str(tmp_path / "hf")]) == 2
    assert message in capsys.readouterr().err


# ---- imported windowed and Gemma 2 checkpoints -> their own architecture ------------------------------------

@pytest.mark.parametrize("family,architecture_name", [
    ("mistral-window", "MistralForCausalLM"), ("qwen2-window", "Qwen2ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
    ("gemma2", "Gemma2ForCausalLM"), ("gemma3", "Gemma3ForCausalLM")])
def test_an_imported_checkpoint_exports_as_its_family_with_the_same_logits(tiny_tokenizer, tmp_path, family,
                                                                           architecture_name):
    original = save_random(tmp_path / "hf", tiny_tokenizer, family)
    import_hf(tmp_path / "hf", tmp_path / "ours")
    out = export_hf(tmp_path / "ours", tmp_path / "again")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [architecture_name]
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again).__name__ == architecture_name
    gemma = ("head_dim", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
    for key in ("sliding_window", "layer_types", "rope_parameters") + (gemma if family.startswith("gemma") else ()):
        assert getattr(again.config, key, None) == getattr(original.config, key, None), key
    ids = torch.randint(0, tiny_tokenizer.vocab_size, (2, 40))  # past the windows of 8
    with torch.no_grad():
        assert (again(ids).logits - original(ids).logits).abs().max().item() <= 1e-5

    import_hf(out, tmp_path / "back")
    a, _ = load_model_dir(tmp_path / "ours")
    b, _ = load_model_dir(tmp_path / "back")
    assert b.config == a.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:  # Gemma's norm weights go through w + 1 - 1 in float32
        torch.testing.assert_close(sb[k], sa[k], atol=1e-7 if family.startswith("gemma") else 0, rtol=0)


# ---- Qwen3, SmolLM3, Phi-3 -> their own classes ---------------------------------------------------------

@pytest.mark.parametrize("family,cls,fields", [
    ("qwen3", "Qwen3ForCausalLM", dict(head_dim=32)),
    ("smollm3", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    ("phi3", "Phi3ForCausalLM", dict(partial_rotary_factor=0.75)),
])
def test_an_imported_checkpoint_exports_back_to_the_same_checkpoint(tiny_tokenizer, tmp_path, family, cls, fields):
    """import-hf then export-hf gives transformers the class, the tensors under the names (Phi-3's fused
    qkv_proj and gate_up_proj) and the settings it started from, and import-hf of that the same model."""
    hf = save_random(tmp_path / "hf", tiny_tokenizer, family)
    import_hf(tmp_path / "hf", tmp_path / "ours")
    out = export_hf(tmp_path / "ours", tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again).__name__ == cls
    assert {k: getattr(again.config, k) for k in fields} == fields
    assert again.config.rope_parameters["rope_theta"] == hf.config.rope_parameters["rope_theta"]
    want, got = hf.state_dict(), again.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.tensor([tiny_tokenizer.encode("Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace")])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
    import_hf(out, tmp_path / "twice")
    a, _ = load_model_dir(tmp_path / "ours")
    b, _ = load_model_dir(tmp_path / "twice")
    assert b.config == a.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_model_no_hugging_face_class_expresses_is_refused(tiny_tokenizer, tmp_path, capsys):
    model = make_model(vocab_size=tiny_tokenizer.vocab_size, **{**LLAMA_STYLE, "qk_norm": True, "rotary_fraction": 0.5})
    save_model_dir(model, tiny_tokenizer, tmp_path / "odd")
    assert main([str(tmp_path / "odd"), "-o", str(tmp_path / "hf")]) == 2
    assert "this model needs qwen3 and phi3" in capsys.readouterr().err


@pytest.mark.parametrize("family,overrides", [("phi3", dict(partial_rotary_factor=1.0)),
                                              ("smollm3", dict(no_rope_layers=[1, 1]))])
def test_a_checkpoint_with_nothing_a_llama_lacks_exports_as_a_llama(tiny_tokenizer, tmp_path, family, overrides):
    hf = save_random(tmp_path / "hf", tiny_tokenizer, family, **overrides)
    import_hf(tmp_path / "hf", tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(export_hf(tmp_path / "ours", tmp_path / "back")).eval()
    assert type(again).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([tiny_tokenizer.encode("Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace")])
    with torch.no_grad():
        assert (again(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5
