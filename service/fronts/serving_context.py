"""What the fronts share at run time: the served models (`ModelContext`, by name), whether the server takes
work, the requests in flight (for the drain) and the retry-after hint; the streaming cadence is
`stream_cadence.py`'s, each call's metrics `call.py`'s.

    serving = ServingContext(settings, metrics)   # one per process; every front holds it
    serving.add(served_models(settings), pool)    # at start-up: the models, the first the default, and their pool
    serving.open()                                # once the models are warm: fronts start accepting
    model = serving.resolve(body.model)           # None or "" = the default; UnknownModel otherwise
    engine = await serving.take(model, call)      # loaded if need be, and held until the call ends
    engine = serving.admit(model)                 # NotReady while loading, EngineStopped once draining
    serving.in_flight_enter() ... serving.in_flight_leave()   # a generation in progress (`Generation` does it)

Each model has its own engine (queue, scheduler, KV cache), loaded and unloaded by the model pool
(`model_pool.py`); the server's state is shared: a request over gRPC and one over HTTP, to any model, are
counted in the same `active` and drained together.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from service.engine.async_engine import AsyncEngine, RequestStream
from service.engine.core import EngineStats
from service.engine.errors import EngineStopped, NotReady, UnknownModel
from service.engine.request import TokenEvent
from service.fronts.metrics import Metrics
from service.fronts.model_context import ModelContext
from service.fronts.model_pool import ModelPool
from service.fronts.stream_cadence import StreamCadence
from service.settings import ServerSettings

COMPLETION_WINDOW_S = 30.0  # completions counted for the retry-after hint


class ServingContext:
    """The server's context for its fronts, one per process, shared by every call on every front."""

    def __init__(self, settings: ServerSettings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ModelContext] = {}  # by name, the default first
        self.pool: ModelPool | None = None  # loads and unloads them
        self.accepting = False  # False while loading and once draining
        self.opened = False  # set once the server took work: not accepting since means draining
        self.started = time.monotonic()
        self.completions: deque[float] = deque(maxlen=4096)  # finish times, for the retry-after hint
        self.active = 0  # generations in progress, over every front and model
        self.idle = asyncio.Event()
        self.idle.set()
        self.cadence = StreamCadence(settings)

    def add(self, models: list[ModelContext], pool: ModelPool | None = None) -> None:
        self.models.update((model.name, model) for model in models)
        self.pool = pool

    def open(self) -> None:
        """The models are loaded (or failed): new generations are admitted."""
        self.accepting = self.opened = True

    @property
    def default(self) -> ModelContext | None:
        """The model a request that names none gets: the first bundle's."""
        return next(iter(self.models.values()), None)

    @property
    def taking_work(self) -> bool:
        """The models are warm and the server is not draining: new generations are admitted."""
        return self.accepting

    def engines(self) -> list[AsyncEngine]:
        """The engines of the models that serve."""
        return [m.engine for m in self.models.values() if m.engine is not None and m.state == "serving"]

    def stats(self) -> list[EngineStats]:
        return [engine.stats() for engine in self.engines()]

    def resolve(self, name: str | None) -> ModelContext:
        """The model `name` names: None or "" the default; UnknownModel (naming those served) for any other."""
        model = self.models.get(name) if name else self.default
        if model is None:
            if not self.models:
                raise NotReady("the server is still starting; retry shortly")
            raise UnknownModel(name or "", list(self.models))
        return model

    async def take(self, model: ModelContext, call) -> AsyncEngine:
        """`model`'s engine for `call`, loaded first if need be (the call waits for it), and held (not unloaded)
        until the call ends (`Call.finished`); NotReady or Unavailable when it does not serve."""
        if self.pool is None:
            return model.ready()
        engine = await self.pool.acquire(model)
        call.hold(model)
        return engine

    def let_go(self, model: ModelContext) -> None:
        """A call that held `model` is over."""
        if self.pool is not None:
            self.pool.release(model)

    def ready(self) -> None:
        """NotReady until the models are loaded, for calls that start no generation (a draining server still
        answers them)."""
        if not self.opened:
            raise NotReady("the model is still loading; retry shortly")

    def admit_calls(self) -> None:
        """Refuse new work while loading and once draining (before a request is read)."""
        if not self.accepting:
            raise EngineStopped("the server is draining; retry on another replica") if self.opened \
                else NotReady("the model is still loading; retry shortly")

    def admit(self, model: ModelContext) -> AsyncEngine:
        """`model`'s engine, for a new generation; refused while loading and once draining, and for a model
        that does not serve (`ModelContext.ready`)."""
        self.admit_calls()
        return model.ready()

    def in_flight_enter(self) -> None:
        self.active += 1
        self.idle.clear()

    def in_flight_leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()

    async def next_message(self, stream: RequestStream, engine: AsyncEngine) -> list[TokenEvent]:
        """A stream's next events, gathered as the streaming settings say (`stream_cadence`)."""
        return await self.cadence.next_message(stream, engine.running_sequences)

    def retry_after_ms(self, model: ModelContext | None) -> int:
        """How long until a queue place of `model` is likely free: its waiting requests over the recent
        completion rate (of every model: a rough hint)."""
        now = time.monotonic()
        recent = sum(1 for t in self.completions if t > now - COMPLETION_WINDOW_S)
        if not recent or model is None or model.engine is None:
            return 1000
        rate = recent / COMPLETION_WINDOW_S
        return int(min(30_000, max(100, 1000 * (model.engine.stats().waiting_requests + 1) / rate)))
