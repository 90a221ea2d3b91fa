"""The engine core: schedule -> run the model -> sample -> update and emit, one step at a time.

It deals in token ids only (plus each sequence's text stream, so stop strings end a sequence in
the step that completes them). One thread owns it: `service.engine.async_engine` runs `step()` in
a loop and feeds it requests; tests and benchmarks may drive it directly.

    engine = Engine(EngineConfig(bundle=...))
    [done] = engine.generate([GenerationRequest("r1", prompt_ids)])   # run to the end: done.token_ids()

    engine.add(engine.new_request(GenerationRequest("r2", prompt_ids)))   # or step by step
    for state, item in engine.step():   # item: a TokenEvent, or an EngineError for that request
        ...

A sequence's KV slot is released in the step in which it finishes, is aborted or expires. When a
model call raises, only the requests whose work was in that call fail (`ModelError`): a batch of
new prompts that fails is retried one prompt at a time, so one prompt the model cannot take never
ends the others, and the decode rows run on their own.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from service.engine.beam_search import BeamSearch
from service.engine.beam_step import BeamStep
from service.engine.cache_plan import plan_caches
from service.engine.config import EngineConfig
from service.engine.detokenizer import TextStream
from service.engine.errors import Cancelled, DeadlineExceeded, EngineError, InvalidRequest, ModelError
from service.engine.grammar import Grammar, Grammars, allowed
from service.engine.kv_cache import KVCache
from service.engine.output import Output, OutputStep
from service.engine.prompt_logprobs import record as record_prompt_logprobs
from service.engine.request import EngineLimits, Generated, GenerationRequest, TokenEvent
from service.engine.sampler import SamplingBatch, SequenceSampling, sample
from service.engine.scheduler import PrefillWork, Scheduler
from service.engine.sequence import RequestState, Sequence, Status
from service.engine.speculative_step import SpeculationStats, SpeculativeStep
from service.runtime.graph_choice import open_serving_graph
from service.runtime.static_runner import StaticRunner

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class EngineStats:
    running_requests: int  # requests whose prompt is (being) prefilled and that have not ended
    running_sequences: int  # sequences holding or promised a KV slot
    waiting_requests: int  # requests queued for admission
    kv_slots: int  # sequences the KV cache holds
    kv_free_slots: int
    kv_free_tokens: int  # free slots × positions per slot
    kv_bytes: int  # memory of the KV cache, allocated once
    tokens_per_s: float  # generated tokens per second over the last 10 s
    generated_tokens: int  # since start
    steps: int  # model steps since start
    prefix_queried_tokens: int  # prompt tokens of admitted requests looked up in the prefix cache, since start
    prefix_hit_tokens: int  # of those, found there (their keys and values copied, not computed)
    prefix_cache_bytes: int  # memory of the prefix cache, allocated once (0 when it is off)
    speculation: SpeculationStats  # speculative decoding's drafts and tokens since start (all 0 when it is off)


@dataclass
class RunnerOutput:
    """What one model call gave: a logits row per sequence to sample, and the requests it failed."""

    seqs: list[Sequence] = field(default_factory=list)
    logits: np.ndarray | None = None
    failed: list[Output] = field(default_factory=list)

    def __add__(self, other: RunnerOutput) -> RunnerOutput:
        rows = [r.logits for r in (self, other) if r.seqs]
        return RunnerOutput(self.seqs + other.seqs, np.concatenate(rows) if len(rows) == 2 else (rows or [None])[0],
                   self.failed + other.failed)


class Engine:
    def __init__(self, config: EngineConfig, runner: StaticRunner | None = None):
        self.config = config
        self.runner = runner or open_serving_graph(config.bundle, config.graph, config.providers, config.threads,
                                                   config.max_running, config.allow_low_agreement,
                                                   config.max_source_tokens)
        m = self.runner.manifest.model
        self.model = m
        self.eos_ids = frozenset(m.stop_ids)  # every id that ends generation (Llama 3 has several)
        self.tokenizer = self.runner.tokenizer
        # ids the tokenizer can turn into text: a model's vocabulary may be padded past them, and
        # those ids are never sampled
        self.sampleable = min(self.tokenizer.vocab_size, m.vocab_size)
        plan = plan_caches(config, self.runner)
        self.context = plan.context  # positions per sequence, prompt + completion
        self.encoder_decoder = m.encoder_decoder  # its prompt is a source, encoded apart
        self.prefixes = plan.prefixes
        n_slots = plan.n_slots
        self.kv = KVCache(plan.shape, n_slots, self.runner.slot_state(n_slots))
        self.runner.attach(self.kv.buffers, self.kv.slot_state)
        self.scheduler = Scheduler(self.kv, config.max_running, config.max_batch_tokens, self.prefixes,
                                   encoder_decoder=self.encoder_decoder)
        self.max_running = self.scheduler.max_running  # sequences decoded together (fixed)
        self.output = OutputStep(self.scheduler, self.eos_ids, self.end)
        self.grammars = Grammars(self.tokenizer, m.vocab_size, sorted(self.eos_ids))  # structured output
        self.limits = EngineLimits.of(config, self.context,
                                      self.runner.max_source if self.encoder_decoder else None)
        self.speculation = SpeculativeStep.of(self, config)
        self.beams = BeamStep(self)
        self.requests: dict[str, RequestState] = {}
        self._deadlines: list[tuple[float, int, RequestState]] = []  # a heap; ended requests leave lazily
        self._arrivals = itertools.count()
        self._running_requests = 0
        self._sampling: tuple[tuple[int, ...], SamplingBatch] | None = None  # the decode rows' batch, reused
        self._rate: deque[tuple[float, int]] = deque()  # (time, tokens) of the steps in the rate window
        self._rate_tokens = 0  # their sum
        self.generated_tokens = 0
        self.steps = 0
        log.info("KV cache: %d slots x %d positions, %.1f MiB (%d bytes) allocated once; %s", n_slots,
                 self.kv.shape.max_seq, self.kv.nbytes / 2**20, self.kv.nbytes,
                 f"prefix cache: {self.prefixes.n_blocks} blocks x {self.prefixes.block_tokens} positions, "
                 f"{self.prefixes.nbytes / 2**20:.1f} MiB" if self.prefixes else "prefix caching off")

    def warm_up(self) -> None:
        """Run the model at every decode batch size it will see (before any request is added):
        onnxruntime's first run at a new batch size allocates, and requests should not pay for it."""
        if self.requests:
            raise RuntimeError("warm_up() must run before requests are added")
        started = time.perf_counter()
        self.runner.decode_every_batch_size(self.max_running)
        if self.speculation is not None:
            self.speculation.calibrate()
        try:
            self.grammars.tokenizer()  # the vocabulary as llguidance sees it, for the first constrained request
        except InvalidRequest as e:
            log.info("%s", e)
        log.info("warmed up decode at batch sizes 1-%d and the grammar tokenizer in %.1f s", self.max_running,
                 time.perf_counter() - started)

    # ---- requests in and out -------------------------------------------------------------------

    def new_request(self, request: GenerationRequest, grammar: Grammar | None = None) -> RequestState:
        """Validate a request and build its state. Pure: reads only what never changes (the model,
        the limits, the tokenizer), so any thread may call it; `add` hands the state to the engine.
        A constrained request's `grammar` is compiled here unless given (`AsyncEngine` compiles it
        in a worker thread first)."""
        request.validate(self.model.vocab_size, self.context, self.limits)
        if request.slots > self.max_running:
            field = "beam_width" if request.beam is not None else "n"
            raise InvalidRequest(field, f"{request.slots} sequences; this engine runs at most {self.max_running} at "
                                 "once")
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        state = RequestState(request, seed)
        # penalties count the tokens the model has generated from: the prompt, or an encoder-decoder's target
        history = [self.model.decoder_start_token_id] if self.encoder_decoder else request.prompt_token_ids
        first = SequenceSampling.create(request.sampling, history, self.model.vocab_size, seed,
                                     want_logprobs=request.logprobs, top_logprobs=request.top_logprobs,
                                     suppress=self._suppressed_until_min_tokens(request),
                                     min_tokens=request.stopping.min_new_tokens)
        if request.constraint is not None and grammar is None:
            grammar = self.grammars.compile(request.constraint)
        if request.beam is not None:
            state.beam = BeamSearch(request.beam.width, self.eos_ids | frozenset(request.stopping.stop_token_ids),
                                    request.stopping.max_new_tokens, request.beam.length_penalty,
                                    request.beam.early_stopping)
        for i in range(request.slots):
            sampling = first if i == 0 else first.fork(i, seed)
            seq = Sequence(state, i, sampling, TextStream(self.tokenizer, request.stopping.stop))
            seq.matcher = grammar.matcher() if grammar is not None else None
            state.seqs.append(seq)
        return state

    def _suppressed_until_min_tokens(self, request: GenerationRequest) -> np.ndarray:
        """The ids that would end a sequence before `min_new_tokens`: its stop ids, and the EOS ids."""
        st = request.stopping
        return np.array(list(st.stop_token_ids) + ([] if st.ignore_eos else sorted(self.eos_ids)), dtype=np.int64)

    def add(self, state: RequestState) -> None:
        """Queue a request. Admission (whether there is room) is the caller's decision, made once:
        `AsyncEngine.submit` makes it."""
        if state.id in self.requests:
            raise InvalidRequest("request_id", f"{state.id!r} is already running")
        self.requests[state.id] = state
        self.scheduler.add(state)
        if state.request.deadline is not None:
            heapq.heappush(self._deadlines, (state.request.deadline, next(self._arrivals), state))

    def abort(self, request_id: str, error: EngineError | None = None) -> list[Output]:
        """End a request with `error` (by default `Cancelled`): its slots are free from the next step."""
        state = self.requests.get(request_id)
        return self.end(state, error or Cancelled("the request was cancelled")) if state else []

    def expire(self, now: float | None = None) -> list[Output]:
        """End every request whose deadline has passed, waiting or running."""
        now = time.monotonic() if now is None else now
        out: list[Output] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            state = heapq.heappop(self._deadlines)[2]
            if not state.done:
                where = "in the queue" if state.scheduled_at is None else "while running"
                out += self.end(state, DeadlineExceeded(f"the deadline passed {where}"))
        return out

    def end(self, state: RequestState, error: EngineError | None) -> list[Output]:
        self.scheduler.drop(state)
        state.done = True
        self.requests.pop(state.id, None)
        if state.scheduled_at is not None:
            self._running_requests -= 1
        if len(self._deadlines) > 2 * len(self.requests) + 64:  # drop ended requests' entries now and then
            self._deadlines = [d for d in self._deadlines if not d[2].done]
            heapq.heapify(self._deadlines)
        return [(state, error)] if error is not None else []

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def generate(self, requests: Iterable[GenerationRequest] = (),
                 on_outputs: Callable[[list[Output]], None] | None = None) -> list[Generated]:
        """Run `requests`, and whatever else was queued, to the end on this thread (benchmarks, tests and
        offline use; `AsyncEngine` drives a server's engine), deadlines included. Returns each of
        `requests` in the order given. `on_outputs` sees every output as it comes, a new prompt's
        first token before the decode rows of its step run."""
        results = {}
        for request in requests:
            self.add(self.new_request(request))
            results[request.request_id] = Generated(request.request_id)

        def take(outputs: list[Output]) -> None:
            for state, item in outputs:
                if state.id in results:
                    if isinstance(item, TokenEvent):
                        results[state.id].events.append(item)
                    else:
                        results[state.id].error = item
            if on_outputs is not None:
                on_outputs(outputs)

        while self.has_work:
            take(self.expire())
            take(self.step(emit=take))
        return list(results.values())

    # ---- the step ------------------------------------------------------------------------------

    def step(self, emit: Callable[[list[Output]], None] | None = None) -> list[Output]:
        """Run one step; returns its outputs. With `emit`, the new prompts' first tokens are handed
        to it as soon as they are sampled, before the decode rows run."""
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        out: list[Output] = []
        if batch.new_prompts is not None and self._joins_decode(batch.new_prompts, batch.decode):
            out += self._sample_and_update(self._encode_then_decode(batch.new_prompts, batch.decode))
            self.steps += 1
            return out
        if batch.new_prompts is not None:
            out += self._sample_and_update(self._run_prefill(batch.new_prompts))
            if emit is not None and out:
                emit(out)
                out = []
        if batch.decode:
            out += self.speculation.decode(batch.decode) if self.speculation else self.plain_decode(batch.decode)
        if batch.next_chunk is not None:
            out += self._sample_and_update(self._run_prefill(batch.next_chunk))
        self.steps += 1
        return out

    def plain_decode(self, decode: list[Sequence]) -> list[Output]:
        """One token for each decoding row, from one model call."""
        return self._sample_and_update(self._run_decode(decode))

    # ---- run: one model call, and who fails if it raises ---------------------------------------

    def _run_prefill(self, work: PrefillWork) -> RunnerOutput:
        try:
            return self._prefill(work)
        except Exception as e:
            if len(work.seqs) == 1:
                return RunnerOutput(failed=self._fail([work.seqs[0].request_state], e))
            log.warning("a prefill of %d prompts failed (%s); running them one at a time", len(work.seqs), e)
            ran = RunnerOutput()
            for one in work.split():  # each reads its slot when it runs: a failed one's slot moves others
                ran += self._run_prefill(one)
            return ran

    def _started(self, work: PrefillWork) -> None:
        now = time.monotonic()
        for seq in work.seqs:
            if seq.request_state.scheduled_at is None:
                seq.request_state.scheduled_at = now
                self._running_requests += 1

    def _prefill(self, work: PrefillWork) -> RunnerOutput:
        """Write the prompts (or the chunk); returns a logits row for each sequence whose prompt is now
        complete, the n > 1 siblings included."""
        self._started(work)
        first = work.seqs[0].slot
        states = [seq.request_state for seq in work.seqs]
        scoring = any(state.prompt_logprobs is not None for state in states)
        if work.start > 0:  # a chunk: every position's logits, [1, chunk, vocab]
            logits = self.runner.prefill(first, work.chunks[0], work.start)[None]
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

    def _joins_decode(self, work: PrefillWork, decode: list[Sequence]) -> bool:
        """Whether an encoder-decoder's new sources can join the decode call: each one sequence (no n > 1
        siblings or beams to fork after it), none scoring its prompt, their slots right after the decode rows'."""
        return self.encoder_decoder and all(
            seq.request_state.request.slots == 1 and seq.request_state.prompt_logprobs is None
            and seq.slot == len(decode) + i for i, seq in enumerate(work.seqs))

    def _encode_then_decode(self, work: PrefillWork, decode: list[Sequence]) -> RunnerOutput:
        """An encoder-decoder's new sources go into their slots (the encoder), then their decoder start tokens
        run in the decode call beside the decoding rows' tokens (if any): one decoder call a step instead of
        two, through the decode call's bindings, made once. A row's logits are the same bits either way (the
        graph is batch-invariant). If a call raises, the prompts and the decode rows run apart, as without
        this, so only the work that fails fails."""
        n, k = len(decode), len(work.seqs)
        self._started(work)
        for seq in work.seqs:  # a new slot's length is 0; it feeds the decoder start token
            self.kv.pending[seq.slot] = self.model.decoder_start_token_id
        try:
            self.runner.encode(work.seqs[0].slot, work.chunks)
            logits = self.runner.decode(*self.scheduler.decode_inputs(n + k))
        except Exception as e:
            log.warning("encoding %d sources with the decode step failed (%s); running them apart", k, e)
            return self._run_prefill(work) + (self._run_decode(decode) if decode else RunnerOutput())
        self.scheduler.decoded(n)
        complete = self.scheduler.prefilled(work)
        live = [i for i, s in enumerate(decode) if s.status is Status.DECODING]
        rows = live + [n + row for row, _ in complete]
        return RunnerOutput([decode[i] for i in live] + [seq for _, seq in complete], logits[rows])

    def _run_decode(self, decode: list[Sequence]) -> RunnerOutput:
        """One token for each of slots [0, n); rows still prefilling a long prompt are not sampled."""
        n = len(decode)
        try:
            logits = self.runner.decode(*self.scheduler.decode_inputs(n))
        except Exception as e:
            return RunnerOutput(failed=self.fail_decode(decode, e))
        self.scheduler.decoded(n)
        live = [i for i, s in enumerate(decode) if s.status is Status.DECODING]
        if len(live) == n:
            return RunnerOutput(decode, logits)
        return RunnerOutput([decode[i] for i in live], logits[live])

    def fail_decode(self, decode: list[Sequence], error: Exception) -> list[Output]:
        """A decode call raised: its decoding requests fail."""
        return self._fail(dict.fromkeys(s.request_state for s in decode if s.status is Status.DECODING), error)

    def _fail(self, states: Iterable[RequestState], error: Exception) -> list[Output]:
        log.error("model call failed: %s: %s", type(error).__name__, error, exc_info=error)
        out: list[Output] = []
        for state in states:
            if not state.done:
                out += self.end(state, ModelError("the model call failed", detail=f"{type(error).__name__}: {error}"))
        return out

    # ---- sample, then the output step (engine/output.py) ---------------------------------------

    def _sample_and_update(self, ran: RunnerOutput) -> list[Output]:
        out = ran.failed
        seqs = ran.seqs
        if not seqs:
            return out
        logits = self.only_sampleable(ran.logits)
        beams = [i for i, seq in enumerate(seqs) if seq.request_state.beam is not None]
        if beams:  # beam search requests choose their tokens together, the others are sampled
            out = out + self.beams.update([seqs[i] for i in beams], logits[beams])
            rest = [i for i in range(len(seqs)) if seqs[i].request_state.beam is None]
            if not rest:
                return out
            seqs, logits = [seqs[i] for i in rest], logits[rest]
        result = sample(logits, self._sampling_batch(seqs), masks=self.masks_of(seqs))
        now = time.monotonic()
        tokens, logprobs = result.tokens.tolist(), result.logprobs.tolist()  # Python numbers, once per step
        for i, seq in enumerate(seqs):
            logprob = None if logprobs[i] != logprobs[i] else logprobs[i]  # NaN: the request asked for none
            out += self.output.update(seq, tokens[i], logprob, result.top(i, seq.request.top_logprobs), now)
        self.count_tokens(len(seqs))
        return out

    def only_sampleable(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (the vocabulary on the last axis) with the ids past `sampleable` at -inf, in place."""
        if self.sampleable < logits.shape[-1]:
            logits[..., self.sampleable:] = -np.inf
        return logits

    def masks_of(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, allowed tokens) of the constrained rows among `seqs`."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        bitmask = self.grammars.masks([seqs[i].matcher for i in rows])
        return np.array(rows), allowed(bitmask, self.model.vocab_size)

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The rows' sampling parameters as vectors, rebuilt only when the rows change."""
        key = tuple(id(s.sampling) for s in seqs)  # the cached batch holds these states: their ids stay theirs
        if self._sampling is None or self._sampling[0] != key:
            self._sampling = key, SamplingBatch([s.sampling for s in seqs])
        return self._sampling[1]

    # ---- counters ------------------------------------------------------------------------------

    def count_tokens(self, tokens: int) -> None:
        self.generated_tokens += tokens
        self._rate.append((time.monotonic(), tokens))
        self._rate_tokens += tokens

    def _recent_rate(self, now: float) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S (amortised O(1))."""
        rate = self._rate
        while rate and rate[0][0] < now - RATE_WINDOW_S:
            self._rate_tokens -= rate.popleft()[1]
        return self._rate_tokens / max(now - rate[0][0], 1e-3) if rate else 0.0

    def stats(self) -> EngineStats:
        """A snapshot, in O(1): every figure is a counter kept as the state changes."""
        p = self.prefixes
        return EngineStats(running_requests=self._running_requests, running_sequences=self.scheduler.num_running,
                           waiting_requests=len(self.scheduler.waiting), kv_slots=self.kv.n_slots,
                           kv_free_slots=self.kv.free_slots, kv_free_tokens=self.kv.free_tokens,
                           kv_bytes=self.kv.nbytes, tokens_per_s=self._recent_rate(time.monotonic()),
                           generated_tokens=self.generated_tokens, steps=self.steps,
                           prefix_queried_tokens=p.queried_tokens if p else 0,
                           prefix_hit_tokens=p.hit_tokens if p else 0, prefix_cache_bytes=p.nbytes if p else 0,
                           speculation=self.speculation.stats() if self.speculation else SpeculationStats())
