"""The sample phase of a step: a model call's logits -> each row's tokens, chosen by what the row is.

    step = SampleStep(grammars, vocab_size, sampleable)
    sampled = step.choose(ran)          # a RunnerOutput in; a Sampled out, for `OutputStep.apply`

- a beam search request's rows (every beam of it) go to its `BeamSearch` together, which chooses the next
  beams: their parents and tokens (`BeamChoice`);
- a row that fed speculation's drafts keeps the drafts the target accepts, then the target's own token
  (`speculative.accept`, with the grammar's masks after each draft prefix);
- every other row is sampled by `sampler.sample`, vectorised over the rows: grammar masks, penalties,
  temperature and filters, one uniform from each sampled row's own generator.

Ids past the tokenizer's vocabulary (a padded output head) are never chosen: their logits are set to -inf.
It changes no KV state: the output step applies what it chose.

A fault that can be laid to a row fails that row's request alone (`ModelError`, ended by the output step),
and the other rows are chosen as they would be without it: a beam search steps request by request, drafts are
accepted row by row, and when the vectorised sampler (or a batch of grammar masks) raises, its rows are
sampled again one at a time, each with the uniform it already drew, so a seeded row's tokens do not change.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np

from service.engine.errors import ModelError
from service.engine.grammar import Grammars, allowed
from service.engine.sampler import SampleOutput, SamplingBatch, sample, with_logprobs
from service.engine.sequence import RequestState, Sequence
from service.engine.speculative import accept
from service.engine.step_data import BeamChoice, Drafted, RunnerOutput, Sampled, Verification

log = logging.getLogger(__name__)


class SampleStep:
    def __init__(self, grammars: Grammars, vocab_size: int, sampleable: int):
        self.grammars = grammars  # the constrained rows' masks
        self.vocab_size = vocab_size  # the logits' width
        self.sampleable = sampleable  # ids the tokenizer can turn into text: the rest are never chosen
        self._batch: tuple[tuple[int, ...], SamplingBatch] | None = None  # the last rows' batch, reused

    def choose(self, ran: RunnerOutput) -> Sampled:
        """Each row's tokens (or each beam search's next beams); the requests whose choice failed as faults."""
        sampled = Sampled(failed=ran.failed)
        seqs = ran.seqs
        if not seqs:
            return sampled
        logits = self._only_sampleable(ran.logits) if ran.logits is not None else None
        beam_rows = [i for i, seq in enumerate(seqs) if seq.request_state.beam is not None]
        if not beam_rows and not ran.verified:  # every row sampled: the usual step
            self._sample(seqs, logits, sampled)
            return sampled
        beams: dict[RequestState, list[int]] = defaultdict(list)
        for i in beam_rows:
            beams[seqs[i].request_state].append(i)
        for state, rows in beams.items():
            self._beam_step(state, [seqs[i] for i in rows], logits[rows], sampled)
        plain = [i for i in range(len(seqs)) if i not in ran.verified and seqs[i].request_state.beam is None]
        if plain:
            self._sample([seqs[i] for i in plain], logits[plain], sampled)
        for i, verification in sorted(ran.verified.items()):
            self._accept(seqs[i], verification, sampled)
        return sampled

    def _only_sampleable(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (the vocabulary on the last axis) with the ids past `sampleable` at -inf, in place."""
        if self.sampleable < logits.shape[-1]:
            logits[..., self.sampleable:] = -np.inf
        return logits

    def _fault(self, sampled: Sampled, state: RequestState, error: Exception, what: str) -> None:
        """`state`'s tokens could not be chosen: the output step ends it; the details go to the log with its id."""
        log.error("request %s: %s failed", state.id, what, exc_info=error)
        sampled.faults.append((state, ModelError("the server failed choosing this request's tokens",
                                                 detail=f"{what}: {type(error).__name__}: {error}")))

    # ---- beam search ------------------------------------------------------------------------------

    def _beam_step(self, state: RequestState, seqs: list[Sequence], logits: np.ndarray, sampled: Sampled) -> None:
        """The request's next beams from its beams' rows (any order; every beam decodes in every step)."""
        try:
            if len(seqs) != state.beam.width:
                raise RuntimeError(f"{len(seqs)} of its {state.beam.width} beams were decoded")
            order = sorted(range(len(seqs)), key=lambda row: seqs[row].index)  # beam i is sequence i
            parents, tokens = state.beam.step(logits[order])
        except Exception as e:
            self._fault(sampled, state, e, "the beam search step")
            return
        sampled.beams.append(BeamChoice(state, parents, tokens))

    # ---- the sampler ----------------------------------------------------------------------------

    def _sample(self, seqs: list[Sequence], logits: np.ndarray, sampled: Sampled) -> None:
        """One token per row, vectorised; if that raises, row by row with the uniforms already drawn."""
        batch = self._batch_of(seqs)
        u: list[float] = []  # the sampled rows' uniforms, in `batch.sampled` order, as they are drawn
        try:
            for i in batch.sampled:
                u.append(seqs[i].sampling.rng.random())
            result = sample(logits, batch, masks=self._masks_of(seqs), u=np.array(u))
        except Exception:
            if len(seqs) == 1:
                self._sample_one(seqs[0], logits, u[0] if u else None, sampled)
                return
            log.warning("sampling %d rows together failed; sampling them one at a time", len(seqs))
            drawn = dict(zip(batch.sampled.tolist(), u, strict=False))
            for i, seq in enumerate(seqs):
                self._sample_one(seq, logits[i:i + 1], drawn.get(i), sampled)
            return
        self._take(result, seqs, sampled)

    @staticmethod
    def _take(result: SampleOutput, seqs: list[Sequence], sampled: Sampled) -> None:
        """The sampler's tokens, logprobs and alternatives for `seqs`, as Python values."""
        sampled.seqs += seqs
        sampled.tokens += result.tokens.tolist()  # Python numbers, once per call
        sampled.logprobs += [None if lp != lp else lp for lp in result.logprobs.tolist()]  # NaN: none asked for
        sampled.tops += [None] * len(seqs) if result.top_ids is None else [
            result.top(i, seq.request.top_logprobs) for i, seq in enumerate(seqs)]

    def _sample_one(self, seq: Sequence, logits: np.ndarray, u: float | None, sampled: Sampled) -> None:
        """One row alone (after a batch of them raised): its request fails if it raises again."""
        try:
            batch = SamplingBatch([seq.sampling])
            if batch.sampled.size and u is None:
                u = seq.sampling.rng.random()
            result = sample(logits, batch, masks=self._masks_of([seq]), u=np.array([u] if batch.sampled.size else []))
        except Exception as e:
            self._fault(sampled, seq.request_state, e, "sampling")
            return
        self._take(result, [seq], sampled)

    def _masks_of(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, allowed tokens) of the constrained rows among `seqs`."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        bitmask = self.grammars.masks([seqs[i].matcher for i in rows])
        return np.array(rows), allowed(bitmask, self.vocab_size)

    def _batch_of(self, seqs: list[Sequence]) -> SamplingBatch:
        """The rows' sampling parameters as vectors, rebuilt only when the rows change."""
        key = tuple(id(s.sampling) for s in seqs)  # the cached batch holds these states: their ids stay theirs
        if self._batch is None or self._batch[0] != key:
            self._batch = key, SamplingBatch([s.sampling for s in seqs])
        return self._batch[1]

    # ---- drafts ---------------------------------------------------------------------------------

    def _accept(self, seq: Sequence, verification: Verification, sampled: Sampled) -> None:
        """The drafts the target keeps, then its own token, with their logprobs as the sampler reports them."""
        drafts = verification.drafts
        try:
            logits = self._only_sampleable(verification.logits)
            verdict = accept(logits, drafts, seq.sampling, self._draft_masks(seq, drafts))
            scored = self._logprobs(logits[:len(verdict.tokens)], verdict.tokens, seq)
        except Exception as e:
            self._fault(sampled, seq.request_state, e, "accepting drafts")
            return
        logprobs = [None if lp != lp else lp for lp in scored.logprobs.tolist()]  # NaN: none asked for
        tops = [scored.top(j, seq.request.top_logprobs) for j in range(len(verdict.tokens))]
        sampled.drafted.append(Drafted(seq, verdict.tokens, logprobs, tops, len(drafts), verdict.kept))

    def _draft_masks(self, seq: Sequence, drafts: list[int]) -> np.ndarray | None:
        """The grammar's allowed tokens after each prefix of `drafts` [k + 1, vocab] (None: unconstrained)."""
        m = seq.matcher
        if m is None:
            return None
        bits = [self.grammars.masks([m])]
        for token in drafts:
            m.consume_token(token)
            bits.append(self.grammars.masks([m]))
        m.rollback(len(drafts))
        return allowed(np.concatenate(bits), self.vocab_size)

    @staticmethod
    def _logprobs(rows: np.ndarray, tokens: list[int], seq: Sequence) -> SampleOutput:
        """The model's own logprobs of the row's emitted `tokens` (and alternatives), as the sampler reports them."""
        s = seq.sampling
        asked = np.arange(len(tokens)) if s.want_logprobs or s.top_logprobs else np.arange(0)
        return with_logprobs(rows.astype(np.float32), np.array(tokens), asked, s.top_logprobs)
