"""The engine core: schedule -> run the model -> sample -> update and emit, one step at a time.

It deals in token ids only (plus each sequence's text stream, so stop strings end a sequence in
the step that completes them). One thread owns it: `service.engine.async_engine` runs `step()` in
a loop and feeds it requests; tests and benchmarks may drive it directly.

    engine = Engine(EngineConfig(bundle=...))
    [done] = engine.generate([GenerationRequest("r1", prompt_ids)])   # run to the end: done.token_ids()

    engine.add(engine.new_request(GenerationRequest("r2", prompt_ids)))   # or step by step
    for state, item in engine.step():   # item: a TokenEvent, or an EngineError for that request
        ...

Each phase of a step is a module of its own: `scheduler.py` (who runs), `run_step.py` (the model calls, and
who fails when one raises), `sample_step.py` (logits -> tokens: sampled, a beam search's step, or drafts
accepted), `output.py` (tokens appended, stops, events; slots fed or freed); `step_data.py` holds what flows
between them. A sequence's KV slot is released in the step in which it finishes, is aborted or expires.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from service.engine.beam_step import BeamStep
from service.engine.cache_plan import plan_caches
from service.engine.config import EngineConfig
from service.engine.counters import EngineCounters, SpeculationStats
from service.engine.errors import Cancelled, DeadlineExceeded, EngineError, InvalidRequest
from service.engine.grammar import Grammar, Grammars
from service.engine.kv_cache import KVCache
from service.engine.output import OutputStep
from service.engine.request import EngineLimits, Generated, GenerationRequest, TokenEvent
from service.engine.request_builder import RequestBuilder
from service.engine.run_step import RunStep
from service.engine.sample_step import SampleStep
from service.engine.scheduler import Scheduler
from service.engine.sequence import RequestState
from service.engine.speculative_step import SpeculativeStep
from service.engine.step_data import Output
from service.runtime.graph_choice import open_serving_graph
from service.runtime.static_runner import StaticRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    running_requests: int  # requests whose prompt is (being) prefilled and that have not ended
    running_sequences: int  # sequences holding or promised a KV slot
    waiting_requests: int  # requests queued for admission
    kv_slots: int  # rows a step may run (each reserves a context of address space)
    kv_free_slots: int
    kv_tokens: int  # positions the KV cache's memory holds, for sequences and the prefix cache
    kv_free_tokens: int  # of those, not held by a sequence (the prefix cache's count as free: sequences take them)
    kv_bytes: int  # memory the budget gives the KV cache
    preemptions: int  # sequences preempted (to be recomputed) when the KV cache ran out of blocks, since start
    tokens_per_s: float  # generated tokens per second over the last 10 s
    generated_tokens: int  # since start
    steps: int  # model steps since start
    prefix_queried_tokens: int  # prompt tokens of admitted requests looked up in the prefix cache, since start
    prefix_hit_tokens: int  # of those, found there (their keys and values copied, not computed)
    prefix_cache_bytes: int  # memory the prefix cache's blocks hold now (0 when it is off)
    speculation: SpeculationStats  # speculative decoding's drafts and tokens since start (all 0 when it is off)


class Engine:
    def __init__(self, config: EngineConfig, runner: StaticRunner | None = None, kv_bytes: int | None = None):
        self.config = config
        self.runner = runner or open_serving_graph(config.bundle, config.graph, config.providers, config.threads,
                                                   config.max_running, config.allow_low_agreement,
                                                   config.max_source_tokens, kv_dtype=config.kv_dtype)
        m = self.runner.manifest.model
        self.model = m
        self.eos_ids = frozenset(m.stop_ids)  # every id that ends generation (Llama 3 has several)
        self.tokenizer = self.runner.tokenizer
        # ids the tokenizer can turn into text: a model's vocabulary may be padded past them, and
        # those ids are never sampled
        self.sampleable = min(self.tokenizer.vocab_size, m.vocab_size)
        plan = plan_caches(config, self.runner, kv_bytes)  # kv_bytes: granted by the model pool (several models)
        self.memory = plan.memory  # where the budget went
        self.context = plan.context  # positions per sequence, prompt + completion
        self.encoder_decoder = m.encoder_decoder  # its prompt is a source, encoded apart
        self.prefixes = plan.prefixes
        n_slots = plan.n_slots
        self.kv = KVCache(plan.shape, n_slots, self.runner.slot_state(n_slots), plan.block_tokens, plan.n_blocks)
        self.runner.attach(self.kv.buffers, self.kv.slot_state)
        lookahead = config.speculative_tokens if config.speculative != "off" else 0
        self.scheduler = Scheduler(self.kv, config.max_running, config.max_batch_tokens, self.prefixes,
                                   encoder_decoder=self.encoder_decoder, lookahead=lookahead)
        self.max_running = self.scheduler.max_running  # sequences decoded together (fixed)
        self.block_policy = self.scheduler.blocks  # fixed figures: new_request reads it on any thread
        self.grammars = Grammars(self.tokenizer, m.vocab_size, sorted(self.eos_ids))  # structured output
        self.limits = EngineLimits.of(config, self.context,
                                      self.runner.max_source if self.encoder_decoder else None)
        self.builder = RequestBuilder(m, self.tokenizer, self.limits, self.context, self.max_running, self.eos_ids,
                                      self.grammars)
        self.counters = EngineCounters()
        # the step's phases after the scheduler: run, sample, update
        self.speculation = SpeculativeStep.of(config, self.runner, self.kv, self.context, self.max_running,
                                              self.counters)
        self.run_step = RunStep(self.runner, self.scheduler, self.speculation, self.end, self.counters,
                                self.sampleable)
        self.sample_step = SampleStep(self.grammars, m.vocab_size, self.sampleable)
        beams = BeamStep(self.kv, self.scheduler, self.tokenizer, self.eos_ids, self.end)
        self.output = OutputStep(self.scheduler, self.eos_ids, self.end, beams, self.counters)
        self.requests: dict[str, RequestState] = {}
        self._deadlines: list[tuple[float, int, RequestState]] = []  # a heap; ended requests leave lazily
        self._arrivals = itertools.count()
        log.info("%s", plan.memory.describe(config.memory_budget))
        log.info("KV cache: %d tokens (%d blocks of %d positions, %.1f MiB in %s), taken as sequences write them; "
                 "sequences of up to %d positions (%.1f full contexts), %d at once; %s", plan.tokens, plan.n_blocks,
                 plan.block_tokens, self.kv.nbytes / 2**20, plan.shape.dtype, self.context, plan.tokens / self.context,
                 n_slots,
                 f"prefix cache: up to {self.prefixes.n_blocks * self.prefixes.block_tokens} tokens of it"
                 if self.prefixes else "prefix caching off")

    def warm_up(self) -> None:
        """Run decode once at the widest batch the engine runs (before any request is added): onnxruntime's
        first run at a batch size allocates what every narrower batch then reuses, so requests do not pay for
        it (docs/engine.md has the measurements)."""
        if self.requests:
            raise RuntimeError("warm_up() must run before requests are added")
        started = time.perf_counter()
        self.runner.decode_widest(self.max_running)
        decode_s = time.perf_counter() - started
        if self.speculation is not None:
            self.speculation.calibrate()
        self.kv.discard_unused()  # what warm-up wrote holds no sequence: its pages go back
        try:
            self.grammars.tokenizer()  # the vocabulary as llguidance sees it, for the first constrained request
        except InvalidRequest as e:
            log.info("%s", e)
        log.info("warmed up decode at batch size %d in %.1f s, then the rest%s in %.1f s", self.max_running,
                 decode_s, " (speculation's call times, the grammar tokenizer)" if self.speculation else
                 " (the grammar tokenizer)", time.perf_counter() - started - decode_s)

    # ---- requests in and out -------------------------------------------------------------------

    def new_request(self, request: GenerationRequest, grammar: Grammar | None = None) -> RequestState:
        """Validate a request and build its state (`RequestBuilder.build`): pure, so any thread may call it;
        `add` hands the state to the engine."""
        state = self.builder.build(request, grammar)
        too_big = self.block_policy.refusal(state)
        if too_big is not None:
            raise InvalidRequest("max_new_tokens" if state.request.slots == 1 else "n", too_big)
        return state

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
        """End a request now (every slot and reservation back); returns its error's output, if it has one."""
        self.scheduler.drop(state)
        state.done = True
        self.requests.pop(state.id, None)
        if state.scheduled_at is not None:
            self.counters.running_requests -= 1
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
        """Run one step; returns its outputs. With `emit`, the new prompts' first tokens are handed to it as
        soon as they are sampled, before the decode rows run."""
        batch = self.scheduler.schedule()  # who runs: the decode rows, and new prompts or a long prompt's chunk
        out: list[Output] = []
        for call in self.run_step.calls(batch):
            ran = call.run()  # one model call: each row's logits, or the requests it failed
            sampled = self.sample_step.choose(ran)  # each row's tokens: sampled, a beam step, or drafts kept
            out += self.output.apply(sampled)  # appended, stopped, emitted; each sequence fed or freed
            if ran.plan is not None:  # speculation learns what its decision gave
                self.speculation.measured(ran.plan, sampled)
            if call.first_tokens and emit is not None and out:
                emit(out)
                out = []
        if not batch.empty:
            self.counters.steps += 1
        return out

    def stats(self) -> EngineStats:
        """A snapshot, in O(1): every figure is a counter kept as the state changes."""
        p, c = self.prefixes, self.counters
        return EngineStats(running_requests=c.running_requests, running_sequences=self.scheduler.num_running,
                           waiting_requests=len(self.scheduler.waiting), kv_slots=self.kv.n_slots,
                           kv_free_slots=self.kv.free_slots, kv_tokens=self.kv.n_blocks * self.kv.block_tokens,
                           kv_free_tokens=self.kv.reclaimable_tokens, kv_bytes=self.kv.nbytes,
                           preemptions=self.scheduler.preemptions, tokens_per_s=c.tokens_per_s(time.monotonic()),
                           generated_tokens=c.generated_tokens, steps=c.steps,
                           prefix_queried_tokens=p.queried_tokens if p else 0,
                           prefix_hit_tokens=p.hit_tokens if p else 0, prefix_cache_bytes=p.nbytes if p else 0,
                           speculation=c.speculation())
