"""Beam search inside the engine: a request's beams are its sequences, decoded in the batch beside any other
request's. The sample phase has the request's `BeamSearch` choose the next beams (a `BeamChoice`); this
applies the choice to the sequences, in the output step.

    step = BeamStep(kv, scheduler, tokenizer, eos_ids, end)
    outputs = step.apply(choice, now)     # the next beams taken, or, the search done, its best hypotheses emitted

A beam continued by several next beams keeps its slot for the first and has its keys and values (the
live prefix) copied into the slots of beams nothing continues; a beam continued by one keeps its slot
and copies nothing. An encoder-decoder's source state is the same for every beam of a request. When the
search is done, the n best hypotheses are emitted whole, completion i as sequence i, and every beam's slot
is freed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from service.engine.detokenizer import TextStream
from service.engine.errors import EngineError
from service.engine.kv_cache import KVCache
from service.engine.request import FinishReason, TokenEvent
from service.engine.scheduler import Scheduler
from service.engine.sequence import RequestState
from service.engine.step_data import BeamChoice, Output
from service.runtime.tokenizer import Tokenizer


class BeamStep:
    def __init__(self, kv: KVCache, scheduler: Scheduler, tokenizer: Tokenizer, eos_ids: frozenset[int],
                 end: Callable[[RequestState, EngineError | None], list[Output]]):
        self.kv = kv  # a beam continued by several has its live prefix copied into the spare beams' slots
        self.scheduler = scheduler  # feeds each beam its token, frees the slots when the search ends
        self.tokenizer = tokenizer  # the hypotheses' text
        self.eos_ids = eos_ids  # a hypothesis that ends with one of them finished with EOS
        self.end = end  # ends the request once its hypotheses are out

    def apply(self, choice: BeamChoice, now: float) -> list[Output]:
        """The next beams taken by the request's sequences; or, when its search is done, its hypotheses."""
        if choice.state.beam.done:
            return self._finish(choice.state, now)
        self._take(choice.state, choice.parents, choice.tokens, now)
        return []

    def _take(self, state: RequestState, parents: list[int], tokens: list[int], now: float) -> None:
        """Sequence i holds beam i; the next beam j continues beam parents[j] with tokens[j]."""
        children: dict[int, list[int]] = defaultdict(list)
        for j, p in enumerate(parents):
            children[p].append(j)
        spare = [i for i in range(len(parents)) if i not in children]  # beams nothing continues
        holder = {}  # next beam -> the sequence that holds it
        for p, js in children.items():
            holder[js[0]] = p
            for j in js[1:]:
                holder[j] = spare.pop()
        kv, scheduler = self.kv, self.scheduler
        seqs = state.seqs
        for j, i in holder.items():
            parent = seqs[parents[j]]
            if i != parents[j]:  # the spare slot takes the parent's keys and values
                kv.copy(parent.slot, seqs[i].slot, int(kv.lengths[parent.slot]))
        order = sorted(holder, key=holder.get)  # next beam held by sequence 0, 1, ...
        state.beam.reorder(order)
        for i, j in enumerate(order):
            seqs[i].output_ids = state.beam.running[i]  # a new list each step, never appended to
            scheduler.feed(seqs[i], tokens[j])
        if state.first_token_at is None:
            state.first_token_at = now

    def _finish(self, state: RequestState, now: float) -> list[Output]:
        """The n best hypotheses as completions 0 .. n - 1, whole; every beam's slot back."""
        out: list[Output] = []
        stop_ids = frozenset(state.request.stopping.stop_token_ids)
        for i, hyp in enumerate(state.beam.best(state.request.n)):
            text = TextStream(self.tokenizer, [])
            for k, token in enumerate(hyp.tokens):
                last = k == len(hyp.tokens) - 1
                reason = None
                if last:
                    reason = (FinishReason.STOP if token in stop_ids else FinishReason.EOS if token in self.eos_ids
                              else FinishReason.LENGTH)
                piece = "" if reason in (FinishReason.EOS, FinishReason.STOP) else text.push(token, False)[0]
                if last:
                    piece += text.finish(False)[0]
                out.append((state, TokenEvent(state.id, i, token, None, None, piece, reason, now,
                                              beam_score=hyp.score if last else None)))
        if state.first_token_at is None:
            state.first_token_at = now
        for seq in state.seqs:
            self.scheduler.free(seq)
        return out + self.end(state, None)
