"""The encoder-decoder Transformer: hand-computable cases, the masks, cached against uncached decoding,
cross-attention keys and values computed once per source, and every configuration choice."""

from __future__ import annotations

import itertools

import pytest
import torch

from model.checkpoint import load_model_dir, load_seq2seq_dir, save_model_dir
from model.gpt import sinusoidal_table
from model.seq2seq import EncoderDecoder
from model.seq2seq_config import Seq2SeqConfig
from service.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.needs_torch("builds models in PyTorch")

CHOICES = list(itertools.product(("post", "pre"), ("sinusoidal", "learned"), (True, False)))


def tiny(**overrides) -> EncoderDecoder:
    torch.manual_seed(0)
    fields = dict(vocab_size=40, n_src_ctx=12, n_tgt_ctx=10, n_encoder_layer=2, n_decoder_layer=2, n_head=2,
                  d_model=16, d_ff=32, pad_token_id=0, decoder_start_token_id=1, eos_token_id=2)
    return EncoderDecoder(Seq2SeqConfig(**{**fields, **overrides})).eval()


def sources() -> tuple[torch.Tensor, torch.Tensor]:
    """Two sources, the second padded: lengths 7 and 4."""
    src = torch.tensor([[5, 9, 11, 3, 17, 8, 21], [6, 13, 4, 30, 0, 0, 0]])
    return src, (src != 0).long()


# ---- hand-computable cases ---------------------------------------------------------------------------

def test_the_sinusoidal_table_is_the_papers():
    t = sinusoidal_table(50, 8)
    assert torch.equal(t[0], torch.tensor([0.0, 1.0] * 4))
    pos, i = 7, 1  # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)
    assert t[pos, 2 * i].item() == pytest.approx(torch.sin(torch.tensor(pos / 10000 ** (2 * i / 8))).item(), abs=1e-6)
    assert t[pos, 2 * i + 1].item() == pytest.approx(torch.cos(torch.tensor(pos / 10000 ** (2 * i / 8))).item(), abs=1e-6)


def test_cross_attention_over_one_source_token_returns_its_projected_value():
    """softmax over a single key is 1: whatever the query, the output is W_O · V of that token."""
    attn = tiny().decoder[0].cross_attn
    memory = torch.randn(1, 1, 16)
    k, v = attn.project_kv(memory)
    for query in (torch.randn(1, 3, 16), torch.randn(1, 3, 16) * 10):
        got = attn.attend(attn.project_q(query), k, v, None, is_causal=False)
        want = attn.out_proj(v.transpose(1, 2).reshape(1, 1, 16)).expand(1, 3, 16)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cross_attention_over_equal_keys_averages_the_values():
    attn = tiny().decoder[0].cross_attn
    k = torch.ones(1, 2, 4, 8)  # four identical keys per head: uniform weights
    v = torch.randn(1, 2, 4, 8)
    got = attn.attend(attn.project_q(torch.randn(1, 2, 16)), k, v, None, is_causal=False)
    want = attn.out_proj(v.mean(dim=2, keepdim=True).transpose(1, 2).reshape(1, 1, 16)).expand(1, 2, 16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- masks -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm,pos,shared", CHOICES)
def test_a_padded_source_position_gets_zero_weight(norm, pos, shared):
    """Whatever the padded positions hold, the real positions' encodings and every logit stay the same,
    and a padded source decodes as it does alone."""
    model = tiny(norm_placement=norm, pos_encoding=pos, share_embeddings=shared)
    src, mask = sources()
    tgt = torch.tensor([[1, 7, 12], [1, 25, 3]])
    other = src.clone()
    other[1, 4:] = torch.tensor([33, 14, 9])
    with torch.no_grad():
        a, b = model.encode(src, mask), model.encode(other, mask)
        torch.testing.assert_close(a[1, :4], b[1, :4], atol=1e-6, rtol=0)
        torch.testing.assert_close(model(src, tgt, mask), model(other, tgt, mask), atol=1e-6, rtol=0)
        alone = model(src[1:, :4], tgt[1:])
        torch.testing.assert_close(model(src, tgt, mask)[1:], alone, atol=1e-5, rtol=1e-5)
    assert model.generate(src, mask)[1] == model.generate(src[1:, :4])[0]


def test_the_decoder_is_causal():
    model = tiny()
    src, mask = sources()
    tgt = torch.tensor([[1, 7, 12, 5], [1, 25, 3, 9]])
    changed = tgt.clone()
    changed[:, 2:] = torch.tensor([[30, 31], [32, 33]])
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt, mask)[:, :2], model(src, changed, mask)[:, :2], atol=0, rtol=0)


# ---- cached decoding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("norm,pos,shared", CHOICES)
def test_cached_decoding_equals_uncached(norm, pos, shared):
    model = tiny(norm_placement=norm, pos_encoding=pos, share_embeddings=shared, tie_embeddings=not shared)
    src, mask = sources()
    with torch.no_grad():
        cross = model.cross_kv(model.encode(src, mask))
        tgt = torch.tensor([[1, 7, 12, 5, 19], [1, 25, 3, 9, 2]])
        whole = model.decode(tgt, cross, mask)
        cache = model.new_kv_cache(2)
        steps = torch.cat([model.decode(tgt[:, i:i + 1], cross, mask, cache) for i in range(tgt.size(1))], dim=1)
    torch.testing.assert_close(steps, whole, atol=1e-5, rtol=1e-5)
    assert model.generate(src, mask, 8) == model.generate(src, mask, 8, use_cache=False)


def test_cross_attention_keys_and_values_are_computed_once_per_source(monkeypatch):
    model = tiny()
    calls = []
    for layer in model.decoder:
        original = layer.cross_attn.project_kv
        monkeypatch.setattr(layer.cross_attn, "project_kv", lambda m, f=original: calls.append(m.shape) or f(m))
    src, mask = sources()
    out = model.generate(src, mask, max_new_tokens=9)
    assert max(map(len, out)) > 1  # several decoder steps ran
    assert calls == [(2, 7, 16)] * model.config.n_decoder_layer  # one projection per layer, for the whole batch


def test_generation_stops_at_eos_and_at_the_target_context():
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    src, mask = sources()
    # all logits equal: argmax is id 0, never EOS, so both rows run to the context (start token + 9)
    assert model.generate(src, mask) == [[0] * 9, [0] * 9]
    with pytest.raises(ValueError, match="n_src_ctx"):
        model.encode(torch.ones(1, 13, dtype=torch.long))


# ---- configurations and model directories ------------------------------------------------------------

def test_each_choice_changes_the_model():
    base = tiny()
    counts = {name: tiny(**{name: value}).num_parameters() for name, value in (
        ("share_embeddings", False), ("tie_embeddings", False), ("pos_encoding", "learned"))}
    assert all(n > base.num_parameters() for n in counts.values())
    assert not hasattr(base, "enc_norm") and hasattr(tiny(norm_placement="pre"), "enc_norm")
    src, mask = sources()
    tgt = torch.tensor([[1, 7], [1, 25]])
    with torch.no_grad():
        scaled, unscaled = tiny()(src, tgt, mask), tiny(scale_embedding=False)(src, tgt, mask)
    assert not torch.allclose(scaled, unscaled)
    with pytest.raises(ValueError, match="norm_placement"):
        Seq2SeqConfig(norm_placement="sandwich")


def test_a_model_directory_round_trips(tmp_path, tiny_tokenizer):
    model = tiny(share_embeddings=False, pos_encoding="learned", final_logits_bias=True, embedding_norm=True)
    with torch.no_grad():
        model.logits_bias.normal_()
    save_model_dir(model, tiny_tokenizer(40), tmp_path / "m")
    loaded, _ = load_seq2seq_dir(tmp_path / "m")
    src, mask = sources()
    tgt = torch.tensor([[1, 7], [1, 25]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, tgt, mask), model(src, tgt, mask), atol=0, rtol=0)
    with pytest.raises(ValueError, match="encoder-decoder"):
        load_model_dir(tmp_path / "m")


@pytest.fixture
def tiny_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    def make(n: int) -> Tokenizer:
        return Tokenizer(HFTokenizer(WordLevel({f"t{i}": i for i in range(n)}, unk_token="t3")), eos_id=2)

    return make
