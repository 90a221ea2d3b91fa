"""Rotary position embeddings (RoPE), in the rotate-half convention of Hugging Face Llama.

Positions enter attention instead of the residual stream: each query and key vector is split into
pairs (x_i, x_{i + d/2}), and pair i at position p is rotated by the angle p·ω_i, with
ω_i = theta^(-2i/d). A rotation by p·ω on the query and q·ω on the key leaves their dot product a
function of the offset q - p alone, so attention sees relative positions, and nothing is learned.

    cos, sin = RotaryEmbedding(d_head, theta, scaling)(position_ids)     # (B, 1, T, d_head) each
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)          # (B, H, T, d_head)

`scaling` stretches the frequencies for contexts longer than training saw: "linear" divides every
ω_i by `factor`; "llama3" divides only the low frequencies (long wavelengths), keeps the high ones,
and blends between them (Llama 3.1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

SCALINGS = ("linear", "llama3")


def inverse_frequencies(d_head: int, theta: float, scaling: dict | None = None) -> Tensor:
    """ω_i = theta^(-2i/d_head) for i < d_head/2, scaled as `scaling` asks. (d_head/2,) float32, computed in
    float32 as Hugging Face computes it (at position 2047 a last-bit difference in ω moves the angle)."""
    inv = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head)
    kind = rope_type(scaling)
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)  # 0 at the long-wavelength edge, 1 at the short
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor, torch.where(wavelen < old_ctx / high, inv, blended))
    return inv


def rope_type(scaling: dict | None) -> str | None:
    """The scaling's kind (HF configs name it `rope_type`, older ones `type`); None for none or "default"."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in SCALINGS:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SCALINGS)})")
    return kind


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) of x (B, H, T, D) by its angle; cos/sin broadcast to x. When cos and
    sin are d < D wide (partial rotary, Phi-3/4), only x's first d dimensions rotate, paired within
    themselves (x_i with x_{i+d/2}), and the rest pass through, as Hugging Face's Phi-3 does."""
    d = cos.size(-1)
    if d == x.size(-1):
        return x * cos + rotate_half(x) * sin
    rotated, kept = x[..., :d], x[..., d:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, kept), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, d_head: int, theta: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(d_head, theta, scaling), persistent=False)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """position_ids (B, T) -> cos, sin (B, 1, T, d_head), in float32."""
        angles = position_ids[..., None].float() * self.inv_freq  # (B, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (B, T, D): pair i uses angle i in both halves
        return angles.cos()[:, None], angles.sin()[:, None]
