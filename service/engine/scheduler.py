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

With a prefix cache, a prompt whose first blocks are cached gets them copied into its slot and
continues from there, like the rest of a chunked prompt: it runs alone in its call (onnxruntime's
attention continues a cache one row at a time), so it is admitted only at the head of a step's
prompts. A prompt whose logprobs are asked for is never looked up: it needs every position's logits.
A prompt's whole blocks are kept when its prefill ends, and the blocks of what a sequence
wrote (prompt and output) when it finishes, so a later chat turn finds the earlier one.

The scheduler is the one owner of the KV cache's bookkeeping: which sequence holds which slot,
how many positions each slot has written, and the token each decode row feeds next. The engine
reports what ran (`prefilled`, `decoded`, `kept_drafts`, `feed`, `free`, `drop`); the runner only reads.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from service.engine.kv_cache import KVCache
from service.engine.prefix_cache import PrefixCache
from service.engine.sequence import RequestState, Sequence, Status


@dataclass
class PrefillWork:
    """Prompts (or one chunk of a long prompt) to write into the cache: sequence i's `chunks[i]`
    go to its slot from position `start`. The sequences of one call hold consecutive slots."""

    seqs: list[Sequence]  # one sequence per prompt in this call (the first of each request)
    chunks: list[list[int]]  # token ids written this step, per sequence
    start: int  # position the chunk starts at (0 unless a long prompt is continued)

    @property
    def tokens(self) -> int:
        """What the call costs of the step's budget: the prompts padded to the longest."""
        return len(self.seqs) * max(len(c) for c in self.chunks)

    def split(self) -> list[PrefillWork]:
        """One call per prompt (to find the prompt a failing call cannot take)."""
        return [PrefillWork([seq], [chunk], self.start) for seq, chunk in zip(self.seqs, self.chunks, strict=True)]


@dataclass
class Batch:
    """One step's work. New prompts run first (their slots come after the decode rows'); the rest of
    a long prompt runs after the decode rows, which write a placeholder into its slot."""

    decode: list[Sequence] = field(default_factory=list)  # owners of slots [0, n), in slot order
    new_prompts: PrefillWork | None = None  # whole prompts, or the first chunk of a long one
    next_chunk: PrefillWork | None = None  # the next chunk of a long prompt already started

    @property
    def prefill(self) -> PrefillWork | None:
        """This step's prefill, of either kind (at most one runs per step)."""
        return self.new_prompts or self.next_chunk

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


class Scheduler:
    def __init__(self, kv: KVCache, max_running: int, max_batch_tokens: int, prefixes: PrefixCache | None = None,
                 encoder_decoder: bool = False):
        self.kv = kv
        self.prefixes = prefixes
        self.max_running = min(max_running, kv.n_slots)
        self.max_batch_tokens = max_batch_tokens
        # the prompts are an encoder-decoder's sources: each is encoded whole (never chunked), and what its
        # prefill leaves in the cache is one target position, the decoder start token
        self.encoder_decoder = encoder_decoder
        self.waiting: deque[RequestState] = deque()
        self.chunking: Sequence | None = None  # a long prompt part-way through prefill

    @property
    def num_running(self) -> int:
        """Sequences holding (or promised) a slot."""
        return self.kv.used + self.kv.reserved

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def schedule(self) -> Batch:
        batch = Batch(decode=list(self.kv.owners[:self.kv.used]))
        budget = self.max_batch_tokens - len(batch.decode)
        if self.chunking is not None:
            batch.next_chunk = self._next_chunk(self.chunking, budget)
        elif self.waiting:
            batch.new_prompts = self._admit(budget)
        return batch

    def _next_chunk(self, seq: Sequence, budget: int) -> PrefillWork:
        start = seq.num_prefilled
        return PrefillWork([seq], [seq.request_state.prompt[start:start + max(budget, 1)]], start)

    def _admit(self, budget: int) -> PrefillWork | None:
        batch: list[RequestState] = []
        longest = 0
        while self.waiting:
            state = self.waiting[0]
            n, length = state.request.slots, len(state.prompt)
            if n > self.kv.free_slots or self.num_running + n > self.max_running:
                break
            if batch and (len(batch) + 1) * max(longest, length) > budget:
                break
            # a prompt to score is computed whole: a cached position's logits would not be
            hit = self.prefixes.match(state.prompt) if self.prefixes and state.request.prompt_logprobs is None \
                else None
            if hit and hit.blocks and batch:
                break  # it continues a cache: alone, at the head of the next step's prompts
            self.waiting.popleft()
            first = state.seqs[0]
            first.slot = self.kv.allocate(first)
            self.kv.reserve(n - 1)  # the siblings get slots when the prompt is in the cache
            state.reserved = n - 1
            first.status = Status.PREFILLING
            if hit is not None:
                self.prefixes.count(length, hit)
            if hit and hit.blocks:  # the cached blocks go into the slot; the rest is prefilled like a chunk
                self.prefixes.load(hit, self.kv, first.slot)
                first.num_prefilled = state.cached_tokens = hit.tokens
                self.chunking = first
                return self._next_chunk(first, budget)
            if length > budget and not self.encoder_decoder:  # alone, and still too long: chunk it
                self.chunking = first
                return self._next_chunk(first, budget)
            batch.append(state)
            longest = max(longest, length)
        if not batch:
            return None
        return PrefillWork([s.seqs[0] for s in batch], [s.prompt for s in batch], 0)

    # ---- what ran: the KV bookkeeping follows ---------------------------------------------------

    def prefilled(self, work: PrefillWork) -> list[tuple[int, Sequence]]:
        """`work` is in the cache. Returns, for each prompt now complete, (its row in `work`, each
        sequence of its request): n > 1 siblings get their reserved slots with a copy of the prompt."""
        complete = []
        for row, (seq, chunk) in enumerate(zip(work.seqs, work.chunks, strict=True)):
            seq.num_prefilled += len(chunk)
            self.kv.lengths[seq.slot] = 1 if self.encoder_decoder else seq.num_prefilled
            if seq.num_prefilled < seq.prompt_len:
                continue
            seq.status = Status.DECODING
            if self.chunking is seq:
                self.chunking = None
            if self.prefixes:
                self.prefixes.store(seq.request_state.prompt, self.kv, seq.slot)
            complete.append((row, seq))
            for sibling in seq.request_state.seqs:
                if sibling is not seq:
                    self._fork(seq, sibling)
                    complete.append((row, sibling))
        return complete

    def decode_inputs(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The token each of slots [0, n) feeds next, and the position it goes to. A prompt part-way
        through chunked prefill feeds a placeholder where its next chunk starts (and overwrites it)."""
        return self.kv.pending[:n], self.kv.lengths[:n]  # read by the runner before `decoded` advances them

    def decoded(self, n: int) -> None:
        """Slots [0, n) have each written one more position."""
        self.kv.lengths[:n] += 1

    def kept_drafts(self, seq: Sequence, kept: int) -> None:
        """`seq`'s slot, which verified drafts after its fed token, keeps the first `kept` of them (what the
        verification wrote past them is overwritten next)."""
        self.kv.lengths[seq.slot] += kept

    def feed(self, seq: Sequence, token: int) -> None:
        """`token` is what `seq` feeds at its next decode."""
        self.kv.pending[seq.slot] = token

    def _fork(self, seq: Sequence, sibling: Sequence) -> None:
        """Give a reserved slot to `sibling` with a copy of `seq`'s prompt cache."""
        sibling.slot = self.kv.allocate(sibling, reserved=True)
        sibling.request_state.reserved -= 1
        self.kv.copy(seq.slot, sibling.slot, int(self.kv.lengths[seq.slot]))
        sibling.num_prefilled = seq.num_prefilled
        sibling.status = Status.DECODING

    def free(self, seq: Sequence) -> None:
        """Release the sequence's slot (or its reservation) now; a prefix cache keeps what it wrote."""
        if seq.slot is not None and self.prefixes and seq.status is Status.DECODING:
            written = int(self.kv.lengths[seq.slot])  # the prompt, then every output token fed back
            self.prefixes.store((seq.request_state.prompt + seq.output_ids)[:written], self.kv, seq.slot)
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
        if state.seqs[0].status is not Status.WAITING:  # admitted: not queued (and a failed remove formats
            return False  # the state's whole repr into its ValueError, a cost paid by every finished request)
        try:
            self.waiting.remove(state)
            return True
        except ValueError:
            return False
