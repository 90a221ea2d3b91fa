"""Check an encoder-decoder bundle against PyTorch, through the serving runner (`Seq2SeqRunner`).

- encoder: a batch of sources of mixed lengths, padded; the cross-attention keys and values of every
  real source position against `EncoderDecoder.cross_kv`;
- decoder: teacher-forced targets of mixed lengths, every real position's logits;
- greedy: each source decoded step by step from the decoder start token, as serving runs it,
  token for token against `EncoderDecoder.generate`.
Logits and keys must agree to `tol` (max |Δ|) and greedy tokens exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from export.verify import Check, Report
from model.seq2seq import EncoderDecoder
from service.runtime.seq2seq_runner import Seq2SeqRunner


def random_sources(rng: np.random.Generator, lengths: list[int], low: int, vocab: int) -> list[list[int]]:
    return [rng.integers(low, vocab, n).tolist() for n in lengths]


def verify_seq2seq(model: EncoderDecoder, bundle, tol: float = 1e-4, seed: int = 0) -> Report:
    c = model.config
    runner = Seq2SeqRunner(bundle, provider="cpu")
    rng = np.random.default_rng(seed)
    low = min(4, c.vocab_size - 1)  # ordinary tokens: past the usual specials (pad, start, eos, unk)
    lengths = [min(n, c.n_src_ctx) for n in (c.n_src_ctx, 5, 1)]
    sources = random_sources(rng, lengths, low, c.vocab_size)
    width = max(lengths)
    src = torch.tensor([s + [c.pad_token_id] * (width - len(s)) for s in sources])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sources])
    report = Report(graph="encoder + decoder", tol=tol)
    model = model.eval()
    with torch.no_grad():
        cross = model.cross_kv(model.encode(src, mask))
    steps = min(c.n_tgt_ctx, 12)
    with runner.scratch_cache(len(sources), steps):
        runner.encode(0, sources)
        diff = 0.0
        for layer, (k, v) in enumerate(cross):
            key, value = runner.source_state[2 * layer], runner.source_state[2 * layer + 1]
            for row, n in enumerate(lengths):
                got = key[row, :, :, :n].swapaxes(-1, -2) if runner.keys_transposed else key[row, :, :n]
                diff = max(diff, float(np.abs(got - k[row, :, :n].numpy()).max()),
                           float(np.abs(value[row, :, :n] - v[row, :, :n].numpy()).max()))
        report.checks.append(Check("encoder", diff, diff <= tol, f"sources of {lengths} tokens"))
        tgt_lengths = [steps, 3, 1]
        targets = [[c.decoder_start_token_id] + rng.integers(low, c.vocab_size, n - 1).tolist() for n in tgt_lengths]
        got = runner.decode_targets(0, targets)
        tw = max(tgt_lengths)
        tgt = torch.tensor([t + [c.pad_token_id] * (tw - len(t)) for t in targets])
        with torch.no_grad():
            want = model.decode(tgt, cross, mask).numpy()
        diff = max(float(np.abs(got[i, :n] - want[i, :n]).max()) for i, n in enumerate(tgt_lengths))
        report.checks.append(Check("decoder", diff, diff <= tol, f"targets of {tgt_lengths} tokens"))
    with runner.scratch_cache(len(sources), steps):
        logits = runner.prefill_batch(0, sources)
        tokens = [[] for _ in sources]
        done = np.zeros(len(sources), dtype=bool)
        for step in range(1, steps):
            ids = logits.argmax(-1)
            for i in np.flatnonzero(~done):
                tokens[i].append(int(ids[i]))
            done |= ids == c.eos_token_id
            if done.all() or step == steps - 1:
                break
            logits = runner.decode(ids, np.full(len(sources), step))
    want_tokens = model.generate(src, mask, max_new_tokens=steps - 1)
    same = sum(a == b for a, b in zip(tokens, want_tokens, strict=True))
    report.checks.append(Check("greedy", 0.0, same == len(sources),
                               f"{same}/{len(sources)} sources decode to PyTorch's tokens"))
    return report


def verify_int8_pair(bundle) -> Report:
    """The INT8 encoder and decoder against the fp32 pair on this CPU, as the start-up self-check measures
    them (`service.runtime.self_check.check`, probing with `seq2seq_check`): top-1 agreement on the probe's
    targets, and batch invariance."""
    from export.seq2seq_bundle import INT8_GRAPH
    from service.runtime.self_check import MIN_AGREEMENT, check

    reference = Seq2SeqRunner(bundle, "static", provider="cpu")
    checked = check(Seq2SeqRunner(bundle, INT8_GRAPH, provider="cpu"), reference, allow_low_agreement=True)
    agreed, invariance = checked.agreement, checked.invariance
    report = Report(graph=INT8_GRAPH, tol=float("nan"))
    least = MIN_AGREEMENT["int8"]
    report.checks.append(Check("agreement", agreed.max_abs_diff, agreed.top1 >= least,
                               f"top-1 token as fp32's at {agreed.top1:.1%} of {agreed.positions} probe positions "
                               f"(at least {least:.0%})"))
    report.checks.append(Check("invariance", invariance.max_abs_diff, invariance.identical, invariance.describe()))
    return report
