"""What the fronts share at run time: the one engine, whether it takes work, what validation knows of the
model, the requests in flight (for the drain) and the retry-after hint; the streaming cadence is
`stream_cadence.py`'s, each call's metrics `call.py`'s.

    serving = ServingContext(settings, metrics)   # one per process; every front holds it
    serving.attach(engine)                        # once the model is warm: fronts start accepting
    engine = serving.admit()                      # NotReady while loading, EngineStopped once draining
    serving.in_flight_enter() ... serving.in_flight_leave()   # a generation in progress (`Generation` does it)

One engine, one queue, one set of limits: a request over gRPC and one over HTTP are admitted by the
same `AsyncEngine.submit`, counted in the same `active`, and drained together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from service.engine.async_engine import AsyncEngine, RequestStream
from service.engine.errors import EngineStopped, NotReady
from service.engine.request import TokenEvent
from service.fronts.generation_defaults import sampling_defaults
from service.fronts.metrics import Metrics
from service.fronts.stream_cadence import StreamCadence
from service.fronts.token_texts import TokenTexts
from service.fronts.validation import ModelFacts
from service.settings import ServerSettings

log = logging.getLogger("attnserve.server")

COMPLETION_WINDOW_S = 30.0  # completions counted for the retry-after hint


class ServingContext:
    """The server's context for its fronts, one per process, shared by every call on every front."""

    def __init__(self, settings: ServerSettings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self.engine: AsyncEngine | None = None  # set once the model is loaded and warm
        self.accepting = False  # False while loading and once draining
        self.started = time.monotonic()
        self.completions: deque[float] = deque(maxlen=4096)  # finish times, for the retry-after hint
        self.active = 0  # generations in progress, over every front
        self.idle = asyncio.Event()
        self.idle.set()
        self.texts: TokenTexts | None = None
        self.model: ModelFacts | None = None
        self.cadence = StreamCadence(settings)

    def attach(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.texts = TokenTexts(engine.tokenizer)
        n_ctx = engine.context  # the served context, which may be shorter than the model's
        longest = max(len(engine.tokenizer.decode([i])) for i in range(engine.model.vocab_size))
        # no longer text can tokenize to the prompt's limit (an encoder-decoder's: its longest source)
        prompt_tokens = engine.limits.max_prompt_tokens if engine.encoder_decoder else n_ctx
        self.model = ModelFacts(engine.tokenizer, n_ctx, engine.limits,
                                max_prompt_chars=prompt_tokens * max(longest, 1),
                                sampling_defaults=sampling_defaults(engine.config.bundle))
        if self.model.sampling_defaults:
            log.info("sampling defaults from the model's generation config: %s", self.model.sampling_defaults)
        self.accepting = True

    @property
    def taking_work(self) -> bool:
        """The model is warm and the server is not draining: new generations are admitted."""
        return self.accepting and self.engine is not None

    def ready(self) -> AsyncEngine:
        """The engine, for calls that need the model but start no generation (model info, tokenize)."""
        if self.engine is None:
            raise NotReady("the model is still loading; retry shortly")
        return self.engine

    def served_name(self) -> str:
        """The name clients know the model by (/v1/models, each response's `model`, GetModelInfo):
        `served_model_name`, else the bundle's own. NotReady while loading."""
        engine = self.ready()
        return self.settings.served_model_name or engine.model.name

    def admit(self) -> AsyncEngine:
        """The engine, for a new generation; refused while loading and once draining."""
        if not self.accepting:
            raise EngineStopped("the server is draining; retry on another replica") if self.engine \
                else NotReady("the model is still loading; retry shortly")
        return self.engine

    def in_flight_enter(self) -> None:
        self.active += 1
        self.idle.clear()

    def in_flight_leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()

    async def next_message(self, stream: RequestStream) -> list[TokenEvent]:
        """A stream's next events, gathered as the streaming settings say (`stream_cadence`)."""
        return await self.cadence.next_message(stream, self.engine.running_sequences if self.engine else 0)

    def retry_after_ms(self) -> int:
        """How long until a queue place is likely free: waiting requests over the recent completion rate."""
        now = time.monotonic()
        recent = sum(1 for t in self.completions if t > now - COMPLETION_WINDOW_S)
        if not recent or self.engine is None:
            return 1000
        rate = recent / COMPLETION_WINDOW_S
        return int(min(30_000, max(100, 1000 * (self.engine.stats().waiting_requests + 1) / rate)))
