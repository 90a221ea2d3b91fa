"""Beam search inside the engine: a request's beams are its sequences, decoded in the batch beside any other
request's; after each step its `BeamSearch` chooses the next beams, and the sequences take them.

    step = BeamStep(engine)
    outputs = step.update(seqs, logits)     # the beam requests' rows of a step's sampled logits

A beam continued by several next beams keeps its slot for the first and has its keys and values (the
live prefix) copied into the slots of beams nothing continues; a beam continued by one keeps its slot
and copies nothing. An encoder-decoder's source state is the same for every beam of a request. When the
search is done, the n best hypotheses are emitted whole, completion i as sequence i, and every beam's slot
is freed.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from service.engine.detokenizer import TextStream
from service.engine.request import FinishReason, TokenEvent
from service.engine.sequence import RequestState, Sequence


class BeamStep:
    def __init__(self, engine):
        self.engine = engine

    def update(self, seqs: list[Sequence], logits: np.ndarray) -> list:
        """`seqs` are rows of beam search requests (every beam of each, in any order), `logits` their rows."""
        rows: dict[RequestState, dict[int, int]] = defaultdict(dict)
        for row, seq in enumerate(seqs):
            rows[seq.request_state][seq.index] = row
        out = []
        for state, by_index in rows.items():
            width = state.beam.width
            assert len(by_index) == width, "a beam search request decodes all its beams in every step"
            parents, tokens = state.beam.step(logits[[by_index[i] for i in range(width)]])
            if state.beam.done:
                out += self._finish(state)
            else:
                self._take(state, parents, tokens)
        return out

    def _take(self, state: RequestState, parents: list[int], tokens: list[int]) -> None:
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
        kv, scheduler = self.engine.kv, self.engine.scheduler
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
            state.first_token_at = time.monotonic()

    def _finish(self, state: RequestState) -> list:
        """The n best hypotheses as completions 0 .. n - 1, whole; every beam's slot back."""
        e = self.engine
        now = time.monotonic()
        out = []
        stop_ids = frozenset(state.request.stopping.stop_token_ids)
        for i, hyp in enumerate(state.beam.best(state.request.n)):
            text = TextStream(e.tokenizer, [])
            for k, token in enumerate(hyp.tokens):
                last = k == len(hyp.tokens) - 1
                reason = None
                if last:
                    reason = (FinishReason.STOP if token in stop_ids else FinishReason.EOS if token in e.eos_ids
                              else FinishReason.LENGTH)
                piece = "" if reason in (FinishReason.EOS, FinishReason.STOP) else text.push(token, False)[0]
                if last:
                    piece += text.finish(False)[0]
                out.append((state, TokenEvent(state.id, i, token, None, None, piece, reason, now,
                                              beam_score=hyp.score if last else None)))
        if state.first_token_at is None:
            state.first_token_at = now
        e.count_tokens(len(out))
        for seq in state.seqs:
            e.scheduler.free(seq)
        return out + e.end(state, None)
