"""Who runs in the next step: iteration-level (continuous) batching under a token budget.

Every step spends one token per running sequence (the decode rows, slots [0, used)) and offers
the rest of `max_batch_tokens` to prefill, in the waiting queue's order (`waiting_queue.py`): by
priority, lower first, then first come first served:

- If a long prompt is part-way through prefill, its next chunk takes the whole remaining budget.
- Otherwise waiting requests are admitted in that order while a KV slot and the KV blocks are
  free for each of their n sequences, `max_running` is respected, and their prompts (right-padded
  to the longest) fit the budget. They are prefilled together in one call, into consecutive new slots.
- A prompt longer than the budget on its own is chunked: its first chunk starts now, and the
  requests behind it wait. No request is overtaken by one of its own priority or a less urgent one, so
  among equals none waits unboundedly; a steady stream of more urgent requests can hold it back.

Priority orders admission only: a running request is never preempted because a more urgent one arrives.

So decode never stalls for more than one budgeted step, however long the prompts are.

KV memory is held in blocks of positions (`kv_cache.py`). A sequence gets the blocks for its prompt
when it is admitted, and one more whenever its decode reaches the end of what it holds (`_grow`,
before each step). A request of one sampled sequence takes no more: it is preemptible. A request
that forks (n > 1, beams), scores its prompt or is an encoder-decoder's gets at admission the blocks
for its whole completion (prompt + max_new_tokens, per sequence), and never grows. When a sequence
must grow and no block is free, the prefix cache gives blocks back first; then a running preemptible
request is preempted, the least urgent first (the highest priority number), the newest of those first:
its slot and blocks are freed, and it goes back to the queue, keeping its priority and arrival (so ahead
of every request of its priority that arrived after it), to be prefilled again, prompt and output so far,
when blocks are free (recomputation, as vLLM does on a GPU; on a CPU "swapping" out would use the same
memory). It then feeds its last token and decodes on, its output streamed as before.

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

from dataclasses import dataclass, field

import numpy as np

from service.engine.kv_cache import KVCache
from service.engine.prefix_cache import PrefixCache
from service.engine.sequence import RequestState, Sequence, Status
from service.engine.waiting_queue import WaitingQueue


@dataclass(frozen=True)
class BlockPolicy:
    """What each request gets of the KV cache's blocks, from the cache's fixed figures alone (so any thread
    may ask: `Engine.new_request` refuses a request that could never fit before it is queued)."""

    block_tokens: int
    context: int  # positions per sequence
    n_blocks: int  # the cache's blocks
    encoder_decoder: bool
    lookahead: int  # positions a decode row may write past its fed token (speculative drafts)

    def blocks_for(self, positions: int) -> int:
        return -(-min(positions, self.context) // self.block_tokens)

    def preemptible(self, state: RequestState) -> bool:
        """Whether a request can be preempted and recomputed: one sampled sequence of a decoder, not scoring
        its prompt (whose logprobs are recorded as its chunks run)."""
        return (state.request.slots == 1 and state.beam is None and not self.encoder_decoder
                and state.prompt_logprobs is None)

    def each(self, state: RequestState) -> int:
        """The blocks each of a request's sequences gets at admission: a preemptible one's prefill (and the
        padding position a prefill call may write past it), any other's whole completion."""
        if self.preemptible(state):
            return self.blocks_for(len(state.seqs[0].prefill_tokens) + 1)
        written = 1 if self.encoder_decoder else len(state.prompt)  # an encoder-decoder's cache holds its target
        return self.blocks_for(written + state.request.stopping.max_new_tokens + 1 + self.lookahead)

    def refusal(self, state: RequestState) -> str | None:
        """Why the KV cache could never hold `state` (None: it can, once the others leave)."""
        n = state.request.slots
        need = n * self.each(state)
        if need > self.n_blocks:
            return (f"its {n} sequences of up to {need // n * self.block_tokens} positions need "
                    f"{need * self.block_tokens} positions of KV cache; the server holds "
                    f"{self.n_blocks * self.block_tokens}")
        return None


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
                 encoder_decoder: bool = False, lookahead: int = 0):
        self.kv = kv
        self.prefixes = prefixes
        if prefixes is not None:
            prefixes.share(kv)
        self.lookahead = lookahead  # positions a decode row may write past its fed token (speculative drafts)
        self.blocks = BlockPolicy(kv.block_tokens, kv.shape.max_seq, kv.n_blocks, encoder_decoder, lookahead)
        self.preemptions = 0  # since start
        self._admissions = 0
        self.max_running = min(max_running, kv.n_slots)
        self.max_batch_tokens = max_batch_tokens
        # the prompts are an encoder-decoder's sources: each is encoded whole (never chunked), and what its
        # prefill leaves in the cache is one target position, the decoder start token
        self.encoder_decoder = encoder_decoder
        self.waiting = WaitingQueue()
        self.chunking: Sequence | None = None  # a long prompt part-way through prefill

    @property
    def num_running(self) -> int:
        """Sequences holding (or promised) a slot."""
        return self.kv.used + self.kv.reserved

    def add(self, state: RequestState) -> None:
        self.waiting.add(state)

    def schedule(self) -> Batch:
        self._grow()
        batch = Batch(decode=list(self.kv.owners[:self.kv.used]))
        budget = self.max_batch_tokens - len(batch.decode)
        if self.chunking is not None:
            batch.next_chunk = self._next_chunk(self.chunking, budget)
        elif self.waiting:
            batch.new_prompts = self._admit(budget)
        return batch

    def _next_chunk(self, seq: Sequence, budget: int) -> PrefillWork:
        start = seq.num_prefilled
        return PrefillWork([seq], [seq.prefill_tokens[start:start + max(budget, 1)]], start)

    # ---- KV blocks: admission, growth, preemption ----------------------------------------------

    def preemptible(self, state: RequestState) -> bool:
        return self.blocks.preemptible(state)

    def blocks_each(self, state: RequestState) -> int:
        return self.blocks.each(state)

    def _room(self, blocks: int) -> bool:
        """Whether `blocks` are free, after the prefix cache gives back what it must."""
        short = blocks - self.kv.free_blocks
        if short > 0 and self.prefixes is not None:
            self.prefixes.evict(short)
        return blocks <= self.kv.free_blocks

    def _grow(self) -> None:
        """Give each decoding row the blocks for what its next step writes, preempting preemptible requests when
        none are free: the least urgent first, the newest of those first."""
        for seq in self.kv.owners[:self.kv.used]:  # a preemption moves slots: each sequence is seen once
            if seq.slot is None or seq.status is not Status.DECODING:
                continue
            needed = int(self.kv.lengths[seq.slot]) + 1 + self.lookahead
            while seq.slot is not None and not self._room(self.kv.missing(seq.slot, needed)):
                victim = max((s.request_state for s in self.kv.owners[:self.kv.used]
                              if s is not None and self.preemptible(s.request_state)),
                             key=lambda state: (state.request.priority, state.admitted), default=None)
                if victim is None:  # only fully reserved requests hold blocks: they never grow, so this cannot be
                    raise RuntimeError(f"no KV block free for a sequence of {needed} positions, none preemptible")
                self.preempt(victim)
            if seq.slot is not None:
                self.kv.grow(seq.slot, needed)

    def preempt(self, state: RequestState) -> None:
        """Free a preemptible request's slot and blocks and queue it again (at its priority and arrival), to be
        prefilled again with its output."""
        seq = state.seqs[0]
        seq.resume = state.prompt + seq.output_ids[:-1] if seq.output_ids else None
        moved = self.kv.release(seq.slot)
        if moved is not None:
            moved[0].slot = moved[1]
        seq.slot, seq.num_prefilled, seq.status = None, 0, Status.WAITING
        if self.chunking is seq:
            self.chunking = None
        self.waiting.add(state)
        self.preemptions += 1

    # ---- admission -------------------------------------------------------------------------------

    def _admit(self, budget: int) -> PrefillWork | None:
        batch: list[RequestState] = []
        longest = 0
        while self.waiting:
            state = self.waiting[0]
            n, length = state.request.slots, len(state.seqs[0].prefill_tokens)
            if n > self.kv.free_slots or self.num_running + n > self.max_running:
                break
            if batch and (len(batch) + 1) * max(longest, length) > budget:
                break
            blocks = self.blocks_each(state)
            if not self._room(n * blocks):
                break
            # a prompt to score is computed whole: a cached position's logits would not be
            hit = self.prefixes.match(state.seqs[0].prefill_tokens) \
                if self.prefixes and state.request.prompt_logprobs is None else None
            if hit and hit.blocks and batch:
                break  # it continues a cache: alone, at the head of the next step's prompts
            self.waiting.popleft()
            first = state.seqs[0]
            first.slot = self.kv.allocate(first, blocks)
            self.kv.reserve(n - 1, blocks)  # the siblings get slots when the prompt is in the cache
            state.reserved, state.blocks_each = n - 1, blocks
            state.admitted, self._admissions = self._admissions, self._admissions + 1
            first.status = Status.PREFILLING
            if hit is not None and first.resume is None:
                self.prefixes.count(length, hit)
            if hit and hit.blocks:  # the cached blocks go into the slot; the rest is prefilled like a chunk
                self.prefixes.load(hit, self.kv, first.slot)
                first.num_prefilled = hit.tokens
                if first.resume is None:  # a recomputation's hits are not the prompt's: usage reports the first's
                    state.cached_tokens = hit.tokens
                self.chunking = first
                return self._next_chunk(first, budget)
            if length > budget and not self.encoder_decoder:  # alone, and still too long: chunk it
                self.chunking = first
                return self._next_chunk(first, budget)
            batch.append(state)
            longest = max(longest, length)
        if not batch:
            return None
        return PrefillWork([s.seqs[0] for s in batch], [s.seqs[0].prefill_tokens for s in batch], 0)

    # ---- what ran: the KV bookkeeping follows ---------------------------------------------------

    def prefilled(self, work: PrefillWork) -> list[tuple[int, Sequence]]:
        """`work` is in the cache. Returns, for each prompt now complete, (its row in `work`, each
        sequence of its request): n > 1 siblings get their reserved slots with a copy of the prompt. A sequence
        that was preempted is not among them: it decodes on from its last token."""
        complete = []
        for row, (seq, chunk) in enumerate(zip(work.seqs, work.chunks, strict=True)):
            seq.num_prefilled += len(chunk)
            self.kv.lengths[seq.slot] = 1 if self.encoder_decoder else seq.num_prefilled
            if seq.num_prefilled < len(seq.prefill_tokens):
                continue
            seq.status = Status.DECODING
            if self.chunking is seq:
                self.chunking = None
            if self.prefixes:
                self.prefixes.store(seq.prefill_tokens, self.kv, seq.slot)
            if seq.resume is not None:
                seq.resume = None
                self.feed(seq, seq.output_ids[-1])
                continue
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
        sibling.slot = self.kv.allocate(sibling, sibling.request_state.blocks_each, reserved=True)
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
        self.kv.unreserve(state.reserved, state.blocks_each)
        state.reserved = 0

    def remove_waiting(self, state: RequestState) -> bool:
        if state.seqs[0].status is not Status.WAITING:  # admitted: not queued (and a failed remove formats
            return False  # the state's whole repr into its ValueError, a cost paid by every finished request)
        try:
            self.waiting.remove(state)
            return True
        except ValueError:
            return False
