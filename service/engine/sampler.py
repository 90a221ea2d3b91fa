"""Logits -> next tokens for a whole batch at once: pure numpy, per-row parameters, per-row RNG.

    grammar masks (structured output) -> logit bias -> penalties (repetition, presence, frequency) ->
    suppression (min_new_tokens) -> greedy rows: argmax
    -> other rows: / temperature -> softmax -> top-k, top-p, min-p -> inverse-CDF draw with the row's RNG

Every operation is row-wise, and each row draws its uniform number from its own generator, so a
seeded sequence samples the same tokens alone or in any batch (a row's bias, like its penalties, is
added to its own row of a copy of the logits). Reported logprobs are the model's own (log-softmax of
the raw logits), as vLLM reports them, not of the adjusted distribution: a logit bias changes which
tokens are chosen, not the logprobs reported for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from service.engine.request import SamplingParams

NO_IDS = np.empty(0, dtype=np.int64)
NO_BIAS = np.empty(0, dtype=np.float32)


@dataclass
class SequenceSampling:
    """One sequence's sampling, kept between steps: its parameters, its own seeded generator, which logprobs it
    reports, its logit bias as arrays, and the history the sampler's adjustments read (the counts and seen ids
    its penalties need, the ids it suppresses until `min_tokens` are generated)."""

    params: SamplingParams
    rng: np.random.Generator  # this sequence's own generator
    vocab_size: int
    want_logprobs: bool = True  # report the chosen token's logprob (its row pays a full-vocabulary log-softmax)
    top_logprobs: int = 0  # ... and this many most likely alternatives
    counts: np.ndarray | None = None  # generated-token counts [vocab], kept only when penalties are on
    seen: np.ndarray | None = None  # prompt or generated token [vocab] bool, for the repetition penalty
    suppress: np.ndarray = field(default_factory=lambda: NO_IDS)  # ids masked while < `min_tokens` are generated
    min_tokens: int = 0
    generated: int = 0
    bias_ids: np.ndarray = field(default_factory=lambda: NO_IDS)  # the ids `params.logit_bias` biases ...
    bias: np.ndarray = field(default_factory=lambda: NO_BIAS)  # ... and each one's bias (float32)

    @classmethod
    def create(cls, params: SamplingParams, prompt: list[int], vocab_size: int, seed: int, index: int = 0, *,
               want_logprobs: bool = True, top_logprobs: int = 0, suppress: np.ndarray = NO_IDS,
               min_tokens: int = 0) -> SequenceSampling:
        state = cls(params, np.random.default_rng([seed, index]), vocab_size, want_logprobs, top_logprobs,
                    suppress=suppress, min_tokens=min_tokens)
        if params.biased:
            state.bias_ids = np.fromiter(params.logit_bias, dtype=np.int64, count=len(params.logit_bias))
            state.bias = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias))
        if params.penalised:
            state.counts = np.zeros(vocab_size, dtype=np.int32)
            state.seen = np.zeros(vocab_size, dtype=bool)
            state.seen[prompt] = True
        return state

    @property
    def suppressing(self) -> bool:
        return self.generated < self.min_tokens and self.suppress.size > 0

    def accept(self, token: int) -> None:
        self.generated += 1
        if self.counts is not None:
            self.counts[token] += 1
            self.seen[token] = True

    def fork(self, index: int, seed: int) -> SequenceSampling:
        """A sibling sequence of the same request (n > 1), with its own RNG stream."""
        twin = replace(self, rng=np.random.default_rng([seed, index]))
        if self.counts is not None:
            twin.counts, twin.seen = self.counts.copy(), self.seen.copy()
        return twin


class SamplingBatch:
    """The parameters of a batch of rows as vectors, built once while the rows stay the same (the
    engine keeps one for its decode rows), so a step loops over rows only for per-row state: the
    biased and penalised rows, the rows still suppressing ids, and one RNG draw per sampled row."""

    def __init__(self, states: list[SequenceSampling]):
        self.states = states
        params = [s.params for s in states]
        self.greedy = np.array([p.greedy for p in params])
        self.all_greedy = bool(self.greedy.all())
        self.sampled = np.flatnonzero(~self.greedy)  # rows drawn at random
        drawn = [params[i] for i in self.sampled]
        self.temperature = np.array([p.temperature for p in drawn], dtype=np.float32)
        self.filtered = np.array([p.filtered for p in drawn], dtype=bool)  # among the drawn rows
        kept = [p for p in drawn if p.filtered]
        self.filters = Filters.of(kept)
        # the rows whose logits every step adjusts: a bias, penalties
        self.adjusted = [i for i, s in enumerate(states) if s.counts is not None or s.bias_ids.size]
        self.may_suppress = [i for i, s in enumerate(states) if s.suppress.size and s.min_tokens]
        self.logprob_rows = np.flatnonzero([s.want_logprobs or s.top_logprobs for s in states])
        self.top_n = max((s.top_logprobs for s in states), default=0)

    def __len__(self) -> int:
        return len(self.states)


@dataclass
class Filters:
    """top-k / top-p / min-p of the filtered rows, as vectors."""

    params: list[SamplingParams]
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    widest_top_k: int

    @classmethod
    def of(cls, params: list[SamplingParams]) -> Filters:
        return cls(params, np.array([q.top_k for q in params], dtype=np.int64), np.array([q.top_p for q in params]),
                   np.array([q.min_p for q in params]), max([q.top_k for q in params], default=0))

    def rows(self, index: np.ndarray) -> Filters:
        if len(index) == len(self.params):
            return self
        return Filters.of([self.params[i] for i in index])


@dataclass
class SampleOutput:
    tokens: np.ndarray  # [B] chosen ids
    logprobs: np.ndarray  # [B] model logprob of each chosen id (NaN for rows that asked for none)
    top_ids: np.ndarray | None  # [B, N] most likely ids, when any row asked for alternatives
    top_logprobs: np.ndarray | None  # [B, N] their logprobs

    def top(self, row: int, k: int) -> list[tuple[int, float]] | None:
        if not k or self.top_ids is None:
            return None
        return list(zip(self.top_ids[row, :k].tolist(), self.top_logprobs[row, :k].tolist(), strict=True))


def apply_adjustments(logits: np.ndarray, states: list[SequenceSampling], rows: list[int] | None = None) -> None:
    """Logit bias, penalties and suppression, in place, for `rows` (default: every row). A bias added to -inf
    (a token the grammar masks) leaves it -inf: no bias makes a masked token possible."""
    for i in range(len(states)) if rows is None else rows:
        s = states[i]
        p = s.params
        if s.bias_ids.size:
            logits[i, s.bias_ids] += s.bias
        if s.counts is not None:
            row = logits[i]
            if p.repetition_penalty != 1.0:
                hit = s.seen
                row[hit] = np.where(row[hit] > 0, row[hit] / p.repetition_penalty, row[hit] * p.repetition_penalty)
            row -= p.frequency_penalty * s.counts + p.presence_penalty * (s.counts > 0)
        if s.suppressing:
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


def filter_sorted(ps: np.ndarray, filters: Filters) -> np.ndarray:
    """Keep-mask over probabilities sorted in descending order: top-k, then top-p, then min-p."""
    width = ps.shape[1]
    top_k = np.where(filters.top_k > 0, filters.top_k, width)
    keep = np.arange(width)[None, :] < top_k[:, None]
    keep &= (np.cumsum(ps, axis=1) - ps) < filters.top_p[:, None]  # the smallest prefix whose mass reaches top_p
    keep &= ps >= filters.min_p[:, None] * ps[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    return keep


def sample_filtered(scaled: np.ndarray, filters: Filters, u: np.ndarray) -> np.ndarray:
    """top-k / top-p / min-p rows. Looks at the most likely `CANDIDATES` tokens (or top_k, if more).
    Rows whose nucleus or min-p set reaches past them (flat distributions) are done over the whole
    vocabulary, together: at once when the candidates cannot hold top_p of the mass whatever they are,
    otherwise after the candidates show it."""
    rows, vocab = scaled.shape
    e = np.exp(scaled - scaled.max(axis=1, keepdims=True))  # the most likely token has 1
    z = e.sum(axis=1, dtype=np.float64)[:, None].astype(np.float32)  # softmax normaliser, summed in float64
    width = min(vocab, max(CANDIDATES, filters.widest_top_k))
    if width == vocab:
        return _sample_whole_rows(e, z, filters, u)
    tokens = np.empty(rows, dtype=np.int64)
    whole = (filters.top_p < 1.0) & (width / z[:, 0] < filters.top_p)  # width tokens of mass <= 1/z each
    part = np.flatnonzero(~whole)
    if part.size:
        cand = np.argpartition(-e[part], width - 1, axis=1)[:, :width]
        ce = np.take_along_axis(e[part], cand, axis=1)
        order = np.argsort(-ce, axis=1, kind="stable")
        cand = np.take_along_axis(cand, order, axis=1)
        ps = np.take_along_axis(ce, order, axis=1) / z[part]  # [rows, width], descending
        mine = filters.rows(part)
        keep = filter_sorted(ps, mine)
        tokens[part] = cand[np.arange(part.size), draw(np.where(keep, ps, 0.0), u[part])]
        short = ((mine.top_p < 1.0) & (ps.sum(axis=1) < mine.top_p)) | \
                ((mine.min_p > 0) & keep[:, -1] & (mine.top_k == 0))
        whole[part[short]] = True
    redo = np.flatnonzero(whole)
    if redo.size:
        tokens[redo] = _sample_whole_rows(e[redo], z[redo], filters.rows(redo), u[redo])
    return tokens


def _sample_whole_rows(e: np.ndarray, z: np.ndarray, filters: Filters, u: np.ndarray) -> np.ndarray:
    """The filters over the whole vocabulary, then a draw among the tokens kept, in vocabulary order."""
    return draw(_kept_weights(e, z, filters), u)


def _kept_weights(e: np.ndarray, z: np.ndarray, filters: Filters) -> np.ndarray:
    """`e` (unnormalised probabilities, normaliser `z`) with the filtered-out tokens at 0: sort the values
    (not the indices: several times faster) and find each row's cut-off."""
    desc = np.sort(e, axis=1)[:, ::-1]
    keep = filter_sorted(desc / z, filters)  # a prefix of each row
    cutoff = desc[np.arange(len(desc)), keep.sum(axis=1) - 1]
    return np.where(e >= cutoff[:, None], e, 0.0)


def sample_rows(logits: np.ndarray, batch: SamplingBatch, u: np.ndarray) -> np.ndarray:
    """The drawn rows (`batch.sampled`): temperature, then top-k/top-p/min-p where asked, then one draw each."""
    scaled = logits / batch.temperature[:, None]
    tokens = np.empty(len(batch.sampled), dtype=np.int64)
    plain = ~batch.filtered
    if plain.all():
        return draw(np.exp(scaled - scaled.max(axis=1, keepdims=True)), u)
    if plain.any():
        x = scaled[plain]
        tokens[plain] = draw(np.exp(x - x.max(axis=1, keepdims=True)), u[plain])
    tokens[batch.filtered] = sample_filtered(scaled[batch.filtered], batch.filters, u[batch.filtered])
    return tokens


def sample(logits: np.ndarray, batch: SamplingBatch | list[SequenceSampling], top_n: int = 0,
           masks: tuple[np.ndarray, np.ndarray] | None = None, u: np.ndarray | None = None) -> SampleOutput:
    """Choose one token per row of `logits` [B, vocab] (not modified). `masks` = (rows, allowed [R, vocab]
    bool): those rows may choose only allowed tokens. `u`: the drawn rows' uniforms (`batch.sampled` order),
    drawn from each row's generator when not given. Logprobs are computed only for the rows that asked
    for them; the others get NaN."""
    if not isinstance(batch, SamplingBatch):
        batch = SamplingBatch(batch)
    states = batch.states
    adjust = batch.adjusted + [i for i in batch.may_suppress if states[i].suppressing and i not in batch.adjusted]
    adjusted = logits
    if masks is not None:
        rows, allowed = masks
        adjusted = np.array(logits, dtype=np.float32)  # own copy: biases and penalties may write into it
        if len(rows) == len(logits):
            np.copyto(adjusted, np.float32(-np.inf), where=~allowed)
        else:
            adjusted[rows] = np.where(allowed, adjusted[rows], np.float32(-np.inf))
    elif adjust:
        adjusted = np.array(logits, dtype=np.float32)  # own copy: biases and penalties write into it
    if adjust:
        apply_adjustments(adjusted, states, adjust)
    if batch.all_greedy:
        tokens = adjusted.argmax(axis=1)
    else:
        tokens = np.empty(len(batch), dtype=np.int64)
        if batch.sampled.size < len(batch):
            tokens[batch.greedy] = adjusted[batch.greedy].argmax(axis=1)
        if u is None:
            u = np.array([states[i].rng.random() for i in batch.sampled])
        tokens[batch.sampled] = sample_rows(adjusted[batch.sampled], batch, u)
    return with_logprobs(logits, tokens, batch.logprob_rows, max(top_n, batch.top_n))


def with_logprobs(logits: np.ndarray, tokens: np.ndarray, rows: np.ndarray, top_n: int) -> SampleOutput:
    """The chosen tokens' logprobs (and the top-N) under the raw logits, for `rows` only."""
    logprobs = np.full(len(tokens), np.nan, dtype=np.float32)
    if not rows.size:
        return SampleOutput(tokens, logprobs, None, None)
    x = logits if rows.size == len(tokens) else logits[rows]
    lse = log_partition(x)
    logprobs[rows] = x[np.arange(len(rows)), tokens[rows]] - lse
    if not top_n:
        return SampleOutput(tokens, logprobs, None, None)
    top_ids = np.zeros((len(tokens), top_n), dtype=np.int64)
    top_lp = np.full((len(tokens), top_n), np.nan, dtype=np.float32)
    top_ids[rows], top_lp[rows] = most_likely(x, lse, top_n)
    return SampleOutput(tokens, logprobs, top_ids, top_lp)


def log_partition(x: np.ndarray) -> np.ndarray:
    """[R] the log-partition of each row of raw logits [R, vocab]: a row's logprobs are x - it."""
    m = x.max(axis=1)
    return m + np.log(np.exp(x - m[:, None]).sum(axis=1))


def most_likely(x: np.ndarray, lse: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n most likely ids of each row of `x` [R, vocab] and their logprobs ([R, n] each), most likely first."""
    ids = np.argpartition(-x, n - 1, axis=1)[:, :n]
    lp = np.take_along_axis(x, ids, axis=1) - lse[:, None]
    order = np.argsort(-lp, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(lp, order, axis=1)
