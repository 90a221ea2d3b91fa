"""The run phase of a step: the step's model calls, one at a time, and who fails if one raises.

    run = RunStep(runner, scheduler, speculation, end, counters, sampleable)
    for call in run.calls(batch):       # new prompts, the decode rows, a long prompt's next chunk
        ran = call.run()                 # a RunnerOutput: the rows to sample and their logits, the requests failed

- **Prompts** (new ones, or a long prompt's next chunk) are written into their slots by one prefill call,
  which gives a logits row for each prompt now complete (its n > 1 siblings and beams included). A prefill
  that holds a prompt asking for its logprobs keeps every position's logits and scores it.
- **Decode rows** feed one token each, in one call. With speculation on, a row it plans drafts for feeds
  them after its token in a verification call of its own, and its row carries every position's logits.
- **An encoder-decoder's new sources** are encoded, and their start tokens decoded in the decode rows' call.

When a model call raises, only the requests whose work was in it fail (`ModelError`) and are ended at
once: a batch of new prompts that fails is retried one prompt at a time, so one prompt the model cannot
take never ends the others; prompts and decode rows are separate calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import NamedTuple

import numpy as np

from service.engine.counters import EngineCounters
from service.engine.errors import EngineError, ModelError
from service.engine.prompt_logprobs import record as record_prompt_logprobs
from service.engine.scheduler import Batch, PrefillWork, Scheduler
from service.engine.sequence import RequestState, Sequence, Status
from service.engine.speculative_step import SpeculativeStep
from service.engine.step_data import Output, RunnerOutput, Verification
from service.runtime.static_runner import StaticRunner

log = logging.getLogger(__name__)


class ModelCall(NamedTuple):
    run: Callable[[], RunnerOutput]  # the call, bound to its work
    first_tokens: bool  # it gives new prompts their first tokens, which go out before the step's next call


class RunStep:
    def __init__(self, runner: StaticRunner, scheduler: Scheduler, speculation: SpeculativeStep | None,
                 end: Callable[[RequestState, EngineError | None], list[Output]], counters: EngineCounters,
                 sampleable: int):
        self.runner = runner
        self.scheduler = scheduler  # reads the decode inputs, and is told what each call wrote
        self.kv = scheduler.kv
        self.speculation = speculation  # plans and verifies the decode rows' drafts (None: off)
        self.end = end  # ends a request with an error: a call that raises fails its requests
        self.counters = counters  # the requests running count from their first prefill
        model = runner.manifest.model
        self.encoder_decoder = model.encoder_decoder  # its new sources may join the decode call
        self.decoder_start_token_id = model.decoder_start_token_id
        self.sampleable = sampleable  # ids a prompt's logprobs range over (not a padded vocabulary's)

    def calls(self, batch: Batch) -> list[ModelCall]:
        """The step's model calls in the order they run: new prompts first (into the slots past the decode rows'),
        then the decode rows, then a long prompt's next chunk (whose slot is among the decode rows', a row whose
        decode writes a placeholder that the chunk overwrites)."""
        if batch.new_prompts is not None and self._joins_decode(batch.new_prompts, batch.decode):
            return [ModelCall(partial(self.encode_then_decode, batch.new_prompts, batch.decode), False)]
        calls = []
        if batch.new_prompts is not None:
            calls.append(ModelCall(partial(self.prefill, batch.new_prompts), True))
        if batch.decode:
            calls.append(ModelCall(partial(self.decode, batch.decode), False))
        if batch.next_chunk is not None:
            calls.append(ModelCall(partial(self.prefill, batch.next_chunk), False))
        return calls

    # ---- prefill ---------------------------------------------------------------------------------

    def prefill(self, work: PrefillWork) -> RunnerOutput:
        """Write the prompts (or the chunk); a logits row for each sequence whose prompt is now complete. A call
        of several prompts that raises is run again one prompt at a time."""
        try:
            return self._prefill(work)
        except Exception as e:
            if len(work.seqs) == 1:
                return RunnerOutput(failed=self._fail([work.seqs[0].request_state], e))
            log.warning("a prefill of %d prompts failed (%s); running them one at a time", len(work.seqs), e)
            ran = RunnerOutput()
            for one in work.split():  # each reads its slot when it runs: a failed one's slot moves others
                ran += self.prefill(one)
            return ran

    def _prefill(self, work: PrefillWork) -> RunnerOutput:
        self._started(work)
        first = work.seqs[0].slot
        states = [seq.request_state for seq in work.seqs]
        scoring = any(state.prompt_logprobs is not None for state in states)
        if work.start > 0:  # a chunk: its last position's logits [1, vocab], or every position's [1, chunk, vocab]
            logits = self.runner.prefill(first, work.chunks[0], work.start, every_position=scoring)[None]
        elif scoring:  # prompts, one scored: every position's, [k, longest, vocab]
            logits = self.runner.prefill_batch(first, work.chunks, every_position=True)
        else:  # prompts: the last positions', [k, vocab]
            logits = self.runner.prefill_batch(first, work.chunks)
        last = logits
        if logits.ndim == 3:
            if scoring:
                record_prompt_logprobs(states, logits, work.start, self.sampleable)
            last = logits[np.arange(len(work.chunks)), [len(chunk) - 1 for chunk in work.chunks]]
        complete = self.scheduler.prefilled(work)
        return RunnerOutput([seq for _, seq in complete], last[[row for row, _ in complete]])

    def _started(self, work: PrefillWork) -> None:
        now = time.monotonic()
        for seq in work.seqs:
            if seq.request_state.scheduled_at is None:
                seq.request_state.scheduled_at = now
                self.counters.running_requests += 1

    # ---- decode ----------------------------------------------------------------------------------

    def decode(self, decode: list[Sequence]) -> RunnerOutput:
        """One token for each of slots [0, n) in one call, and for each row speculation plans drafts for, its
        token and drafts in a verification call of its own. Rows still prefilling a long prompt are not sampled."""
        n = len(decode)
        plan = self.speculation.plan(decode) if self.speculation is not None else None
        drafts = plan.drafts if plan is not None else {}
        ids, starts = self.scheduler.decode_inputs(n)
        logits = None
        try:
            if len(drafts) < n:  # every row writes its fed token; the verifications overwrite theirs
                logits = self.runner.decode(ids, starts)
            verified = self.speculation.verify(decode, drafts, ids, starts) if drafts else {}
        except Exception as e:
            return RunnerOutput(failed=self._fail_decoding(decode, e))
        self.scheduler.decoded(n)
        live = [i for i, s in enumerate(decode) if s.status is Status.DECODING]
        if len(live) == n:
            return RunnerOutput(decode, logits, {i: Verification(drafts[i], v) for i, v in verified.items()},
                                plan=plan)
        row = {i: r for r, i in enumerate(live)}
        return RunnerOutput([decode[i] for i in live], logits[live] if logits is not None else None,
                            {row[i]: Verification(drafts[i], v) for i, v in verified.items()}, plan=plan)

    def _joins_decode(self, work: PrefillWork, decode: list[Sequence]) -> bool:
        """Whether an encoder-decoder's new sources can join the decode call: each one sequence (no n > 1
        siblings or beams to fork after it), none scoring its prompt, their slots right after the decode rows'."""
        return self.encoder_decoder and all(
            seq.request_state.request.slots == 1 and seq.request_state.prompt_logprobs is None
            and seq.slot == len(decode) + i for i, seq in enumerate(work.seqs))

    def encode_then_decode(self, work: PrefillWork, decode: list[Sequence]) -> RunnerOutput:
        """An encoder-decoder's new sources go into their slots (the encoder), then their decoder start tokens
        run in the decode call beside the decoding rows' tokens (if any): one decoder call a step instead of
        two, through the decode call's bindings, made once. A row's logits are the same bits either way (the
        graph is batch-invariant). If a call raises, the prompts and the decode rows run apart, as without
        this, so only the work that fails fails."""
        n, k = len(decode), len(work.seqs)
        self._started(work)
        for seq in work.seqs:  # a new slot's length is 0; it feeds the decoder start token
            self.kv.pending[seq.slot] = self.decoder_start_token_id
        try:
            self.runner.encode(work.seqs[0].slot, work.chunks)
            logits = self.runner.decode(*self.scheduler.decode_inputs(n + k))
        except Exception as e:
            log.warning("encoding %d sources with the decode step failed (%s); running them apart", k, e)
            return self.prefill(work) + (self.decode(decode) if decode else RunnerOutput())
        self.scheduler.decoded(n)
        complete = self.scheduler.prefilled(work)
        live = [i for i, s in enumerate(decode) if s.status is Status.DECODING]
        rows = live + [n + row for row, _ in complete]
        return RunnerOutput([decode[i] for i in live] + [seq for _, seq in complete], logits[rows])

    # ---- who fails -------------------------------------------------------------------------------

    def _fail_decoding(self, decode: list[Sequence], error: Exception) -> list[Output]:
        """A decode call raised: its decoding requests fail."""
        return self._fail(dict.fromkeys(s.request_state for s in decode if s.status is Status.DECODING), error)

    def _fail(self, states: Iterable[RequestState], error: Exception) -> list[Output]:
        log.error("model call failed: %s: %s", type(error).__name__, error, exc_info=error)
        out: list[Output] = []
        for state in states:
            if not state.done:
                out += self.end(state, ModelError("the model call failed", detail=f"{type(error).__name__}: {error}"))
        return out
