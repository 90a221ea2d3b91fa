"""The standard (Concat-cache) decoder graph behind a plain step function. numpy only, no torch.

This is the reference path: export verification and the graph-variant benchmarks drive it. The
engine serves the static-cache graph through `service.runtime.static_runner` instead.

`ConcatRunner.step(input_ids, position_ids, attention_mask, cache) -> (logits, cache)` runs one
prefill or decode step of the bundle's decoder graph. The cache is a list of 2·n_layer arrays
[batch, kv heads, past_seq, d_head] in graph order (layer 0 key, layer 0 value, layer 1 key, ...).
"""

from __future__ import annotations

import numpy as np

from service.runtime.session import GraphRunner


class ConcatRunner(GraphRunner):
    CACHE = "concat"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache_dtype = np.dtype(self.spec.dtype)

    @property
    def n_layer(self) -> int:
        return self.manifest.model.n_layer

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        m = self.manifest.model
        return [np.zeros((batch, m.kv_heads, 0, m.d_head), dtype=self.cache_dtype) for _ in range(2 * m.n_layer)]

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One forward pass. attention_mask covers past + new positions; returns logits [B, T, V]."""
        feeds = {"input_ids": input_ids.astype(np.int64, copy=False),
                 "attention_mask": attention_mask.astype(np.int64, copy=False),
                 "position_ids": position_ids.astype(np.int64, copy=False)}
        for i in range(self.n_layer):
            feeds[f"past_key_values.{i}.key"] = cache[2 * i]
            feeds[f"past_key_values.{i}.value"] = cache[2 * i + 1]
        logits, *present = self.session.run(None, feeds)
        return logits, present
