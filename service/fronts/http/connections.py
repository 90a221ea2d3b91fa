"""The HTTP front's connections as a bounded resource: uvicorn's h11 protocol with the limits a public port needs.

    guard = ConnectionGuard(limits, metrics)
    uvicorn.Config(app, http=guard.protocol, ...)    # every connection is a GuardedH11Protocol
    task = asyncio.create_task(guard.sweep_forever())

- **A cap.** At most `max_connections` are served. A new connection past it closes the oldest silent
  one (open, and not a byte of a request sent: never spoken, or idle between requests) and takes its
  place, so connections that only sit there cannot keep out one that speaks. When every connection is
  mid-request, up to RESERVE more are read for one request each within 2 s: `GET /health` is answered
  there (so probes see a server at its cap as up) and anything else gets a 503. Beyond those, a
  connection gets the 503 as soon as it opens.
- **Deadlines to speak.** A connection must send its request line and headers within `header_timeout_s`
  of opening, or of its first byte after an idle keep-alive; then it gets a 408 and is closed. (The body
  has its own deadline, `body_timeout_s`, kept by the application, which answers 408 too.)
- **Responses that are not read.** Output waiting for a client that has read none of it for
  `write_timeout_s` ends the connection (an SSE stream's generation is cancelled with it).
- **Errors in OpenAI's shape.** uvicorn answers a malformed request or oversized headers with plain text;
  here they get `{"error": {...}}`, and oversized headers a 431.

One task sweeps every connection each SWEEP_S for the deadlines, rather than a timer per connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.fronts.http.errors import error_body
from service.fronts.metrics import Metrics
from service.fronts.status import HttpStatus

log = logging.getLogger("attnserve.server")

RESERVE = 32  # connections past the cap that are read for GET /health
RESERVE_HEADER_TIMEOUT_S = 2.0  # ... and must send it within this long
REFUSED_LINGER_S = 1.0  # a refused connection is closed this long after its answer
SWEEP_S = 0.25
MAX_HEADER_BYTES = 16 * 1024  # request line and headers


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    write_timeout_s: float


def error_json(status: int, message: str, code: str) -> bytes:
    """An error body in OpenAI's shape (`errors.error_body`), with the connection-level `code`."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    body = error_body(HttpStatus(status, kind, message))
    body["error"]["code"] = code
    return json.dumps(body).encode()


def raw_error(status: int, message: str, code: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's shape that closes the connection, for the moments when
    no ASGI request exists to answer through."""
    body = error_json(status, message, code)
    retry = f"retry-after: {retry_after_s}\r\n" if retry_after_s else ""
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{retry}connection: close\r\n\r\n")
    return head.encode() + body


class ConnectionGuard:
    def __init__(self, limits: ConnectionLimits, metrics: Metrics):
        self.limits = limits
        self.metrics = metrics
        self.open: set[GuardedH11Protocol] = set()
        self.silent: dict[GuardedH11Protocol, None] = {}  # open, no byte of a request received; oldest first
        refusal = (f"the server holds its most connections ({limits.max_connections}, max_connections); "
                   "retry shortly")
        self.over_capacity_body = error_json(503, refusal, "service_unavailable")
        self.over_capacity = raw_error(503, refusal, "service_unavailable", retry_after_s=1)
        guard = self

        class Protocol(GuardedH11Protocol):
            pass

        Protocol.guard = guard
        self.protocol = Protocol
        metrics.http_connections.set_function(lambda: len(self.open))

    def closed(self, reason: str) -> None:
        self.metrics.connections_closed.labels("http", reason).inc()

    def make_room(self, newcomer: GuardedH11Protocol) -> None:
        """Past the cap: close the oldest silent connection, so that `newcomer` takes its place."""
        if len(self.open) <= self.limits.max_connections:
            return
        victim = next((c for c in self.silent if c is not newcomer), None)
        if victim is None:
            return
        del self.silent[victim]
        self.open.discard(victim)
        victim.transport.close()
        self.closed("evicted")

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for connection in list(self.open):
                connection.check(now)


class GuardedH11Protocol(H11Protocol):
    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        guard.open.add(self)
        self._header_since: float | None = time.monotonic()  # awaiting a request's headers since
        self._header_limit = guard.limits.header_timeout_s
        self._heard = False  # any byte of the current request received
        self._stalled_since: float | None = None  # output waiting, none of it read, since
        self._buffered = 0
        self._oversized = False
        guard.make_room(self)
        over = len(guard.open) - guard.limits.max_connections
        self._refused = over > RESERVE
        if self._refused:
            # answer, and close only after a moment: closing a socket with the client's request unread would
            # reset the connection, and the reset can destroy the answer before the client reads it
            transport.write(guard.over_capacity)
            if transport.can_write_eof():
                transport.write_eof()
            self.loop.call_later(REFUSED_LINGER_S, transport.close)
            guard.closed("over_capacity")
        else:
            guard.silent[self] = None
            if over > 0:
                self.app = _HealthOnly(self.app, guard)
                self._header_limit = min(self._header_limit, RESERVE_HEADER_TIMEOUT_S)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.open.discard(self)
        self.guard.silent.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._header_since is None and self.conn.their_state is h11.IDLE:
            self._header_since = time.monotonic()  # a new request after an idle keep-alive
        self._heard = True
        self.guard.silent.pop(self, None)
        if self.conn.their_state is h11.IDLE and self._headers_too_large(data):
            self.send_400_response("")
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._header_since = None  # the headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._heard = bool(self.conn.trailing_data[0])
        self._header_since = time.monotonic() if self._heard and self.conn.their_state is h11.IDLE else None
        if not self._heard and not self.transport.is_closing():
            self.guard.silent[self] = None  # idle between requests

    def _headers_too_large(self, data: bytes) -> bool:
        """Whether the request line and headers, `data` included, run past MAX_HEADER_BYTES (h11 checks only
        headers that arrive in pieces)."""
        buffered = self.conn.trailing_data[0]
        if len(buffered) + len(data) <= MAX_HEADER_BYTES:
            return False
        head = (buffered + data[:MAX_HEADER_BYTES + 4])[:MAX_HEADER_BYTES + 4]
        self._oversized = b"\r\n\r\n" not in head
        return self._oversized

    def send_400_response(self, msg: str) -> None:
        if self._oversized or len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:
            response = raw_error(431, f"the request line and headers exceed "
                                 f"{MAX_HEADER_BYTES} bytes", "request_header_fields_too_large")
            status = "431"
        else:
            response = raw_error(400, "the request is not valid HTTP/1.1", "invalid_request")
            status = "400"
        self.guard.metrics.requests.labels("http", "other", status).inc()
        self.transport.write(response)
        self.transport.close()

    def check(self, now: float) -> None:
        """Enforce the header deadline and the write timeout (called by the sweep)."""
        if self.transport.is_closing() or self._refused:
            return
        if self._header_since is not None and now - self._header_since > self._header_limit:
            self._header_since = None
            if self._heard:
                self.transport.write(raw_error(408, f"the request headers did not arrive within "
                                               f"{self._header_limit:g} s (header_timeout_s)", "timeout"))
            self.transport.close()
            self.guard.closed("header_timeout")
            return
        waiting = self.transport.get_write_buffer_size()
        if not waiting:
            self._stalled_since = None
        elif self._stalled_since is None or waiting < self._buffered:
            self._stalled_since = now  # new output, or the client read some
        self._buffered = waiting
        if self._stalled_since is not None and now - self._stalled_since > self.guard.limits.write_timeout_s:
            log.info("closing an HTTP connection whose client read nothing for %g s (write_timeout_s)",
                     self.guard.limits.write_timeout_s)
            self.transport.abort()
            self.guard.closed("write_timeout")


class _HealthOnly:
    """The application for a connection past the cap: `GET /health` as usual, a 503 for the rest; either
    way the connection closes after one response."""

    def __init__(self, app, guard: ConnectionGuard):
        self.app, self.guard = app, guard

    async def __call__(self, scope, receive, send) -> None:
        async def send_closing(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == "/health":
            await self.app(scope, receive, send_closing)
            return
        self.guard.closed("over_capacity")
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": self.guard.over_capacity_body})
