"""BART import parity: a random BartForConditionalGeneration built with transformers, saved locally,
imported, and compared logit for logit and token for token, alone and batched; then our encoder-decoder
exported back as BART and loaded by transformers."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_seq2seq_dir  # noqa: E402
from model.export_hf import export_hf  # noqa: E402
from model.hf_bart import Unsupported  # noqa: E402
from model.import_hf import import_hf, main  # noqa: E402
from tests.conftest import make_lively_seq2seq  # noqa: E402

SENTENCES = ["Tomorrow, and tomorrow, and tomorrow,", "Ham.", "To be, or not to be, that is the question"]


def byte_level_bart_tokenizer():
    """A byte-level BPE with BART's specials (<s> 0, <pad> 1, </s> 2, <unk> 3) and its post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from tests.conftest import TINY_TEXTS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TINY_TEXTS, trainer=trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tok


@pytest.fixture(scope="module")
def random_bart(tmp_path_factory):
    """(transformers model, its directory): weights at std 0.5 so greedy output varies with the source."""
    path = tmp_path_factory.mktemp("bart")
    tok = byte_level_bart_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=tok.get_vocab_size(), d_model=32, encoder_layers=2, decoder_layers=3,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=48, init_std=0.5,
                                     activation_function="gelu", scale_embedding=True)
    hf = transformers.BartForConditionalGeneration(config).eval()
    with torch.no_grad():
        hf.final_logits_bias.normal_(std=0.1)
    hf.save_pretrained(path)
    return hf, path


def padded(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tok.encode(t) for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [1] * (width - len(r)) for r in rows])  # BART's <pad> is 1
    return ids, (ids != 1).long()


def hf_greedy(hf, ids, mask, n: int) -> list[list[int]]:
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, num_beams=1,
                      min_length=0, forced_bos_token_id=None, forced_eos_token_id=None,
                      decoder_start_token_id=hf.config.decoder_start_token_id)
    rows = []
    for row in out[:, 1:].tolist():  # after the decoder start token; up to and with EOS, then HF's padding
        rows.append(row[:row.index(2) + 1] if 2 in row else row)
    return rows


def test_imported_bart_matches_transformers(random_bart, tmp_path):
    hf, path = random_bart
    import_hf(path, tmp_path / "ours")
    ours, tok = load_seq2seq_dir(tmp_path / "ours")
    c = ours.config
    assert (c.n_encoder_layer, c.n_decoder_layer, c.d_model, c.n_head, c.position_offset, c.architecture) == (
        2, 3, 32, 4, 2, "bart")
    assert (c.norm_placement, c.embedding_norm, c.final_logits_bias, c.scale_embedding) == ("post", True, True, True)
    assert tok.encode("Ham.")[0] == 0 and tok.encode("Ham.")[-1] == 2  # <s> ... </s>, as BART's tokenizer adds
    ids, mask = padded(tok, SENTENCES)
    tgt = torch.tensor([[2, 0, 40, 41, 42], [2, 0, 7, 7, 9], [2, 0, 100, 5, 6]])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=tgt).logits
        got = ours(ids, tgt, mask)
    assert (got - want).abs().max().item() <= 1e-4
    batched = ours.generate(ids, mask, 24)
    assert batched == hf_greedy(hf, ids, mask, 24)
    # a random post-LN BART repeats one token whatever its source; the sources still pick which
    assert len({tuple(r) for r in batched}) > 1
    for i, text in enumerate(SENTENCES):  # alone, no padding: the same tokens
        alone = torch.tensor([tok.encode(text)])
        assert ours.generate(alone, max_new_tokens=24)[0] == batched[i]


def test_our_encoder_decoder_exports_as_bart(tmp_path):
    from model.checkpoint import save_model_dir
    from model.g2p_data import g2p_tokenizer

    tokenizer = g2p_tokenizer()
    model = make_lively_seq2seq(tokenizer.vocab_size, activation="gelu", norm_placement="post",
                                tie_embeddings=True)  # sinusoidal positions, post-LN: what BART expresses
    save_model_dir(model, tokenizer, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["BartForConditionalGeneration"]
    hf = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    src = torch.tensor([tokenizer.encode("transformer"), tokenizer.encode("cat") + [0] * 8])
    mask = (src != 0).long()
    tgt = torch.tensor([[1, 50, 51, 60], [1, 44, 45, 46]])
    with torch.no_grad():
        assert (hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
                - model(src, tgt, mask)).abs().max().item() <= 1e-4
    # and back: the round trip keeps the weights
    import_hf(tmp_path / "hf", tmp_path / "again")
    again, _ = load_seq2seq_dir(tmp_path / "again")
    with torch.no_grad():
        assert (again(src, tgt, mask) - model(src, tgt, mask)).abs().max().item() <= 1e-5


def test_what_bart_cannot_express_is_refused(tmp_path, random_bart, capsys):
    from model.checkpoint import save_model_dir
    from model.g2p_data import g2p_tokenizer

    tokenizer = g2p_tokenizer()
    save_model_dir(make_lively_seq2seq(tokenizer.vocab_size, norm_placement="pre"), tokenizer, tmp_path / "pre")
    with pytest.raises(Unsupported, match="post-LN"):
        export_hf(tmp_path / "pre", tmp_path / "hf")
    _, path = random_bart
    config = json.loads((path / "config.json").read_text())
    odd = tmp_path / "odd"
    odd.mkdir()
    for f in path.iterdir():
        (odd / f.name).write_bytes(f.read_bytes())
    (odd / "config.json").write_text(json.dumps({**config, "decoder_ffn_dim": 128}))
    assert main([str(odd), "-o", str(tmp_path / "out")]) == 2
    assert "feed-forward widths" in capsys.readouterr().err
