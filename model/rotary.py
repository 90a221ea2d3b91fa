"""Rotary position embeddings (RoPE), in the rotate-half convention of Hugging Face Llama.

Positions enter attention instead of the residual stream: each query and key vector is split into
pairs (x_i, x_{i + d/2}), and pair i at position p is rotated by the angle p·ω_i, with
ω_i = theta^(-2i/d). A rotation by p·ω on the query and q·ω on the key leaves their dot product a
function of the offset q - p alone, so attention sees relative positions, and nothing is learned.

    cos, sin = RotaryEmbedding(d_rot, theta, scaling, n_ctx)(position_ids)  # (B, 1, T, d_rot) each
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)             # (B, H, T, d_rot)

`d_rot` is the rotated width of a head. `scaling` (a Hugging Face `rope_scaling`) stretches the
frequencies for contexts longer than training saw, as transformers' `modeling_rope_utils` does:

- "linear" divides every ω_i by `factor`.
- "llama3" divides only the low frequencies (long wavelengths) by `factor`, keeps the high ones, and
  blends between them (Llama 3.1).
- "yarn" blends ω_i / factor and ω_i by wavelength (the ramp between `beta_fast` and `beta_slow`
  rotations within `original_max_position_embeddings`) and multiplies cos and sin by an attention
  factor, so every query·key score by its square (Qwen2.5/Qwen3 long contexts, DeepSeek's mscale).
- "longrope" divides ω_i by per-pair factors and multiplies cos and sin by an attention factor (Phi-3,
  Phi-4-mini): `short_factor` at positions below `original_max_position_embeddings`, `long_factor` from
  there on. transformers picks one set for a whole forward call, by the length the call ends at; a cache
  that keeps each key as it was rotated needs a position's angle to depend on the position alone, and
  this rule is what transformers' cached generation of a prompt within the original context computes
  (docs/model.md says where the served model and transformers part).

"dynamic" (NTK) is refused, by name, with its reason (REFUSED).

`cos_sin` is the one source of angles: the PyTorch model takes its cos/sin from it at its positions, and
the serving graph its tables at every position of the context (`rotary_cos_sin`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

SCALINGS = ("linear", "llama3", "yarn", "longrope")
REFUSED = {
    "dynamic": "dynamic NTK recomputes every position's frequencies from the sequence's current length once it is "
               "past max_position_embeddings, and a KV cache holds keys already rotated (within "
               "max_position_embeddings it is the unscaled RoPE: without rope_scaling the checkpoint serves the same)",
}


def rope_type(scaling: dict | None) -> str | None:
    """The scaling's kind (HF configs name it `rope_type`, older ones `type`); None for none or "default"."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind in REFUSED:
        raise ValueError(f"rope_scaling type {kind!r} is not supported: {REFUSED[kind]}")
    if kind not in SCALINGS:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SCALINGS)})")
    return kind


def inverse_frequencies(d_rot: int, theta: float, scaling: dict | None = None, long: bool = False) -> Tensor:
    """ω_i = theta^(-2i/d_rot) for i < d_rot/2, scaled as `scaling` asks (`long`: longrope's long factors).
    (d_rot/2,) float32, computed in float32 in transformers' order of operations (at position 2047 a last-bit
    difference in ω moves the angle)."""
    exponents = torch.arange(0, d_rot, 2, dtype=torch.int64).float() / d_rot
    kind = rope_type(scaling)
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.shape != (d_rot // 2,):
            raise ValueError(f"longrope factors must be {d_rot // 2} long (one per rotated pair), got "
                             f"{tuple(factors.shape)}")
        return 1.0 / (factors * theta ** exponents)
    if kind == "yarn":
        return _yarn(theta ** exponents, d_rot, theta, scaling)  # theta^(2i/d_rot) = 1/ω_i
    inv = 1.0 / theta ** exponents
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


def _yarn(powers: Tensor, d_rot: int, theta: float, scaling: dict) -> Tensor:
    """YaRN: pairs that turn more than `beta_fast` times within the original context keep ω_i, those that
    turn fewer than `beta_slow` times take ω_i / factor, and a linear ramp over the pair index blends between."""
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]

    def pair_of(rotations: float) -> float:  # the (fractional) pair index that turns `rotations` times in old_ctx
        return d_rot * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(scaling.get("beta_fast") or 32), pair_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_rot - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(d_rot // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (ω_i kept), 0: interpolate (ω_i / factor)
    return 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep


def attention_factor(scaling: dict | None, n_ctx: int | None) -> float:
    """What cos and sin are multiplied by: 1, or yarn's and longrope's attention factor (`attention_factor`
    when the config gives it, else inferred from `factor` as transformers infers it). `n_ctx` is
    max_position_embeddings, whose ratio to the original context stands in for a missing `factor`."""
    kind = rope_type(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_ctx = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        if n_ctx is None:
            raise ValueError(f"{kind} without a factor needs max_position_embeddings to infer it")
        factor = n_ctx / old_ctx
    if kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def long_context_start(scaling: dict | None) -> int | None:
    """longrope's switch: positions from this one on take the long factors, the ones before it the short."""
    return scaling["original_max_position_embeddings"] if rope_type(scaling) == "longrope" else None


def rotary_frequencies(d_rot: int, theta: float, scaling: dict | None, n_ctx: int | None) -> tuple[Tensor, float]:
    """(inverse frequencies (sets, d_rot/2), attention factor). One set, or longrope's two: short, then long."""
    sets = [inverse_frequencies(d_rot, theta, scaling)]
    if rope_type(scaling) == "longrope":
        sets.append(inverse_frequencies(d_rot, theta, scaling, long=True))
    return torch.stack(sets), attention_factor(scaling, n_ctx)


def cos_sin(positions: Tensor, inv_freq: Tensor, attention: float, long_from: int | None) -> tuple[Tensor, Tensor]:
    """cos, sin (*positions.shape, d_rot/2) of the angles position·ω_i, times the attention factor: the
    multiplications transformers makes, so the same bits. `inv_freq` (sets, d_rot/2); with two sets a position
    takes the second from `long_from` on."""
    angles = positions[..., None].float() * inv_freq[0]  # (..., d_rot/2)
    if long_from is not None:
        angles = torch.where(positions[..., None] >= long_from, positions[..., None].float() * inv_freq[1], angles)
    cos, sin = angles.cos(), angles.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos, sin


def rotary_cos_sin(positions: Tensor, d_rot: int, theta: float, scaling: dict | None,
                   n_ctx: int | None) -> tuple[Tensor, Tensor]:
    """cos, sin (*positions.shape, d_rot/2) at `positions` of a model with these settings: the angles the
    PyTorch model rotates by, and the serving graph's tables (at every position of the context)."""
    return cos_sin(positions, *rotary_frequencies(d_rot, theta, scaling, n_ctx), long_context_start(scaling))


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
    def __init__(self, d_rot: int, theta: float = 10000.0, scaling: dict | None = None, n_ctx: int | None = None):
        """`n_ctx` (max_position_embeddings) infers yarn's and longrope's missing `factor`; else unused."""
        super().__init__()
        inv_freq, self.attention = rotary_frequencies(d_rot, theta, scaling, n_ctx)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (sets, d_rot/2)
        self.long_from = long_context_start(scaling)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """position_ids (B, T) -> cos, sin (B, 1, T, d_rot), in float32."""
        cos, sin = cos_sin(position_ids, self.inv_freq, self.attention, self.long_from)  # (B, T, d_rot/2)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # pair i: angle i in both halves
        return cos[:, None], sin[:, None]
