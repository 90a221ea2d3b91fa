"""The engine on its own thread, behind an asyncio API.

    engine = AsyncEngine(EngineConfig(bundle=...))
    engine.start()
    async for event in engine.submit(request):     # TokenEvent, token by token
        ...
    engine.abort(request_id); engine.stats(); await engine.shutdown()

`submit` validates in the caller's thread (a bad request raises `InvalidRequest` at once, and a
full queue raises `Overloaded`), then hands the request to the engine thread. That thread runs
`Engine.step()` in a loop; onnxruntime releases the GIL while it computes, so the event loop
stays responsive. Each step's events reach the loop in one `call_soon_threadsafe` callback.
The engine thread never waits for a consumer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections import deque

from service.config import EngineConfig
from service.engine import Engine, EngineStats, Output
from service.errors import EngineError, EngineStopped, InvalidRequest, ModelError
from service.request import GenerationRequest, TokenEvent
from service.sequence import RequestState

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle engine sleeps before re-checking deadlines


class RequestStream:
    """The async iterator returned by `submit`: one request's events, then its end.

    Iterate it for one event at a time, or call `next_batch()` for every event that has arrived
    (a consumer that fell behind catches up in one go). Leaving early (`cancel()`, or the consuming
    task being cancelled) aborts the request and frees its KV slots at the engine's next step.
    """

    def __init__(self, engine: AsyncEngine, state: RequestState):
        self._engine = engine
        self.state = state
        self._items: deque[TokenEvent | EngineError | None] = deque()
        self._arrived = asyncio.Event()
        self._open = state.request.n  # sequences not finished yet
        self.finished = False
        self._min_events = 1  # wake the consumer once this many events are queued
        self._min_age_s = 0.0  # ... and the oldest of them has waited this long,
        self._max_delay_s = 0.0  # or once the oldest has waited this long anyway

    @property
    def request_id(self) -> str:
        return self.state.id

    def _put(self, item: TokenEvent | EngineError | None, now: float) -> None:
        self._items.append(item)
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
        if item is None:
            self._close()
            raise StopAsyncIteration
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
        item = self._items.popleft()
        self._close()
        if isinstance(item, EngineError):
            raise item
        return []

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
        self._engine._streams.pop(self.request_id, None)

    def cancel(self) -> None:
        """The consumer is gone: abort the request and free its slots."""
        if not self.finished:
            self._close()
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: Engine | None = None):
        self.engine = engine or Engine(config)
        self.config = config
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._queued = 0  # requests submitted but not yet taken in by the engine thread
        self._queued_seqs = 0  # their sequences
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = self.engine.stats()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
            self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request (call from the event loop); iterate the result for its events."""
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        self._loop = self._loop or asyncio.get_running_loop()
        state = self.engine.new_request(request)  # validates; raises InvalidRequest
        if request.request_id in self._streams:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already running")
        with self._lock:
            self.engine.check_capacity(request.n, self._queued, self._queued_seqs)  # raises Overloaded
            self._queued += 1
            self._queued_seqs += request.n
        stream = RequestStream(self, state)
        self._streams[state.id] = stream
        self._inbox.append(("add", state))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """The latest snapshot (taken by the engine thread after each step), counting requests
        submitted but not yet taken in by the engine thread as waiting."""
        return dataclasses.replace(self._stats, waiting_requests=self._stats.waiting_requests + self._queued)

    @property
    def running_sequences(self) -> int:
        """Sequences holding a KV slot after the latest step (cheaper than `stats()`)."""
        return self._stats.running_sequences

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet ended."""
        return len(self._streams)

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            self._wake.clear()
            out: list[Output] = []
            while self._inbox:
                kind, arg = self._inbox.popleft()
                if kind == "add":
                    with self._lock:
                        self._queued -= 1
                        self._queued_seqs -= arg.request.n
                    try:
                        engine.add(arg)
                    except EngineError as e:
                        out.append((arg, e))
                else:
                    out += engine.abort(arg)
            if self._stopping and not engine.has_work:
                self._stats = engine.stats()
                self._deliver(out)
                return
            try:
                out += engine.expire()
                if engine.has_work:
                    out += engine.step(emit=self._deliver)
            except Exception as e:  # a bug, not a model fault: fail what is in flight, keep the thread alive
                log.exception("engine step failed")
                for state in list(engine.requests.values()):
                    out += engine.end(state, ModelError(f"engine failure: {type(e).__name__}: {e}"))
            self._stats = engine.stats()
            self._deliver(out)
            if not engine.has_work and not self._inbox:
                self._wake.wait(IDLE_WAIT_S)

    def _deliver(self, out: list[Output]) -> None:
        if out and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, out)

    def _dispatch(self, out: list[Output]) -> None:
        now = time.monotonic()
        for state, item in out:
            stream = self._streams.get(state.id)
            if stream is not None and stream.state is state:
                stream._put(item, now)
