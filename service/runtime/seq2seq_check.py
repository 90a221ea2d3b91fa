"""The start-up self-check's probe for an encoder-decoder graph (`self_check.py` has the rules it serves).

The probe is `PROBE_ROWS` random sources of mixed lengths, and for each a target the fp32 graph samples
itself at temperature 1 with a fixed seed, `PROBE_TOKENS` tokens at most (the decoder start token
first), with the logits it sampled them from. A graph scores the targets as serving runs them, which is
how the reference sampled them: the sources encoded together and the start token decoded (a prefill),
then one decode step per target token, each reading the cache the steps before wrote. Batch invariance
compares rows scored alone with the same rows among all the others, whose sources have other lengths, so
the encoder's padding is probed too.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from service.runtime import probes
from service.runtime.seq2seq_runner import Seq2SeqRunner

SOURCE_LENGTHS = (1, 3, 5, 8, 11, 14, 17, 20)  # one per probe row, cut to the source positions a slot holds


@dataclass
class Probe:
    sources: list[list[int]]
    targets: np.ndarray  # [rows, tokens]: the decoder start token, then what the reference sampled
    logits: np.ndarray  # [rows, tokens, vocab]: the reference's logits after each target token


def probe(reference: Seq2SeqRunner, rows: int = probes.PROBE_ROWS, tokens: int = probes.PROBE_TOKENS,
          seed: int = probes.PROBE_SEED) -> Probe:
    m = reference.manifest.model
    tokens = min(tokens, m.n_ctx)
    sampleable = min(reference.tokenizer.vocab_size, m.vocab_size)
    low = min(4, sampleable - 1)  # ordinary tokens: past the usual specials (pad, start, end, unknown)
    rng = np.random.default_rng(seed)
    lengths = [min(SOURCE_LENGTHS[i % len(SOURCE_LENGTHS)], reference.max_source) for i in range(rows)]
    sources = [rng.integers(low, sampleable, n).tolist() for n in lengths]
    targets = np.full((rows, tokens), m.decoder_start_token_id, dtype=np.int64)
    with reference.scratch_cache(rows, tokens):
        logits = np.empty((rows, tokens, reference.vocab_size), dtype=np.float32)
        logits[:, 0] = reference.prefill_batch(0, sources)
        for t in range(1, tokens):
            targets[:, t] = probes.sample_tokens(logits[:, t - 1, :sampleable], rng)
            logits[:, t] = reference.decode(targets[:, t], np.full(rows, t))
    return Probe(sources, targets, logits)


def served_chunks(runner: Seq2SeqRunner, sources: list[list[int]], targets: np.ndarray) -> Generator[np.ndarray]:
    """[rows, 1, vocab] per target position: the logits after each target token, as serving computes them
    (the prefill's, then each decode step's)."""
    rows, tokens = targets.shape
    with runner.scratch_cache(rows, tokens):
        yield runner.prefill_batch(0, sources).astype(np.float32)[:, None]
        for t in range(1, tokens):
            yield runner.decode(targets[:, t], np.full(rows, t)).astype(np.float32)[:, None]


def served_logits(runner: Seq2SeqRunner, sources: list[list[int]], targets: np.ndarray) -> np.ndarray:
    """[rows, tokens, vocab]: the logits after each target token, as serving computes them."""
    return np.concatenate(list(served_chunks(runner, sources, targets)), axis=1)


def agreement(candidate: Seq2SeqRunner, reference: Seq2SeqRunner, p: Probe,
              least: float | None = None) -> probes.Agreement:
    """How closely `candidate` follows the logits `reference` sampled the probe from; with `least`, stopping
    once it can no longer reach that top-1 agreement."""
    return probes.Agreement.scored(served_chunks(candidate, p.sources, p.targets), p.logits, least)


def batch_invariance(runner: Seq2SeqRunner, p: Probe) -> probes.Invariance:
    steps = min(probes.INVARIANCE_STEPS + 1, p.targets.shape[1])
    targets = p.targets[:, :steps]
    together = served_logits(runner, p.sources, targets)
    probed = sorted({r % len(p.sources) for r in probes.INVARIANCE_ROWS})
    alone = np.stack([served_logits(runner, [p.sources[r]], targets[r:r + 1])[0] for r in probed])
    return probes.Invariance.of(alone, together[probed], len(p.sources))


SEQ2SEQ_PROBES = probes.Probes(probe, agreement, batch_invariance)
