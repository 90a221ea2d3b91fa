"""What the start-up self-check (`self_check.py`) measures a graph with, whatever the kind of model: the
probe's size and seed, `Agreement` (a graph's logits against the reference's), `Invariance` (rows scored
alone against the same rows in a batch), `Probes` (the three functions a kind of model is probed with:
the decoder's in `self_check.py`, the encoder-decoder's in `seq2seq_check.py`) and `sample_tokens`, how
the reference writes the probe's tokens itself.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np

PROBE_ROWS = 8
PROBE_TOKENS = 64
PROBE_SEED = 20240
INVARIANCE_ROWS = (0, PROBE_ROWS - 1)  # probe rows scored alone and among the others
INVARIANCE_STEPS = 16  # decode steps after the prefill


@dataclass
class Agreement:
    top1: float  # fraction of probe positions where both graphs' most likely token is the same
    positions: int  # probe positions compared
    max_abs_diff: float  # largest |Δlogit| over them
    scale: float  # largest |logit| of the reference
    complete: bool = True  # False: scoring stopped before the probe's end (`scored`)

    @classmethod
    def of(cls, got: np.ndarray, want: np.ndarray) -> Agreement:
        """How closely logits `got` follow the reference's `want` (the vocabulary on the last axis)."""
        same = got.argmax(-1) == want.argmax(-1)
        return cls(top1=float(same.mean()), positions=same.size, max_abs_diff=float(np.abs(got - want).max()),
                   scale=max(float(np.abs(want).max()), 1.0))

    @classmethod
    def scored(cls, chunks: Generator[np.ndarray], want: np.ndarray, least: float | None = None) -> Agreement:
        """`of` the logits `chunks` yields, each [rows, positions, vocab] following the one before, against
        `want` [rows, tokens, vocab]. With `least`, scoring stops (and `chunks` is closed) as soon as the
        positions left could no longer lift the top-1 agreement to it: a graph that cannot pass is not run to
        the end. The result then covers the positions scored, and says it is not `complete`."""
        rows, tokens = want.shape[:2]
        got, agreed, done = [], 0, 0
        try:
            for chunk in chunks:
                span = want[:, done:done + chunk.shape[1]]
                agreed += int((chunk.argmax(-1) == span.argmax(-1)).sum())
                got.append(chunk)
                done += chunk.shape[1]
                if least is not None and agreed + rows * (tokens - done) < least * rows * tokens:
                    break
        finally:
            chunks.close()
        result = cls.of(np.concatenate(got, axis=1), want[:, :done])
        result.complete = done == tokens
        return result


@dataclass
class Invariance:
    identical: bool  # every compared logit the same bits alone and in the batch
    rows: int  # rows scored alone
    batch: int  # rows in the batch they were scored in
    max_abs_diff: float

    @classmethod
    def of(cls, alone: np.ndarray, together: np.ndarray, batch: int) -> Invariance:
        """Rows' logits scored alone against the same rows scored in a batch of `batch`."""
        return cls(identical=bool(np.array_equal(alone, together)), rows=len(alone), batch=batch,
                   max_abs_diff=float(np.abs(alone - together).max()))

    def describe(self) -> str:
        verdict = "identical" if self.identical else f"differ by up to {self.max_abs_diff:.3g}"
        return f"batch-invariant: {'yes' if self.identical else 'no'} ({self.rows} rows alone and among " \
               f"{self.batch}: logits {verdict})"


@dataclass(frozen=True)
class Probes:
    """How a kind of model is probed: `probe(reference)` makes the probe (what the reference sampled, and the
    logits it sampled from), `agreement(candidate, reference, probe)` and `batch_invariance(runner, probe)`
    measure a graph on it."""

    probe: Callable
    agreement: Callable
    batch_invariance: Callable


def sample_tokens(logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of `logits`, drawn at temperature 1 from its softmax."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(len(row), p=row) for row in p])
