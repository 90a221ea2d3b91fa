"""The engine's speculative decode step: which rows propose how many tokens, a verification call for each
row that does (its fed token and drafts, `StaticRunner.prefill` from the row's length), a plain decode
for the rest, and each row's kept tokens through the output step. onnxruntime's attention continues a
cache with several tokens for one row at a time, hence a call per speculating row.

    step = SpeculativeStep.of(engine, config)   # None when config.speculative is "off"
    step.calibrate()                       # at warm-up: the model's call times by rows and tokens per row
    drafts = step.plan(decode)             # {row: drafts}; empty when decoding as usual costs less
    outputs = step.run(decode, drafts)
    step.stats()                           # drafts, draft tokens and accepted tokens since start

The policy (docs/speculative.md): each sequence keeps an estimate `a` of the share of its drafts the
target kept (an exponential average over its recent steps); a row that proposes k tokens then yields
(1 - a^(k+1)) / (1 - a) tokens in expectation. A row proposes the k that maximises its expected tokens
per second of its verification call; the step then speculates only if the batch's expected tokens per
second beat a plain decode's, counting a call per speculating row (and the decode of the others). The
seconds are the call times measured at start-up, so speculation stops by itself where the calls cost
more than the drafts yield: in practice beyond a batch of one or two.

A draft token counts as accepted when the target kept it and the sequence emitted it (a stop met before
it drops it): the engine's counters and each sequence's (`Speculation`, on its last event) count alike.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from service.engine.config import EngineConfig
from service.engine.grammar import allowed
from service.engine.request import TokenEvent
from service.engine.sampler import SamplingBatch, sample, with_logprobs
from service.engine.sequence import Sequence, Status
from service.engine.speculative import (
    FIRST_ACCEPTANCE,
    NgramIndex,
    Speculation,
    Verdict,
    accept,
    averaged,
    expected_tokens,
)

log = logging.getLogger(__name__)

CALIBRATION_ROUNDS = 3
RATE_MEMORY = 0.9  # weight of the previous tokens/s in each update of a step kind's measured rate
TRIAL_EVERY = 16  # steps a losing speculation sits out before it is tried again, at first
LONGEST_SIT_OUT = 512  # ... doubling after each trial it loses, up to this


@dataclass(frozen=True)
class SpeculationStats:
    """Speculative decoding since the engine started, as its snapshot carries it (all 0 when it is off)."""

    drafts: int = 0  # drafts the target checked: one per speculating row and step
    draft_tokens: int = 0  # their tokens
    accepted_tokens: int = 0  # of those, the ones the target kept and the sequences emitted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class SpeculativeStep:
    @classmethod
    def of(cls, engine, config: EngineConfig) -> SpeculativeStep | None:
        """The engine's speculative step as `config` asks for it (None: off)."""
        if config.speculative == "off":
            return None
        if engine.encoder_decoder:
            raise ValueError("speculative decoding serves decoder-only models; this bundle is an encoder-decoder")
        return cls(engine, config.speculative_tokens)

    def __init__(self, engine, max_tokens: int):
        self.engine = engine
        self.max_tokens = max_tokens  # drafts per row at most
        # measured by calibrate: a plain decode's seconds by batch width; a one-row verification's by drafts
        self.decode_seconds: dict[int, float] = {}
        self.verify_seconds = np.zeros(0)
        # measured while serving, by batch width: whole steps' tokens/s, plain and speculative
        self.rates: dict[int, dict[str, float]] = {}
        self._sat_out: dict[int, int] = {}  # by batch width: steps sat out since the last trial
        self._patience: dict[int, int] = {}  # by batch width: steps to sit out before the next trial
        self.trial_every = TRIAL_EVERY
        self.measure_rates = True  # False: the call times alone decide (the tests' deterministic engines)
        self.acceptance = FIRST_ACCEPTANCE  # over every sequence's recent drafts: a new sequence starts from it
        # since start: drafts checked, their tokens, of those the ones kept and emitted, decode calls (plain or
        # verifying), tokens they gave
        self.drafts = self.proposed = self.accepted = self.calls = self.tokens = 0

    def stats(self) -> SpeculationStats:
        return SpeculationStats(self.drafts, self.proposed, self.accepted)

    def report(self) -> None:
        """Log the counts since start in one line (`AsyncEngine` does when its thread stops)."""
        s = self.stats()
        log.info("speculative decoding: %d drafts, %d draft tokens proposed, %d accepted (acceptance rate %.1f%%)",
                 s.drafts, s.draft_tokens, s.accepted_tokens, 100 * s.acceptance_rate)

    # ---- the policy ------------------------------------------------------------------------------

    def calibrate(self) -> None:
        """Time a plain decode at batch widths 1, 2, 4, ... up to the engine's, and a one-row verification
        of 2 .. max_tokens + 1 tokens (before any request holds a slot: the calls write slots' first
        positions, which prefills overwrite)."""
        runner, widest = self.engine.runner, self.engine.max_running
        started = time.perf_counter()
        for n in sorted({min(2 ** i, widest) for i in range(widest.bit_length() + 1)}):
            zeros = np.zeros(n, dtype=np.int64)
            self.decode_seconds[n] = _median_seconds(lambda: runner.decode(zeros, zeros))  # noqa: B023
        self.verify_seconds = np.array([0.0] + [_median_seconds(lambda: runner.prefill(0, [0] * s, 0))  # noqa: B023
                                                for s in range(2, self.max_tokens + 2)])
        log.info("speculative decoding: a decode at 1 row takes %.2f ms, a verification of 2 .. %d tokens %s ms "
                 "(measured in %.1f s)", self.decode_seconds[1] * 1e3, self.max_tokens + 1,
                 " ".join(f"{t * 1e3:.2f}" for t in self.verify_seconds[1:]), time.perf_counter() - started)

    def _decode_seconds(self, n: int) -> float:
        """A plain decode at `n` rows: the nearest measured width at or above it."""
        wider = [w for w in self.decode_seconds if w >= n]
        return self.decode_seconds[min(wider)] if wider else self.decode_seconds[max(self.decode_seconds)]

    def plan(self, decode: list[Sequence]) -> dict[int, list[int]]:
        """The drafts each row checks this step (rows with none are absent); empty: a plain decode."""
        if not self.decode_seconds:
            return {}
        n = len(decode)
        # what the call times leave out (proposing, checking, emitting) shows in the rates measured while
        # serving: while speculating is the slower, it sits out `trial_every` steps between trials
        if self._losing(n):
            self._sat_out[n] = self._sat_out.get(n, 0) + 1
            if self._sat_out[n] < self._patience.get(n, self.trial_every):
                return {}
        plain_rate = n / self._decode_seconds(n)
        # even every row keeping every draft would not beat a plain decode at this width: nothing to propose
        if max((1 + k) / t for k, t in enumerate(self.verify_seconds) if k) <= plain_rate:
            return {}
        alone = np.concatenate([[self.decode_seconds[1]], self.verify_seconds[1:]])  # one row, by drafts
        drafts: dict[int, list[int]] = {}
        for i, seq in enumerate(decode):
            if seq.status is not Status.DECODING or not seq.request.speculative:
                continue
            if seq.speculation is None:  # its first step: it starts from the engine's recent acceptance
                seq.speculation = Speculation(self.acceptance, NgramIndex())
                seq.speculation.index.extend(seq.request_state.prompt)
            a = seq.speculation.acceptance
            best = int(np.argmax([expected_tokens(a, k) / t for k, t in enumerate(alone)]))
            k = min(best, self._room(seq))
            if k and (proposal := self._propose(seq, k)):
                drafts[i] = proposal
        if not drafts:
            return {}
        # the batch's tokens per second with these drafts (a call per speculating row, a decode for the
        # rest) against a plain decode's
        seconds = sum(self.verify_seconds[len(d)] for d in drafts.values())
        if len(drafts) < n:
            seconds += self._decode_seconds(n)
        tokens = n + sum(expected_tokens(decode[i].speculation.acceptance, len(d)) - 1 for i, d in drafts.items())
        if tokens / seconds <= plain_rate:
            return {}
        self._sat_out[n] = 0
        return drafts

    def decode(self, decode: list[Sequence]) -> list:
        """The step's decode rows: speculating where `plan` finds it pays, else a plain decode; the step's
        tokens per second update the measured rate of its kind."""
        started = time.perf_counter()
        drafts = self.plan(decode)
        self.calls += 1
        out = self.run(decode, drafts) if drafts else self.engine.plain_decode(decode)
        tokens = sum(isinstance(item, TokenEvent) for _, item in out)
        rate = tokens / max(time.perf_counter() - started, 1e-9)
        n = len(decode)
        rates = self.rates.setdefault(n, {})
        kind = "speculative" if drafts else "plain"
        rates[kind] = rate if kind not in rates else RATE_MEMORY * rates[kind] + (1 - RATE_MEMORY) * rate
        if drafts:  # a trial that still measures the slower doubles the next sit-out; one that wins ends it
            patience = self._patience.get(n, self.trial_every)
            self._patience[n] = min(2 * patience, LONGEST_SIT_OUT) if self._losing(n) else self.trial_every
        return out

    def _losing(self, n: int) -> bool:
        """Whether speculating has measured slower than plain decoding at `n` rows."""
        rates = self.rates.get(n, {})
        return self.measure_rates and rates.get("speculative", np.inf) < rates.get("plain", 0.0)

    def _room(self, seq: Sequence) -> int:
        """Drafts the sequence can take: one token is left for the target's own, and the slot keeps room
        for the call's padding."""
        left = seq.request.stopping.max_new_tokens - len(seq.output_ids) - 1
        room = self.engine.context - int(self.engine.kv.lengths[seq.slot]) - 3
        return max(0, min(self.max_tokens, left, room))

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        index = seq.speculation.index
        index.extend(seq.output_ids[len(index.history) - seq.prompt_len:])  # the last is the one fed now
        drafts = index.propose(k)
        if drafts and seq.matcher is not None:  # only what the grammar allows is worth checking
            valid = seq.matcher.try_consume_tokens(drafts)
            seq.matcher.rollback(valid)
            drafts = drafts[:valid]
        return drafts

    # ---- the step --------------------------------------------------------------------------------

    def run(self, decode: list[Sequence], drafts: dict[int, list[int]]) -> list:
        """Verify `drafts` (row -> ids) of the decode rows [0, n), a call per row, and decode the others in
        one call; then emit each row's kept tokens. Rows without drafts are sampled as a plain decode
        samples them."""
        e = self.engine
        n = len(decode)
        ids, starts = (a.copy() for a in e.scheduler.decode_inputs(n))
        logits: dict[int, np.ndarray] = {}  # row -> its positions' logits
        try:
            if len(drafts) < n:  # every row writes its fed token; the verifications below overwrite theirs
                first = e.runner.decode(ids, starts)
                logits = {i: e.only_sampleable(first[i][None].copy()) for i in range(n) if i not in drafts}
            for i, d in drafts.items():
                logits[i] = e.only_sampleable(e.runner.prefill(decode[i].slot, [int(ids[i]), *d], int(starts[i])))
        except Exception as err:
            return e.fail_decode(decode, err)
        live = [i for i, s in enumerate(decode) if s.status is Status.DECODING]
        verdicts = self._verdicts(decode, live, logits, drafts)
        e.scheduler.verified(n, {i: v.kept for i, v in verdicts.items()})
        out = []
        now = time.monotonic()
        for i, verdict in verdicts.items():
            seq = decode[i]
            if i in drafts:
                seq.speculation.record(len(drafts[i]), verdict.kept)
                self.acceptance = averaged(self.acceptance, verdict.kept / len(drafts[i]))
                self.drafts += 1
                self.proposed += len(drafts[i])
            scored = self._logprobs(logits[i][:len(verdict.tokens)], verdict.tokens, seq)
            for j, token in enumerate(verdict.tokens):
                if j < verdict.kept:  # counted before its event, which may be the sequence's last and report it
                    seq.speculation.accepted += 1
                    self.accepted += 1
                logprob = None if scored.logprobs[j] != scored.logprobs[j] else float(scored.logprobs[j])  # NaN: none
                out += e.output.update(seq, token, logprob, scored.top(j, seq.request.top_logprobs), now)
                self.tokens += 1
                e.count_tokens(1)
                if seq.status is Status.FINISHED or seq.request_state.done:
                    break
        return out

    def _verdicts(self, decode: list[Sequence], live: list[int], logits: dict[int, np.ndarray],
                  drafts: dict[int, list[int]]) -> dict[int, Verdict]:
        e = self.engine
        verdicts: dict[int, Verdict] = {}
        plain = [i for i in live if i not in drafts]
        if plain:  # no drafts: the sampler, exactly as a plain decode step
            seqs = [decode[i] for i in plain]
            first = np.stack([logits[i][0] for i in plain]).astype(np.float32)
            result = sample(first, SamplingBatch([s.sampling for s in seqs]), masks=e.masks_of(seqs))
            for i, token in zip(plain, result.tokens.tolist(), strict=True):
                verdicts[i] = Verdict([token], 0)
        for i in live:
            if i in drafts:
                seq, d = decode[i], drafts[i]
                verdicts[i] = accept(logits[i][:len(d) + 1], d, seq.sampling, self._draft_masks(seq, d))
        return dict(sorted(verdicts.items()))

    def _draft_masks(self, seq: Sequence, drafts: list[int]) -> np.ndarray | None:
        """The grammar's allowed tokens after each prefix of `drafts` [k + 1, vocab] (None: unconstrained)."""
        m = seq.matcher
        if m is None:
            return None
        grammars = self.engine.grammars
        bits = [grammars.masks([m])]
        for token in drafts:
            m.consume_token(token)
            bits.append(grammars.masks([m]))
        m.rollback(len(drafts))
        return allowed(np.concatenate(bits), self.engine.model.vocab_size)

    @staticmethod
    def _logprobs(rows: np.ndarray, tokens: list[int], seq: Sequence):
        """The model's own logprobs of the row's emitted `tokens` (and alternatives), as the sampler reports them."""
        s = seq.sampling
        asked = np.arange(len(tokens)) if s.want_logprobs or s.top_logprobs else np.arange(0)
        return with_logprobs(rows.astype(np.float32), np.array(tokens), asked, s.top_logprobs)


def _median_seconds(call, rounds: int = CALIBRATION_ROUNDS) -> float:
    call()  # the first run at a shape allocates
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
