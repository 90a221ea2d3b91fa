"""Export to a Hugging Face GPT-2 directory: transformers loads it offline and computes our logits."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model_dir, save_model_dir  # noqa: E402
from model.export_hf import export_hf, main  # noqa: E402
from model.import_hf import import_hf  # noqa: E402
from tests.conftest import make_model  # noqa: E402


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
    assert main([str(tmp_path / "sin"), "-o", str(tmp_path / "hf")]) == 1
    assert "learned positions" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "sin" / "config.json").read_text())
    assert cfg["pos_encoding"] == "sinusoidal"
