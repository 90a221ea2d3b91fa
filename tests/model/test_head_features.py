"""The per-head choices of the newer Llama-family models, each against transformers' own attention module on
the same weights: a head width of its own and RMSNorm on each query and key head (Qwen3), rotary positions on
the leading share of each head with fused projections (Phi-3/4), and blocks without rotary positions
(SmolLM3)."""

from __future__ import annotations

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.rotary import RotaryEmbedding, apply_rotary

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2,
             max_position_embeddings=64, rms_norm_eps=1e-6, vocab_size=97)


def our_decoder(hf_config, **fields) -> GPT:
    c = hf_config
    config = GPTConfig(vocab_size=c.vocab_size, n_ctx=c.max_position_embeddings, n_layer=c.num_hidden_layers,
                       n_head=c.num_attention_heads, n_kv_head=c.num_key_value_heads, d_model=c.hidden_size,
                       d_ff=c.intermediate_size, bias=False, layer_norm_eps=c.rms_norm_eps, norm="rmsnorm",
                       pos_encoding="rotary", rope_theta=c.rope_parameters["rope_theta"], mlp="swiglu",
                       tie_embeddings=False, **fields)
    return GPT(config).eval()


def randomize(module: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)  # norm weights around 1, so each one matters


def our_attention(model: GPT, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Block `layer`'s attention on x (B, T, d_model), causal, positions 0..T-1: what `TransformerBlock` does
    before its residual add."""
    attn = model.blocks[layer].attn
    q, k, v = attn.project_qkv(x)
    if model.config.uses_rotary(layer):
        cos, sin = model.rotary(torch.arange(x.size(1)).expand(x.size(0), -1))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return attn.attend(q, k, v, None, is_causal=True)


def hf_attention(hf_attn, rotary, x: torch.Tensor) -> torch.Tensor:
    position_ids = torch.arange(x.size(1)).expand(x.size(0), -1)
    mask = torch.full((x.size(1), x.size(1)), float("-inf")).triu(1)[None, None]  # additive causal mask
    return hf_attn(x, rotary(x, position_ids), mask)[0]


@torch.no_grad()
def test_qwen3_attention_with_its_own_head_width_and_query_key_norms_equals_transformers():
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    hf_config = transformers.Qwen3Config(**SHAPE, head_dim=32, attn_implementation="eager")  # 4 x 32 = 128 != 64
    hf_attn = qwen3.Qwen3Attention(hf_config, layer_idx=0).eval()
    randomize(hf_attn)
    model = our_decoder(hf_config, head_dim=32, qk_norm=True)
    attn = model.blocks[0].attn
    assert (attn.d_head, attn.d_inner, attn.out_proj.weight.shape) == (32, 128, (64, 128))
    attn.qkv_proj.weight.copy_(torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight]))
    attn.out_proj.weight.copy_(hf_attn.o_proj.weight)
    attn.q_norm.weight.copy_(hf_attn.q_norm.weight)
    attn.k_norm.weight.copy_(hf_attn.k_norm.weight)
    x = torch.randn(2, 9, 64)
    want = hf_attention(hf_attn, qwen3.Qwen3RotaryEmbedding(hf_config), x)
    torch.testing.assert_close(our_attention(model, 0, x), want, atol=1e-5, rtol=1e-5)
    attn.q_norm.weight.fill_(1.0)  # the norm is really applied: other weights, other result
    assert not torch.allclose(our_attention(model, 0, x), want, atol=1e-3)


@torch.no_grad()
def test_query_key_norm_is_transformers_rmsnorm_per_head():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    model = our_decoder(transformers.Qwen3Config(**SHAPE), qk_norm=True)
    attn = model.blocks[0].attn
    hf_norm = Qwen3RMSNorm(16, eps=1e-6)
    randomize(hf_norm)
    attn.k_norm.weight.copy_(hf_norm.weight)
    x = torch.randn(3, 5, 64) * 4
    _, k, _ = attn.project_qkv(x)  # (B, H_kv, T, D), normalised
    raw = x @ attn.qkv_proj.weight[64:96].T  # the keys before the norm, (B, T, H_kv·D)
    torch.testing.assert_close(k, hf_norm(raw.view(3, 5, 2, 16)).transpose(1, 2), atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_partial_rotary_and_fused_projections_equal_transformers_phi3():
    from transformers.models.phi3 import modeling_phi3 as phi3

    hf_config = transformers.Phi3Config(**SHAPE, partial_rotary_factor=0.75, attn_implementation="eager",
                                        pad_token_id=0)
    hf_attn = phi3.Phi3Attention(hf_config, layer_idx=0).eval()
    randomize(hf_attn)
    model = our_decoder(hf_config, rotary_fraction=0.75)
    assert model.config.rotary_dim == 12 and model.rotary.inv_freq.shape[-1] == 6  # 12 of each head's 16
    attn = model.blocks[0].attn
    attn.qkv_proj.weight.copy_(hf_attn.qkv_proj.weight)  # Phi-3's fused layout is ours: queries, keys, values
    attn.out_proj.weight.copy_(hf_attn.o_proj.weight)
    x = torch.randn(2, 11, 64)
    rotary = phi3.Phi3RotaryEmbedding(hf_config)
    torch.testing.assert_close(our_attention(model, 0, x), hf_attention(hf_attn, rotary, x), atol=1e-5, rtol=1e-5)
    cos, sin = rotary(x, torch.arange(11)[None])
    ours_cos, ours_sin = model.rotary(torch.arange(11)[None])
    torch.testing.assert_close((ours_cos[:, 0], ours_sin[:, 0]), (cos, sin), atol=0, rtol=0)


def test_partial_rotary_turns_the_leading_dimensions_and_keeps_the_rest():
    torch.manual_seed(1)
    x = torch.randn(1, 2, 3, 16)
    cos, sin = RotaryEmbedding(12)(torch.tensor([[5, 6, 7]]))
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y[..., 12:], x[..., 12:], atol=0, rtol=0)
    torch.testing.assert_close(y[..., :12], apply_rotary(x[..., :12], cos, sin), atol=0, rtol=0)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation


@torch.no_grad()
def test_a_smollm3_block_without_rotary_positions_equals_transformers():
    from transformers.models.smollm3 import modeling_smollm3 as smollm3

    hf_config = transformers.SmolLM3Config(**SHAPE, no_rope_layers=[1, 0], attn_implementation="eager",
                                           pad_token_id=0)
    model = our_decoder(hf_config, no_rotary_layers=[1])
    rotary = smollm3.SmolLM3RotaryEmbedding(hf_config)
    x = torch.randn(2, 7, 64)
    for layer, uses_rope in enumerate((True, False)):
        hf_attn = smollm3.SmolLM3Attention(hf_config, layer_idx=layer).eval()
        assert bool(hf_attn.use_rope) == uses_rope == model.config.uses_rotary(layer)
        randomize(hf_attn)
        attn = model.blocks[layer].attn
        attn.qkv_proj.weight.copy_(torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight]))
        attn.out_proj.weight.copy_(hf_attn.o_proj.weight)
        torch.testing.assert_close(our_attention(model, layer, x), hf_attention(hf_attn, rotary, x), atol=1e-5,
                                   rtol=1e-5)


@torch.no_grad()
def test_decoding_from_the_cache_equals_a_full_forward_with_every_feature():
    model = GPT(GPTConfig(vocab_size=97, n_ctx=32, n_layer=3, n_head=4, n_kv_head=2, d_model=32, head_dim=16,
                          qk_norm=True, rotary_fraction=0.5, no_rotary_layers=[1], bias=False, norm="rmsnorm",
                          pos_encoding="rotary", mlp="swiglu")).eval()
    ids = torch.randint(0, 97, (2, 12))
    cache = model.new_kv_cache(2)
    assert cache.k.shape == (3, 2, 2, 32, 16)  # the model's own head width
    steps = [model(ids[:, :7], kv_cache=cache)] + [model(ids[:, t:t + 1], kv_cache=cache) for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), model(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fields, message", [
    (dict(head_dim=10, rotary_fraction=0.3), "even rotated width, got 3"),
    (dict(rotary_fraction=0.0), r"rotary_fraction must be in \(0, 1\]"),
    (dict(no_rotary_layers=[2]), r"no_rotary_layers \[2\] must be block indices below n_layer=2"),
    (dict(no_rotary_layers=[0], pos_encoding="learned"), "need pos_encoding='rotary'"),
])
def test_inconsistent_head_settings_are_refused(fields, message):
    base = dict(n_layer=2, n_head=4, d_model=30, head_dim=8, pos_encoding="rotary")  # 30 / 4 is no width
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**base, **fields})
    GPTConfig(**base)
