"""The HTTP front's listener: uvicorn, in the server's own event loop, beside gRPC.

    listener = HttpListener(app, settings, metrics)
    port = await listener.start()     # bound and accepting; PortUnavailable if the port is taken
    await listener.stop()             # stop accepting, let responses in progress finish

The socket is bound here, not by uvicorn, so a port in use is an error the server reports at start-up
(uvicorn would exit the process). Signals stay the server's: uvicorn installs no handler of its own.
TLS and mutual TLS take the same files as the gRPC port. Connections are bounded by
`service.fronts.http.connections` (a cap, deadlines to speak and to read, errors in OpenAI's shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from service.fronts.auth import read_pem
from service.fronts.http.connections import MAX_HEADER_BYTES, ConnectionGuard, ConnectionLimits
from service.fronts.metrics import Metrics
from service.fronts.ports import port_error
from service.settings import ServerSettings

STOP_GRACE_S = 5  # after the drain: connections still open are closed after this long
BACKLOG = 511  # connections the kernel queues before they are accepted (nginx's default)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the attnserve server handles SIGTERM and SIGINT for both fronts
        yield


class HttpListener:
    def __init__(self, app, settings: ServerSettings, metrics: Metrics, max_connections: int | None = None):
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # the server logs its own start and calls
        self.settings = settings
        s = settings
        tls = {}
        if s.tls_cert_file is not None and s.tls_key_file is not None:
            read_pem(s.tls_cert_file, "tls_cert_file")
            read_pem(s.tls_key_file, "tls_key_file")
            tls = {"ssl_certfile": str(s.tls_cert_file), "ssl_keyfile": str(s.tls_key_file)}
            if s.tls_client_ca_file is not None:
                read_pem(s.tls_client_ca_file, "tls_client_ca_file")
                tls.update(ssl_ca_certs=str(s.tls_client_ca_file), ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.tls = bool(tls)
        self.guard = ConnectionGuard(ConnectionLimits(max_connections or s.max_connections, s.header_timeout_s,
                                                      s.write_timeout_s), metrics)
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, server_header=False,
                                timeout_graceful_shutdown=STOP_GRACE_S, http=self.guard.protocol,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_keep_alive=s.idle_timeout_s,
                                backlog=BACKLOG, **tls)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None
        self._sweep: asyncio.Task | None = None
        self._socket: socket.socket | None = None
        self.port = 0

    async def start(self) -> int:
        host, port = self.settings.host, self.settings.http_port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on the connections of a TCP listener only, and without
        # it Nagle's algorithm holds a stream's small chunks for the client's delayed acknowledgement (~40 ms)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise port_error("http_port", host, port, e) from None
        sock.set_inheritable(True)
        self._socket = sock
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="attnserve-http")
        self._sweep = asyncio.create_task(self.guard.sweep_forever(), name="attnserve-http-deadlines")
        while not self._server.started:
            if self._task.done():
                error = self._task.exception()
                raise OSError(f"the HTTP front did not start: {error or 'uvicorn stopped'}")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        if self._sweep is not None:
            self._sweep.cancel()
        self._task = None
        if self._socket is not None:
            self._socket.close()
