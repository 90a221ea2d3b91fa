"""One generation on any front: its engine requests (one per prompt; gRPC sends one), their events as
they arrive, and the guarantee that whatever ends the call (the last token, an error, the client going
away) frees every KV slot it holds at the engine's next step, and counts it out of the drain.

    gen = await Generation.start(serving, call, model, accepted_requests)   # every prompt submitted, or none
    async for stream_index, events in gen.events(receive):   # receive: watch for a disconnect
        ...
    gen.close()                                # idempotent; cancels what is still running
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from service.engine.async_engine import AsyncEngine, RequestStream
from service.engine.errors import Cancelled, EngineError
from service.engine.request import TokenEvent
from service.engine.sequence import Timing
from service.fronts.call import Call
from service.fronts.model_context import ModelContext
from service.fronts.serving_context import ServingContext
from service.fronts.validation import AcceptedRequest

_GONE = object()  # the client disconnected


class ClientGone(Cancelled):
    """The client closed the connection before the response was complete."""


class Generation:
    def __init__(self, serving: ServingContext, call: Call, model: ModelContext, engine: AsyncEngine):
        self.serving, self.call, self.model, self.engine = serving, call, model, engine
        self.streams: list[RequestStream] = []
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    @classmethod
    async def start(cls, serving: ServingContext, call: Call, model: ModelContext,
                    accepted_requests: list[AcceptedRequest], whole: bool = False) -> Generation:
        """Compile the requests' grammars (in worker threads), then submit every prompt to `model`'s engine, or
        none. `whole`: the response is sent once every request has ended, so their events may arrive all at once."""
        call.model = model
        engine = serving.admit(model)
        generation = cls(serving, call, model, engine)
        serving.in_flight_enter()
        try:
            grammars = await engine.compile([a.request for a in accepted_requests])
            engine = serving.admit(model)  # still serving after the wait
            for accepted, grammar in zip(accepted_requests, grammars, strict=True):
                stream = engine.submit(accepted.request, grammar, whole=whole)
                generation.streams.append(stream)
                call.accepted(accepted, stream)
        except BaseException:
            generation.close()
            raise
        return generation

    async def events(self, receive=None) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
        """(stream index, events) as they arrive, until every stream has ended. An engine error ends it
        (after the events before it); with `receive`, a disconnect ends it with `ClientGone`."""
        if len(self.streams) == 1 and receive is None:  # the common case needs no helper tasks
            stream = self.streams[0]
            while batch := await self.serving.next_message(stream, self.engine):
                self.call.observe(batch, stream)
                yield 0, batch
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, s, queue)) for i, s in enumerate(self.streams)]
        if receive is not None:
            self._tasks.append(asyncio.create_task(_watch(receive, queue)))
        open_streams = len(self.streams)
        while open_streams:
            item = await queue.get()
            if item is _GONE:
                raise ClientGone("the client disconnected")
            index, batch = item
            if isinstance(batch, BaseException):
                raise batch
            if batch is None:
                open_streams -= 1
                continue
            self.call.observe(batch, self.streams[index])
            yield index, batch

    async def _pump(self, index: int, stream: RequestStream, queue: asyncio.Queue) -> None:
        try:
            while batch := await self.serving.next_message(stream, self.engine):
                queue.put_nowait((index, batch))
            queue.put_nowait((index, None))
        except EngineError as e:
            queue.put_nowait((index, e))

    def timings(self) -> list[Timing]:
        """Each prompt's arrival, prefill, first token and cached prompt tokens, as of its latest event."""
        return [stream.timing for stream in self.streams]

    def close(self) -> None:
        """Cancel what still runs and free the slots; count the generation out of the drain."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            stream.cancel()  # no-op once finished; otherwise frees the slots at the next step
        self.serving.in_flight_leave()


async def _watch(receive, queue: asyncio.Queue) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(_GONE)
            return
