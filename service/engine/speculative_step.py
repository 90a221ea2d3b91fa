"""The engine's speculative decoding policy and its model calls: which decode rows propose how many tokens,
and a verification call for each row that does (its fed token and drafts, `StaticRunner.prefill` from the
row's length). onnxruntime's attention continues a cache with several tokens for one row at a time, hence a
call per speculating row. It neither samples nor updates: the sample phase keeps what the target accepts
(`SampleStep`), and the output step emits it.

    step = SpeculativeStep.of(config, runner, kv, context, max_running, counters)   # None when it is off
    step.calibrate()                         # at warm-up: the model's call times by rows and tokens per row
    plan = step.plan(decode)                 # plan.drafts {row: drafts}; empty when a plain decode costs less
    logits = step.verify(decode, plan.drafts, ids, starts)   # {row: [k + 1, vocab]}, a call per row
    step.measured(plan, sampled)             # once the phase is applied: acceptance estimates, measured rates

The policy (docs/speculative.md): each sequence keeps an estimate `a` of the share of its drafts the
target kept (an exponential average over its recent steps); a row that proposes k tokens then yields
(1 - a^(k+1)) / (1 - a) tokens in expectation. A row proposes the k that maximises its expected tokens
per second of its verification call; the step then speculates only if the batch's expected tokens per
second beat a plain decode's, counting a call per speculating row (and the decode of the others). The
seconds are the call times measured at start-up, so speculation stops by itself where the calls cost
more than the drafts yield: in practice beyond a batch of one or two. A beam never speculates: it takes
the token its search chooses.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from service.engine.config import EngineConfig
from service.engine.counters import EngineCounters
from service.engine.kv_cache import KVCache
from service.engine.sequence import Sequence, Status
from service.engine.speculative import FIRST_ACCEPTANCE, NgramIndex, Speculation, averaged, expected_tokens
from service.engine.step_data import Sampled, SpeculationPlan
from service.runtime.static_runner import StaticRunner

log = logging.getLogger(__name__)

CALIBRATION_ROUNDS = 3
RATE_MEMORY = 0.9  # weight of the previous tokens/s in each update of a step kind's measured rate
TRIAL_EVERY = 16  # steps a losing speculation sits out before it is tried again, at first
LONGEST_SIT_OUT = 512  # ... doubling after each trial it loses, up to this


class SpeculativeStep:
    @classmethod
    def of(cls, config: EngineConfig, runner: StaticRunner, kv: KVCache, context: int, max_running: int,
           counters: EngineCounters) -> SpeculativeStep | None:
        """The engine's speculative step as `config` asks for it (None: off)."""
        if config.speculative == "off":
            return None
        if runner.manifest.model.encoder_decoder:
            raise ValueError("speculative decoding serves decoder-only models; this bundle is an encoder-decoder")
        return cls(runner, kv, context, max_running, config.speculative_tokens, counters)

    def __init__(self, runner: StaticRunner, kv: KVCache, context: int, max_running: int, max_tokens: int,
                 counters: EngineCounters):
        self.runner = runner
        self.kv = kv  # its lengths: the room a row's slot has for drafts
        self.context = context  # positions per sequence
        self.max_running = max_running  # the widest decode, calibrated
        self.max_tokens = max_tokens  # drafts per row at most
        self.counters = counters  # the engine's: the decode phases decided, and what the speculating ones gave
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

    def report(self) -> None:
        """Log the engine's counts since start in one line (`AsyncEngine` does when its thread stops)."""
        s = self.counters.speculation()
        log.info("speculative decoding: %d drafts, %d draft tokens proposed, %d accepted (acceptance rate %.1f%%)",
                 s.drafts, s.draft_tokens, s.accepted_tokens, 100 * s.acceptance_rate)

    # ---- the policy ------------------------------------------------------------------------------

    def calibrate(self) -> None:
        """Time a plain decode at batch widths 1, 2, 4, ... up to the engine's, and a one-row verification
        of 2 .. max_tokens + 1 tokens (before any request holds a slot: the calls write slots' first
        positions, which prefills overwrite)."""
        runner, widest = self.runner, self.max_running
        started = time.perf_counter()
        for n in sorted({min(2 ** i, widest) for i in range(widest.bit_length() + 1)}):
            zeros = np.zeros(n, dtype=np.int64)
            self.decode_seconds[n] = _median_seconds(lambda: runner.decode(zeros, zeros))  # noqa: B023
        def verification(s: int) -> float:
            return _median_seconds(lambda: runner.prefill(0, [0] * s, 0, every_position=True))

        self.verify_seconds = np.array([0.0] + [verification(s) for s in range(2, self.max_tokens + 2)])
        log.info("speculative decoding: a decode at 1 row takes %.2f ms, a verification of 2 .. %d tokens %s ms "
                 "(measured in %.1f s)", self.decode_seconds[1] * 1e3, self.max_tokens + 1,
                 " ".join(f"{t * 1e3:.2f}" for t in self.verify_seconds[1:]), time.perf_counter() - started)

    def _decode_seconds(self, n: int) -> float:
        """A plain decode at `n` rows: the nearest measured width at or above it."""
        wider = [w for w in self.decode_seconds if w >= n]
        return self.decode_seconds[min(wider)] if wider else self.decode_seconds[max(self.decode_seconds)]

    def plan(self, decode: list[Sequence]) -> SpeculationPlan:
        """The drafts each decode row checks this step (rows with none are absent; none: a plain decode)."""
        started = time.perf_counter()  # the phase's time counts its planning
        return SpeculationPlan(len(decode), self._drafts(decode), started)

    def _drafts(self, decode: list[Sequence]) -> dict[int, list[int]]:
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
            # a beam takes the token its search chooses, never a draft
            if seq.status is not Status.DECODING or not seq.request.speculative or seq.request_state.beam is not None:
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

    def measured(self, plan: SpeculationPlan, sampled: Sampled) -> None:
        """The decode phase `plan` decided has been applied: the drafts kept update the acceptance estimates,
        and the phase's tokens per second (planning, calls, sampling and emitting) the measured rate of its kind."""
        tokens = sampled.chosen
        for row in sampled.drafted:
            row.seq.speculation.acceptance = averaged(row.seq.speculation.acceptance, row.kept / row.drafts)
            self.acceptance = averaged(self.acceptance, row.kept / row.drafts)
        self.counters.decode_calls += 1
        if plan.drafts:
            self.counters.speculating_tokens += tokens
        rate = tokens / max(time.perf_counter() - plan.started, 1e-9)
        n = plan.width
        rates = self.rates.setdefault(n, {})
        kind = "speculative" if plan.drafts else "plain"
        rates[kind] = rate if kind not in rates else RATE_MEMORY * rates[kind] + (1 - RATE_MEMORY) * rate
        if plan.drafts:  # a trial that still measures the slower doubles the next sit-out; one that wins ends it
            patience = self._patience.get(n, self.trial_every)
            self._patience[n] = min(2 * patience, LONGEST_SIT_OUT) if self._losing(n) else self.trial_every

    def _losing(self, n: int) -> bool:
        """Whether speculating has measured slower than plain decoding at `n` rows."""
        rates = self.rates.get(n, {})
        return self.measure_rates and rates.get("speculative", np.inf) < rates.get("plain", 0.0)

    def _room(self, seq: Sequence) -> int:
        """Drafts the sequence can take: one token is left for the target's own, and the slot keeps room
        for the call's padding."""
        left = seq.request.stopping.max_new_tokens - len(seq.output_ids) - 1
        room = self.context - int(self.kv.lengths[seq.slot]) - 3
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

    # ---- the calls ------------------------------------------------------------------------------

    def verify(self, decode: list[Sequence], drafts: dict[int, list[int]], ids: np.ndarray,
               starts: np.ndarray) -> dict[int, np.ndarray]:
        """Feed each drafting row's pending token (`ids[row]`, at `starts[row]`) and its drafts in a call of its own,
        which writes their keys and values in place. Returns row -> the logits of every position fed
        [k + 1, vocab]. The row's length then advances by the drafts kept, plus one (the output step)."""
        return {i: self.runner.prefill(decode[i].slot, [int(ids[i]), *d], int(starts[i]), every_position=True)
                for i, d in drafts.items()}


def _median_seconds(call, rounds: int = CALIBRATION_ROUNDS) -> float:
    call()  # the first run at a shape allocates
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
