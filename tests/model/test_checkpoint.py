"""Model directories: config.json + model.safetensors + tokenizer.json, loaded without pickle."""

from __future__ import annotations

import json

import pytest
import torch

from model.checkpoint import load_model_dir, save_model_dir
from tests.conftest import make_model


def test_save_and_load_give_identical_logits(tiny_tokenizer, tmp_path):
    model = make_model(vocab_size=tiny_tokenizer.vocab_size)
    save_model_dir(model, tiny_tokenizer, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded, tok = load_model_dir(tmp_path)
    ids = torch.tensor([tiny_tokenizer.encode("To be, or not to be")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    assert tok.eos_id == model.config.eos_token_id


def test_weights_file_is_safetensors_not_pickle(tiny_tokenizer, tmp_path):
    save_model_dir(make_model(vocab_size=tiny_tokenizer.vocab_size), tiny_tokenizer, tmp_path)
    raw = (tmp_path / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + header_len])
    assert "tok_emb.weight" in header and "lm_head.weight" not in header  # tied weight stored once
    assert not raw.startswith(b"\x80")  # not a pickle stream


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_incomplete_directory_is_a_clear_error(tiny_tokenizer, tmp_path, missing):
    save_model_dir(make_model(vocab_size=tiny_tokenizer.vocab_size), tiny_tokenizer, tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        load_model_dir(tmp_path)


def test_tokenizer_larger_than_model_vocab_is_rejected(tiny_tokenizer, tmp_path):
    save_model_dir(make_model(vocab_size=50), tiny_tokenizer, tmp_path)
    with pytest.raises(ValueError, match="tokenizer has"):
        load_model_dir(tmp_path)
