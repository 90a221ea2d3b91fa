"""Sliding-window attention and Gemma 2's pieces, each against transformers' own module or function: the
window mask, the attention scale with soft-capped scores, RMSNorm with Gemma's offset weight, GeGLU,
scaled embeddings and soft-capped logits; and the windowed decoder's cache against a full forward."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.masking_utils import sliding_window_causal_mask_function  # noqa: E402
from transformers.models.gemma2 import modeling_gemma2  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402

from model.attention import MultiHeadAttention, sliding_window_mask  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.gpt import FeedForward  # noqa: E402
from model.norm import RMSNorm  # noqa: E402
from model.rotary import RotaryEmbedding  # noqa: E402
from tests.conftest import LLAMA, make_model  # noqa: E402

GEMMA = dict(LLAMA, qkv_bias=False, mlp="geglu", activation="gelu_tanh", post_norms=True, scale_embeddings=True,
             attn_scale=24 ** -0.5, attn_softcap=4.0, final_softcap=3.0)


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("t_query,t_key", [(12, 12), (1, 12), (4, 20)])
def test_the_window_mask_is_transformers(window, t_query, t_key):
    want_fn = sliding_window_causal_mask_function(window)
    offset = t_key - t_query
    want = torch.tensor([[bool(want_fn(0, 0, torch.tensor(offset + i), torch.tensor(j))) for j in range(t_key)]
                         for i in range(t_query)])
    got = sliding_window_mask(t_query, t_key, window)
    assert torch.equal(got, want)
    assert (got.sum(-1) <= window).all() and got[-1].sum() == min(window, t_key)


@torch.no_grad()
def test_scaled_soft_capped_attention_is_gemma2s():
    """Our explicit attention with `scale` and `softcap` against transformers' Gemma 2 eager attention."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, n_kv_head=2, bias=False, scale=24 ** -0.5, softcap=4.0).eval()
    q, k, v = torch.randn(2, 4, 10, 8) * 3, torch.randn(2, 2, 10, 8) * 3, torch.randn(2, 2, 10, 8)
    mask = sliding_window_mask(10, 10, 4)
    additive = torch.zeros(10, 10).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
    module = type("Module", (), {"num_key_value_groups": 2, "training": False, "head_dim": 8})()
    want, _ = modeling_gemma2.eager_attention_forward(module, q, k, v, additive, scaling=24 ** -0.5, softcap=4.0)
    mha.out_proj.weight.copy_(torch.eye(32))
    got = mha.attend(q, k, v, mask[None, None], is_causal=False)
    torch.testing.assert_close(got, want.reshape(2, 10, 32), atol=1e-6, rtol=0)


@torch.no_grad()
def test_rmsnorm_with_the_weight_plus_one_is_gemmas_norm_bit_for_bit():
    torch.manual_seed(1)
    theirs = modeling_gemma2.Gemma2RMSNorm(64, eps=1e-6)
    theirs.weight.normal_(0, 0.3)
    ours = RMSNorm(64, eps=1e-6)
    ours.weight.copy_(theirs.weight.float() + 1.0)
    x = torch.randn(3, 7, 64) * 5
    assert torch.equal(ours(x), theirs(x))


@torch.no_grad()
def test_geglu_is_gemma2s_mlp():
    config = GPTConfig(d_model=32, n_head=4, d_ff=48, bias=False, mlp="geglu", activation="gelu_tanh")
    ours = FeedForward(config)
    theirs = modeling_gemma2.Gemma2MLP(transformers.Gemma2Config(hidden_size=32, intermediate_size=48,
                                                                  hidden_activation="gelu_pytorch_tanh"))
    theirs.gate_proj.weight.copy_(ours.fc_gate.weight)
    theirs.up_proj.weight.copy_(ours.fc_in.weight)
    theirs.down_proj.weight.copy_(ours.fc_out.weight)
    x = torch.randn(2, 5, 32)
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_scaled_embeddings_are_gemma2s(dtype):
    """The factor √d_model rounded to the weights' dtype first, as Gemma does (in bfloat16, √32 is 5.65625)."""
    model = make_model(**GEMMA, n_layer=1).to(dtype)
    theirs = modeling_gemma2.Gemma2TextScaledWordEmbedding(97, 32, 0, embed_scale=32 ** 0.5).to(dtype)
    theirs.weight.copy_(model.tok_emb.weight)
    ids = torch.randint(0, 97, (2, 6))
    seen = []
    handle = model.blocks[0].ln_1.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model(ids)
    handle.remove()
    assert torch.equal(seen[0], theirs(ids))


@torch.no_grad()
def test_final_logits_are_soft_capped():
    capped = make_model(**{**GEMMA, "final_softcap": 0.2})  # a random model's logits are small
    plain = make_model(**{**GEMMA, "final_softcap": None})
    ids = torch.randint(0, 97, (2, 9))
    raw = plain(ids)
    assert raw.abs().max() > 0.2  # the cap is reached
    torch.testing.assert_close(capped(ids), torch.tanh(raw / 0.2) * 0.2)


@torch.no_grad()
def test_each_layer_kind_takes_gemma3s_rotary():
    """Gemma 3's rotary per layer kind: global layers rope_theta with its linear scaling, sliding ones their own
    base, unscaled; our RotaryEmbedding of `config.rope_of(layer)` against transformers' for that layer type."""
    hf_config = transformers.Gemma3TextConfig(
        hidden_size=64, num_attention_heads=2, head_dim=32, num_hidden_layers=2, sliding_window_pattern=2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    theirs = modeling_gemma3.Gemma3RotaryEmbedding(hf_config)
    config = GPTConfig(n_layer=2, d_model=64, n_head=2, head_dim=32, pos_encoding="rotary", rope_theta=1_000_000.0,
                       rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_theta=10_000.0,
                       sliding_window=16, layer_types=list(hf_config.layer_types))
    positions = torch.arange(300)[None]
    for layer, kind in enumerate(hf_config.layer_types):
        cos, sin = RotaryEmbedding(32, *config.rope_of(layer))(positions)
        want_cos, want_sin = theirs(torch.zeros(1, 300, 64), positions, kind)
        torch.testing.assert_close((cos[:, 0], sin[:, 0]), (want_cos, want_sin), atol=1e-6, rtol=0)
    assert config.rope_of(0) != config.rope_of(1)


@pytest.mark.parametrize("overrides", [
    dict(LLAMA, sliding_window=5),
    dict(LLAMA, n_layer=3, sliding_window=5, layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    dict(GEMMA, n_layer=3, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    dict(GEMMA, n_layer=3, sliding_window=5, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
         head_dim=16, qk_norm=True, rope_theta=1_000_000.0, rope_local_theta=10_000.0, attn_softcap=None,
         final_softcap=None),
], ids=["every-layer", "some-layers", "gemma2", "gemma3"])
@torch.no_grad()
def test_windowed_decoding_from_the_cache_equals_a_full_forward(overrides):
    model = make_model(**overrides)
    assert [b.window for b in model.blocks] == [model.config.window(i) for i in range(model.config.n_layer)]
    torch.manual_seed(3)
    ids = torch.randint(0, 97, (2, 20))
    cache = model.new_kv_cache(2)
    steps = [model(ids[:, :9], kv_cache=cache)]
    for t in range(9, 20):
        steps.append(model(ids[:, t:t + 1], kv_cache=cache))
    full = model(ids)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    if model.config.rope_local_theta is None:  # else the windowed layers also rotate otherwise
        unwindowed = make_model(**{**overrides, "sliding_window": None, "layer_types": None})
        assert not torch.allclose(unwindowed(ids)[:, 6:], full[:, 6:], atol=1e-3)  # the window changes what is seen
        torch.testing.assert_close(unwindowed(ids)[:, :5], full[:, :5], atol=1e-5, rtol=0)  # but not inside it


@torch.no_grad()
def test_a_left_padded_row_sees_the_same_window_as_alone():
    model = make_model(**dict(LLAMA, sliding_window=4))
    ids = torch.randint(0, 97, (1, 12))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded, attention_mask=mask)[:, 5:], model(ids), atol=1e-5, rtol=0)


def test_layer_types_must_name_every_layer_with_known_kinds():
    with pytest.raises(ValueError, match="layer_types names 1 layers"):
        GPTConfig(n_layer=2, sliding_window=4, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="layer_types must be among"):
        GPTConfig(n_layer=1, sliding_window=4, layer_types=["chunked_attention"])
    assert math.isclose(GPTConfig(d_model=64, n_head=4).scale, 0.25)
