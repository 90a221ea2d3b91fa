"""The sampler on its own (pure numpy): each transformation, and the distribution it draws from."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.request import SamplingParams
from service.engine.sampler import SequenceSampling, apply_adjustments, sample

V = 12


def state(prompt=(), seed: int = 0, index: int = 0, vocab: int = V, suppress=None, min_tokens: int = 0,
          **params) -> SequenceSampling:
    return SequenceSampling.create(SamplingParams(**params), list(prompt), vocab, seed, index,
                                suppress=np.empty(0, dtype=np.int64) if suppress is None else suppress,
                                min_tokens=min_tokens)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(0, 2, (6, V)).astype(np.float32)


def test_greedy_is_argmax(logits):
    before = logits.copy()
    out = sample(logits, [state(temperature=0.0) for _ in logits])
    assert out.tokens.tolist() == logits.argmax(axis=1).tolist()
    np.testing.assert_array_equal(logits, before)  # the input is not modified


def test_logprobs_are_log_softmax_of_the_raw_logits(logits):
    states = [state(temperature=0.0), state(temperature=0.7, seed=1), state(temperature=1.0, top_k=2, seed=2),
              state(temperature=0.0, repetition_penalty=2.0, prompt=[int(logits[3].argmax())]),
              state(temperature=0.5, presence_penalty=1.0, seed=4), state(temperature=1.5, top_p=0.5, seed=5)]
    out = sample(logits, states, top_n=4)
    lsm = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, lsm[np.arange(6), out.tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-logits, axis=1)[:, :4])
    np.testing.assert_allclose(out.top_logprobs, np.sort(lsm, axis=1)[:, ::-1][:, :4], atol=1e-5)


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=1, top_p=0.5)])
def test_filters_that_leave_one_token_are_greedy(logits, params):
    for seed in range(20):
        out = sample(logits, [state(temperature=1.5, seed=seed, index=i, **params) for i in range(len(logits))])
        assert out.tokens.tolist() == logits.argmax(axis=1).tolist()


def draw_many(row: np.ndarray, n: int, vocab: int = V, **params) -> np.ndarray:
    """`n` draws from one row in one batch: n sequences sharing one seeded generator."""
    logits = np.repeat(row[None].astype(np.float32), n, axis=0)
    rng = np.random.default_rng(12345)
    p = SamplingParams(**params)
    return sample(logits, [SequenceSampling(p, rng, vocab) for _ in range(n)]).tokens


def frequencies(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=V) / len(tokens)


ROW = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0, -2.0, 0.25, 1.25, -3.0])
N = 12_000
TOL = 0.02  # > 4.5 standard errors of a frequency near 0.3 with 12k draws


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_frequencies_match_softmax_over_temperature(temperature):
    freq = frequencies(draw_many(ROW, N, temperature=temperature))
    np.testing.assert_allclose(freq, softmax(ROW / temperature), atol=TOL)


def test_top_k_renormalises_over_the_k_most_likely():
    freq = frequencies(draw_many(ROW, N, temperature=1.0, top_k=3))
    want = np.zeros(V)
    top = np.argsort(-ROW)[:3]
    want[top] = softmax(ROW[top])
    np.testing.assert_allclose(freq, want, atol=TOL)
    assert set(np.flatnonzero(freq)) == set(top)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = softmax(ROW)
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    k = int(np.searchsorted(cum, 0.8) + 1)  # tokens needed to reach 0.8
    freq = frequencies(draw_many(ROW, N, temperature=1.0, top_p=0.8))
    want = np.zeros(V)
    want[order[:k]] = p[order[:k]] / p[order[:k]].sum()
    np.testing.assert_allclose(freq, want, atol=TOL)
    assert set(np.flatnonzero(freq)) == set(order[:k])


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    p = softmax(ROW)
    keep = p >= 0.2 * p.max()
    assert 1 < keep.sum() < V
    freq = frequencies(draw_many(ROW, N, temperature=1.0, min_p=0.2))
    want = np.where(keep, p, 0) / p[keep].sum()
    np.testing.assert_allclose(freq, want, atol=TOL)
    assert (freq[~keep] == 0).all()


def expected_keep(row: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """The filtered distribution computed the slow, obvious way: full sort, then the three rules."""
    p = softmax(row.astype(np.float64) / temperature)
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    keep = np.ones(len(p), dtype=bool)
    if top_k:
        keep &= np.arange(len(p)) < top_k
    keep &= (np.cumsum(ps) - ps) < top_p
    keep &= ps >= min_p * ps[0]
    keep[0] = True
    want = np.zeros(len(p))
    want[order[keep]] = ps[keep] / ps[keep].sum()
    return want


LARGE = 1000
LARGE_CASES = [
    ("peaked-top-p", np.random.default_rng(10).normal(0, 3.0, LARGE), dict(top_p=0.9)),
    ("flat-top-p", np.random.default_rng(11).normal(0, 0.3, LARGE), dict(top_p=0.9)),  # nucleus of ~900 tokens
    ("flat-min-p", np.random.default_rng(12).normal(0, 0.5, LARGE), dict(min_p=0.2)),  # ~520 kept
    ("top-k-400", np.random.default_rng(13).normal(0, 1.0, LARGE), dict(top_k=400)),
    ("all-three", np.random.default_rng(14).normal(0, 1.0, LARGE), dict(top_k=600, top_p=0.8, min_p=0.05)),
]


@pytest.mark.parametrize("name,row,params", LARGE_CASES, ids=[c[0] for c in LARGE_CASES])
def test_filters_over_a_large_vocabulary(name, row, params):
    """A vocabulary larger than any shortcut over the most likely few hundred tokens: the kept set
    and the draw frequencies match the full-sort definition."""
    n = 8000
    want = expected_keep(row, 0.9, **params)
    draws = draw_many(row, n, vocab=LARGE, temperature=0.9, **params)
    freq = np.bincount(draws, minlength=LARGE) / n
    kept = want > 0
    assert kept[draws].all(), "drew a token the filters exclude"
    likely = want * n >= 6  # tokens expected several times: each should have been drawn
    assert (freq[likely] > 0).mean() > 0.97
    # probability mass of bands of tokens, most likely first: matches within sampling error
    order = np.argsort(-want)[:kept.sum()]
    for band in np.array_split(order, 5):
        assert abs(freq[band].sum() - want[band].sum()) < 0.025, (name, want[band].sum())


def test_draws_are_per_row_seeded_and_independent_of_the_batch():
    rng = np.random.default_rng(3)
    rows = rng.normal(0, 1.5, (8, V)).astype(np.float32)
    params = [dict(temperature=0.8), dict(temperature=1.0, top_k=4), dict(temperature=0.0), dict(temperature=1.2, top_p=0.7),
              dict(temperature=0.9, min_p=0.1, presence_penalty=0.4), dict(temperature=1.0, repetition_penalty=1.4),
              dict(temperature=0.5), dict(temperature=2.0, top_k=6, top_p=0.9)]

    def states():
        return [state(prompt=[1, 2], seed=7, index=i, **p) for i, p in enumerate(params)]

    together, alone = states(), states()
    got = []
    for _ in range(30):
        got.append(sample(rows, together).tokens)
        for s, t in zip(together, got[-1], strict=True):
            s.accept(int(t))
    for i in range(8):
        mine = []
        for _ in range(30):
            t = int(sample(rows[i:i + 1], [alone[i]]).tokens[0])
            alone[i].accept(t)
            mine.append(t)
        assert mine == [int(g[i]) for g in got], params[i]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    row = np.array([[4.0, -1.0, 3.0, -0.5, 1.0, 0.0]], dtype=np.float32)
    s = state(prompt=[0, 1], vocab=6, repetition_penalty=2.0)
    s.accept(4)
    out = row.copy()
    apply_adjustments(out, [s])
    np.testing.assert_allclose(out[0], [2.0, -2.0, 3.0, -0.5, 0.5, 0.0])
    # the ranking changes: the prompt's token 0 loses its lead to token 2
    assert sample(row, [state(prompt=[0], vocab=6, temperature=0.0, repetition_penalty=2.0)]).tokens[0] == 2
    assert sample(row, [state(prompt=[0], vocab=6, temperature=0.0)]).tokens[0] == 0
    # below 1 it rewards repetition instead
    out = np.array([[1.0, 1.2, -3.0]], dtype=np.float32)
    apply_adjustments(out, [state(prompt=[0, 2], vocab=3, repetition_penalty=0.5)])
    np.testing.assert_allclose(out[0], [2.0, 1.2, -1.5])


def test_presence_and_frequency_penalties_subtract_for_generated_tokens():
    s = state(prompt=[5], vocab=6, presence_penalty=0.5, frequency_penalty=0.25)
    for t in (1, 1, 1, 3):
        s.accept(t)
    out = np.zeros((1, 6), dtype=np.float32)
    apply_adjustments(out, [s])
    # token 1: 0.5 + 3 x 0.25; token 3: 0.5 + 0.25; the prompt's token 5 and unseen ones: untouched
    np.testing.assert_allclose(out[0], [0.0, -1.25, 0.0, -0.75, 0.0, 0.0])
    neg = state(vocab=3, presence_penalty=-1.0, frequency_penalty=-0.5)
    neg.accept(2)
    out = np.zeros((1, 3), dtype=np.float32)
    apply_adjustments(out, [neg])
    np.testing.assert_allclose(out[0], [0.0, 0.0, 1.5])


def test_penalties_change_the_greedy_choice_and_only_their_row():
    row = np.array([[3.0, 2.9, 0.0]], dtype=np.float32)
    logits = np.repeat(row, 2, axis=0)
    pen, plain = state(vocab=3, temperature=0.0, frequency_penalty=0.2), state(vocab=3, temperature=0.0)
    pen.accept(0)
    assert sample(logits, [pen, plain]).tokens.tolist() == [1, 0]
    np.testing.assert_array_equal(logits, np.repeat(row, 2, axis=0))


def test_suppress_masks_tokens():
    row = np.array([[5.0, 4.0, 3.0, -1.0]], dtype=np.float32)
    g = state(vocab=4, temperature=0.0, suppress=np.array([0, 1]), min_tokens=1)
    assert sample(row, [g]).tokens[0] == 2
    g.accept(2)  # min_tokens reached: nothing is suppressed any more
    assert sample(row, [g]).tokens[0] == 0
    draws = draw_many(np.array([5.0, 4.0, 3.0, -1.0]), 2000, vocab=4, temperature=3.0)
    assert set(draws.tolist()) == {0, 1, 2, 3}
    rng = np.random.default_rng(1)
    sts = [SequenceSampling(SamplingParams(temperature=3.0), rng, 4, suppress=np.array([0, 3]), min_tokens=1)
           for _ in range(2000)]
    out = sample(np.repeat(row, 2000, axis=0), sts)
    assert set(out.tokens.tolist()) == {1, 2}
    # the reported logprob is still the model's own
    np.testing.assert_allclose(out.logprobs, (row[0] - np.log(np.exp(row[0]).sum()))[out.tokens], atol=1e-5)


def test_fork_gives_siblings_their_own_stream_and_a_copy_of_the_counts():
    s = state(prompt=[1], seed=9, temperature=1.0, frequency_penalty=0.1)
    twin = s.fork(1, 9)
    assert twin.counts is not s.counts and twin.seen is not s.seen
    s.accept(3)
    assert twin.counts[3] == 0 and s.counts[3] == 1
    assert twin.seen[1]
    a = [s.rng.random() for _ in range(5)]
    b = [twin.rng.random() for _ in range(5)]
    assert a != b
    assert [state(seed=9, index=1).rng.random() for _ in range(1)] == b[:1]
