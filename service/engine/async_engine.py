"""The engine on its own thread, behind an asyncio API.

    engine = AsyncEngine(EngineConfig(bundle=...))
    engine.start()
    async for event in engine.submit(request):     # TokenEvent, token by token
        ...
    engine.abort(request_id); engine.end_all(error); engine.stats(); await engine.shutdown()

One thread owns the engine: it alone reads or writes the scheduler, the KV cache and the requests'
state. The event loop talks to it through one queue of commands (add, abort, stop) and reads only
what the engine thread publishes after each step: a stats snapshot, and each request's events with
its timings. onnxruntime releases the GIL while it computes, so the event loop stays responsive;
each step's events reach the loop in one `call_soon_threadsafe` callback, and the engine thread
never waits for a consumer. A request submitted `whole` (a unary call, whose consumer reads its events
only at the end) has its events handed over when it ends, in one callback: waking the loop for every
step of it would only make the engine thread and the loop take turns at the GIL.

`submit` decides admission, once, on the loop: a bad request raises `InvalidRequest` at once, and
a request that finds the engine full (every KV slot promised and `max_waiting` requests queued)
raises `Overloaded`. A request it accepts is never refused later.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from service.engine.config import EngineConfig
from service.engine.core import Engine, EngineStats, Output
from service.engine.errors import EngineError, EngineStopped, InvalidRequest, ModelError, Overloaded
from service.engine.grammar import Grammar
from service.engine.request import GenerationRequest, TokenEvent
from service.engine.sequence import RequestState, Timing
from service.engine.step_turns import StepTurns

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle engine thread waits for a command before looking again
ADD, ABORT, STOP = "add", "abort", "stop"


class RequestStream:
    """The async iterator returned by `submit`: one request's events, then its end.

    Iterate it for one event at a time, or call `next_batch()` for every event that has arrived
    (a consumer that fell behind catches up in one go). Leaving early (`cancel()`, or the consuming
    task being cancelled) aborts the request and frees its KV slots at the engine's next step.
    `timing` is the request's arrival, start of prefill and first token, as of its latest event.
    """

    def __init__(self, request: GenerationRequest, timing: Timing, on_close: Callable[[RequestStream], None],
                 abort: Callable[[str], None], owner: object = None):
        self.request_id = request.request_id
        self._owner = owner  # the engine's state of this request: compared by identity, never read
        self.n = request.n
        self.slots = request.slots  # KV slots its sequences hold (its beams, or its n samples)
        self.timing = timing
        self._on_close, self._abort = on_close, abort
        self._items: deque[TokenEvent | EngineError] = deque()
        self._arrived = asyncio.Event()
        self._open = request.n  # sequences the consumer has not seen finish yet
        self._live = request.n  # sequences the engine has not finished yet
        self.ended = False  # the engine is done with the request (its events may still be unread)
        self.finished = False  # ... and the consumer has read them all
        self._min_events = 1  # wake the consumer once this many events are queued
        self._min_age_s = 0.0  # ... and the oldest of them has waited this long,
        self._max_delay_s = 0.0  # or once the oldest has waited this long anyway

    def _put(self, item: TokenEvent | EngineError, timing: Timing, now: float) -> None:
        self.timing = timing
        self._items.append(item)
        if isinstance(item, EngineError):
            self._live = 0
        elif item.finish_reason is not None:
            self._live -= 1
        self.ended = self._live == 0
        if self._ready(now):
            self._arrived.set()

    def _ready(self, now: float) -> bool:
        items = self._items
        if not items:
            return False
        last = items[-1]
        if not isinstance(last, TokenEvent) or last.finish_reason is not None:
            return True
        age = now - items[0].time
        return age >= self._max_delay_s or (len(items) >= self._min_events and age >= self._min_age_s)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        self._min_events, self._min_age_s = 1, 0.0
        await self._wait()
        item = self._items.popleft()
        if isinstance(item, EngineError):
            self._close()
            raise item
        self._count(item)
        return item

    async def next_batch(self, min_events: int = 1, min_age_s: float = 0.0,
                         max_delay_s: float = math.inf) -> list[TokenEvent]:
        """Every event that has arrived, waiting for at least one; [] once the request has ended.
        An error is raised after the events that came before it have been returned.

        A consumer that pays per batch can ask for fewer, larger ones: it is woken once at least
        `min_events` events are queued and the oldest has waited `min_age_s`, or once the oldest has
        waited `max_delay_s` whatever the count, or when the request ends. Ages are checked as
        events arrive, so a wake-up can be late by one engine step."""
        if self.finished:
            return []
        self._min_events, self._min_age_s, self._max_delay_s = min_events, min_age_s, max_delay_s
        await self._wait()
        events: list[TokenEvent] = []
        while self._items and isinstance(self._items[0], TokenEvent):
            item = self._items.popleft()
            self._count(item)
            events.append(item)
            if self.finished:
                return events
        if events:
            return events
        error = self._items.popleft()  # nothing but an error follows a request's events
        self._close()
        raise error

    async def _wait(self) -> None:
        """Return once the queued events are ready for the consumer; `_put` sets `_arrived` only then."""
        if self._ready(time.monotonic()):
            return
        self._arrived.clear()
        try:
            await self._arrived.wait()
        except asyncio.CancelledError:
            self.cancel()
            raise

    def _count(self, event: TokenEvent) -> None:
        if event.finish_reason is not None:
            self._open -= 1
            if self._open == 0:
                self._close()

    def _close(self) -> None:
        self.finished = True
        self._on_close(self)

    def cancel(self) -> None:
        """The consumer is gone: abort the request and free its slots."""
        if not self.finished:
            self._close()
            if not self.ended:
                self._abort(self.request_id)


@dataclass(frozen=True)
class Published:
    """What the engine thread publishes after each step for the loop to read."""

    stats: EngineStats
    taken: int  # add commands taken from the queue so far

GRAMMAR_COMPILE_S = 10.0  # a constraint that takes longer to compile is refused
COMPILE_THREADS = 2  # grammars compiled at once; more wait their turn (within the time limit)


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: Engine | None = None, turns: StepTurns | None = None):
        self.engine = engine or Engine(config)
        self.config = config
        self._turns = turns or contextlib.nullcontext()  # several engines in a process: one step at a time
        e = self.engine
        self.model, self.tokenizer, self.limits = e.model, e.tokenizer, e.limits  # fixed for the engine's life
        self.context = e.context  # positions per sequence: the model context or a shorter max_context
        self.encoder_decoder = e.encoder_decoder  # the prompt is a source; the completion its target
        self.runner = e.runner
        self.max_running = e.max_running
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._published = Published(e.stats(), 0)
        # the loop's own state
        self._streams: dict[str, RequestStream] = {}  # requests accepted and not ended
        self._seqs_in_flight = 0  # their sequences
        self._submitted = 0  # add commands sent
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._compiler = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        # the engine thread's own: the outputs of each request submitted `whole`, held until it ends
        self._held: dict[RequestState, list[TokenEvent | EngineError]] = {}

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
            self._thread.start()

    # ---- the loop's side -----------------------------------------------------------------------

    async def compile(self, requests: list[GenerationRequest]) -> list[Grammar | None]:
        """The grammars of the constrained `requests`, compiled in worker threads (or found in the cache)
        within `GRAMMAR_COMPILE_S`; raises InvalidRequest for one that does not compile in time."""
        grammars: list[Grammar | None] = []
        for request in requests:
            c = request.constraint
            cached = self.engine.grammars.cached(c) if c is not None else None
            if c is None or cached is not None:
                grammars.append(cached)
                continue
            try:
                grammars.append(await asyncio.wait_for(
                    asyncio.get_running_loop().run_in_executor(self._compiler, self.engine.grammars.compile, c),
                    GRAMMAR_COMPILE_S))
            except TimeoutError:
                raise InvalidRequest("constraint", f"the {c.kind.replace('_', ' ')} took longer than "
                                     f"{GRAMMAR_COMPILE_S:g} s to compile; simplify it") from None
        return grammars

    def submit(self, request: GenerationRequest, grammar: Grammar | None = None, whole: bool = False
               ) -> RequestStream:
        """Accept a request or refuse it (call from the event loop); iterate the result for its events.
        A constrained request's grammar comes from `compile` (else it is compiled here, on the loop).
        `whole`: its events arrive together once it has ended (cancelling the stream still aborts it)."""
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        self._loop = self._loop or asyncio.get_running_loop()
        state = self.engine.new_request(request, grammar)  # pure: validates, raises InvalidRequest
        if request.request_id in self._streams:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already running")
        self._admit(request.slots)
        stream = RequestStream(request, state.timing(), self._forget, self.abort, owner=state)
        self._streams[state.id] = stream
        self._seqs_in_flight += request.slots
        self._submitted += 1
        self._commands.put((ADD, (state, whole)))
        return stream

    def _admit(self, n: int) -> None:
        """Raise `Overloaded` unless a request of `n` sequences has room: either every request in
        flight and this one fit the KV slots together, or fewer than `max_waiting` requests wait.
        Requests in flight are the loop's own count; the waiting ones are estimated from the latest
        published stats (requests that started since count as waiting: the estimate errs towards
        refusing, by at most one step's changes)."""
        if self._seqs_in_flight + n <= self.max_running:
            return
        waiting = len(self._streams) - self._published.stats.running_requests
        if waiting >= self.config.max_waiting:
            raise Overloaded(f"{waiting} requests are waiting (max_waiting={self.config.max_waiting}) and no KV "
                             f"slot is free for {n} more sequence(s); retry later")

    def most_admitted_at_once(self, n: int = 1) -> int:
        """The most requests of `n` sequences that `submit` can take one after another on an idle engine:
        those its KV slots hold, or `max_waiting`, whichever is more (`_admit` counts requests not yet
        started as waiting). A batch of more can never be admitted whole."""
        return max(self.max_running // max(n, 1), self.config.max_waiting, 1)

    def _forget(self, stream: RequestStream) -> None:
        """The request has ended, in the engine or for its consumer: it no longer counts as in flight."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self._seqs_in_flight -= stream.slots

    def abort(self, request_id: str) -> None:
        self._commands.put((ABORT, (request_id, None)))

    def end_all(self, error: EngineError) -> int:
        """End every request in flight with `error`, which each one's consumer receives (the drain's last
        word once its grace period is over); returns how many."""
        for request_id in list(self._streams):
            self._commands.put((ABORT, (request_id, error)))
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The latest snapshot the engine thread published, counting requests submitted but not yet
        taken in by the engine thread as waiting."""
        p = self._published
        return dataclasses.replace(p.stats, waiting_requests=p.stats.waiting_requests + self._submitted - p.taken)

    @property
    def running_sequences(self) -> int:
        """Sequences holding a KV slot after the latest step (cheaper than `stats()`)."""
        return self._published.stats.running_sequences

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet ended."""
        return len(self._streams)

    async def shutdown(self) -> None:
        """Finish the work in flight, then stop the engine thread."""
        self._stopping = True
        self._commands.put((STOP, None))
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        self._compiler.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self, out: list[tuple[str, RequestState, TokenEvent | EngineError | None, Timing]]) -> None:
        now = time.monotonic()
        for request_id, state, item, timing in out:
            stream = self._streams.get(request_id)
            if stream is not None and stream._owner is state:  # not a later request that reused the id
                stream._put(item, timing, now)
                if stream.ended:
                    self._forget(stream)

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        taken = 0
        stopping = False
        while True:
            out: list[Output] = []
            for kind, arg in self._take(wait=not engine.has_work and not stopping):
                if kind == ADD:
                    taken += 1
                    state, whole = arg
                    try:
                        engine.add(state)
                    except EngineError as e:
                        out.append((state, e))
                        continue
                    if whole:
                        self._held[state] = []
                elif kind == ABORT:
                    out += engine.abort(*arg)
                else:
                    stopping = True
            try:
                out += engine.expire()
                if engine.has_work:
                    with self._turns:
                        out += engine.step(emit=self._deliver)
            except Exception as e:  # a bug, not a model fault: fail what is in flight, keep the thread alive
                log.exception("engine step failed")
                for state in list(engine.requests.values()):
                    out += engine.end(state, ModelError("the engine step failed", detail=f"{type(e).__name__}: {e}"))
            self._published = Published(engine.stats(), taken)
            self._deliver(out)
            if stopping and not engine.has_work:
                if engine.speculation is not None:  # what speculating gave over the engine's life, in the log
                    engine.speculation.report()
                return

    def _take(self, wait: bool) -> list[tuple[str, object]]:
        """Every queued command; when `wait`, block up to IDLE_WAIT_S for the first."""
        commands = []
        try:
            if wait:
                commands.append(self._commands.get(timeout=IDLE_WAIT_S))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _deliver(self, out: list[Output]) -> None:
        """Hand outputs to the loop, with each request's timing as of now (copied on this thread); a whole
        request's wait in `_held` until it has ended."""
        if out and self._loop is not None and not self._loop.is_closed():
            items = []
            for state, item in out:
                held = self._held.get(state)
                if held is None:
                    items.append((state.id, state, item, state.timing()))
                    continue
                held.append(item)
                if state.done:
                    timing = state.timing()
                    items += [(state.id, state, one, timing) for one in self._held.pop(state)]
            if items:
                self._loop.call_soon_threadsafe(self._dispatch, items)
