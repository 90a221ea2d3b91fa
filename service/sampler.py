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


BLOCK = 64  # inverse-CDF sampling finds the block first, then the token inside it
CANDIDATES = 256  # top-k/top-p/min-p look at this many most likely tokens (more when a row needs it)


def draw(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Index i per row with probability weights[i] / sum(weights): inverse CDF, two-level.

    A full-row cumulative sum is sequential and slow; block sums are vectorised, and only the
    chosen block is summed token by token.
    """
    rows, width = weights.shape
    if width % BLOCK:
        weights = np.pad(weights, ((0, 0), (0, BLOCK - width % BLOCK)))
    blocks = weights.reshape(rows, -1, BLOCK)
    cum = np.cumsum(blocks.sum(axis=2).astype(np.float64), axis=1)  # [rows, n_blocks]
    target = u * cum[:, -1]
    r = np.arange(rows)
    b = np.minimum((cum <= target[:, None]).sum(axis=1), cum.shape[1] - 1)
    inner = blocks[r, b].astype(np.float64)  # [rows, BLOCK]
    before = np.where(b > 0, cum[r, np.maximum(b - 1, 0)], 0.0)
    j = ((before[:, None] + np.cumsum(inner, axis=1)) <= target[:, None]).sum(axis=1)
    last_positive = BLOCK - 1 - np.argmax(inner[:, ::-1] > 0, axis=1)  # rounding can overshoot the block
    return b * BLOCK + np.minimum(j, last_positive)


def filter_sorted(ps: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Keep-mask over probabilities sorted in descending order: top-k, then top-p, then min-p."""
    width = ps.shape[1]
    top_k = np.array([q.top_k or width for q in params])
    top_p = np.array([q.top_p for q in params])
    min_p = np.array([q.min_p for q in params])
    keep = np.arange(width)[None, :] < top_k[:, None]
    keep &= (np.cumsum(ps, axis=1) - ps) < top_p[:, None]  # the smallest prefix whose mass reaches top_p
    keep &= ps >= min_p[:, None] * ps[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    return keep


def sample_filtered(scaled: np.ndarray, params: list[SamplingParams], u: np.ndarray) -> np.ndarray:
    """top-k / top-p / min-p rows. Looks at the most likely `CANDIDATES` tokens (or top_k, if more);
    a row whose nucleus or min-p set reaches past them is redone over the whole vocabulary."""
    rows, vocab = scaled.shape
    m = scaled.max(axis=1, keepdims=True)
    z = np.exp(scaled - m).sum(axis=1, dtype=np.float64)[:, None]  # softmax normaliser over the full vocabulary
    width = min(vocab, max([CANDIDATES] + [q.top_k for q in params]))
    cand = np.argpartition(-scaled, width - 1, axis=1)[:, :width] if width < vocab else \
        np.tile(np.arange(vocab), (rows, 1))
    cl = np.take_along_axis(scaled, cand, axis=1)
    order = np.argsort(-cl, axis=1, kind="stable")
    cand = np.take_along_axis(cand, order, axis=1)
    ps = np.exp(np.take_along_axis(cl, order, axis=1) - m) / z  # [rows, width], descending
    keep = filter_sorted(ps, params)
    if width < vocab:
        short = np.array([(q.top_p < 1.0 and ps[i].sum() < q.top_p) or (q.min_p > 0 and keep[i, -1] and q.top_k == 0)
                          for i, q in enumerate(params)])
        for i in np.flatnonzero(short):  # rare: a flat distribution; sort this row in full
            full = np.argsort(-scaled[i])
            fps = np.exp(scaled[i, full] - m[i]) / z[i]
            k = filter_sorted(fps[None], [params[i]])[0]
            return_idx = draw(np.where(k, fps, 0.0)[None], u[i:i + 1])[0]
            cand[i, 0], ps[i, 0], keep[i, 0], keep[i, 1:] = full[return_idx], 1.0, True, False
    j = draw(np.where(keep, ps, 0.0), u)
    return cand[np.arange(rows), j]


def sample_rows(logits: np.ndarray, params: list[SamplingParams], u: np.ndarray) -> np.ndarray:
    """Stochastic rows: temperature, then top-k/top-p/min-p where asked, then one draw each."""
    temps = np.array([p.temperature for p in params], dtype=np.float32)
    scaled = logits / temps[:, None]
    tokens = np.empty(len(params), dtype=np.int64)
    filtered = np.array([p.filtered for p in params])
    plain = ~filtered
    if plain.any():
        x = scaled[plain]
        weights = np.exp(x - x.max(axis=1, keepdims=True))
        tokens[plain] = draw(weights, u[plain])
    if filtered.any():
        chosen = [p for p, f in zip(params, filtered, strict=True) if f]
        tokens[filtered] = sample_filtered(scaled[filtered], chosen, u[filtered])
    return tokens


def sample(logits: np.ndarray, states: list[SamplingState], top_n: int = 0) -> SampleOutput:
    """Choose one token per row of `logits` [B, vocab] (not modified)."""
    m = logits.max(axis=1)
    shifted = logits - m[:, None]
    lse = m + np.log(np.exp(shifted, out=shifted).sum(axis=1))  # [B] log-partition of the raw logits
    adjusted = logits
    if any(s.counts is not None or s.suppress for s in states):
        adjusted = np.array(logits, dtype=np.float32)  # own copy: penalties write into it
        apply_penalties(adjusted, states)
    params = [s.params for s in states]
    greedy = np.array([p.greedy for p in params])
    tokens = np.empty(len(states), dtype=np.int64)
    if greedy.all():
        tokens = adjusted.argmax(axis=1)
    elif greedy.any():
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
