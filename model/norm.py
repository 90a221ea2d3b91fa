"""The two norms a block can use: LayerNorm (GPT-2) and RMSNorm (Llama).

RMSNorm(x) = x / sqrt(mean(x²) + eps) · g: LayerNorm without the mean subtraction and the bias. It
is computed in float32 whatever the input's dtype, as Hugging Face computes it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(kind: str, d_model: int, eps: float, bias: bool) -> nn.Module:
    """`kind` "layernorm" or "rmsnorm" (an RMSNorm has no bias)."""
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps)
    return nn.LayerNorm(d_model, eps=eps, bias=bias)
