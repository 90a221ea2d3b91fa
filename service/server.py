"""`attnserve serve`: one process, the engine and its fronts (gRPC with health and reflection, the
OpenAI-compatible HTTP API, Prometheus metrics), from start-up to a graceful drain.

    attnserve serve                                   # the shipped model: gRPC on 127.0.0.1:50051, HTTP on :8000
    attnserve serve --bundle my-bundle --host 0.0.0.0 --max-running 32
    attnserve serve --bundle a --bundle b              # two models, each with its own engine; a the default

Both fronts run in this process's one event loop (`ServingContext`); each model has its own engine (queue,
scheduler, KV cache), a request's model name picks it, and the model pool loads and unloads them
(`fronts/model_pool.py`). Life cycle: bind the HTTP port (/health 503) -> load the models `preload` names,
in turn, while the memory budget holds them (each: its graph chosen and self-checked, or as `cache_dir`
remembers it, its KV cache planned, warmed up; with several, one that fails is logged and its model marked
failed, and the others serve; the rest load on their first request) -> open the gRPC port, SERVING. On SIGTERM or
SIGINT: health NOT_SERVING, the gRPC port closes to new calls and new HTTP requests get 503, requests in
flight on either front get `grace_period_s` to finish, then the process exits 0. A second SIGTERM or SIGINT
during the drain ends the requests still in flight at once, with the error the end of the grace period would
have given them. A SIGTERM or SIGINT while loading ends the process at once (exit 0): the loading runs on a
thread of its own, in native calls nothing can interrupt, and the process exits without waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from attnserve.v1 import generate_pb2_grpc as pb_grpc
from service import logs
from service.engine.async_engine import AsyncEngine
from service.engine.errors import EngineStopped
from service.engine.step_turns import StepTurns
from service.fronts.file_handles import fit_connections
from service.fronts.grpc.decoding import MalformedMessages
from service.fronts.grpc.options import server_options
from service.fronts.grpc.security import BearerToken, server_credentials
from service.fronts.grpc.servicer import SERVICE_NAME, TextGenerationService
from service.fronts.http.app import HttpFront
from service.fronts.http.listener import HttpListener
from service.fronts.metrics import Metrics
from service.fronts.model_context import served_models
from service.fronts.model_pool import ModelPool
from service.fronts.ports import ensure_bindable, port_error
from service.fronts.serving_context import ServingContext
from service.model_loading import LOADING_THREAD, ModelLoader
from service.settings import ServerSettings

log = logging.getLogger("attnserve.server")

END_WAIT_S = 2.0  # after the grace period: how long the fronts get to tell clients their requests ended
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Server:
    """The whole server: gRPC (generation, health, reflection), HTTP (OpenAI's API), metrics, and the engine.

        server = Server(settings); await server.start(); ...; await server.drain()
    """

    def __init__(self, settings: ServerSettings, engine: AsyncEngine | None = None):
        self.settings = settings
        self.metrics = Metrics()
        self.serving = ServingContext(settings, self.metrics)
        self.service = TextGenerationService(self.serving)
        self.health = health.aio.HealthServicer()
        turns = StepTurns() if len(settings.bundle) > 1 and settings.step_turns else None  # several: one step at a time
        self.loader = ModelLoader(settings, engine, turns)  # `engine`: a prebuilt engine of the default model (tests)
        self.pool: ModelPool | None = None  # built in start(), with the models
        self._cut_short = asyncio.Event()  # set by cut_short(): the drain ends what is in flight at once
        self.loading: str | None = "starting up"  # what start-up is doing, for the log; None once serving
        self.port = 0  # the gRPC port, once bound (after the model is warm)
        self.http_port = 0
        self.metrics_port = 0
        token = settings.bearer_token()
        max_connections = fit_connections(settings.max_connections, fronts=2 if settings.http_port else 1)
        self.http = HttpListener(HttpFront(self.serving, token).app, settings, self.metrics,
                                 max_connections) if settings.http_port else None
        interceptors = [MalformedMessages()] + ([BearerToken(token)] if token else [])
        self.grpc = grpc.aio.server(interceptors=interceptors, options=server_options(settings, max_connections))
        pb_grpc.add_TextGenerationServicer_to_server(self.service, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)

    @property
    def engine(self) -> AsyncEngine | None:
        """The default model's engine."""
        default = self.serving.default
        return default.engine if default is not None else None

    async def start(self) -> None:
        """Take the HTTP port (`/health` 503 while loading), load and warm the models, then open the gRPC port,
        SERVING from its first call: a balancer that knows nothing of health (nginx, an L4 proxy) cannot send
        a call to a replica that is still loading. ValueError when two bundles share a name."""
        s = self.settings
        asyncio.get_running_loop().set_exception_handler(logs.ThrottledLoopErrors())
        models = served_models(s)
        self.pool = ModelPool(s, models, self.loader, self._loading_status)
        self.serving.add(models, self.pool)
        await self._set_health(NOT_SERVING)
        credentials = server_credentials(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
        ensure_bindable("port", s.host, s.port)  # before the model loads: a port in use fails at once
        if self.http is not None:
            self.http_port = await self.http.start()
        if s.metrics_port:
            self.metrics_port = self.metrics.serve(s.host, s.metrics_port)
        scheme = "https" if credentials else "http"
        self.loading = "loading the model (its graph chosen and self-checked, or as the cache says)"
        log.info("loading %s%s%s", "the model" if len(models) == 1 else f"{len(models)} models",
                 f"; HTTP (OpenAI API) on {scheme}://{s.host}:{self.http_port}/v1 answers 503 until "
                 f"{'it is' if len(models) == 1 else 'they are'} warm" if self.http_port else "",
                 f"; metrics on http://{s.host}:{self.metrics_port}/metrics" if self.metrics_port else "")
        await self.pool.start()
        self.metrics.watch(self.serving.stats)
        self.loading = None
        self.serving.open()
        await self._set_health(SERVING)
        address = f"{s.host}:{s.port}"
        try:
            self.port = (self.grpc.add_secure_port(address, credentials) if credentials
                         else self.grpc.add_insecure_port(address))
        except RuntimeError as e:  # taken while the model loaded
            raise port_error("port", s.host, s.port, str(e)) from None
        if self.port == 0:
            raise port_error("port", s.host, s.port, "grpc bound no address")
        await self.grpc.start()
        serving = ", ".join(f"{m.name} ({m.engine.runner.graph_name} graph)" for m in models if m.state == "serving")
        later = ", ".join(m.name for m in models if m.state == "unloaded")
        serving += f"; loaded on their first request: {later}" if later else ""
        log.info("serving %s: gRPC on %s:%d (%s%s)%s", serving, s.host, self.port,
                 "mutual TLS" if s.tls_client_ca_file else "TLS" if credentials else "plaintext",
                 ", bearer token required" if s.auth_token or s.auth_token_file else "",
                 f", HTTP :{self.http_port}" if self.http_port else "")

    def _loading_status(self, what: str) -> None:
        """What start-up is doing, for the log of a signal that stops it (loads once serving do not count)."""
        if not self.serving.opened:
            self.loading = what

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop taking work, let requests in flight finish for up to `grace_s`, then stop everything.

        Health turns NOT_SERVING (every Watch hears it at once) and the gRPC port closes to new calls
        (GOAWAY: a call racing it is retried by the client's channel, a proxy connects to another replica)
        while the calls in flight go on. New HTTP requests get 503, which a proxy passes to the next replica."""
        grace_s = self.settings.grace_period_s if grace_s is None else grace_s
        self.serving.accepting = False
        if self.pool is not None:
            await self.pool.close()
        await self.health.enter_graceful_shutdown()
        closing = asyncio.create_task(self.grpc.stop(grace=grace_s + END_WAIT_S + 1.0)) if self.port \
            else None
        if self.loading is None:  # (a start-up cut short has nothing in flight)
            log.info("draining: %d request(s) in flight, up to %.0f s to finish", self.serving.active, grace_s)
        await self._finish_in_flight(grace_s)
        if self.http is not None:
            await self.http.stop()
        if closing is not None:
            await self.grpc.stop(grace=1.0)  # what is left: health watches
            await closing
        for engine in self._engines():
            await engine.shutdown()
        self.metrics.close()
        log.info("stopped")

    def cut_short(self) -> None:
        """End the drain now (a second SIGTERM or SIGINT): the requests in flight, running or queued, get the
        error they would get when the grace period is over, and the server stops without waiting for it.
        Called before `drain`, it makes the drain end at once whatever is in flight."""
        if not self._cut_short.is_set():
            log.warning("second signal: stopping now, %d request(s) cut off", self.serving.active)
            self._cut_short.set()

    async def _finish_in_flight(self, grace_s: float) -> None:
        """Wait for the requests in flight for up to `grace_s`, or until `cut_short`; end those left with
        `EngineStopped` (gRPC UNAVAILABLE, HTTP 503) and give the fronts `END_WAIT_S` to deliver it."""
        if self.serving.active:
            waits = [asyncio.ensure_future(event.wait()) for event in (self.serving.idle, self._cut_short)]
            await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
        if not self.serving.active:
            return
        if self._cut_short.is_set():
            why = "a second SIGTERM or SIGINT cut its drain short"
        else:
            log.warning("grace period over with %d request(s) in flight; ending them", self.serving.active)
            why = f"its grace period of {grace_s:g} s for requests in flight is over"
        if self._engines():
            for engine in self._engines():
                engine.end_all(EngineStopped(f"the server stopped before the request finished ({why})"))
            with contextlib.suppress(TimeoutError):  # each front sends its error (UNAVAILABLE, 503)
                await asyncio.wait_for(self.serving.idle.wait(), timeout=END_WAIT_S)

    def _engines(self) -> list[AsyncEngine]:
        """Every engine loaded."""
        return [m.engine for m in self.serving.models.values() if m.engine is not None]

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


# ---- the command -------------------------------------------------------------------------------

async def serve(settings: ServerSettings) -> int:
    server = Server(settings)
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():  # the operator will not wait for the drain
            server.cut_short()
            return
        if server.loading:
            log.info("%s received while %s: stopping now, without serving", sig.name, server.loading)
        else:
            log.info("%s received; a second SIGTERM or SIGINT ends the drain at once", sig.name)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    starting = asyncio.create_task(server.start())
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting in done and starting.exception() is not None:
        stopping.cancel()
        await server.grpc.stop(grace=0)
        if server.http is not None:
            await server.http.stop()
        server.metrics.close()
        error = starting.exception()
        log.error("start-up failed: %s", error)
        return 1
    await stopping
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
    await server.drain()
    return 0


def main(argv: list[str] | None = None) -> int:
    from service.settings import SettingsError, load_settings, settings_parser

    parser = settings_parser("attnserve serve", __doc__.split("\n\n")[0])
    args = vars(parser.parse_args(argv))
    config_file = args.pop("config", None)
    try:
        settings = load_settings(args, config_file)
    except SettingsError as e:
        parser.exit(2, f"attnserve serve: invalid configuration:\n{e}\n")
    logs.setup_logging(settings.log_format, settings.log_level)
    code = asyncio.run(serve(settings))
    if any(t.name == LOADING_THREAD and t.is_alive() for t in threading.enumerate()):
        # stopped while loading: the thread is in onnxruntime, whose teardown at a normal exit could meet it
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
