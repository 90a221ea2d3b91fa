"""The Llama-family pieces, each against a reference written the slow way: grouped-query attention
against per-head loops, rotary positions against their defining property, RMSNorm and SwiGLU against
their formulas, and the whole decoder's cache (KV heads only) against a full forward."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import MultiHeadAttention, scaled_dot_product_attention
from model.norm import RMSNorm
from model.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies
from tests.conftest import LLAMA, make_model


def naive_gqa(mha: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Causal self-attention head by head: query head h uses key/value head h // (H / H_kv)."""
    B, T, _ = x.shape
    H, H_kv, D = mha.n_head, mha.n_kv_head, mha.d_head
    w, b = mha.qkv_proj.weight, mha.qkv_proj.bias
    qkv = x @ w.T + (0 if b is None else b)
    q, k, v = qkv[..., :H * D], qkv[..., H * D:(H + H_kv) * D], qkv[..., (H + H_kv) * D:]
    heads = []
    for h in range(H):
        g = h // (H // H_kv)
        qh, kh, vh = q[..., h * D:(h + 1) * D], k[..., g * D:(g + 1) * D], v[..., g * D:(g + 1) * D]
        out = torch.zeros(B, T, D)
        for t in range(T):
            scores = (qh[:, t:t + 1] @ kh[:, :t + 1].transpose(1, 2)) / math.sqrt(D)  # (B, 1, t+1)
            out[:, t] = (torch.softmax(scores, dim=-1) @ vh[:, :t + 1])[:, 0]
        heads.append(out)
    return mha.out_proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("use_sdpa", [True, False], ids=["sdpa", "explicit"])
@torch.no_grad()
def test_grouped_query_attention_equals_per_head_loops(n_kv_head, use_sdpa):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, n_kv_head=n_kv_head, use_sdpa=use_sdpa, qkv_bias=True).eval()
    assert mha.qkv_proj.weight.shape == ((4 + 2 * n_kv_head) * 8, 32)
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(mha(x, is_causal=True), naive_gqa(mha, x), atol=1e-5, rtol=0)


def test_a_kv_head_count_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match="n_kv_head=3 must divide n_head=4"):
        MultiHeadAttention(32, 4, n_kv_head=3)


@torch.no_grad()
def test_rotary_scores_depend_on_the_offset_alone():
    """q·k after rotating q to position p and k to position p' is a function of p - p'."""
    torch.manual_seed(1)
    rope = RotaryEmbedding(16, theta=10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(p: int, p_key: int) -> float:
        cq, sq = rope(torch.tensor([[p]]))
        ck, sk = rope(torch.tensor([[p_key]]))
        return float((apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum())

    assert score(9, 4) == pytest.approx(score(105, 100), abs=1e-4)
    assert score(9, 4) != pytest.approx(score(9, 5), abs=1e-3)
    cos, sin = rope(torch.tensor([[0]]))  # position 0 is the identity
    torch.testing.assert_close(apply_rotary(q, cos, sin), q)


def test_rotary_pairs_the_two_halves():
    """Rotate-half convention: dimension i pairs with i + d/2, and pair i turns by p·theta^(-2i/d)."""
    d, p, theta = 8, 3, 100.0
    x = torch.zeros(1, 1, 1, d)
    x[..., 1] = 1.0  # the first coordinate of pair 1
    cos, sin = RotaryEmbedding(d, theta)(torch.tensor([[p]]))
    y = apply_rotary(x, cos, sin)[0, 0, 0]
    angle = p * theta ** (-2 / d)
    expected = torch.zeros(d)
    expected[1], expected[1 + d // 2] = math.cos(angle), math.sin(angle)
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)


def test_rope_scaling_linear_and_llama3():
    base = inverse_frequencies(64, 500000.0)
    torch.testing.assert_close(inverse_frequencies(64, 500000.0, {"rope_type": "linear", "factor": 4.0}), base / 4)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    scaled = inverse_frequencies(64, 500000.0, llama3)
    wavelen = 2 * math.pi / base
    torch.testing.assert_close(scaled[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high frequencies kept
    torch.testing.assert_close(scaled[wavelen > 8192], base[wavelen > 8192] / 8)  # low ones divided
    middle = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert middle.any() and ((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all()
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported"):
        inverse_frequencies(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_rope_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=llama3,
                                      max_position_embeddings=131072)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(inverse_frequencies(64, 500000.0, llama3), want, atol=0, rtol=0)


def test_rmsnorm_is_the_formula():
    torch.manual_seed(2)
    norm = RMSNorm(6, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6))
    x = torch.randn(3, 6)
    expected = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    assert not hasattr(norm, "bias")


@torch.no_grad()
def test_swiglu_feed_forward_is_down_of_silu_gate_times_up():
    model = make_model(**LLAMA)
    ffn = model.blocks[0].ffn
    x = torch.randn(2, 5, 32)
    gate, up = x @ ffn.fc_gate.weight.T, x @ ffn.fc_in.weight.T
    torch.testing.assert_close(ffn(x), (gate * torch.sigmoid(gate) * up) @ ffn.fc_out.weight.T)
    assert ffn.fc_in.bias is None and ffn.fc_in.weight.shape == (80, 32)


@torch.no_grad()
def test_the_cache_holds_only_the_kv_heads_and_decoding_from_it_equals_a_full_forward():
    model = make_model(**LLAMA)
    torch.manual_seed(3)
    ids = torch.randint(0, 97, (2, 20))
    cache = model.new_kv_cache(2)
    assert cache.k.shape == (2, 2, 2, 64, 8)  # (layers, batch, KV heads = 2 of 4, context, d_head)
    steps = [model(ids[:, :12], kv_cache=cache)]
    for t in range(12, 20):
        steps.append(model(ids[:, t:t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), model(ids), atol=1e-5, rtol=0)
    # the cached keys are rotated: layer 0's keys equal the projection, rotated to their positions
    block = model.blocks[0]
    _, k, _ = block.attn.project_qkv(block.ln_1(model.tok_emb(ids)))
    cos, sin = model.rotary(torch.arange(20).expand(2, 20))
    torch.testing.assert_close(cache.k[0, :, :, :20], apply_rotary(k, cos, sin), atol=1e-5, rtol=0)


@torch.no_grad()
def test_untied_embeddings_are_their_own_parameters():
    tied, untied = make_model(), make_model(**LLAMA)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_scaled_dot_product_attention_is_the_one_attention():
    """GQA adds no attention path: with the KV heads repeated, the result is the plain function's."""
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mha = MultiHeadAttention(32, 4, n_kv_head=2, use_sdpa=False).eval()
    with torch.no_grad():
        mha.out_proj.weight.copy_(torch.eye(32))
        mha.out_proj.bias.zero_()
        got = mha.attend(q, k, v, None, is_causal=False)
    want = scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(1, 5, 32))
