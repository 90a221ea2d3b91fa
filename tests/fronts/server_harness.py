"""A real attnserve gRPC server on a free localhost port, on its own event loop thread.

    with ServerThread(settings(bundle)) as srv:     # started, warm, SERVING
        Client(srv.address).generate("...")

`engine=` passes an `AsyncEngine` built by the test (for instance with a `Gate` on its runner);
otherwise the server builds its own from the settings, as `attnserve serve` does. A test that needs the
server in a process of its own (signals, exit codes, a probe that must not share its interpreter) uses
`service.client.server_process.ServerProcess`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from service.client.server_process import free_port  # noqa: F401 - the tests take it from here with the rest
from service.engine.async_engine import AsyncEngine
from service.engine.core import Engine
from service.server import Server
from service.settings import ServerSettings

STARTUP_TIMEOUT_S = 60.0


def settings(bundle: Path, **overrides) -> ServerSettings:
    """Settings for a test server on `bundle`. It serves the fp32 graph `static`, as `make_engine`'s engines
    do, so the two agree token for token on any bundle; `attnserve serve` on its own defaults to `auto`."""
    values = dict(bundle=bundle, graph="static", host="127.0.0.1", port=0, http_port=0, metrics_port=0, max_running=8,
                  max_batch_tokens=256, max_waiting=64, threads=1, grace_period_s=10.0)
    values.update(overrides)
    return ServerSettings(**values)


def with_chat_template(bundle: Path, directory: Path, template: str) -> Path:
    """A copy of `bundle` in `directory` with `template` beside its tokenizer, as an imported checkpoint
    brings one."""
    copy = directory / "bundle"
    shutil.copytree(bundle, copy)
    (copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return copy


def engine_for(s: ServerSettings, wrap: Callable[[Engine], None] | None = None) -> AsyncEngine:
    """An AsyncEngine built from `s`, with `wrap(engine)` applied first (to install a gate or a fault)."""
    engine = Engine(s.engine_config())
    if wrap is not None:
        wrap(engine)
    return AsyncEngine(s.engine_config(), engine=engine)


def slowed(seconds: float) -> Callable[[Engine], None]:
    """For `engine_for`: each decode step takes at least `seconds`, so a deadline, a cancel or a
    signal lands while a request is generating."""
    def wrap(engine: Engine) -> None:
        original = engine.runner.decode

        def decode(ids, positions):
            time.sleep(seconds)
            return original(ids, positions)

        engine.runner.decode = decode
    return wrap


class ServerThread:
    def __init__(self, s: ServerSettings, engine: AsyncEngine | None = None, start: bool = True):
        self.settings = s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()
        self.server: Server = self.call(self._make(s, engine))
        self.starting = None
        self.stopped = False
        if start:
            self.call(self.server.start(), STARTUP_TIMEOUT_S)

    @staticmethod
    async def _make(s: ServerSettings, engine: AsyncEngine | None) -> Server:
        return Server(s, engine)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_async(self):
        """Begin `start()` without waiting for it (to watch the NOT_SERVING phase)."""
        self.starting = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop)
        return self.starting

    @property
    def address(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.port and time.monotonic() < deadline:
            time.sleep(0.01)
        return f"127.0.0.1:{self.server.port}"

    @property
    def http_url(self) -> str:
        """The HTTP front's base URL (the settings must give it a port: `http_port=free_port()`)."""
        assert self.server.http_port, "this server has no HTTP front"
        return f"http://127.0.0.1:{self.server.http_port}"

    def drain(self, grace_s: float | None = None):
        """Begin draining; returns a future that completes when the server has stopped."""
        self.stopped = True
        return asyncio.run_coroutine_threadsafe(self.server.drain(grace_s), self.loop)

    def close(self) -> None:
        if not self.stopped:
            self.drain(0.0).result(30.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        self.loop.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@contextlib.contextmanager
def templated_server(bundle: Path, directory: Path, template: str) -> Iterator[ServerThread]:
    """A server, gRPC and HTTP, on a copy of `bundle` in `directory` that brings `template` as its chat template."""
    with ServerThread(settings(with_chat_template(bundle, directory, template), http_port=free_port())) as srv:
        yield srv
