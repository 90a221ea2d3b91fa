"""The output step: what the sample phase chose, applied. Each token is appended to its sequence, checked
against the stop conditions, emitted as a `TokenEvent`, and the sequence fed to the next decode or finished
(its slot freed; the request ends with its last sequence); a beam search's next beams are taken (`BeamStep`).
A sequence's last event carries its speculative decoding counts.

    step = OutputStep(scheduler, eos_ids, end, beams, counters)   # end(request_state, error) ends a request
    outputs = step.apply(sampled)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from service.engine.beam_step import BeamStep
from service.engine.counters import EngineCounters
from service.engine.errors import EngineError, ModelError
from service.engine.request import FinishReason, TokenEvent
from service.engine.scheduler import Scheduler
from service.engine.sequence import RequestState, Sequence, Status
from service.engine.step_data import BeamChoice, Drafted, Output, Sampled

log = logging.getLogger(__name__)


class OutputStep:
    def __init__(self, scheduler: Scheduler, eos_ids: frozenset[int],
                 end: Callable[[RequestState, EngineError | None], list[Output]], beams: BeamStep,
                 counters: EngineCounters):
        self.scheduler = scheduler
        self.eos_ids = eos_ids  # every id that ends generation (Llama 3 has several)
        self.end = end
        self.beams = beams  # applies a beam search's next beams
        self.counters = counters  # tokens emitted, drafts checked and accepted

    def apply(self, sampled: Sampled) -> list[Output]:
        """Apply one model call's choices; returns the outputs, the call's failed requests' first. The rows that
        verified drafts have their slots' lengths advanced past the drafts kept first (before any slot moves),
        then the requests whose sampling failed end, then each beam search and each row takes its tokens."""
        now = time.monotonic()
        out = list(sampled.failed)
        for row in sampled.drafted:
            self.scheduler.kept_drafts(row.seq, row.kept)
            row.seq.speculation.proposed += row.drafts  # before its tokens: its last event reports it
            self.counters.drafts += 1
            self.counters.draft_tokens += row.drafts
        for state, error in sampled.faults:
            if not state.done:
                out += self.end(state, error)
        emitted = len(sampled.tokens)
        for choice in sampled.beams:
            events = self._beam(choice, now)
            emitted += len(events)
            out += events
        for seq, token, logprob, top in zip(sampled.seqs, sampled.tokens, sampled.logprobs, sampled.tops,
                                            strict=True):
            out += self.update(seq, token, logprob, top, now)
        for row in sampled.drafted:
            emitted += self._drafted(row, now, out)
        self.counters.count_tokens(emitted, now)
        return out

    def _drafted(self, row: Drafted, now: float, out: list[Output]) -> int:
        """A row's kept drafts and the target's token, in order, until one ends it; returns how many it took."""
        seq = row.seq
        for j, token in enumerate(row.tokens):
            if seq.status is Status.FINISHED or seq.request_state.done:
                return j  # a stop before the rest drops it
            if j < row.kept:  # counted before its event, which may be the sequence's last and report it
                seq.speculation.accepted += 1
                self.counters.accepted_tokens += 1
            out += self.update(seq, token, row.logprobs[j], row.tops[j], now)
        return len(row.tokens)

    def _beam(self, choice: BeamChoice, now: float) -> list[Output]:
        """A beam search's next beams taken (or its hypotheses emitted); a failure here is the request's alone."""
        if choice.state.done:
            return []
        try:
            return self.beams.apply(choice, now)
        except Exception as e:
            return self._fault(choice.state, e, "taking the next beams")

    def update(self, seq: Sequence, token: int, logprob: float | None, top: list | None, now: float) -> list[Output]:
        """Append `token` to `seq`, emit it, and either feed it to the next decode or end the sequence. A
        failure here is the request's alone: it ends with a ModelError (the details logged with its id), and
        the step goes on for the others. A request that ended earlier in the step takes no more tokens."""
        if seq.request_state.done:
            return []
        try:
            return self._update(seq, token, logprob, top, now)
        except Exception as e:
            return self._fault(seq.request_state, e, f"the output step on token {token}")

    def _fault(self, state: RequestState, error: Exception, what: str) -> list[Output]:
        """A bug in one request's output: that request ends (the details logged with its id), never the step
        nor another request."""
        log.error("request %s: %s failed", state.id, what, exc_info=error)
        return self.end(state, ModelError("the server failed producing this request's output",
                                          detail=f"{what}: {type(error).__name__}: {error}"))

    def _update(self, seq: Sequence, token: int, logprob: float | None, top: list | None, now: float) -> list[Output]:
        state = seq.request_state
        seq.output_ids.append(token)
        seq.sampling.accept(token)
        if state.first_token_at is None:
            state.first_token_at = now
        complete = False  # the output is a whole sentence of its grammar, which allows nothing more
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):
                return self.end(state, ModelError("a generated token was refused by the request's constraint",
                                                  detail=f"token {token}: {seq.matcher.get_error()}"))
            complete = seq.matcher.is_stopped()
        reason, text = self.stop(seq, token, complete)
        event = TokenEvent(state.id, seq.index, token, logprob, top, text, reason, now)
        if len(seq.output_ids) == 1:
            event.prompt_logprobs = state.prompt_logprobs
        if reason is not None and seq.speculation is not None:
            event.draft_tokens, event.accepted_draft_tokens = seq.speculation.proposed, seq.speculation.accepted
        out: list[Output] = [(state, event)]
        if reason is None:
            self.scheduler.feed(seq, token)
        else:
            out += self.finish(seq, reason)
        return out

    def stop(self, seq: Sequence, token: int, complete: bool = False) -> tuple[FinishReason | None, str]:
        """Whether `seq` ends with `token` (and why), and the text to emit with it. Stop conditions
        count only from min_new_tokens on; the max_new_tokens limit and a `complete` grammar always do."""
        st = seq.request.stopping
        n_out = len(seq.output_ids)
        active = n_out >= st.min_new_tokens
        if active and token in self.eos_ids and not st.ignore_eos:
            reason = FinishReason.EOS
        elif active and token in st.stop_token_ids:
            reason = FinishReason.STOP
        else:
            text, by_string = seq.text.push(token, check_stop=active)
            if by_string:
                return FinishReason.STOP, text
            if n_out < st.max_new_tokens and not complete:
                return None, text
            tail, by_string = seq.text.finish(check_stop=active)  # a stop string may still match the held text
            return (FinishReason.STOP if by_string or complete else FinishReason.LENGTH), text + tail
        tail, by_string = seq.text.finish(check_stop=active)
        return (FinishReason.STOP if by_string else reason), tail

    def finish(self, seq: Sequence, reason: FinishReason) -> list[Output]:
        """Release `seq`'s slot; the request ends with its last sequence."""
        seq.finish_reason = reason
        self.scheduler.free(seq)
        if all(s.status is Status.FINISHED for s in seq.request_state.seqs):
            return self.end(seq.request_state, None)
        return []
