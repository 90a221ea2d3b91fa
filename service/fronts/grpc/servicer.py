"""The gRPC front: the TextGeneration servicer. Thin: it converts the protobuf request
(`protocol`), submits it to the engine (`service.engine.async_engine`) and sends the events back.
Every error becomes a status code in `service.fronts.status` alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

import grpc

from attnserve import __version__
from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from service import logs
from service.engine.async_engine import AsyncEngine
from service.engine.errors import EngineStopped, NotReady, Overloaded
from service.engine.request import TokenEvent
from service.fronts.grpc.protocol import Collector, StreamState, TokenTexts, parse_request, stream_messages
from service.fronts.metrics import Metrics
from service.fronts.status import status_for
from service.fronts.validation import AcceptedRequest, ModelFacts
from service.settings import ServerSettings

log = logging.getLogger("attnserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
COMPLETION_WINDOW_S = 30.0  # completions counted for the retry-after hint
STREAM_FANOUT = 8  # adaptive streaming: about this many stream messages per model step in all
MAX_TOKENS_PER_MESSAGE = 16


class Call:
    """One RPC in progress: its request id (in every log line), latency metrics, status accounting."""

    def __init__(self, service: TextGenerationService, method: str):
        self.service, self.method = service, method
        self.metrics = service.metrics
        self.wire: AcceptedRequest | None = None
        self.stream = None
        self.tokens = 0
        self._last: dict[int, float] = {}  # completion index -> time of its latest token

    def accepted(self, wire: AcceptedRequest, stream) -> None:
        self.wire, self.stream = wire, stream
        logs.request_id.set(wire.request_id)
        self.metrics.prompt_tokens.inc(len(wire.request.prompt_token_ids))

    def observe(self, events: list[TokenEvent]) -> None:
        if not self._last and events:
            t = self.stream.timing
            self.metrics.time_to_first_token.observe(t.first_token_at - t.arrival)
            self.metrics.queue_duration.observe((t.scheduled_at or t.first_token_at) - t.arrival)
        itl = self.metrics.inter_token_latency
        for e in events:
            prev = self._last.get(e.index)
            if prev is not None:
                itl.observe(e.time - prev)
            self._last[e.index] = e.time
        self.tokens += len(events)
        self.metrics.generated_tokens.inc(len(events))

    def finished(self, code: grpc.StatusCode) -> None:
        self.metrics.requests.labels(self.method, code.name).inc()
        if self.wire is None:
            return
        total = time.monotonic() - self.stream.timing.arrival
        if code is grpc.StatusCode.OK:
            self.metrics.request_duration.observe(total)
            self.service.completions.append(time.monotonic())
        log.info("%s %s", self.method, code.name, extra={
            "prompt_tokens": len(self.wire.request.prompt_token_ids), "completion_tokens": self.tokens,
            "total_ms": round(1000 * total, 1)})


class TextGenerationService(pb_grpc.TextGenerationServicer):
    def __init__(self, settings: ServerSettings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self.engine: AsyncEngine | None = None  # set once the model is loaded and warm
        self.accepting = False  # False while loading and once draining
        self.started = time.monotonic()
        self.completions: deque[float] = deque(maxlen=4096)  # finish times, for the retry-after hint
        self.active = 0  # generation RPCs in progress
        self.idle = asyncio.Event()
        self.idle.set()
        self._texts: TokenTexts | None = None
        self._model: ModelFacts | None = None
        self._min_age_s = settings.stream_interval_ms / 1000
        self._max_delay_s = settings.stream_max_delay_ms / 1000

    def attach(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._texts = TokenTexts(engine.tokenizer)
        n_ctx = engine.model.n_ctx
        longest = max(len(engine.tokenizer.decode([i])) for i in range(engine.model.vocab_size))
        # no longer text can tokenize to n_ctx tokens
        self._model = ModelFacts(engine.tokenizer, n_ctx, engine.limits, max_prompt_chars=n_ctx * max(longest, 1))
        self.accepting = True

    # ---- RPCs ----------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        async with self._generation(request, context, "Generate") as (call, wire, stream):
            collector = Collector(wire, self._texts)
            while batch := await stream.next_batch():
                call.observe(batch)
                collector.add(batch)
            return collector.response(stream.timing)

    async def GenerateStream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with self._generation(request, context, "GenerateStream") as (call, wire, stream):
            sent = StreamState()
            batch = await stream.next_batch()  # the first token goes out at once
            while batch:
                call.observe(batch)
                for msg in stream_messages(wire, batch, self._texts, sent, stream.timing, last=stream.finished):
                    yield msg
                batch = await stream.next_batch(self._tokens_per_message(), self._min_age_s, self._max_delay_s)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        async with self._rpc(context, "Tokenize"):
            tokenizer = self._ready().tokenizer
            ids = await asyncio.to_thread(tokenizer.encode, request.text) if len(request.text) > 65536 else \
                tokenizer.encode(request.text)
            return pb.TokenizeResponse(token_ids=ids, tokens=[self._texts(i) for i in ids])

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        async with self._rpc(context, "GetModelInfo"):
            engine = self._ready()
            m, runner = engine.model, engine.runner
            return pb.ModelInfo(name=m.name, vocab_size=m.vocab_size, context_tokens=m.n_ctx,
                                eos_token_id=m.eos_token_id, dtype=runner.spec.dtype,
                                provider=runner.session.get_providers()[0], graph=runner.graph_name,
                                architecture=m.architecture, attention_heads=m.n_head, kv_heads=m.kv_heads,
                                eos_token_ids=m.stop_ids, layers=m.n_layer)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.ServerInfo:
        async with self._rpc(context, "GetServerInfo"):
            info = pb.ServerInfo(uptime_seconds=time.monotonic() - self.started, version=__version__)
            if self.engine is not None:
                s = self.engine.stats()
                info.MergeFrom(pb.ServerInfo(
                    requests_running=s.running_requests, requests_waiting=s.waiting_requests, kv_slots=s.kv_slots,
                    kv_free_slots=s.kv_free_slots, kv_free_tokens=s.kv_free_tokens, tokens_per_second=s.tokens_per_s))
            return info

    # ---- plumbing ------------------------------------------------------------------------------

    def _ready(self) -> AsyncEngine:
        if self.engine is None:
            raise NotReady("the model is still loading; retry shortly")
        return self.engine

    @contextlib.asynccontextmanager
    async def _rpc(self, context, method: str):
        """Every RPC runs inside this: request id for the logs, status accounting, errors to status codes."""
        logs.request_id.set("-")
        call = Call(self, method)
        code = grpc.StatusCode.OK
        try:
            yield call
        except asyncio.CancelledError:  # the client cancelled, went away, or its deadline passed
            code = _cancel_code(context)
            raise
        except GeneratorExit:  # a stream closed by grpc after the client went away
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            status = status_for(e, self._retry_after_ms() if isinstance(e, Overloaded) else 0)
            code = status.code
            if status.is_bug:
                log.error("%s", status.details, exc_info=e)
            elif call.wire is None:  # refused before it reached the engine (requests that ran log in finished())
                log.info("%s %s: %s", method, code.name, status.details)
            await context.abort(status.code, status.details, status.trailing_metadata)
        finally:
            call.finished(code)

    @contextlib.asynccontextmanager
    async def _generation(self, request: pb.GenerateRequest, context, method: str):
        """Validate, submit, and hand the stream to the RPC body; always frees the request's slots."""
        async with self._rpc(context, method) as call:
            logs.request_id.set(request.request_id or "-")
            if not self.accepting:
                raise EngineStopped("the server is draining; retry on another replica") if self.engine \
                    else NotReady("the model is still loading; retry shortly")
            engine = self.engine
            wire = parse_request(request, self._model)
            logs.request_id.set(wire.request_id)
            remaining = context.time_remaining()
            if remaining is not None:
                wire.request.deadline = time.monotonic() + remaining
            stream = engine.submit(wire.request)
            call.accepted(wire, stream)
            self._enter()
            try:
                yield call, wire, stream
            finally:
                stream.cancel()  # no-op once finished; otherwise frees the slots at the next step
                self._leave()

    def _tokens_per_message(self) -> int:
        """Tokens a stream message waits for (`stream_tokens`). Adaptive: 1 while few sequences run;
        beyond STREAM_FANOUT, enough that the whole server sends about STREAM_FANOUT messages per
        model step. Each message costs the server and the client CPU that the model would use."""
        if self.settings.stream_tokens:
            return self.settings.stream_tokens
        running = self.engine.running_sequences if self.engine else 0
        return min(-(-running // STREAM_FANOUT), MAX_TOKENS_PER_MESSAGE) or 1

    def _retry_after_ms(self) -> int:
        """How long until a queue place is likely free: waiting requests over the recent completion rate."""
        now = time.monotonic()
        recent = sum(1 for t in self.completions if t > now - COMPLETION_WINDOW_S)
        if not recent or self.engine is None:
            return 1000
        rate = recent / COMPLETION_WINDOW_S
        return int(min(30_000, max(100, 1000 * (self.engine.stats().waiting_requests + 1) / rate)))

    def _enter(self) -> None:
        self.active += 1
        self.idle.clear()

    def _leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()


def _cancel_code(context) -> grpc.StatusCode:
    with contextlib.suppress(Exception):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
