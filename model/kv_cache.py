"""An explicit, preallocated key/value cache for `GPT.forward`.

The cache is a plain object owned by the caller, never hidden module state: one buffer of shape
(n_layer, B, H, max_len, D) for keys and one for values. Every row of the batch has the same
length (`length`), so batches of prompts with different lengths are left-padded, and the
attention mask passed to `forward` says which positions are padding.
"""

from __future__ import annotations

import torch
from torch import Tensor


class BatchKVCache:
    def __init__(self, n_layer: int, batch_size: int, n_head: int, d_head: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        shape = (n_layer, batch_size, n_head, max_len, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H, max_len, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H, max_len, D)
        self.length = 0  # positions already written, the same for every row

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's k/v (B, H, T, D) after the cached ones; return all keys and values so far."""
        end = self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions needed, capacity is {self.max_len}")
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, H, end, D)

    def advance(self, n: int) -> None:
        """Commit n new positions once every layer has written them."""
        self.length += n
