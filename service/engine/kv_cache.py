"""The KV cache: slots of reserved address space, memory held in blocks of positions, kept dense so a step runs
over slots [0, used).

One key and one value buffer per layer, each [n_slots, n_head, max_seq, d_head]. A sequence owns one slot;
its tokens sit at the start of the slot, so sequences of different lengths need no padding. The buffers are
bound to the static-cache graph as both past and present, and the graph writes each step's keys and values
in place: nothing is copied or allocated per step.

Memory follows the tokens (docs/engine.md#kv-cache-memory). Every slot reserves its whole context as address
space only (`lazy_zeros`): the kernel gives a page memory when a position in it is first written, and a
sequence that ends gives its pages back (`release_pages`). So the cache is paged, with the MMU's page table
as its block table, and the attention still reads each row's positions contiguously. What the engine
accounts is blocks: `block_tokens` positions of every layer, key and value (a whole number of pages per head
row), out of `n_blocks` that the memory budget holds. A sequence holds the blocks for the positions it may
write (`allocate`, `grow`); the prefix cache's blocks count against the same total (`shared`). Admission and
growth are by free blocks; slots are only the rows a step can run.

Slots are kept dense: `allocate` hands out the next free slot, and `release` moves the last used slot into
the hole, so a decode step always covers slots [0, used). A move copies only the moved sequence's live prefix
(its length, not max_seq), and only when a sequence leaves.

An encoder-decoder model keeps more per slot: its source's cross-attention keys and values and its source
mask (`slot_state`, arrays whose first axis is the slot), written once when the source is encoded. They move
and fork with the slot, whole.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from service.runtime.memory import release_pages
from service.runtime.static_runner import CacheShape

BLOCK_TOKENS = 16


def block_tokens_for(shape: CacheShape) -> int:
    """Positions per block: 16. A block of one head's row is a page at d_head 64 in fp32 (128 in fp16); with
    narrower heads a sequence's last page per row holds more than its blocks, at most a page per head row and
    sequence (24 MiB for 64 sequences at Qwen2.5-0.5B's shape), which the budget's margin covers."""
    return BLOCK_TOKENS


class KVCache:
    def __init__(self, shape: CacheShape, n_slots: int, slot_state: list[np.ndarray] | None = None,
                 block_tokens: int | None = None, n_blocks: int | None = None):
        self.shape = shape
        self.n_slots = n_slots
        self.block_tokens = block_tokens or block_tokens_for(shape)
        self.blocks_per_slot = self.blocks_for(shape.max_seq)
        self.n_blocks = n_slots * self.blocks_per_slot if n_blocks is None else n_blocks  # the budget's blocks
        self.buffers = shape.buffers(n_slots)  # address space; pages are taken as positions are written
        self.slot_state = slot_state or []  # per-slot arrays that move whole with their slot
        assert all(a.shape[0] == n_slots for a in self.slot_state)
        self.lengths = np.zeros(n_slots, dtype=np.int64)  # positions written per slot (= next write position)
        self.pending = np.zeros(n_slots, dtype=np.int64)  # per slot: the token the next decode writes
        self.owners: list[object | None] = [None] * n_slots  # who holds each slot
        self.held = np.zeros(n_slots, dtype=np.int64)  # blocks each slot's sequence holds
        self.used = 0  # slots [0, used) are taken
        self.reserved = 0  # slots promised to admitted sequences but not yet handed out
        self.promised = 0  # blocks promised with them
        self.held_total = 0  # blocks held by the slots
        self.shared: Callable[[], int] = lambda: 0  # blocks the prefix cache holds (it sets this)

    # ---- what is free ------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """The memory the budget gives the cache (its blocks), plus the slots' state."""
        return self.n_blocks * self.block_bytes + sum(a.nbytes for a in self.slot_state)

    @property
    def block_bytes(self) -> int:
        return self.shape.bytes_per_slot // self.shape.max_seq * self.block_tokens

    @property
    def free_slots(self) -> int:
        return self.n_slots - self.used - self.reserved

    @property
    def free_blocks(self) -> int:
        return self.n_blocks - self.held_total - self.promised - self.shared()

    @property
    def free_tokens(self) -> int:
        return self.free_blocks * self.block_tokens

    @property
    def reclaimable_tokens(self) -> int:
        """Positions a sequence could take: the free blocks and those the prefix cache would give back."""
        return (self.n_blocks - self.held_total - self.promised) * self.block_tokens

    def blocks_for(self, positions: int) -> int:
        return -(-min(positions, self.shape.max_seq) // self.block_tokens)

    # ---- slots and their blocks ----------------------------------------------------------------

    def reserve(self, n: int, blocks_each: int = 0) -> None:
        """Promise `n` slots of `blocks_each` blocks to an admitted request's later sequences."""
        if n > self.free_slots or n * blocks_each > self.free_blocks:
            raise RuntimeError(f"cannot reserve {n} slots of {blocks_each} blocks: {self.free_slots} slots and "
                               f"{self.free_blocks} blocks are free")
        self.reserved += n
        self.promised += n * blocks_each

    def unreserve(self, n: int, blocks_each: int = 0) -> None:
        assert 0 <= n <= self.reserved, f"cannot unreserve {n} of {self.reserved} reserved slots"
        self.reserved -= n
        self.promised -= n * blocks_each

    def allocate(self, owner: object, blocks: int = 0, reserved: bool = False) -> int:
        """Hand out the next slot with `blocks` blocks; `reserved` draws both from an earlier `reserve`."""
        if reserved:
            assert self.reserved > 0 and self.promised >= blocks, "no reserved slot to draw from"
            self.reserved -= 1
            self.promised -= blocks
        elif self.free_slots < 1 or blocks > self.free_blocks:
            raise RuntimeError(f"no free KV slot with {blocks} blocks ({self.free_slots} slots, "
                               f"{self.free_blocks} blocks free)")
        slot = self.used
        self.used += 1
        self.owners[slot] = owner
        self.lengths[slot] = 0
        self.pending[slot] = 0
        self.held[slot] = blocks
        self.held_total += blocks
        return slot

    def missing(self, slot: int, positions: int) -> int:
        """Blocks `slot` lacks to write positions [0, positions)."""
        return max(self.blocks_for(positions) - int(self.held[slot]), 0)

    def grow(self, slot: int, positions: int) -> None:
        """Give `slot` the blocks it lacks for positions [0, positions); they must be free."""
        more = self.missing(slot, positions)
        if more > self.free_blocks:
            raise RuntimeError(f"slot {slot} needs {more} more blocks, {self.free_blocks} are free")
        self.held[slot] += more
        self.held_total += more

    def release(self, slot: int) -> tuple[object, int] | None:
        """Free `slot`, its blocks and its pages. If another slot had to move into it, returns (its owner,
        its new slot)."""
        assert 0 <= slot < self.used and self.owners[slot] is not None, f"slot {slot} is not in use"
        last = self.used - 1
        self.held_total -= int(self.held[slot])
        moved = None
        if slot != last:
            length = int(self.lengths[last])
            self.copy(last, slot, length)
            self.discard(slot, length)  # what the old owner wrote past the moved prefix
            self.pending[slot] = self.pending[last]
            self.owners[slot] = self.owners[last]
            self.held[slot] = self.held[last]
            moved = (self.owners[slot], slot)
        self.discard(last, 0)
        self.owners[last] = None
        self.lengths[last] = 0
        self.pending[last] = 0
        self.held[last] = 0
        self.used -= 1
        return moved

    def copy(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (every layer, K and V)."""
        for buf in self.buffers:
            buf[dst, :, :length] = buf[src, :, :length]
        for state in self.slot_state:
            state[dst] = state[src]
        self.lengths[dst] = length

    def discard(self, slot: int, start: int) -> int:
        """Give back the pages of `slot` from position `start` on (every layer, key and value, head). Returns
        the bytes released."""
        n_head, max_seq, d_head = self.shape.n_head, self.shape.max_seq, self.shape.d_head
        position = d_head * self.buffers[0].itemsize
        released = 0
        for buf in self.buffers:
            for head in range(n_head):
                row = (slot * n_head + head) * max_seq * position
                released += release_pages(buf, row + start * position, row + max_seq * position)
        return released

    def discard_unused(self) -> None:
        """Give back the pages of every slot no sequence holds (after warm-up or a probe wrote into them)."""
        for slot in range(self.used, self.n_slots):
            self.discard(slot, 0)
