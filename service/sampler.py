"""Logits -> next tokens for a whole batch at once: pure numpy, per-row parameters, per-row RNG.

    penalties (repetition, presence, frequency) -> suppression (min_new_tokens) -> greedy rows: argmax
    -> other rows: / temperature -> softmax -> top-k, top-p, min-p -> inverse-CDF draw with the row's RNG

Every operation is row-wise, and each row draws its uniform number from its own generator, so a
seeded sequence samples the same tokens alone or in any batch. Reported logprobs are the model's
own (log-softmax of the raw logits), as vLLM reports them, not of the adjusted distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.request import SamplingParams


@dataclass
class SamplingState:
    """What the sampler keeps for one sequence between steps."""

    params: SamplingParams
    rng: np.random.Generator  # this sequence's own generator
    vocab_size: int
    counts: np.ndarray | None = None  # generated-token counts [vocab], kept only when penalties are on
    seen: np.ndarray | None = None  # prompt or generated token [vocab] bool, for the repetition penalty
    suppress: list[int] = field(default_factory=list)  # ids masked out this step (EOS before min_new_tokens)

    @classmethod
    def create(cls, params: SamplingParams, prompt: list[int], vocab_size: int, seed: int, index: int) -> SamplingState:
        state = cls(params, np.random.default_rng([seed, index]), vocab_size)
        if params.penalised:
            state.counts = np.zeros(vocab_size, dtype=np.int32)
            state.seen = np.zeros(vocab_size, dtype=bool)
            state.seen[prompt] = True
        return state

    def accept(self, token: int) -> None:
        if self.counts is not None:
            self.counts[token] += 1
            self.seen[token] = True

    def fork(self, index: int, seed: int) -> SamplingState:
        """A sibling sequence of the same request (n > 1), with its own RNG stream."""
        twin = SamplingState(self.params, np.random.default_rng([seed, index]), self.vocab_size)
        if self.counts is not None:
            twin.counts, twin.seen = self.counts.copy(), self.seen.copy()
        return twin


@dataclass
class SampleOutput:
    tokens: np.ndarray  # [B] chosen ids
    logprobs: np.ndarray  # [B] model logprob of each chosen id
    top_ids: np.ndarray | None  # [B, N] most likely ids, when any row asked for alternatives
    top_logprobs: np.ndarray | None  # [B, N] their logprobs


def apply_penalties(logits: np.ndarray, states: list[SamplingState]) -> None:
    for i, s in enumerate(states):
        p = s.params
        if s.counts is not None:
            row = logits[i]
            if p.repetition_penalty != 1.0:
                hit = s.seen
                row[hit] = np.where(row[hit] > 0, row[hit] / p.repetition_penalty, row[hit] * p.repetition_penalty)
            row -= p.frequency_penalty * s.counts + p.presence_penalty * (s.counts > 0)
        if s.suppress:
            logits[i, s.suppress] = -np.inf


def draw(probs: np.ndarray, u: np.ndarray, n_valid: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling per row; `n_valid` bounds the index (zero-probability tail)."""
    cdf = np.cumsum(probs, axis=1)
    idx = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    return np.minimum(idx, n_valid - 1)


def sample_rows(logits: np.ndarray, params: list[SamplingParams], u: np.ndarray) -> np.ndarray:
    """Stochastic rows: temperature, softmax, top-k/top-p/min-p, then one draw each."""
    temps = np.array([p.temperature for p in params], dtype=np.float32)
    scaled = logits / temps[:, None]
    probs = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    tokens = np.empty(len(params), dtype=np.int64)
    filtered = np.array([p.filtered for p in params])
    plain = ~filtered
    if plain.any():
        tokens[plain] = draw(probs[plain], u[plain], np.full(plain.sum(), probs.shape[1]))
    if filtered.any():
        fp = [p for p, f in zip(params, filtered) if f]
        p = probs[filtered]
        order = np.argsort(-p, axis=1, kind="stable")
        ps = np.take_along_axis(p, order, axis=1)
        vocab = ps.shape[1]
        top_k = np.array([q.top_k or vocab for q in fp])
        top_p = np.array([q.top_p for q in fp], dtype=np.float32)
        min_p = np.array([q.min_p for q in fp], dtype=np.float32)
        keep = np.arange(vocab)[None, :] < top_k[:, None]
        keep &= (np.cumsum(ps, axis=1) - ps) < top_p[:, None]  # the smallest prefix reaching top_p
        keep &= ps >= min_p[:, None] * ps[:, :1]
        keep[:, 0] = True  # the most likely token always survives
        ps = np.where(keep, ps, 0.0)
        j = draw(ps, u[filtered], keep.sum(axis=1))
        tokens[filtered] = order[np.arange(len(j)), j]
    return tokens


def sample(logits: np.ndarray, states: list[SamplingState], top_n: int = 0) -> SampleOutput:
    """Choose one token per row of `logits` [B, vocab] (not modified)."""
    m = logits.max(axis=1)
    lse = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))  # [B] log-partition of the raw logits
    adjusted = logits
    if any(s.counts is not None or s.suppress for s in states):
        adjusted = np.array(logits, dtype=np.float32)  # own copy: penalties write into it
        apply_penalties(adjusted, states)
    params = [s.params for s in states]
    greedy = np.array([p.greedy for p in params])
    tokens = np.empty(len(states), dtype=np.int64)
    if greedy.any():
        tokens[greedy] = adjusted[greedy].argmax(axis=1)
    if not greedy.all():
        rows = np.flatnonzero(~greedy)
        u = np.array([states[i].rng.random() for i in rows])
        tokens[rows] = sample_rows(adjusted[rows], [params[i] for i in rows], u)
    rows = np.arange(len(states))
    chosen = logits[rows, tokens] - lse
    if not top_n:
        return SampleOutput(tokens, chosen, None, None)
    top_ids = np.argpartition(-logits, top_n - 1, axis=1)[:, :top_n]
    top_lp = np.take_along_axis(logits, top_ids, axis=1) - lse[:, None]
    order = np.argsort(-top_lp, axis=1, kind="stable")
    return SampleOutput(tokens, chosen, np.take_along_axis(top_ids, order, axis=1),
                        np.take_along_axis(top_lp, order, axis=1))
