"""The engine core: schedule -> run the model -> sample -> update and emit, one step at a time.

It deals in token ids only (plus each sequence's text stream, so stop strings end a sequence in
the step that completes them). One thread owns it: `service.async_engine` runs `step()` in a
loop and feeds it requests; tests may drive it directly.

    engine = Engine(EngineConfig(bundle=...))
    engine.add(engine.new_request(GenerationRequest("r1", prompt_ids)))
    while engine.has_work:
        for state, item in engine.step():   # item: a TokenEvent, or an EngineError for that request
            ...

A sequence's KV slot is released in the step in which it finishes, is aborted or expires. An
exception from the model fails only the requests in that step (`ModelError`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from service.config import EngineConfig
from service.detokenizer import TextStream
from service.errors import Cancelled, DeadlineExceeded, EngineError, InvalidRequest, ModelError, Overloaded
from service.graph_choice import open_serving_graph
from service.kv_cache import KVCache, plan_slots
from service.request import EngineLimits, FinishReason, GenerationRequest, TokenEvent
from service.runner import ModelRunner
from service.sampler import SamplingState, sample
from service.scheduler import PrefillWork, Scheduler, SchedulerOutput
from service.sequence import RequestState, Sequence, Status

log = logging.getLogger(__name__)

Output = tuple[RequestState, "TokenEvent | EngineError"]
RATE_WINDOW_S = 10.0


@dataclass
class EngineStats:
    running_requests: int  # requests with at least one sequence holding a slot
    running_sequences: int  # sequences holding or promised a KV slot
    waiting_requests: int  # requests queued for admission
    kv_slots: int  # sequences the KV cache holds
    kv_free_slots: int
    kv_free_tokens: int  # free slots × positions per slot
    kv_bytes: int  # memory of the KV cache, allocated once
    tokens_per_s: float  # generated tokens per second over the last 10 s
    generated_tokens: int  # since start
    steps: int  # model steps since start


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        self.config = config
        self.runner = runner or open_serving_graph(config)
        m = self.runner.manifest.model
        self.model = m
        self.tokenizer = self.runner.tokenizer
        # ids the tokenizer can turn into text: a model's vocabulary may be padded past them, and
        # those ids are never sampled
        self.sampleable = min(self.tokenizer.vocab_size, m.vocab_size)
        n_slots = plan_slots(self.runner.cache_shape, config.max_running, config.kv_cache_bytes)
        self.kv = KVCache(self.runner.cache_shape, n_slots)
        self.runner.attach(self.kv)
        self.scheduler = Scheduler(self.kv, config.max_running, config.max_batch_tokens)
        self.limits = EngineLimits(max_new_tokens=min(config.max_new_tokens or m.n_ctx - 1, m.n_ctx - 1),
                                   max_prompt_tokens=min(config.max_prompt_tokens or m.n_ctx - 1, m.n_ctx - 1))
        self.requests: dict[str, RequestState] = {}
        self._rate: deque[tuple[float, int]] = deque()  # (time, tokens) of the steps in the rate window
        self._rate_tokens = 0  # their sum
        self.generated_tokens = 0
        self.steps = 0
        log.info("KV cache: %d slots x %d positions, %.1f MiB (%d bytes) allocated once", n_slots,
                 self.kv.shape.max_seq, self.kv.nbytes / 2**20, self.kv.nbytes)

    def warm_up(self) -> None:
        """Run the model at every decode batch size it will see (before any request is added)."""
        if self.requests:
            raise RuntimeError("warm_up() must run before requests are added")
        started = time.perf_counter()
        self.runner.warm_up(self.scheduler.max_running)
        log.info("warmed up decode at batch sizes 1-%d in %.1f s", self.scheduler.max_running,
                 time.perf_counter() - started)

    # ---- requests in and out -------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Check a request against the model and limits (pure: safe from any thread)."""
        request.validate(self.model.vocab_size, self.model.n_ctx, self.limits)
        if request.n > self.scheduler.max_running:
            raise InvalidRequest("n", f"{request.n} sequences; this engine runs at most "
                                      f"{self.scheduler.max_running} at once")

    def new_request(self, request: GenerationRequest) -> RequestState:
        """Validate and wrap a request; `add` queues it."""
        self.validate(request)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        state = RequestState(request, seed)
        first = None
        for i in range(request.n):
            sampling = (SamplingState.create(request.sampling, request.prompt_token_ids, self.model.vocab_size, seed, i)
                        if first is None else first.sampling.fork(i, seed))
            seq = Sequence(state, i, sampling, TextStream(self.tokenizer, request.stopping.stop))
            self._set_suppression(seq)
            state.seqs.append(seq)
            first = first or seq
        return state

    def add(self, state: RequestState) -> None:
        if state.id in self.requests:
            raise InvalidRequest("request_id", f"{state.id!r} is already running")
        self.check_capacity(state.request.n)
        self.requests[state.id] = state
        self.scheduler.add(state)

    def check_capacity(self, n: int, in_flight: int = 0, in_flight_seqs: int = 0) -> None:
        """Raise `Overloaded` unless a request of `n` sequences fits: either the free KV slots take it
        (with everything queued before it) at the next step, or the queue has room.

        `in_flight` / `in_flight_seqs` count requests (and their sequences) handed over by another
        thread but not yet queued."""
        waiting = len(self.scheduler.waiting) + in_flight
        queued_n = sum(s.request.n for s in list(self.scheduler.waiting)) + in_flight_seqs
        fits_now = self.kv.free_slots - queued_n >= n and self.scheduler.num_running + queued_n + n <= \
            self.scheduler.max_running
        if waiting >= self.config.max_waiting and not fits_now:
            raise Overloaded(f"{waiting} requests are waiting (max_waiting={self.config.max_waiting}) and no KV "
                             f"slot is free for {n} more sequence(s); retry later")

    def abort(self, request_id: str) -> list[Output]:
        state = self.requests.get(request_id)
        return self.end(state, Cancelled("the request was cancelled")) if state else []

    def expire(self, now: float | None = None) -> list[Output]:
        """End every request whose deadline has passed, waiting or running."""
        now = time.monotonic() if now is None else now
        out: list[Output] = []
        late = [s for s in self.requests.values() if s.request.deadline is not None and s.request.deadline <= now]
        for state in late:
            where = "in the queue" if state.scheduled_at is None else "while running"
            out += self.end(state, DeadlineExceeded(f"the deadline passed {where}"))
        return out

    def end(self, state: RequestState, error: EngineError | None) -> list[Output]:
        self.scheduler.drop(state)
        state.done = True
        self.requests.pop(state.id, None)
        return [(state, error)] if error is not None else []

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------

    def step(self, emit: Callable[[list[Output]], None] | None = None) -> list[Output]:
        """Run one step; returns its outputs. New prompts are prefilled before the decode rows run,
        and with `emit` their first tokens are handed to it then, before the decode rows' tokens,
        so a request's first token does not wait for the rest of the batch."""
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        out: list[Output] = []
        fresh = sched.prefill if sched.prefill is not None and sched.prefill.start == 0 else None
        if fresh is not None:  # new prompts in new slots (>= the decode rows'): independent of them
            ran = self._run(sched, lambda: self._prefill(fresh))
            if isinstance(ran, list):
                return ran
            out += self._sample_and_append(*ran)
            if emit is not None and out:
                emit(out)
                out = []
        if sched.decode or (sched.prefill is not None and fresh is None):
            ran = self._run(sched, lambda: self._execute(sched.decode, None if fresh else sched.prefill))
            if isinstance(ran, list):
                return out + ran
            out += self._sample_and_append(*ran)
        self.steps += 1
        return out

    def _run(self, sched: SchedulerOutput, run: Callable[[], tuple[list[Sequence], np.ndarray]]):
        """`run()`, or, if the model raises, the failure of every request in this step (a list)."""
        try:
            return run()
        except Exception as e:  # the model failed: fail this step's requests, keep serving
            log.exception("model step failed")
            hit = {s.request.id: s.request for s in sched.decode}
            if sched.prefill:
                hit.update((s.request.id, s.request) for s in sched.prefill.seqs)
            out: list[Output] = []
            for state in hit.values():
                if not state.done:
                    out += self.end(state, ModelError(f"model step failed: {type(e).__name__}: {e}"))
            return out

    def _sample_and_append(self, seqs: list[Sequence], logits: np.ndarray) -> list[Output]:
        if not seqs:
            return []
        top_n = max(s.request.request.top_logprobs for s in seqs)
        if self.sampleable < logits.shape[1]:
            logits[:, self.sampleable:] = -np.inf
        result = sample(logits, [s.sampling for s in seqs], top_n)
        now = time.monotonic()
        out = []
        for i, seq in enumerate(seqs):
            top = None
            if seq.request.request.top_logprobs:
                k = seq.request.request.top_logprobs
                ids, lps = result.top_ids[i, :k].tolist(), result.top_logprobs[i, :k].tolist()
                top = list(zip(ids, lps, strict=True))
            out += self._append(seq, int(result.tokens[i]), float(result.logprobs[i]), top, now)
        self._count(len(seqs))
        return out

    def _execute(self, decode: list[Sequence], prefill: PrefillWork | None) -> tuple[list[Sequence], np.ndarray]:
        """Run decode (slots [0, n)) then the rest of a chunked prompt; returns the sequences to sample
        and their logits."""
        seqs: list[Sequence] = []
        rows: list[np.ndarray] = []
        if decode:
            n = len(decode)
            # Decoding rows write their pending token at their length; a prompt part-way through
            # chunked prefill writes a throwaway token where its next chunk starts (and overwrites it).
            pos = self.kv.lengths[:n].copy()
            logits = self.runner.decode(self.kv.pending[:n], pos)
            self.kv.lengths[:n] += 1
            live = [i for i, s in enumerate(decode) if s.status is Status.DECODING]
            if len(live) == n:
                seqs += decode
                rows.append(logits)
            else:
                seqs += [decode[i] for i in live]
                rows.append(logits[live])
        if prefill is not None:
            done, last = self._prefill(prefill)
            seqs += done
            rows.append(last)
        if len(rows) == 1:
            return seqs, rows[0]
        return seqs, (np.concatenate(rows) if rows else np.empty((0, self.model.vocab_size), np.float32))

    def _prefill(self, work: PrefillWork) -> tuple[list[Sequence], np.ndarray]:
        """Write a prefill's tokens; returns the sequences whose prompts are complete (with the
        siblings of n > 1 requests forked from them) and a logits row for each."""
        now = time.monotonic()
        for seq in work.seqs:
            seq.request.scheduled_at = seq.request.scheduled_at or now
        if work.start > 0:
            last = self.runner.prefill(work.first_slot, work.chunks[0], work.start)[-1:]
        else:
            last = self.runner.prefill_batch(work.first_slot, work.chunks)
        done = self.scheduler.prefill_done(work)
        for seq in work.seqs:
            self.kv.lengths[seq.slot] = seq.num_prefilled
        seqs: list[Sequence] = []
        rows: list[int] = []
        for i, seq in enumerate(work.seqs):
            if seq not in done:
                continue
            family = [seq] + [sib for sib in seq.request.seqs if sib is not seq]
            for sib in family[1:]:
                self.scheduler.fork(seq, sib)
            seqs += family
            rows += [i] * len(family)
        return seqs, last[rows] if rows else np.empty((0, self.model.vocab_size), np.float32)

    # ---- update and emit -----------------------------------------------------------------------

    def _append(self, seq: Sequence, token: int, logprob: float, top: list | None, now: float) -> list[Output]:
        state, req = seq.request, seq.request.request
        st = req.stopping
        seq.output_ids.append(token)
        seq.sampling.accept(token)
        state.first_token_at = state.first_token_at or now
        n_out = len(seq.output_ids)
        active = n_out >= st.min_new_tokens  # stop conditions count only from min_new_tokens on
        reason = None
        if active and token == self.model.eos_token_id and not st.ignore_eos:
            reason = FinishReason.EOS
        elif active and token in st.stop_token_ids:
            reason = FinishReason.STOP
        text, by_string = "", False
        if reason is None:
            text, by_string = seq.text.push(token, check_stop=active)
            if by_string:
                reason = FinishReason.STOP
            elif n_out >= st.max_new_tokens:
                reason = FinishReason.LENGTH
        if reason is not None and not by_string:  # flush held-back text (a stop string may still match)
            tail, by_string = seq.text.finish(check_stop=active)
            text += tail
            reason = FinishReason.STOP if by_string else reason
        self._set_suppression(seq)
        event = TokenEvent(state.id, seq.index, token, logprob, top, text, reason, now)
        out: list[Output] = [(state, event)]
        if reason is None:
            self.kv.pending[seq.slot] = token
        else:
            seq.finish_reason = reason
            self.scheduler.free(seq)
            if all(s.status is Status.FINISHED for s in state.seqs):
                out += self.end(state, None)
        return out

    def _set_suppression(self, seq: Sequence) -> None:
        st = seq.request.request.stopping
        if len(seq.output_ids) < st.min_new_tokens:
            seq.sampling.suppress = list(st.stop_token_ids) + ([] if st.ignore_eos else [self.model.eos_token_id])
        else:
            seq.sampling.suppress = []

    def _count(self, tokens: int) -> None:
        self.generated_tokens += tokens
        self._rate.append((time.monotonic(), tokens))
        self._rate_tokens += tokens

    def _recent_rate(self, now: float) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S (amortised O(1): the engine
        thread asks after every step)."""
        rate = self._rate
        while rate and rate[0][0] < now - RATE_WINDOW_S:
            self._rate_tokens -= rate.popleft()[1]
        return self._rate_tokens / max(now - rate[0][0], 1e-3) if rate else 0.0

    def stats(self) -> EngineStats:
        rate = self._recent_rate(time.monotonic())
        running = {o.request.id for o in self.kv.owners[:self.kv.used] if o is not None}
        return EngineStats(running_requests=len(running), running_sequences=self.scheduler.num_running,
                           waiting_requests=len(self.scheduler.waiting), kv_slots=self.kv.n_slots,
                           kv_free_slots=self.kv.free_slots, kv_free_tokens=self.kv.free_tokens,
                           kv_bytes=self.kv.nbytes, tokens_per_s=rate, generated_tokens=self.generated_tokens,
                           steps=self.steps)
