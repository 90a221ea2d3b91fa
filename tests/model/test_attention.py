"""Pins the attention math: a worked example by hand, numpy, and torch.nn.MultiheadAttention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.attention import MultiHeadAttention, causal_mask, scaled_dot_product_attention

X = [[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
W = [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]]  # d_model 4 -> 2 heads of d_head 1
# X·W by hand: row 1 = [0.1+0.6+1.5+2.8, 0.2+0.8+1.8+3.2] = [5, 6]; each next row of X adds 4 to
# every entry, so adds 4·(column sums 1.6, 2.0) = [6.4, 8]: [[5, 6], [11.4, 14], [17.8, 22]].
XW = [[5.0, 6.0], [11.4, 14.0], [17.8, 22.0]]
# The specification's worked example states Q = K = V = [[5, 6], [13, 15], [21, 24]] directly.
QKV = [[5.0, 6.0], [13.0, 15.0], [21.0, 24.0]]


def numpy_attention(q, k, v, mask=None):
    """Independent reference: softmax(QKᵀ/√d_k)V in float64 numpy."""
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def as_heads(rows) -> torch.Tensor:
    """(T=3, 2) -> (H=2, T=3, d_head=1): column h is head h."""
    return torch.tensor(rows).T.unsqueeze(-1)


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    return out.squeeze(-1).T  # (3, 2)


def test_worked_example_projection():
    torch.testing.assert_close(torch.tensor(X) @ torch.tensor(W), torch.tensor(XW))


@pytest.mark.parametrize("rows", [QKV, XW], ids=["specified-qkv", "projected-xw"])
def test_worked_example_unmasked_every_query_takes_the_largest_key(rows):
    h = as_heads(rows)
    out = merge_heads(scaled_dot_product_attention(h, h, h))
    torch.testing.assert_close(out, torch.tensor([rows[-1]] * 3), atol=1e-2, rtol=0)
    ref = merge_heads(torch.from_numpy(numpy_attention(*(h.double().numpy(),) * 3)))
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5)


@pytest.mark.parametrize("rows", [QKV, XW], ids=["specified-qkv", "projected-xw"])
def test_worked_example_causal_each_query_takes_its_own_value(rows):
    h = as_heads(rows)
    mask = causal_mask(3, 3)
    out = merge_heads(scaled_dot_product_attention(h, h, h, mask=mask))
    torch.testing.assert_close(out, torch.tensor(rows), atol=1e-2, rtol=0)
    ref = merge_heads(torch.from_numpy(numpy_attention(*(h.double().numpy(),) * 3, mask=mask.numpy())))
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5)


@pytest.mark.parametrize("use_sdpa", [False, True])
def test_worked_example_through_multi_head_attention(use_sdpa):
    mha = MultiHeadAttention(4, n_head=2, d_head=1, bias=False, use_sdpa=use_sdpa).eval()
    with torch.no_grad():
        mha.qkv_proj.weight.copy_(torch.tensor(W).T.repeat(3, 1))  # W_Q = W_K = W_V = W
        mha.out_proj = torch.nn.Identity()  # no output projection in the worked example
    x = torch.tensor([X])
    torch.testing.assert_close(mha(x)[0], torch.tensor([XW[-1]] * 3), atol=1e-2, rtol=0)
    torch.testing.assert_close(mha(x, is_causal=True)[0], torch.tensor(XW), atol=1e-2, rtol=0)


def test_scale_is_sqrt_of_key_dim_not_sequence_length():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 7, 16), torch.randn(1, 7, 16), torch.randn(1, 7, 16)
    expected = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v  # √16 = 4
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v), expected)


def test_random_inputs_match_numpy():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 5, 8)) for _ in range(3))
    mask = rng.random((2, 1, 5, 5)) > 0.3
    mask[..., 0] = True  # every row keeps one key
    out = scaled_dot_product_attention(*(torch.tensor(a, dtype=torch.float32) for a in (q, k, v)),
                                       mask=torch.tensor(mask))
    np.testing.assert_allclose(out.numpy(), numpy_attention(q, k, v, mask), rtol=1e-4, atol=1e-5)


def test_fully_masked_row_gives_zeros_not_nan():
    q = k = v = torch.randn(1, 1, 3, 4)
    mask = torch.tensor([[False, False, False], [True, False, False], [True, True, True]])
    out = scaled_dot_product_attention(q, k, v, mask=mask)
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, 0, 0], torch.zeros(4))


def test_causal_mask_offset_for_cached_queries():
    # Two new queries after three cached positions see 4 and 5 keys.
    assert causal_mask(2, 5).tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def copy_into_torch_mha(ours: MultiHeadAttention) -> torch.nn.MultiheadAttention:
    ref = torch.nn.MultiheadAttention(ours.d_model, ours.n_head, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv_proj.weight)
        ref.in_proj_bias.copy_(ours.qkv_proj.bias)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref.eval()


@pytest.mark.parametrize("use_sdpa", [False, True])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "both"])
def test_matches_torch_multihead_attention(use_sdpa, cross, masks):
    torch.manual_seed(1)
    B, Tq, d, H = 3, 6, 32, 4
    Tk = 9 if cross else Tq
    ours = MultiHeadAttention(d, H, use_sdpa=use_sdpa).eval()
    ref = copy_into_torch_mha(ours)
    x = torch.randn(B, Tq, d)
    ctx = torch.randn(B, Tk, d) if cross else None
    kv = ctx if cross else x

    causal = masks in ("causal", "both")
    pad = None
    if masks in ("padding", "both"):
        pad = torch.zeros(B, Tk, dtype=torch.bool)
        pad[0, -2:] = True  # right padding on row 0
        pad[2, :1] = True  # left padding on row 2, the first key is masked for everyone
    ref_mask = None
    if causal:
        ref_mask = ~causal_mask(Tq, Tk)  # torch: True = not allowed
    out = ours(x, ctx, is_causal=causal, key_padding_mask=pad)
    expected, _ = ref(x, kv, kv, key_padding_mask=pad, attn_mask=ref_mask, need_weights=False)
    if causal and pad is not None:
        # Query 0 of row 2 sees only key 0, which is padding: torch gives NaN, we give a zero context.
        assert not torch.isnan(out).any()
        expected = torch.where(torch.isnan(expected), out, expected)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cross", [False, True])
def test_fast_path_equals_explicit_path(cross):
    torch.manual_seed(2)
    explicit = MultiHeadAttention(64, 8, use_sdpa=False).eval()
    fast = MultiHeadAttention(64, 8, use_sdpa=True).eval()
    fast.load_state_dict(explicit.state_dict())
    x = torch.randn(2, 11, 64)
    ctx = torch.randn(2, 5, 64) if cross else None
    pad = torch.zeros(2, 5 if cross else 11, dtype=torch.bool)
    pad[1, :3] = True
    for kwargs in ({}, {"is_causal": not cross}, {"key_padding_mask": pad}):
        torch.testing.assert_close(fast(x, ctx, **kwargs), explicit(x, ctx, **kwargs), atol=1e-6, rtol=1e-5)


def test_cross_attention_uses_context_for_keys_and_values():
    torch.manual_seed(3)
    mha = MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 4, 16)
    a = mha(x, torch.randn(1, 5, 16))
    b = mha(x, torch.randn(1, 5, 16))
    assert not torch.allclose(a, b)
    assert a.shape == (1, 4, 16)


def test_d_model_must_divide_into_heads():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(30, 4)
