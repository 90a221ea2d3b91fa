"""Who runs in the next step: iteration-level (continuous) batching under a token budget.

Every step spends one token per running sequence (the decode rows, slots [0, used)) and offers
the rest of `max_batch_tokens` to prefill, first come first served:

- If a long prompt is part-way through prefill, its next chunk takes the whole remaining budget.
- Otherwise waiting requests are admitted in arrival order while a KV slot is free for each of
  their n sequences, `max_running` is respected, and their prompts (right-padded to the longest)
  fit the budget. They are prefilled together in one call, into consecutive new slots.
- A prompt longer than the budget on its own is chunked: its first chunk starts now, and the
  requests behind it wait. FCFS means no request is overtaken, so none waits unboundedly.

So decode never stalls for more than one budgeted step, however long the prompts are.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from service.kv_cache import KVCache
from service.sequence import RequestState, Sequence, Status


@dataclass
class PrefillWork:
    seqs: list[Sequence]  # one sequence per prompt in this call (the first of each request)
    chunks: list[list[int]]  # token ids written this step, per sequence
    start: int  # position the chunk starts at (0 unless a long prompt is continued)
    first_slot: int  # slots first_slot ... first_slot + len(seqs) - 1

    @property
    def chunked(self) -> bool:
        """One prompt written in pieces (not in one go)."""
        return len(self.seqs) == 1 and (self.start > 0 or len(self.chunks[0]) < self.seqs[0].prompt_len)

    @property
    def tokens(self) -> int:
        return len(self.seqs) * max(len(c) for c in self.chunks)  # padded cost


@dataclass
class SchedulerOutput:
    decode: list[Sequence] = field(default_factory=list)  # owners of slots [0, n), in slot order
    prefill: PrefillWork | None = None

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


class Scheduler:
    def __init__(self, kv: KVCache, max_running: int, max_batch_tokens: int):
        self.kv = kv
        self.max_running = min(max_running, kv.n_slots)
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[RequestState] = deque()
        self.chunking: Sequence | None = None  # a long prompt part-way through prefill

    @property
    def num_running(self) -> int:
        """Sequences holding (or promised) a slot."""
        return self.kv.used + self.kv.reserved

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(decode=list(self.kv.owners[:self.kv.used]))
        budget = self.max_batch_tokens - len(out.decode)
        if self.chunking is not None:
            out.prefill = self._next_chunk(self.chunking, budget)
        elif self.waiting:
            out.prefill = self._admit(budget)
        return out

    def _next_chunk(self, seq: Sequence, budget: int) -> PrefillWork:
        start = seq.num_prefilled
        chunk = seq.request.prompt[start:start + max(budget, 1)]
        return PrefillWork([seq], [chunk], start, seq.slot)

    def _admit(self, budget: int) -> PrefillWork | None:
        batch: list[RequestState] = []
        longest = 0
        while self.waiting:
            state = self.waiting[0]
            n, length = state.request.n, len(state.prompt)
            if n > self.kv.free_slots or self.num_running + n > self.max_running:
                break
            if batch and (len(batch) + 1) * max(longest, length) > budget:
                break
            self.waiting.popleft()
            first = state.seqs[0]
            first.slot = self.kv.allocate(first)
            self.kv.reserve(n - 1)  # the siblings get slots when the prompt is in the cache
            state.reserved = n - 1
            first.status = Status.PREFILLING
            if length > budget:  # alone, and still too long: chunk it
                self.chunking = first
                return self._next_chunk(first, budget)
            batch.append(state)
            longest = max(longest, length)
        if not batch:
            return None
        seqs = [s.seqs[0] for s in batch]
        return PrefillWork(seqs, [s.prompt for s in batch], 0, seqs[0].slot)

    def prefill_done(self, work: PrefillWork) -> list[Sequence]:
        """Record a prefill step; returns the sequences whose prompts are now complete."""
        done = []
        for seq, chunk in zip(work.seqs, work.chunks, strict=True):
            seq.num_prefilled += len(chunk)
            if seq.num_prefilled == seq.prompt_len:
                seq.status = Status.DECODING
                done.append(seq)
        if self.chunking is not None and self.chunking.status is not Status.PREFILLING:
            self.chunking = None
        return done

    def fork(self, seq: Sequence, sibling: Sequence) -> None:
        """Give a reserved slot to `sibling` with a copy of `seq`'s prompt cache."""
        sibling.slot = self.kv.allocate(sibling, reserved=True)
        sibling.request.reserved -= 1
        self.kv.copy(seq.slot, sibling.slot, seq.prompt_len)
        sibling.num_prefilled = seq.num_prefilled
        sibling.status = Status.DECODING

    def free(self, seq: Sequence) -> None:
        """Release the sequence's slot (or its reservation) now."""
        if seq.slot is not None:
            moved = self.kv.release(seq.slot)
            if moved is not None:
                owner, slot = moved
                owner.slot = slot
            seq.slot = None
        if self.chunking is seq:
            self.chunking = None
        seq.status = Status.FINISHED

    def drop(self, state: RequestState) -> None:
        """The request is over (finished, aborted or expired): every slot and reservation goes back."""
        if not self.remove_waiting(state):
            for seq in state.seqs:
                if seq.status is not Status.FINISHED:
                    self.free(seq)
        self.kv.unreserve(state.reserved)
        state.reserved = 0

    def remove_waiting(self, state: RequestState) -> bool:
        try:
            self.waiting.remove(state)
            return True
        except ValueError:
            return False
