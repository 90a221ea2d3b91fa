"""Speculative decoding: tokens proposed cheaply, then checked by the target model in one call.

    index = NgramIndex(max_ngram=3); index.extend(prompt + output)
    drafts = index.propose(k)                             # up to k ids that followed the history's last n-gram
    emitted = accept(logits, drafts, state, masks)        # the tokens the target keeps, one more than the drafts kept

A row feeds its pending token and its k drafts in one call (`StaticRunner.prefill` from the row's length);
position j's logits are the target's distribution after the drafts before j. `accept` walks the drafts:

- greedy rows keep a draft while it is the target's argmax, then add the target's own token, so the
  text is the one decoding without speculation gives (up to the attention kernel's rounding of a
  several-position call, about 1e-6: docs/speculative.md);
- sampled rows keep a draft d with probability p(d), the rule of Leviathan et al. / Chen et al. (2023)
  for a certain draft (q(d) = 1), and otherwise take a token that follows p without d: `_match` draws
  the target's own token with the sequence's next uniform, as decoding without speculation would, and
  keeps d if it is that token; so the sampled output does not depend on which steps speculated. After k
  kept drafts the target's last position gives one more token.

p is what the sampler would draw from at that position: the grammar mask, logit bias, penalties and suppression
as if the drafts before it were generated, then temperature and top-k/top-p/min-p. Every uniform
number comes from the sequence's own generator, so a seeded request repeats itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from service.engine.sampler import SamplingBatch, SequenceSampling, apply_adjustments, sample_rows

MAX_NGRAM = 3  # the longest suffix looked up in the history
MIN_NGRAM = 1


FIRST_ACCEPTANCE = 0.5  # a new sequence's estimate, before any of its drafts were checked
ACCEPTANCE_MEMORY = 0.7  # weight of the previous estimate in each update (the rest: this step's share)


@dataclass
class Speculation:
    """One sequence's speculative decoding: its estimate of the share of its drafts the target keeps, its
    prompt lookup, and its counts (its last event reports them). Made at the sequence's first speculative step."""

    acceptance: float  # the share of its drafts the target keeps, averaged over its steps (the policy's)
    index: NgramIndex  # its prompt lookup
    proposed: int = 0  # draft tokens the target checked (the output step counts them)
    accepted: int = 0  # of those, the ones it kept and the sequence emitted (likewise)


def averaged(estimate: float, share: float) -> float:
    """An acceptance estimate after one more step's share of kept drafts (an exponential average)."""
    return ACCEPTANCE_MEMORY * estimate + (1 - ACCEPTANCE_MEMORY) * share


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a row yields in expectation from k drafts, each kept with probability `acceptance`."""
    a = min(acceptance, 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


class NgramIndex:
    """Prompt lookup for one sequence: where each n-gram (n = 1 .. max_ngram) of its history last occurred,
    kept up to date as the history grows, so a proposal costs a few dictionary lookups. `propose` gives
    the tokens that followed the latest earlier occurrence of the history's last n tokens, the longest n
    first: text that repeats or edits the prompt is proposed from it."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []
        self._follows: dict[tuple[int, ...], int] = {}  # n-gram -> where what followed its latest occurrence starts

    def extend(self, tokens: list[int]) -> None:
        h = self.history
        for token in tokens:
            h.append(token)
            end = len(h) - 1  # the n-grams ending just before `token` are now followed by it
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._follows[tuple(h[end - n:end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to `k` ids to follow the history (its last id the one being fed now)."""
        h = self.history
        for n in range(min(self.max_ngram, len(h)), self.min_ngram - 1, -1):
            start = self._follows.get(tuple(h[len(h) - n:]))
            if start is not None:
                return h[start:start + k]
        return []


@dataclass
class Verdict:
    """What the target made of one row's drafts."""

    tokens: list[int]  # the drafts kept, then the target's own token
    kept: int  # drafts kept


def accept(logits: np.ndarray, drafts: list[int], state: SequenceSampling, allowed: np.ndarray | None = None
           ) -> Verdict:
    """The tokens the target keeps of `drafts` (certain drafts, as prompt lookup's): `logits` [k + 1, vocab] are
    the target's at the row's k + 1 fed positions (not modified); `allowed` [k + 1, vocab] the grammar masks
    after each draft prefix."""
    k = len(drafts)
    adjusted = target_logits(logits, drafts, state, allowed)
    if state.params.greedy:
        best = adjusted.argmax(axis=1)
        kept = 0
        while kept < k and best[kept] == drafts[kept]:
            kept += 1
        return Verdict(drafts[:kept] + [int(best[kept])], kept)
    return _match(adjusted, drafts, state)


def _match(adjusted: np.ndarray, drafts: list[int], state: SequenceSampling) -> Verdict:
    """Certain drafts, sampled: at each position the target draws its own token as the sampler would,
    with the sequence's next uniform, and a draft is kept while it is that token. A draft d is so kept
    with probability p(d), and otherwise the token follows p without d: the rule above for q(d) = 1. One
    uniform per emitted token, drawn as decoding without speculation draws it, so the output is the same
    tokens as decoding without speculation (up to the logits' rounding)."""
    batch = SamplingBatch([state])
    for j in range(len(drafts) + 1):
        token = int(sample_rows(adjusted[j:j + 1], batch, np.array([state.rng.random()]))[0])
        if j == len(drafts) or token != drafts[j]:
            return Verdict(drafts[:j] + [token], j)
    raise AssertionError("unreachable")


def target_logits(logits: np.ndarray, drafts: list[int], state: SequenceSampling,
                  allowed: np.ndarray | None) -> np.ndarray:
    """Each position's logits as the sampler would adjust them, the drafts before it counted as generated:
    the grammar mask, then logit bias, penalties and suppression (the same operations `sample` applies, row
    by row)."""
    adjusted = np.array(logits, dtype=np.float32)
    if allowed is not None:
        np.copyto(adjusted, np.float32(-np.inf), where=~allowed)
    if state.counts is None and not state.bias_ids.size and not state.suppressing:  # suppression only ever ends
        return adjusted
    ahead = copy.copy(state)
    if state.counts is not None:
        ahead.counts, ahead.seen = state.counts.copy(), state.seen.copy()
    for j in range(len(logits)):
        if j:
            ahead.accept(drafts[j - 1])
        apply_adjustments(adjusted[j:j + 1], [ahead])
    return adjusted
