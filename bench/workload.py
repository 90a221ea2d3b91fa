"""The requests a benchmark sends: the same prompts for every system, drawn from a fixed seed.

- **fixed**: every request has `prompt_tokens` random token ids and asks for `new_tokens`.
- **mixed**: prompt lengths uniform in [8, 512] and new tokens uniform in [16, 256], clipped to the
  model's context: new tokens to `context − 8`, and the prompt's oldest tokens dropped to fit
  here, so a short-context model runs the same draw.

Token ids are drawn from [1, vocab) (0 is the end-of-text id of the shipped model; with ignore_eos it
would not matter, but a prompt of random text tokens is the closer stand-in for real text).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIXED_PROMPT = (8, 512)
MIXED_NEW = (16, 256)
MIN_PROMPT = 8


@dataclass(frozen=True)
class Item:
    prompt: list[int]
    new_tokens: int


def fixed(count: int, prompt_tokens: int, new_tokens: int, vocab: int, seed: int) -> list[Item]:
    rng = np.random.default_rng(seed)
    return [Item(rng.integers(1, vocab, prompt_tokens).tolist(), new_tokens) for _ in range(count)]


def mixed(count: int, vocab: int, context: int, seed: int) -> list[Item]:
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(count):
        prompt_len = int(rng.integers(MIXED_PROMPT[0], MIXED_PROMPT[1] + 1))
        new = int(rng.integers(MIXED_NEW[0], MIXED_NEW[1] + 1))
        prompt = rng.integers(1, vocab, prompt_len).tolist()
        new = min(new, context - MIN_PROMPT)
        items.append(Item(prompt[-(context - new):], new))
    return items


def batches(items: list[Item], clients: int) -> list[list[Item]]:
    """Deal `items` out to `clients` round-robin: client i sends items i, i + clients, ..."""
    return [items[i::clients] for i in range(clients)]
