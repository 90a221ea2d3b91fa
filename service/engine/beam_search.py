"""Beam search for one request: k running beams, the k best finished hypotheses, and the rule that
chooses them, as transformers' `generate(num_beams=k)` does (its `_beam_search`), in numpy.

    search = BeamSearch(width=4, eos_ids={2}, max_new_tokens=30, length_penalty=1.0, early_stopping=False)
    parents, tokens = search.step(logits)       # logits [k, vocab] of the running beams -> the next beams
    # beam i continues running beam parents[i] with tokens[i]; until search.done
    best = search.best(n)                        # [(token ids, score)], best first

Each step every running beam's log-softmax is added to its score; the 2k best continuations over all
beams are taken in order. A continuation that ends the beam (an end-of-sequence id, or the token limit)
becomes a finished hypothesis if it ranks among the first k, scored by its log-probability over its
length (generated tokens, the end id included) to the power `length_penalty`; the k best of the others
run on. The search ends when no running beam can beat the worst finished hypothesis any more (with
`early_stopping`: as soon as k hypotheses are finished), or every continuation ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.engine.sampler import log_partition

NEGLIGIBLE = -1.0e9  # the score of a beam that does not exist yet (transformers' value)


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, the end id included
    score: float  # log-probability / length ** length_penalty


@dataclass
class BeamSearch:
    width: int
    eos_ids: frozenset[int]
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers takes it
    running: list[list[int]] = field(init=False)  # each running beam's generated ids
    scores: np.ndarray = field(init=False)  # [width] their log-probabilities
    finished: list[Hypothesis] = field(init=False)  # the best `width` finished hypotheses, best first
    improvable: bool = field(init=False, default=True)  # a running beam may still beat the worst finished
    done: bool = field(init=False, default=False)

    def __post_init__(self):
        self.running = [[] for _ in range(self.width)]
        self.scores = np.full(self.width, NEGLIGIBLE, dtype=np.float32)
        self.scores[0] = 0.0  # the first step continues one beam: the others are copies of it
        self.finished = []

    def step(self, logits: np.ndarray) -> tuple[list[int], list[int]]:
        """Advance by one token: `logits` [width, vocab] of the running beams. Returns, for each next
        running beam, the running beam it continues and its new token (meaningless once `done`)."""
        k, vocab = logits.shape
        logp = logits.astype(np.float32) - log_partition(logits)[:, None]
        total = (logp + self.scores[:, None]).reshape(-1)
        keep = max(2, 1 + len(self.eos_ids)) * k
        order = _top(total, keep)
        cand_scores = total[order]
        parents, tokens = (order // vocab).tolist(), (order % vocab).tolist()
        length = len(self.running[0]) + 1  # generated tokens with this step's
        ends = np.array([t in self.eos_ids or length >= self.max_new_tokens for t in tokens])
        # the k best that go on
        going = _top(np.where(ends, cand_scores + NEGLIGIBLE, cand_scores), k)
        # the candidates that end among the first k become hypotheses, if they may still count
        if self.improvable and not (self.early_stopping is True and self._all_finished()):
            normalised = cand_scores / np.float32(length ** self.length_penalty)
            for rank in range(k):
                if ends[rank]:
                    self._add(Hypothesis(self.running[parents[rank]] + [tokens[rank]], float(normalised[rank])))
        new_parents = [parents[i] for i in going]
        new_tokens = [tokens[i] for i in going]
        self.running = [self.running[p] + [t] for p, t in zip(new_parents, new_tokens, strict=True)]
        self.scores = np.where(ends[going], cand_scores[going] + NEGLIGIBLE, cand_scores[going]).astype(np.float32)
        self._check_improvable(length)
        all_end = bool(ends.all())
        self.done = not self.improvable or (self.early_stopping is True and self._all_finished()) or all_end
        return new_parents, new_tokens

    def reorder(self, order: list[int]) -> None:
        """Running beam i becomes what was running beam order[i]."""
        self.running = [self.running[j] for j in order]
        self.scores = self.scores[order]

    def _add(self, h: Hypothesis) -> None:
        self.finished.append(h)
        self.finished.sort(key=lambda x: -x.score)  # stable: an earlier hypothesis wins a tie
        del self.finished[self.width:]

    def _all_finished(self) -> bool:
        return len(self.finished) >= self.width

    def _check_improvable(self, length: int) -> None:
        if not self._all_finished():
            return
        best_length = self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
        best_possible = float(self.scores[0]) / best_length ** self.length_penalty
        self.improvable = self.improvable and best_possible > min(h.score for h in self.finished)

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: the lower index first)."""
    part = np.argpartition(-values, k - 1)[:k] if k < len(values) else np.arange(len(values))
    return part[np.lexsort((part, -values[part]))]
