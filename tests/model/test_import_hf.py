"""GPT-2 import parity: a random transformers.GPT2LMHeadModel, saved locally, imported, compared."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model_dir  # noqa: E402
from model.generate import generate  # noqa: E402
from model.hf.import_hf import import_hf  # noqa: E402


def save_random_gpt2(path, tokenizer, safe_serialization=True, **overrides):
    fields = dict(vocab_size=tokenizer.vocab_size, n_positions=96, n_embd=48, n_layer=3, n_head=4,
                  eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.eos_id)
    fields.update(overrides)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields)).eval()
    hf.save_pretrained(path)
    if not safe_serialization:  # the legacy pickle format, as older checkpoints ship it
        (path / "model.safetensors").unlink()
        torch.save(hf.state_dict(), path / "pytorch_model.bin")
    return hf


@pytest.mark.parametrize("weights", ["safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize("tokenizer_files", ["tokenizer.json", "vocab+merges"])
def test_imported_gpt2_matches_transformers(tiny_tokenizer, tmp_path, weights, tokenizer_files):
    src = tmp_path / "hf"
    hf = save_random_gpt2(src, tiny_tokenizer, safe_serialization=weights == "safetensors")
    if tokenizer_files == "tokenizer.json":
        tiny_tokenizer.save(src / "tokenizer.json")
    else:
        tiny_tokenizer.hf.model.save(str(src))  # vocab.json + merges.txt
    assert (src / ("model.safetensors" if weights == "safetensors" else "pytorch_model.bin")).exists()

    import_hf(src, tmp_path / "ours")
    ours, tok = load_model_dir(tmp_path / "ours")
    assert (ours.config.n_layer, ours.config.n_head, ours.config.d_model, ours.config.n_ctx) == (3, 4, 48, 96)

    text = "Tomorrow, and tomorrow, and tomorrow"
    assert tok.encode(text) == tiny_tokenizer.encode(text)
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert (got - expected).abs().max().item() <= 1e-4

    hf_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                            do_sample=False, pad_token_id=tok.eos_id)[0, ids.size(1):].tolist()
    our_tokens = generate(ours, [ids[0].tolist()], 32, temperature=0.0)[0]
    assert our_tokens == hf_tokens and len(our_tokens) == 32


def test_left_padded_batch_matches_transformers(tiny_tokenizer, tmp_path):
    hf = save_random_gpt2(tmp_path / "hf", tiny_tokenizer)
    tiny_tokenizer.save(tmp_path / "hf" / "tokenizer.json")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    ours, _ = load_model_dir(tmp_path / "ours")
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max().item() <= 1e-4


def test_unsupported_checkpoint_is_rejected(tiny_tokenizer, tmp_path):
    save_random_gpt2(tmp_path / "hf", tiny_tokenizer, activation_function="relu")
    tiny_tokenizer.save(tmp_path / "hf" / "tokenizer.json")
    with pytest.raises(ValueError, match="activation_function"):
        import_hf(tmp_path / "hf", tmp_path / "ours")


def test_missing_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10, "n_layer": 1, "n_head": 1, "n_embd": 4}')
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        import_hf(tmp_path, tmp_path / "ours")
