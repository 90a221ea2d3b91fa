"""The KV cache: fixed slots, allocated once, kept dense so a step runs over slots [0, used).

One key and one value buffer per layer, each [n_slots, n_head, max_seq, d_head]. A sequence owns
one slot; its tokens sit at the start of the slot, so sequences of different lengths need no
padding. The buffers are bound to the static-cache graph as both past and present, and the graph
writes each step's keys and values in place: nothing is copied or allocated per step.

Slots are kept dense: `allocate` hands out the next free slots, and `release` moves the last used
slot into the hole, so a decode step always covers slots [0, used). A move copies only the moved
sequence's live prefix (its length, not max_seq), and only when a sequence leaves.

An encoder-decoder model keeps more per slot: its source's cross-attention keys and values and its
source mask (`slot_state`, arrays whose first axis is the slot), written once when the source is
encoded. They move and fork with the slot, whole.
"""

from __future__ import annotations

import numpy as np

from service.runtime.static_runner import CacheShape


def plan_slots(shape: CacheShape, max_running: int, memory_budget_bytes: int | None, state_bytes: int = 0) -> int:
    """How many slots to allocate: max_running, or fewer if the memory budget cannot hold them
    (`state_bytes`: what else each slot holds, an encoder-decoder's source state)."""
    if memory_budget_bytes is None:
        return max_running
    per_slot = shape.bytes_per_slot + state_bytes
    fits = memory_budget_bytes // per_slot
    if fits < 1:
        raise ValueError(f"kv_cache_bytes={memory_budget_bytes} cannot hold one sequence of {shape.max_seq} "
                         f"positions ({per_slot} bytes)")
    return int(min(max_running, fits))


class KVCache:
    def __init__(self, shape: CacheShape, n_slots: int, slot_state: list[np.ndarray] | None = None):
        self.shape = shape
        self.n_slots = n_slots
        self.buffers = shape.buffers(n_slots)
        self.slot_state = slot_state or []  # per-slot arrays that move whole with their slot
        assert all(a.shape[0] == n_slots for a in self.slot_state)
        self.lengths = np.zeros(n_slots, dtype=np.int64)  # positions written per slot (= next write position)
        self.pending = np.zeros(n_slots, dtype=np.int64)  # per slot: the token the next decode writes
        self.owners: list[object | None] = [None] * n_slots  # who holds each slot
        self.used = 0  # slots [0, used) are taken
        self.reserved = 0  # slots promised to admitted sequences but not yet handed out

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers) + sum(a.nbytes for a in self.slot_state)

    @property
    def free_slots(self) -> int:
        return self.n_slots - self.used - self.reserved

    @property
    def free_tokens(self) -> int:
        return self.free_slots * self.shape.max_seq

    def reserve(self, n: int) -> None:
        if n > self.free_slots:
            raise RuntimeError(f"cannot reserve {n} slots, {self.free_slots} are free")
        self.reserved += n

    def allocate(self, owner: object, reserved: bool = False) -> int:
        """Hand out the next slot; `reserved` draws it from an earlier `reserve`."""
        if reserved:
            assert self.reserved > 0, "no reserved slot to draw from"
            self.reserved -= 1
        elif self.free_slots < 1:
            raise RuntimeError("no free KV slot")
        slot = self.used
        self.used += 1
        self.owners[slot] = owner
        self.lengths[slot] = 0
        self.pending[slot] = 0
        return slot

    def unreserve(self, n: int) -> None:
        assert 0 <= n <= self.reserved, f"cannot unreserve {n} of {self.reserved} reserved slots"
        self.reserved -= n

    def release(self, slot: int) -> tuple[object, int] | None:
        """Free `slot`. If another slot had to move into it, returns (its owner, its new slot)."""
        assert 0 <= slot < self.used and self.owners[slot] is not None, f"slot {slot} is not in use"
        last = self.used - 1
        moved = None
        if slot != last:
            self.copy(last, slot, int(self.lengths[last]))
            self.pending[slot] = self.pending[last]
            self.owners[slot] = self.owners[last]
            moved = (self.owners[slot], slot)
        self.owners[last] = None
        self.lengths[last] = 0
        self.pending[last] = 0
        self.used -= 1
        return moved

    def copy(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (every layer, K and V)."""
        for buf in self.buffers:
            buf[dst, :, :length] = buf[src, :, :length]
        for state in self.slot_state:
            state[dst] = state[src]
        self.lengths[dst] = length
