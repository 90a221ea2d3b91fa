"""Scaled dot-product attention and multi-head attention, written out from first principles.

Mask convention (the same as `torch.nn.functional.scaled_dot_product_attention`): a boolean
mask is True where a query may attend to a key. `key_padding_mask` follows
`torch.nn.MultiheadAttention`: True marks a padded key that must be ignored.

Two options change the scores: `scale` replaces 1/√d_k on Q·Kᵀ, and `softcap` bounds them smoothly,
cap · tanh(scores / cap), before the mask (Gemma 2). A sliding window (`sliding_window_mask`) limits a
query to the last `window` keys up to itself.

A query row whose keys are all masked has no defined softmax; it returns zeros instead of
NaN, so padded rows in a batch never poison anything downstream.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.norm import RMSNorm


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0,
    scale: float | None = None, softcap: float | None = None,
) -> Tensor:
    """softmax(Q·Kᵀ / √d_k) · V, step by step (`scale` in place of 1/√d_k; scores soft-capped by `softcap`).

    q: (..., Tq, d_k), k: (..., Tk, d_k), v: (..., Tk, d_v); mask broadcastable to (..., Tq, Tk).
    """
    if scale is None:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., Tq, Tk)
    else:
        scores = (q @ k.transpose(-2, -1)) * scale  # (..., Tq, Tk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        # A fully masked row is all -inf and softmaxes to NaN; it attends to nothing instead.
        weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v  # (..., Tq, d_v)


def causal_mask(t_query: int, t_key: int, device: torch.device | None = None) -> Tensor:
    """(Tq, Tk) boolean mask for queries that are the last Tq of Tk positions."""
    offset = t_key - t_query
    q_pos = torch.arange(t_query, device=device).unsqueeze(1) + offset
    k_pos = torch.arange(t_key, device=device).unsqueeze(0)
    return k_pos <= q_pos


def sliding_window_mask(t_query: int, t_key: int, window: int, device: torch.device | None = None) -> Tensor:
    """(Tq, Tk) boolean mask for queries that are the last Tq of Tk positions, each seeing itself and the
    window - 1 keys before it: key j is visible to query i when i - window < j <= i (transformers'
    sliding-window causal mask)."""
    offset = t_key - t_query
    q_pos = torch.arange(t_query, device=device).unsqueeze(1) + offset
    k_pos = torch.arange(t_key, device=device).unsqueeze(0)
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with one fused Q/K/V projection and an output projection W_O.

    `qkv_proj.weight` is ((n_head + 2·n_kv_head)·d_head, d_model) with the query, key and value rows
    stacked in that order: with n_kv_head = n_head, the layout of `torch.nn.MultiheadAttention.in_proj_weight`
    and of GPT-2's `c_attn` (transposed). For cross-attention, queries come from `x` and keys/values
    from `context`.

    Grouped-query attention: with n_kv_head < n_head, each key/value head serves a group of
    n_head / n_kv_head consecutive query heads (n_kv_head = 1 is multi-query attention). Keys and
    values are projected, cached and returned by `project_qkv` per KV head, so a KV cache holds only
    those; `attend` repeats each across its group just before the attention itself, which is the same
    `scaled_dot_product_attention` as for plain multi-head attention.

    The head width d_head defaults to d_model / n_head; a model may set its own (Qwen3: 128 for any
    width), and the inner width is then n_head·d_head, which `out_proj` maps back to d_model. With
    `qk_norm_eps` set, each query and each key head is RMS-normalised over its d_head dimensions with
    learned weights (`q_norm`, `k_norm`, shared by the heads) as it is projected, so before any rotary
    positions (Qwen3, Gemma 3).
    """

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, bias: bool = True,
                 use_sdpa: bool = True, d_head: int | None = None, n_kv_head: int | None = None,
                 qkv_bias: bool | None = None, qk_norm_eps: float | None = None,
                 scale: float | None = None, softcap: float | None = None):
        super().__init__()
        if d_head is None:
            if d_model % n_head != 0:
                raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
            d_head = d_model // n_head
        n_kv_head = n_kv_head or n_head
        if n_head % n_kv_head != 0:
            raise ValueError(f"n_kv_head={n_kv_head} must divide n_head={n_head}")
        self.d_model = d_model
        self.n_head = n_head
        self.n_kv_head = n_kv_head
        self.d_head = d_head  # d_k; defaults to d_model / n_head
        self.d_inner = n_head * d_head  # width of the concatenated query heads
        self.d_kv = n_kv_head * d_head  # width of the concatenated key (or value) heads
        self.dropout = dropout
        self.use_sdpa = use_sdpa  # fused torch kernel; the explicit path is the reference
        self.scale = scale  # factor on q·k; None = 1 / sqrt(d_head)
        self.softcap = softcap  # scores soft-capped at ± softcap; torch's fused kernel has no such option
        self.qkv_proj = nn.Linear(d_model, self.d_inner + 2 * self.d_kv, bias=bias if qkv_bias is None else qkv_bias)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm, self.k_norm = RMSNorm(d_head, qk_norm_eps), RMSNorm(d_head, qk_norm_eps)

    def _split_heads(self, x: Tensor, heads: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, heads, self.d_head).transpose(1, 2)  # (B, heads, T, D)

    def _queries(self, q: Tensor) -> Tensor:
        """(B, T, d_inner) -> (B, H, T, D), each head normalised when the model has q_norm."""
        q = self._split_heads(q, self.n_head)
        return q if self.q_norm is None else self.q_norm(q)

    def _keys(self, k: Tensor) -> Tensor:
        """(B, T, d_kv) -> (B, H_kv, T, D), each head normalised when the model has k_norm."""
        k = self._split_heads(k, self.n_kv_head)
        return k if self.k_norm is None else self.k_norm(k)

    def project_qkv(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries from x; keys and values from context (cross) or from x (self). q (B, H, T, D); k and v
        (B, H_kv, T, D)."""
        if context is not None:
            return (self.project_q(x), *self.project_kv(context))
        q, k, v = self.qkv_proj(x).split((self.d_inner, self.d_kv, self.d_kv), dim=-1)
        return self._queries(q), self._keys(k), self._split_heads(v, self.n_kv_head)

    def project_q(self, x: Tensor) -> Tensor:
        """The queries alone, (B, H, T, D): cross-attention projects its keys and values once per source."""
        w, b, n = self.qkv_proj.weight, self.qkv_proj.bias, self.d_inner
        return self._queries(F.linear(x, w[:n], None if b is None else b[:n]))

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of `context`, each (B, H_kv, Tk, D)."""
        w, b, n = self.qkv_proj.weight, self.qkv_proj.bias, self.d_inner
        k, v = F.linear(context, w[n:], None if b is None else b[n:]).split(self.d_kv, dim=-1)
        return self._keys(k), self._split_heads(v, self.n_kv_head)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        """Attention over already projected heads; merges heads and applies W_O. Returns (B, Tq, d_model).
        k and v may have fewer heads than q (grouped-query attention)."""
        if k.size(1) != q.size(1):  # each KV head serves its group of query heads
            group = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dropout_p = self.dropout if self.training else 0.0
        fused = self.use_sdpa and self.softcap is None
        if fused and is_causal and mask is None and q.size(-2) == k.size(-2):
            # The common training case: torch's fused causal kernel, no mask tensor at all.
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=self.scale)
        else:
            if is_causal:
                causal = causal_mask(q.size(-2), k.size(-2), q.device)
                mask = causal if mask is None else mask & causal
            if fused:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=self.scale)
                if mask is not None:
                    y = y.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
            else:
                y = scaled_dot_product_attention(q, k, v, mask=mask, dropout_p=dropout_p, scale=self.scale,
                                                 softcap=self.softcap)
        B, H, T, D = y.shape
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, Tq, d_inner)
        return self.out_proj(y)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        is_causal: bool = False,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """x: (B, Tq, d_model); context: (B, Tk, d_model) or None for self-attention.

        attn_mask: bool, broadcastable to (B, H, Tq, Tk), True = may attend.
        key_padding_mask: bool (B, Tk), True = padded key, ignored.
        """
        q, k, v = self.project_qkv(x, context)
        mask = attn_mask
        if key_padding_mask is not None:
            keep = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, Tk)
            mask = keep if mask is None else mask & keep
        return self.attend(q, k, v, mask, is_causal)
