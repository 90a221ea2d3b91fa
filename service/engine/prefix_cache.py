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

The cache holds at most `n_blocks` blocks, in address space reserved beside the slots; the blocks it
holds take memory and count against the KV cache's blocks (`KVCache.shared`), so it keeps prefixes in
the memory sequences leave free and gives it back when they need it (`evict`). When it is full, or no
block of the budget is free, the least recently used block that no other block extends is evicted (a
leaf: its parent stays useful to others). A slot's positions stay contiguous, as the serving graph
needs, so a hit is copied into the slot rather than mapped: a copy of the prefix's keys and values (a
memory copy per layer) instead of a forward pass over it (docs/engine.md#kv-cache-memory says why).

A hit always leaves at least one prompt token to compute, since the first generated token needs the
logits of the prompt's last position.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from service.engine.kv_cache import KVCache
from service.runtime.memory import lazy_zeros, release_pages
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
        self.pool = [lazy_zeros(dims, shape.dtype) for _ in range(2 * shape.n_layer)]
        self._blocks: dict[int, _Block] = {}
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent, tokens) -> block
        self._recent: OrderedDict[int, None] = OrderedDict()  # every kept block, least recently used first
        self._free: list[int] = []  # blocks given back, taken again first
        self._fresh = 0  # blocks [_fresh, n_blocks) were never taken
        self.queried_tokens = 0  # prompt tokens looked up (counters for the hit rate)
        self.hit_tokens = 0  # of those, found in the cache

    @staticmethod
    def bytes_for(shape: CacheShape, n_blocks: int, block_tokens: int) -> int:
        return n_blocks * block_tokens * shape.bytes_per_slot // shape.max_seq

    @property
    def block_bytes(self) -> int:
        return sum(b[0].nbytes for b in self.pool)

    @property
    def nbytes(self) -> int:
        """The memory its blocks hold now."""
        return self.blocks_used * self.block_bytes

    def share(self, kv: KVCache) -> None:
        """Count the blocks kept here against `kv`'s blocks."""
        kv.shared = lambda: -(-self.blocks_used * self.block_tokens // kv.block_tokens)

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
                block = self._take(keep=parent, fresh=kv.free_blocks > 0)
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

    def _take(self, keep: int, fresh: bool = True) -> int | None:
        """A free block (if `fresh`: the KV budget has room for one more), else the least recently used leaf's
        (never `keep`), evicted."""
        if fresh and self._free:
            return self._free.pop()
        if fresh and self._fresh < self.n_blocks:
            self._fresh += 1
            return self._fresh - 1
        victim = next((b for b in self._recent if self._blocks[b].children == 0 and b != keep), None)
        if victim is None:
            return None
        self._drop(victim)
        return victim

    def evict(self, n: int) -> int:
        """Give up to `n` blocks back to the KV budget, least recently used leaves first (their pages too).
        Returns the blocks given back."""
        given = 0
        while given < n:
            victim = next((b for b in self._recent if self._blocks[b].children == 0), None)
            if victim is None:
                break
            self._drop(victim)
            for buf in self.pool:
                release_pages(buf, victim * buf[0].nbytes, (victim + 1) * buf[0].nbytes)
            self._free.append(victim)
            given += 1
        return given

    def _drop(self, victim: int) -> None:
        gone = self._blocks.pop(victim)
        del self._index[(gone.parent, gone.tokens)]
        del self._recent[victim]
        if gone.parent != ROOT:
            self._blocks[gone.parent].children -= 1

    def clear(self) -> None:
        self.evict(len(self._blocks))
        self._blocks.clear()
        self._index.clear()
        self._recent.clear()
        self._free, self._fresh = [], 0
