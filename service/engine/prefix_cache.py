"""Prefix caching: the keys and values of token blocks that earlier requests wrote, kept for the next
request whose prompt starts with the same tokens (a shared system prompt, a few-shot block, an
earlier chat turn).

    cache = PrefixCache(shape, n_blocks, block_tokens=16)
    hit = cache.match(prompt)             # the longest cached run of whole blocks at the prompt's start
    cache.load(hit, kv, slot)             # copy its keys and values into the slot: positions [0, hit.tokens)
    cache.store(tokens, kv, slot)         # keep the slot's whole blocks of `tokens` (those not kept yet)

Blocks are matched on their tokens *and* everything before them: a block is found by (its parent
block, its tokens), so one block stands for a whole prefix, with no hashing to collide. The blocks
form a tree; a lookup walks it from the root, block by block.

The cache is a pool of `n_blocks` blocks allocated once beside the slots, and counted with them in
the KV budget. When it is full, the least recently used block that no other block extends is
evicted (a leaf: its parent stays useful to others). A slot's positions stay contiguous, as the
serving graph needs, so a hit is copied into the slot rather than shared: a copy of the prefix's
keys and values (a memory copy per layer) instead of a forward pass over it.

A hit always leaves at least one prompt token to compute, since the first generated token needs the
logits of the prompt's last position.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from service.engine.kv_cache import KVCache
from service.runtime.static_runner import CacheShape

ROOT = -1  # the parent of a prompt's first block


@dataclass(frozen=True)
class Hit:
    """The cached blocks a prompt starts with, in order."""

    blocks: tuple[int, ...]
    block_tokens: int

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens


@dataclass
class _Block:
    parent: int  # the block before it, or ROOT
    tokens: tuple[int, ...]
    children: int = 0  # blocks that extend it (an extended block is never evicted before them)


class PrefixCache:
    def __init__(self, shape: CacheShape, n_blocks: int, block_tokens: int = 16):
        if n_blocks < 1 or block_tokens < 1:
            raise ValueError(f"a prefix cache needs at least one block of at least one token, got {n_blocks} "
                             f"blocks of {block_tokens}")
        self.shape = shape
        self.block_tokens = block_tokens
        self.n_blocks = n_blocks
        dims = (n_blocks, shape.n_head, block_tokens, shape.d_head)  # per layer, key and value alike
        self.pool = [np.zeros(dims, dtype=shape.dtype) for _ in range(2 * shape.n_layer)]
        self._blocks: dict[int, _Block] = {}
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent, tokens) -> block
        self._recent: OrderedDict[int, None] = OrderedDict()  # every kept block, least recently used first
        self._free = list(range(n_blocks - 1, -1, -1))
        self.queried_tokens = 0  # prompt tokens looked up (counters for the hit rate)
        self.hit_tokens = 0  # of those, found in the cache

    @staticmethod
    def bytes_for(shape: CacheShape, n_blocks: int, block_tokens: int) -> int:
        return n_blocks * block_tokens * shape.bytes_per_slot // shape.max_seq

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.pool)

    @property
    def blocks_used(self) -> int:
        return len(self._blocks)

    def _walk(self, tokens: list[int], limit: int) -> list[int]:
        """The kept blocks that `tokens[:limit]` starts with, from the first."""
        B, found, parent = self.block_tokens, [], ROOT
        for start in range(0, limit - B + 1, B):
            block = self._index.get((parent, tuple(tokens[start:start + B])))
            if block is None:
                break
            found.append(block)
            parent = block
        return found

    def match(self, prompt: list[int]) -> Hit:
        """The longest run of cached whole blocks the prompt starts with, short of its last token."""
        return Hit(tuple(self._walk(prompt, len(prompt) - 1)), self.block_tokens)

    def count(self, prompt_tokens: int, hit: Hit) -> None:
        """Record one admitted prompt's lookup (the hit rate counts prompts once, however often they
        were looked at while they waited)."""
        self.queried_tokens += prompt_tokens
        self.hit_tokens += hit.tokens

    def load(self, hit: Hit, kv: KVCache, slot: int) -> None:
        """Copy the hit's keys and values into `slot`, positions [0, hit.tokens), and mark its blocks
        recently used."""
        B = self.block_tokens
        for i, block in enumerate(hit.blocks):
            for src, dst in zip(self.pool, kv.buffers, strict=True):
                dst[slot, :, i * B:(i + 1) * B] = src[block]
            self._recent.move_to_end(block)
        kv.lengths[slot] = hit.tokens

    def store(self, tokens: list[int], kv: KVCache, slot: int) -> int:
        """Keep the whole blocks of `tokens`, whose keys and values are in `slot` from position 0; blocks
        already kept are only marked recently used. Returns the blocks added."""
        B, parent, added = self.block_tokens, ROOT, 0
        for start in range(0, len(tokens) - B + 1, B):
            key = (parent, tuple(tokens[start:start + B]))
            block = self._index.get(key)
            if block is None:
                block = self._take(keep=parent)
                if block is None:
                    break  # every block is an ancestor of another: nothing to evict
                for dst, src in zip(self.pool, kv.buffers, strict=True):
                    dst[block] = src[slot, :, start:start + B]
                self._blocks[block] = _Block(parent, key[1])
                self._index[key] = block
                if parent != ROOT:
                    self._blocks[parent].children += 1
                added += 1
            self._recent[block] = None
            self._recent.move_to_end(block)
            parent = block
        return added

    def _take(self, keep: int) -> int | None:
        """A free block, evicting the least recently used leaf (never `keep`) if none is free."""
        if self._free:
            return self._free.pop()
        victim = next((b for b in self._recent if self._blocks[b].children == 0 and b != keep), None)
        if victim is None:
            return None
        gone = self._blocks.pop(victim)
        del self._index[(gone.parent, gone.tokens)]
        del self._recent[victim]
        if gone.parent != ROOT:
            self._blocks[gone.parent].children -= 1
        return victim

    def clear(self) -> None:
        self._blocks.clear()
        self._index.clear()
        self._recent.clear()
        self._free = list(range(self.n_blocks - 1, -1, -1))
