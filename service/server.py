"""The gRPC server: the TextGeneration servicer, health, reflection, metrics, and a graceful drain.

    attnserve serve                                   # the shipped model on 127.0.0.1:50051
    attnserve serve --bundle my-bundle --host 0.0.0.0 --max-running 32

The servicer is thin: it converts the protobuf request (`service.protocol`), submits it to the
engine thread (`service.async_engine`) and sends the events back. Every error becomes a status
code in `service.status` alone.

Life cycle: bind (health NOT_SERVING) -> load the bundle -> warm up -> SERVING. On SIGTERM or
SIGINT: health NOT_SERVING, new generation calls get UNAVAILABLE, requests in flight get
`grace_period_s` to finish, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from attnserve import __version__
from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from service import logs
from service.async_engine import AsyncEngine
from service.config import ServerSettings
from service.errors import EngineStopped, NotReady, Overloaded
from service.metrics import Metrics
from service.protocol import Collector, StreamState, TokenTexts, WireRequest, parse_request, stream_messages
from service.request import GenerationRequest, SamplingParams, StoppingCriteria, TokenEvent
from service.security import BearerToken, server_credentials
from service.status import status_for

log = logging.getLogger("attnserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
COMPLETION_WINDOW_S = 30.0  # completions counted for the retry-after hint
STREAM_FANOUT = 8  # adaptive streaming: about this many stream messages per model step in all
MAX_TOKENS_PER_MESSAGE = 16


class Call:
    """One RPC in progress: its request id (in every log line), latency metrics, status accounting."""

    def __init__(self, service: TextGenerationService, method: str):
        self.service, self.method = service, method
        self.metrics = service.metrics
        self.wire: WireRequest | None = None
        self.state = None
        self.tokens = 0
        self._last: dict[int, float] = {}  # completion index -> time of its latest token

    def accepted(self, wire: WireRequest, state) -> None:
        self.wire, self.state = wire, state
        logs.request_id.set(wire.request_id)
        self.metrics.prompt_tokens.inc(len(wire.request.prompt_token_ids))

    def observe(self, events: list[TokenEvent]) -> None:
        if not self._last and events:
            state = self.state
            self.metrics.time_to_first_token.observe(state.first_token_at - state.arrival)
            self.metrics.queue_duration.observe((state.scheduled_at or state.first_token_at) - state.arrival)
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
        total = time.monotonic() - self.state.arrival
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
        self._max_prompt_chars = 0
        self._min_age_s = settings.stream_interval_ms / 1000
        self._max_delay_s = settings.stream_max_delay_ms / 1000

    def attach(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._texts = TokenTexts(engine.engine.tokenizer)
        model = engine.engine.model
        longest = max(len(engine.engine.tokenizer.decode([i])) for i in range(model.vocab_size))
        self._max_prompt_chars = model.n_ctx * max(longest, 1)  # no longer text can tokenize to n_ctx tokens
        self.accepting = True

    # ---- RPCs ----------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        async with self._generation(request, context, "Generate") as (call, wire, stream):
            collector = Collector(wire, self._texts)
            while batch := await stream.next_batch():
                call.observe(batch)
                collector.add(batch)
            return collector.response(stream.state)

    async def GenerateStream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with self._generation(request, context, "GenerateStream") as (call, wire, stream):
            sent = StreamState()
            batch = await stream.next_batch()  # the first token goes out at once
            while batch:
                call.observe(batch)
                for msg in stream_messages(wire, batch, self._texts, sent, stream.state, last=stream.finished):
                    yield msg
                batch = await stream.next_batch(self._tokens_per_message(), self._min_age_s, self._max_delay_s)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        async with self._rpc(context, "Tokenize"):
            tokenizer = self._ready().engine.tokenizer
            ids = await asyncio.to_thread(tokenizer.encode, request.text) if len(request.text) > 65536 else \
                tokenizer.encode(request.text)
            return pb.TokenizeResponse(token_ids=ids, tokens=[self._texts(i) for i in ids])

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        async with self._rpc(context, "GetModelInfo"):
            engine = self._ready().engine
            m, runner = engine.model, engine.runner
            return pb.ModelInfo(name=m.name, vocab_size=m.vocab_size, context_tokens=m.n_ctx,
                                eos_token_id=m.eos_token_id, dtype=runner.spec.dtype,
                                provider=runner.session.get_providers()[0], graph=runner.graph_name)

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
            model = engine.engine.model
            default_max_new = min(self.settings.default_max_new_tokens, engine.engine.limits.max_new_tokens)
            wire = parse_request(request, engine.engine.tokenizer, model.n_ctx, default_max_new,
                                 self._max_prompt_chars)
            logs.request_id.set(wire.request_id)
            remaining = context.time_remaining()
            if remaining is not None:
                wire.request.deadline = time.monotonic() + remaining
            stream = engine.submit(wire.request)
            call.accepted(wire, stream.state)
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


class Server:
    """The whole server: gRPC (generation, health, reflection), metrics, and the engine.

        server = Server(settings); await server.start(); ...; await server.drain()
    """

    def __init__(self, settings: ServerSettings, engine: AsyncEngine | None = None):
        self.settings = settings
        self.metrics = Metrics()
        self.service = TextGenerationService(settings, self.metrics)
        self.health = health.aio.HealthServicer()
        self._engine = engine  # a prebuilt engine (tests); otherwise built from settings in start()
        self.port = 0
        self.metrics_port = 0
        token = settings.bearer_token()
        self.grpc = grpc.aio.server(interceptors=[BearerToken(token)] if token else [], options=[
            ("grpc.max_receive_message_length", settings.max_receive_message_bytes),
            ("grpc.max_send_message_length", settings.max_send_message_bytes),
            ("grpc.so_reuseport", 0),
        ])
        pb_grpc.add_TextGenerationServicer_to_server(self.service, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)

    @property
    def engine(self) -> AsyncEngine | None:
        return self.service.engine

    async def start(self) -> None:
        """Bind and report NOT_SERVING, load and warm the model, then report SERVING."""
        s = self.settings
        await self._set_health(NOT_SERVING)
        credentials = server_credentials(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
        address = f"{s.host}:{s.port}"
        self.port = (self.grpc.add_secure_port(address, credentials) if credentials
                     else self.grpc.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC port {s.host}:{s.port}")
        await self.grpc.start()
        if s.metrics_port:
            self.metrics_port = self.metrics.serve(s.host, s.metrics_port)
        log.info("gRPC listening on %s:%d (%s%s; health NOT_SERVING until the model is warm)%s", s.host, self.port,
                 "mutual TLS" if s.tls_client_ca_file else "TLS" if credentials else "plaintext",
                 ", bearer token required" if s.auth_token or s.auth_token_file else "",
                 f"; metrics on http://{s.host}:{self.metrics_port}/metrics" if self.metrics_port else "")
        engine = self._engine = self._engine or await asyncio.to_thread(AsyncEngine, s.engine_config())
        if s.warmup:
            await asyncio.to_thread(engine.engine.warm_up)  # before the engine thread owns the engine
        engine.start()
        self.metrics.watch(engine.stats)
        if s.warmup:
            await warm_up(engine)
        self.service.attach(engine)
        await self._set_health(SERVING)
        log.info("serving %s (%s graph) on %s:%d", engine.engine.model.name, engine.engine.runner.graph_name,
                 s.host, self.port)

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop taking work, let requests in flight finish for up to `grace_s`, then stop everything."""
        grace_s = self.settings.grace_period_s if grace_s is None else grace_s
        self.service.accepting = False
        await self.health.enter_graceful_shutdown()
        log.info("draining: %d request(s) in flight, up to %.0f s to finish", self.service.active, grace_s)
        try:
            await asyncio.wait_for(self.service.idle.wait(), timeout=grace_s)
        except TimeoutError:
            log.warning("grace period over with %d request(s) in flight; cancelling them", self.service.active)
        await self.grpc.stop(grace=1.0)
        if self._engine is not None:
            await self._engine.shutdown()
        self.metrics.close()
        log.info("stopped")

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


async def warm_up(engine: AsyncEngine) -> None:
    """Run prefill and decode at a few batch sizes so the first real requests do not pay for it."""
    width = min(engine.engine.scheduler.max_running, 8)
    prompt = [1 % engine.engine.model.vocab_size] * 4

    async def one(i: int) -> None:
        request = GenerationRequest(f"warmup-{uuid.uuid4().hex}", list(prompt), SamplingParams(seed=i),
                                    StoppingCriteria(max_new_tokens=4, ignore_eos=True))
        async for _ in engine.submit(request):
            pass

    await one(0)
    await asyncio.gather(*(one(i) for i in range(width)))


# ---- the command -------------------------------------------------------------------------------

async def serve(settings: ServerSettings) -> int:
    server = Server(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(server.start())
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting in done and starting.exception() is not None:
        stopping.cancel()
        await server.grpc.stop(grace=0)
        server.metrics.close()
        error = starting.exception()
        log.error("start-up failed: %s", error)
        return 1
    await stopping
    log.info("signal received")
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
    await server.drain()
    return 0


def main(argv: list[str] | None = None) -> int:
    from service.config import SettingsError, load_settings, settings_parser

    parser = settings_parser("attnserve serve", __doc__.split("\n\n")[0])
    args = vars(parser.parse_args(argv))
    config_file = args.pop("config", None)
    try:
        settings = load_settings(args, config_file)
    except SettingsError as e:
        parser.exit(2, f"attnserve serve: invalid configuration:\n{e}\n")
    logs.setup_logging(settings.log_format, settings.log_level)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
